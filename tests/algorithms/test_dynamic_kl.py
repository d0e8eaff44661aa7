"""Dynamic KL weight (OThink-MR1's GRPO-D), the ``kl`` member every algorithm declares: the weight after `u` optimizer
updates against the schedule's formula worked out by hand, the loss's KL term scaled by it, the checks of its options,
and a resumed trainer run that continues the schedule where the checkpoint left it (also from a checkpoint of the
earlier layout, which kept the count in algorithm.safetensors)."""

import math

import pytest
import torch

from mmgrpo import registry
from mmgrpo.types import Score
from mmgrpo.validation import ConfigError, build_dataclass

TOKEN_ALGORITHMS = ["grpo", "dr_grpo", "dapo", "gspo", "sapo", "reg_grpo"]
NEW = [[-1.0, -0.5, -2.0], [-0.3, -1.2, 0.0]]
OLD = [[-1.1, -0.5, -1.8], [-0.2, -1.0, 0.0]]
REF = [[-1.0, -0.7, -2.0], [-0.3, -1.0, 0.0]]
MASK = [[1, 1, 1], [1, 1, 0]]
SCHEDULE = {"kl_beta": 0.01, "kl_beta_end": 0.1, "kl_warmup_steps": 4}


def build(name, **options):
    """Algorithm `name` with the flat options of a config file's ``algorithm:`` section."""
    cls = registry.get("algorithm", name)
    return cls(build_dataclass(cls.Config, options, "algorithm"))


def advance(algorithm, updates):
    for _ in range(updates):
        algorithm.kl.step()  # what the trainer calls after each optimizer update it takes


@pytest.mark.parametrize(("schedule", "expected"), [
    # start 0.01, end 0.1 over 4 updates: linear 0.01 + 0.09 * u / 4
    ("linear", {0: 0.01, 1: 0.0325, 2: 0.055, 3: 0.0775, 4: 0.1, 9: 0.1}),
    # cosine: 0.01 + 0.09 * (1 - cos(pi u / 4)) / 2, cos(pi/4) = 0.70711, cos(3 pi/4) = -0.70711
    ("cosine", {0: 0.01, 1: 0.01 + 0.09 * 0.146447, 2: 0.055, 3: 0.01 + 0.09 * 0.853553, 4: 0.1, 9: 0.1}),
])
def test_weight_follows_the_schedule(schedule, expected):
    algorithm = build("grpo", kl_schedule=schedule, **SCHEDULE)
    done = 0
    for update, beta in sorted(expected.items()):
        advance(algorithm, update - done)
        done = update
        assert algorithm.kl() == pytest.approx(beta, abs=1e-6), (schedule, update)


def test_a_falling_schedule_and_the_constant_one():
    falling = build("dapo", kl_schedule="linear", kl_beta=0.2, kl_beta_end=0.0, kl_warmup_steps=2)
    advance(falling, 1)
    assert falling.kl() == pytest.approx(0.1)
    constant = build("grpo", kl_beta=0.04)
    advance(constant, 3)
    assert constant.kl() == 0.04 and not constant.kl.dynamic
    # the weight is a declared member, not a hook attached at run time: no algorithm state of its own
    scheduled = build("grpo", kl_schedule="linear", **SCHEDULE)
    for algorithm in (constant, scheduled):
        assert "after_update" not in vars(algorithm) and "state_dict" not in vars(algorithm)
        assert not algorithm.traits.has_state and not algorithm.traits.after_update


def _kl_by_hand(mode):
    """k3 KL ``exp(d) - d - 1``, d = ref - new, aggregated as the algorithm's loss aggregates its tokens."""
    rows = [[math.exp(REF[i][t] - NEW[i][t]) - (REF[i][t] - NEW[i][t]) - 1 for t in range(3) if MASK[i][t]]
            for i in range(2)]
    if mode == "token_mean":
        return sum(map(sum, rows)) / 5
    if mode == "fixed_length":
        return sum(map(sum, rows)) / 6
    return sum(sum(r) / len(r) for r in rows) / 2


AGGREGATION = {"grpo": "sequence_mean", "dr_grpo": "fixed_length", "dapo": "token_mean", "gspo": "sequence_mean",
               "sapo": "sequence_mean", "reg_grpo": "sequence_mean"}


@pytest.mark.parametrize("name", TOKEN_ALGORITHMS)
def test_loss_kl_term_scales_with_the_scheduled_weight(name):
    """loss = policy loss + beta(u) * KL, beta(u) from the schedule, KL by hand; the policy part does not move."""
    algorithm = build(name, kl_schedule="linear", **SCHEDULE)
    assert algorithm.traits.needs_reference and algorithm.kl.dynamic
    kl = _kl_by_hand(AGGREGATION[name])
    for update, beta in [(0, 0.01), (2, 0.055), (5, 0.1)]:
        algorithm.kl.updates = update
        new = Score(log_prob=torch.tensor(NEW, requires_grad=True), mask=torch.tensor(MASK, dtype=torch.bool))
        out = algorithm.loss(new, torch.tensor(OLD), torch.tensor([1.0, -0.5]), Score(log_prob=torch.tensor(REF)))
        assert out.metrics["kl"] == pytest.approx(kl, abs=1e-6)
        assert out.metrics["kl_beta"] == pytest.approx(beta, abs=1e-9)
        assert out.loss.item() == pytest.approx(out.metrics["policy_loss"] + beta * kl, abs=1e-6)


def test_a_schedule_from_zero_still_scores_the_reference():
    algorithm = build("gspo", kl_schedule="cosine", kl_beta=0.0, kl_beta_end=0.05, kl_warmup_steps=10)
    assert algorithm.traits.needs_reference  # the weight rises above 0 later
    new = Score(log_prob=torch.tensor(NEW, requires_grad=True), mask=torch.tensor(MASK, dtype=torch.bool))
    out = algorithm.loss(new, torch.tensor(OLD), torch.tensor([1.0, -0.5]), Score(log_prob=torch.tensor(REF)))
    assert "kl" not in out.metrics  # weight 0 at update 0: no KL term yet
    assert not build("gspo").traits.needs_reference


def test_state_round_trip():
    algorithm = build("sapo", kl_schedule="linear", **SCHEDULE)
    advance(algorithm, 3)
    state = algorithm.kl.state_dict()
    assert state == {"kl_updates": 3}
    fresh = build("sapo", kl_schedule="linear", **SCHEDULE)
    fresh.kl.load_state_dict(state)
    assert fresh.kl.updates == 3 and fresh.kl() == pytest.approx(0.0775)


@pytest.mark.parametrize(("options", "message"), [
    ({"kl_beta_end": 0.1}, "apply only to a KL schedule"),
    ({"kl_warmup_steps": 3}, "apply only to a KL schedule"),
    ({"kl_schedule": "linear", "kl_warmup_steps": 3}, "needs kl_beta_end"),
    ({"kl_schedule": "linear", "kl_beta_end": 0.1}, "kl_warmup_steps must be >= 1"),
    ({"kl_schedule": "cosine", "kl_beta_end": -0.1, "kl_warmup_steps": 3}, "kl_beta_end must be >= 0"),
    ({"kl_schedule": "exponential"}, "kl_schedule"),
])
@pytest.mark.parametrize("name", sorted(registry.available("algorithm")))  # one KL record for every algorithm
def test_bad_schedules_are_refused_naming_the_key(name, options, message):
    cls = registry.get("algorithm", name)
    with pytest.raises(ConfigError, match=message):
        build_dataclass(cls.Config, options, "algorithm")


def _run_config(tmp_path, tiny_mdlm_dir, max_steps):
    return {
        "output_dir": str(tmp_path / "out"), "seed": 3,
        "pipeline": {"name": "mdlm", "pretrained": tiny_mdlm_dir, "gen_length": 4, "steps_per_block": 4,
                     "lora_rank": 0},
        "algorithm": {"name": "grpo", "kl_schedule": "linear", "kl_beta": 0.0, "kl_beta_end": 0.2,
                      "kl_warmup_steps": 6},
        "reward": {"name": "accuracy", "mode": "numeric", "fuzzy_width": 1000.0},
        "data": {"name": "arith", "digits": 2, "n_train": 32, "n_eval": 8},
        "train": {"max_steps": max_steps, "prompts_per_step": 2, "group_size": 4, "minibatch_size": 4,
                  "learning_rate": 1e-2},
        "eval": {"every": 0},
        "checkpoint": {"every": 2, "keep_last": 3},
    }


def _as_earlier_layout(checkpoint_dir):
    """Rewrites a checkpoint as the layout before the KL weight was a declared member: its update count in
    ``algorithm.safetensors`` (``{"kl_updates": n}``), none in ``trainer_state.json``."""
    import json

    from mmgrpo.state_io import save_state

    state_file = checkpoint_dir / "trainer_state.json"
    meta = json.loads(state_file.read_text())
    save_state({"kl_updates": meta.pop("kl")["kl_updates"]}, checkpoint_dir / "algorithm.safetensors")
    state_file.write_text(json.dumps(meta))


@pytest.mark.parametrize("layout", ["current", "earlier"])
def test_resumed_run_continues_the_schedule_exactly(tmp_path, tiny_mdlm_dir, layout):
    """4 steps in one go equal 2 steps, a checkpoint, and 2 resumed steps: the same count of optimizer updates taken
    and bitwise the same weights, so the KL weight of every update was the same; a checkpoint of the earlier layout
    resumes as exactly."""
    from mmgrpo import checkpoint, config as config_mod
    from mmgrpo.trainer import Trainer

    full = Trainer(config_mod.from_dict(_run_config(tmp_path / "a", tiny_mdlm_dir, 4)))
    full.train()
    raw = _run_config(tmp_path / "b", tiny_mdlm_dir, 2)
    first = Trainer(config_mod.from_dict(raw))
    first.train()
    updates_at_checkpoint = first.algorithm.kl.updates
    assert updates_at_checkpoint > 0
    if layout == "earlier":
        _as_earlier_layout(checkpoint.complete_checkpoints(tmp_path / "b" / "out" / "checkpoints")[-1])
    raw["train"]["max_steps"] = 4
    raw["checkpoint"]["resume_from"] = "latest"
    resumed = Trainer(config_mod.from_dict(raw))
    assert resumed.algorithm.kl.updates == updates_at_checkpoint  # restored from the checkpoint, not 0
    resumed.train()
    assert resumed.algorithm.kl.updates == full.algorithm.kl.updates == 2 * updates_at_checkpoint
    assert full.algorithm.kl() == pytest.approx(0.2 * min(1, full.algorithm.kl.updates / 6))
    for a, b in zip(full.policy.trainable_parameters(), resumed.policy.trainable_parameters()):
        assert torch.equal(a, b)
