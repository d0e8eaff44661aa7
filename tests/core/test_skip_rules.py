"""The trainer's skip rules (mmgrpo.trainer's module docstring) for a flow, a token and a masked-diffusion algorithm,
each with and without a KL term: a step without any finite reward moves nothing, and a sample without reward adds
nothing to the gradient (its KL term included) while the others still update."""

import math
from pathlib import Path

import pytest
import torch

from mmgrpo import config as config_mod
from mmgrpo.advantages import groups_with_signal
from mmgrpo.trainer import Trainer
from mmgrpo.types import RewardResult

EXAMPLES = Path(__file__).resolve().parents[2] / "data" / "examples" / "vlm"
KL = {"flow_grpo": 0.5, "grpo": 0.04, "cj_grpo": 0.04, "dgpo": 0.02}


def make_config(tmp_path, family: str, model_dir: str, kl_beta: float, algorithm: str) -> dict:
    """Tiny real components whose configured reward scores nothing: mini_geneval on prompts without a scene, and the
    accuracy reward looking for a ground truth the data does not carry (both NaN, "not applicable")."""
    no_answer = {"name": "accuracy", "mode": "numeric", "answer_key": "no_such_key"}
    if family == "flow":
        prompts = tmp_path / "prompts.txt"
        prompts.write_text("a red circle\na blue square\n")
        pipeline = {"name": "sd3", "pretrained": model_dir, "resolution": 32, "num_steps": 2, "guidance_scale": 1.0,
                    "lora_rank": 4, "max_sequence_length": 16}
        # flow_grpo keeps zero-advantage samples in the minibatch mean here (not the authors' filter, which drops them)
        options = {"clip_low": 0.2, "drop_zero_advantage": False} if algorithm == "flow_grpo" else {
            "num_train_timesteps": 1, "trunc_steps": 1}
        parts = {"algorithm": {"name": algorithm, "kl_beta": kl_beta, **options},
                 "reward": {"name": "mini_geneval"},
                 "data": {"name": "prompt_file", "train_file": str(prompts), "eval_file": str(prompts)}}
    elif family == "token":
        pipeline = {"name": "qwen_vl", "pretrained": model_dir, "max_new_tokens": 4, "lora_rank": 4, "lora_alpha": 8}
        jsonl = str(EXAMPLES / "count.jsonl")
        parts = {"algorithm": {"name": "grpo", "kl_beta": kl_beta}, "reward": no_answer,
                 "data": {"name": "vlm_jsonl", "train_file": jsonl, "eval_file": jsonl}}
    else:
        pipeline = {"name": "mdlm", "pretrained": model_dir, "gen_length": 4, "steps_per_block": 2, "lora_rank": 4,
                    "lora_alpha": 8}
        parts = {"algorithm": {"name": "cj_grpo", "kl_beta": kl_beta}, "reward": no_answer,
                 "data": {"name": "arith", "digits": 1, "n_train": 8, "n_eval": 2}}
    return {
        "output_dir": str(tmp_path / "run"), "seed": 0, "pipeline": pipeline, **parts,
        "train": {"max_steps": 2, "prompts_per_step": 2, "group_size": 3, "minibatch_size": 6, "learning_rate": 1e-2,
                  "max_grad_norm": 1e6},  # no clipping: the gradients compare by their scale
        "eval": {"every": 0}, "checkpoint": {"every": 0, "keep_last": 1},
    }


CASES = [(family, algorithm, kl) for family, algorithm in (("flow", "flow_grpo"), ("token", "grpo"), ("masked", "cj_grpo"))
         for kl in (0.0, KL[algorithm])]
DGPO = [("flow", "dgpo", 0.0), ("flow", "dgpo", KL["dgpo"])]  # reads its reference and keeps an old model either way


def ids(cases):
    return [f"{algorithm}-kl{kl}" for _, algorithm, kl in cases]


@pytest.fixture
def trainer(request, tmp_path):
    family, algorithm, kl = request.param
    fixture = {"flow": "tiny_sd3_dir", "token": "tiny_qwen2_vl_dir", "masked": "tiny_mdlm_dir"}[family]
    raw = make_config(tmp_path, family, request.getfixturevalue(fixture), kl, algorithm)
    built = Trainer(config_mod.from_dict(raw))
    assert built.algorithm.traits.needs_reference == (kl > 0 or algorithm == "dgpo")
    return built


def weights(trainer):
    return [p.detach().clone() for p in trainer.policy.trainable_parameters()]


@pytest.mark.parametrize("trainer", CASES + DGPO, ids=ids(CASES + DGPO), indirect=True)
def test_a_step_without_any_finite_reward_moves_nothing(trainer):
    """All rewards NaN (the real reward, nothing applicable), then all +inf: no update at all, KL term or not; the
    optimizer keeps no state, the learning-rate schedule and the algorithm's state (DGPO's old model) do not advance,
    and both skipped updates are counted."""
    before, schedule = weights(trainer), trainer.lr_scheduler.state_dict()
    nan_step = trainer.train_step()
    trainer.reward = lambda outputs, batch: RewardResult(scores=torch.full((len(batch),), math.inf))
    inf_step = trainer.train_step()
    assert nan_step["reward/invalid"] == inf_step["reward/invalid"] == 6
    assert all(torch.equal(a, b) for a, b in zip(before, weights(trainer)))  # bitwise
    assert not trainer.optimizer.state_dict()["state"]  # AdamW never stepped (no moments, no weight decay)
    assert trainer.lr_scheduler.state_dict() == schedule
    assert trainer.skipped_updates == inf_step["train/skipped_updates"] == 2
    assert getattr(trainer.algorithm, "updates", 0) == 0


@pytest.mark.parametrize("trainer", CASES, ids=ids(CASES), indirect=True)
@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\(\)`")  # the captured optimizer.step
def test_samples_without_reward_add_nothing_and_the_others_still_update(trainer):
    """Scores ``[0.1, NaN, 0.7 | 0.3, 0.9, +inf]``: the NaN and +inf samples are left out of their groups' statistics
    and add nothing to the gradient (KL term included): it is the gradient of the batch without them, scaled by the
    4 / 6 of the minibatch they leave, and the update is taken."""
    torch.manual_seed(0)
    with torch.no_grad():  # move the policy off its reference, so that every sample has a non-zero KL gradient
        for p in trainer.policy.trainable_parameters():
            p.add_(0.05 * torch.randn_like(p))
    plan = trainer.algorithm.schedule(trainer.policy.num_steps, torch.Generator().manual_seed(0))
    batch = trainer.stream.next_batch(2).repeat(3)
    rollout = trainer.policy.sample(batch, plan, generator=torch.Generator().manual_seed(0))
    scores = torch.tensor([0.1, math.nan, 0.7, 0.3, 0.9, math.inf])
    rewarded = torch.isfinite(scores)
    _, groups, advantages = trainer.global_advantages(RewardResult(scores=scores), rollout.group_ids)
    kept = torch.nonzero(rewarded).flatten()
    assert torch.equal(advantages[kept], trainer.algorithm.advantages(scores[kept], groups[kept]))
    assert not bool(advantages[~rewarded].any())
    grads = []
    trainer.optimizer.step = lambda: grads.append([p.grad.clone() for p in trainer.policy.trainable_parameters()])
    with_signal = groups_with_signal(advantages, groups)
    metrics = trainer.update(rollout, plan, advantages, with_signal, torch.Generator().manual_seed(1), rewarded)
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.update(rollout.select(kept), plan, advantages[kept], with_signal[kept], torch.Generator().manual_seed(1))
    assert len(grads) == 2 and metrics["train/skipped_updates"] == 0  # the update is taken
    assert metrics["train/unscored_share"] == pytest.approx(2 / 6)
    assert any(torch.count_nonzero(g) for g in grads[0])
    for with_unrewarded, without in zip(*grads):  # equal up to float summation order
        expected = without * (4 / 6)
        torch.testing.assert_close(with_unrewarded, expected, rtol=1e-4, atol=1e-5 * float(expected.abs().max()) + 1e-12)
