"""Rollout correction (`mmgrpo/rollout_correction.py`, the options in `algorithms/_options.py`): the weights and kept
tokens of every mode against TRL's and verl's rules written out plainly; and, with an engine double (the same tiny
Qwen2-VL checkpoint with its frozen base in bfloat16: a real second copy of the policy with other numerics), the
recomputed old log-probs, the mismatch metrics and the corrected GRPO loss against an independent computation, and one
trainer step sampled by the double as the trainer's rollout engine."""

import math

import pytest
import torch

from mmgrpo import registry
from mmgrpo.algorithms._options import RolloutCorrectionOptions
from mmgrpo.components import score_unit
from mmgrpo.engines import LocalEngine, RolloutEngine
from mmgrpo.pipelines.qwen_vl import QwenVLConfig, QwenVLPolicy
from mmgrpo.rollout_correction import correct_rollout, correction
from mmgrpo.types import Score
from mmgrpo.validation import ConfigError, build_dataclass
from builders._qwen_vl_batches import vision_batch


def build(name, **options):
    cls = registry.get("algorithm", name)
    return cls(build_dataclass(cls.Config, options, "algorithm"))


def random_batch(seed=0, n=6, s=5):
    g = torch.Generator().manual_seed(seed)
    engine = -torch.rand(n, s, generator=g) * 3
    old = engine + torch.randn(n, s, generator=g) * 0.4  # another numerics: ratios around 1
    lengths = torch.tensor([5, 4, 1, 3, 5, 2])[:n]
    mask = torch.arange(s)[None] < lengths[:, None]
    return old, engine, mask


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize("low,high", [(None, 3.0), (0.5, 1.5), (None, None)])
def test_importance_weights_follow_trl(mode, low, high):
    old, engine, mask = random_batch()
    options = RolloutCorrectionOptions(rollout_correction=mode, rollout_is_clip_min=low, rollout_is_clip_max=high)
    weights, kept = correction(old, engine, mask, options)
    assert torch.equal(kept, mask)
    lo, hi = (-math.inf if low is None else low), (math.inf if high is None else high)
    for i in range(len(old)):
        tokens = [t for t in range(old.shape[1]) if mask[i, t]]
        seq = math.exp(sum(float(old[i, t] - engine[i, t]) for t in tokens))  # TRL: exp of the summed log-ratio
        for t in range(old.shape[1]):
            if not mask[i, t]:
                assert weights[i, t] == 0
                continue
            rho = seq if mode.startswith("sequence") else math.exp(float(old[i, t] - engine[i, t]))
            expected = min(max(rho, lo), hi) if mode.endswith("truncate") else (rho if lo <= rho <= hi else 0.0)
            assert float(weights[i, t]) == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("lower", [None, 0.7])
def test_rejection_follows_verl(level, lower):
    old, engine, mask = random_batch(1)
    upper = 1.1 if level == "geometric" else 1.3  # a geometric mean lies closer to 1
    options = RolloutCorrectionOptions(rollout_correction=f"{level}_reject", rollout_rs_threshold=upper,
                                       rollout_rs_threshold_lower=lower)
    weights, kept = correction(old, engine, mask, options)
    assert weights is None
    low = 1 / upper if lower is None else lower  # verl: the reciprocal of the upper threshold when unset
    for i in range(len(old)):
        tokens = [t for t in range(old.shape[1]) if mask[i, t]]
        logs = [float(old[i, t] - engine[i, t]) for t in tokens]
        seq = math.exp(sum(logs)) if level == "sequence" else math.exp(sum(logs) / len(logs))
        for t in range(old.shape[1]):
            ratio = math.exp(float(old[i, t] - engine[i, t])) if level == "token" else seq
            assert bool(kept[i, t]) == (bool(mask[i, t]) and low <= ratio <= upper), (i, t)
    assert (~kept & mask).any() and kept.any()  # the bounds bite on this batch


def test_recompute_keeps_every_token_and_weighs_nothing():
    old, engine, mask = random_batch(2)
    weights, kept = correction(old, engine, mask, RolloutCorrectionOptions())
    assert weights is None and torch.equal(kept, mask)


@pytest.mark.parametrize("options,key", [
    ({"rollout_correction": "vllm"}, "rollout_correction"),
    ({"rollout_is_clip_max": 0.0}, "rollout_is_clip_max"),
    ({"rollout_is_clip_min": 3.0}, "rollout_is_clip_min"),  # not below clip_max (3.0)
    ({"rollout_rs_threshold": 1.0}, "rollout_rs_threshold"),
    ({"rollout_rs_threshold_lower": 1.5}, "rollout_rs_threshold_lower"),
])
def test_bad_options_name_their_key(options, key):
    with pytest.raises((ConfigError, ValueError), match=key):
        build("grpo", **options)


# ------------------------------------------------------------------------------------------------ the engine double
@pytest.fixture(scope="module")
def policies(tiny_qwen2_vl_dir):
    """The trainer's policy (LoRA on a float32 base) and its engine double (the same weights, base in bfloat16)."""
    options = {"pretrained": tiny_qwen2_vl_dir, "max_new_tokens": 6, "lora_rank": 4, "lora_alpha": 8}
    torch.manual_seed(0)
    trainer_policy = QwenVLPolicy(QwenVLConfig(**options))
    torch.manual_seed(0)  # the same LoRA initialisation
    engine = QwenVLPolicy(QwenVLConfig(**options, weights_dtype="bfloat16"))
    return trainer_policy, engine


class EngineDouble:
    """A rollout engine (`mmgrpo.engines.RolloutEngine`) whose numerics are not the trainer's: a second copy of the
    policy with its frozen base in bfloat16, reporting its own log-probs."""

    name = "bfloat16_double"
    holds_weights = True

    def __init__(self, policy):
        self.policy = policy

    def sample(self, batch, plan, *, generator=None):
        rollout = self.policy.sample(batch, plan, generator=generator)
        rollout.engine_log_probs = rollout.old_log_probs.clone()
        return rollout

    def sync_weights(self, policy) -> None:
        self.policy.model.load_state_dict(policy.model.state_dict(), strict=False)


def engine_rollout(engine, seed=0):
    """A rollout of the engine double, its log-probs reported as the engine's."""
    return EngineDouble(engine).sample(vision_batch(2), build("grpo").schedule(engine.num_steps),
                                       generator=torch.Generator().manual_seed(seed))


def test_engine_double_corrected_grpo_loss_equals_trls_rule(policies):
    trainer_policy, engine = policies
    rollout = engine_rollout(engine)
    algorithm = build("grpo", kl_beta=0.0, rollout_correction="token_truncate", rollout_is_clip_min=0.999,
                      rollout_is_clip_max=1.001)
    unit = list(range(trainer_policy.num_steps))
    corrected, metrics = correct_rollout(rollout, trainer_policy, algorithm, [unit], minibatch_size=4)
    with torch.no_grad():  # the trainer's own log-probs of the engine's tokens
        trainer_old = trainer_policy.log_prob(rollout, unit).log_prob
    mask = rollout.mask
    torch.testing.assert_close(corrected.old_log_probs[mask], trainer_old[mask], rtol=0, atol=1e-6)
    log_rho = (trainer_old - rollout.engine_log_probs)[mask]
    assert log_rho.abs().max() > 1e-4  # bfloat16 numerics: the engine's log-probs differ
    assert metrics["rollout_corr/kl"] == pytest.approx(float(-log_rho.mean()), abs=1e-7)
    assert metrics["rollout_corr/ratio_min"] < 1 < metrics["rollout_corr/ratio_max"]
    # the loss the trainer gets, against TRL's rule written out per token
    advantages = torch.tensor([1.0, 0.3, 0.5, 2.0, 1.5, 0.7])  # one sign: no cancellation in the sum
    new, old, _ = score_unit(trainer_policy, algorithm, corrected, unit, torch.device("cpu"))
    loss = algorithm.loss(new, old, advantages).loss
    expected = 0.0
    for i in range(len(mask)):
        terms = []
        for t in range(mask.shape[1]):
            if not mask[i, t]:
                continue
            r = math.exp(float(new.log_prob[i, t].detach() - trainer_old[i, t]))
            a = float(advantages[i])
            surrogate = max(-a * r, -a * min(max(r, 0.8), 1.2))
            is_weight = min(max(math.exp(float(trainer_old[i, t] - rollout.engine_log_probs[i, t])), 0.999), 1.001)
            terms.append(surrogate * is_weight)
        expected += sum(terms) / len(terms)
    assert float(loss.detach()) == pytest.approx(expected / len(mask), rel=1e-6)
    unweighted = Score(log_prob=new.log_prob, mask=new.mask)
    uncorrected = build("grpo", kl_beta=0.0).loss(unweighted, old, advantages).loss  # the weights change the loss
    assert abs(float(uncorrected.detach()) - float(loss.detach())) > 4e-6  # 4x the tolerance above
    weights = corrected.is_weights[mask]
    assert (weights == 1.001).any() or (weights == 0.999).any()  # the truncation binds on some token


def test_engine_double_rejection_leaves_the_trained_tokens(policies):
    trainer_policy, engine = policies
    rollout = engine_rollout(engine, seed=1)
    unit = list(range(trainer_policy.num_steps))
    with torch.no_grad():
        trainer_old = trainer_policy.log_prob(rollout, unit).log_prob
    median = float((trainer_old - rollout.engine_log_probs)[rollout.mask].abs().median())
    threshold = math.exp(median)  # about half of the tokens are outside
    algorithm = build("dapo", rollout_correction="token_reject", rollout_rs_threshold=threshold)
    corrected, metrics = correct_rollout(rollout, trainer_policy, algorithm, [unit], minibatch_size=16)
    rejected = rollout.mask & ~corrected.mask
    assert rejected.any() and corrected.mask.any()
    assert metrics["rollout_corr/dropped_share"] == pytest.approx(float(rejected.sum() / rollout.mask.sum()))
    new = trainer_policy.log_prob(corrected, unit)
    assert not new.mask[rejected].any()  # the rejected tokens are not scored


def test_local_rollouts_pass_unchanged_and_other_algorithms_refuse_an_engine(policies):
    trainer_policy, engine = policies
    local = trainer_policy.sample(vision_batch(1), build("grpo").schedule(6), generator=torch.Generator())
    same, metrics = correct_rollout(local, trainer_policy, build("grpo"), [list(range(6))], 4)
    assert same is local and metrics == {}
    with pytest.raises(ValueError, match="applies no rollout correction"):
        correct_rollout(engine_rollout(engine), trainer_policy, build("gspo"), [list(range(6))], 4)


def test_a_trainer_step_on_engine_rollouts_logs_the_mismatch(policies, tiny_qwen2_vl_dir, tmp_path):
    from mmgrpo.config import load
    from mmgrpo.trainer import Trainer

    _, engine = policies
    config = load("configs/tiny/vlm_count.yaml", [
        f"output_dir={tmp_path}", f"pipeline.pretrained={tiny_qwen2_vl_dir}", "pipeline.max_new_tokens=6",
        "pipeline.min_pixels=3136", "pipeline.max_pixels=3136", "pipeline.lora_rank=4", "pipeline.lora_alpha=8",
        "train.prompts_per_step=2", "train.group_size=2", "train.minibatch_size=4", "train.updates_per_step=1",
        "train.max_steps=1", "train.max_seconds=0", "eval.every=0", "checkpoint.every=0", "data.n_train=4",
        "data.n_eval=1", "algorithm.rollout_correction=sequence_mask",
    ])
    trainer = Trainer(config)
    assert isinstance(trainer.engine, LocalEngine) and isinstance(trainer.engine, RolloutEngine)
    trainer.engine = EngineDouble(engine)
    assert isinstance(trainer.engine, RolloutEngine)
    trainer.step = 1
    metrics = trainer.train_step()
    assert metrics["rollout_corr/kl"] != 0  # bfloat16 numerics
    assert 0 <= metrics["rollout_corr/dropped_share"] <= 1 and metrics["rollout_corr/ratio_q50"] > 0
