"""Each algorithm against an independent transcription of its reference implementation's formula on the same tensors:
advantages, loss and gradient. References: TRL 1.16 ``GRPOTrainer`` for the token losses (``loss_type`` grpo,
dr_grpo, dapo, sapo; GSPO is ``importance_sampling_level="sequence"``), Flow-GRPO, VisualGRPO (E-GRPO), GCPO
(Chunk-GRPO), DGPO, EOSER-ASS-RL (CJ-GRPO) and d1 (diffu-GRPO). The transcriptions use NumPy and plain tensor ops,
never the package's helpers, so a drift in either shows. The DGPO loss and gradient are checked the same way in
``test_dgpo.py`` (``test_loss_equals_an_independent_computation``); here its advantages.

Every reference's advantage divides by ``std + eps``, with its own eps: 1e-4 (TRL, Flow-GRPO, DGPO) or 1e-8 (GCPO,
VisualGRPO), each algorithm's default.
"""

from pathlib import Path

import numpy as np
import pytest
import torch

from mmgrpo import config as config_mod, registry, updates
from mmgrpo.trainer import Trainer
from mmgrpo.types import Score
from mmgrpo.validation import build_dataclass

EPS = 1e-4
# 3 groups of 2 (G = 2: the unbiased std is sqrt(2) times the population one); the last group's rewards are equal
REWARDS = torch.tensor([1.0, 0.0, 0.25, 0.75, 0.5, 0.5])
GROUPS = torch.tensor([0, 0, 1, 1, 2, 2])


def build(name, **options):
    """Algorithm `name` with the flat options of a config file's ``algorithm:`` section."""
    cls = registry.get("algorithm", name)
    return cls(build_dataclass(cls.Config, options, "algorithm"))


def numpy_advantages(rewards, groups, ddof, clip=None, scale=True, eps=EPS):
    """``(r - mean_g) / (std_g + eps)`` per group with NumPy's std (`ddof` 0: population, 1: unbiased), 0 for a
    group of equal rewards (every reference gives 0 there: its centred rewards are 0)."""
    r, g = rewards.numpy().astype(np.float64), groups.numpy()
    out = np.zeros_like(r)
    for gid in np.unique(g):
        members = g == gid
        centred = r[members] - r[members].mean()
        out[members] = centred / (r[members].std(ddof=ddof) + eps) if scale else centred
    if clip is not None:
        out = np.clip(out, -clip, clip)
    return torch.tensor(out, dtype=torch.float32)


# ----------------------------------------------------------------------------------------- token losses (TRL 1.16)
LOGP = torch.tensor([[-1.0, -0.5, -2.0, -0.7], [-0.3, -1.2, -0.9, 0.0], [-0.6, -0.4, -1.5, -0.2],
                     [-2.0, -0.1, 0.0, 0.0], [-0.5, -0.5, -0.5, 0.0], [-1.1, -0.8, 0.0, 0.0]])
OLD = LOGP + torch.tensor([[0.1, 0.0, -0.3, 0.02], [-0.1, -0.2, 0.05, 0.0], [0.4, -0.05, 0.1, 0.0],
                           [0.01, 0.3, 0.0, 0.0], [0.0, 0.02, -0.01, 0.0], [0.2, -0.3, 0.0, 0.0]])
REF = LOGP + 0.05
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 0, 0]]).bool()


def trl_advantages(rewards, group_size):
    """TRL's ``scale_rewards="group"``: ``(r - mean) / (std + 1e-4)``, ``std`` PyTorch's default (unbiased)."""
    grouped = rewards.view(-1, group_size)
    mean = grouped.mean(dim=1).repeat_interleave(group_size)
    std = grouped.std(dim=1).repeat_interleave(group_size)
    return (rewards - mean) / (std + 1e-4)


def trl_loss(logp, old, adv, mask, loss_type, low=0.2, high=0.2, beta=0.0, ref=None, level="token", max_len=None,
             num_items=None, tau_pos=1.0, tau_neg=1.05):
    """TRL's ``GRPOTrainer._compute_loss`` written out."""
    mask = mask.float()
    log_ratio = logp - old
    if level == "sequence":
        log_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    else:
        log_weights = log_ratio
    coef_1 = torch.exp(log_weights)
    a = adv.unsqueeze(1)
    if loss_type == "sapo":
        tau = torch.where(a > 0, torch.full_like(a, tau_pos), torch.full_like(a, tau_neg))
        per_token_loss = -torch.sigmoid(tau * (coef_1 - 1)) * 4 / tau * a
    else:
        coef_2 = torch.clamp(coef_1, 1 - low, 1 + high)
        per_token_loss = -torch.min(coef_1 * a, coef_2 * a)
    if beta:
        per_token_kl = torch.exp(ref - logp) - (ref - logp) - 1
        per_token_loss = per_token_loss + beta * per_token_kl
    if loss_type in ("grpo", "sapo"):
        return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "dr_grpo":
        return (per_token_loss * mask).sum() / (per_token_loss.size(0) * max_len)
    assert loss_type == "dapo"
    return (per_token_loss * mask).sum() / num_items


def check(ours, expected_fn, leaf):
    """Loss value and gradient with respect to `leaf` of `ours` (a LossOutput) against `expected_fn(leaf)`."""
    grad = torch.autograd.grad(ours.loss, leaf)[0]
    fresh = leaf.detach().clone().requires_grad_(True)
    expected = expected_fn(fresh)
    expected_grad = torch.autograd.grad(expected, fresh)[0]
    assert ours.loss.item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-8)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-8)
    assert expected_grad.abs().sum() > 0  # the comparison is not between two zeros


def token_case(name, trl_kwargs, **options):
    algorithm = build(name, **options)
    adv = algorithm.advantages(REWARDS, GROUPS)
    expected_adv = REWARDS - REWARDS.view(-1, 2).mean(1).repeat_interleave(2) if name == "dr_grpo" \
        else trl_advantages(REWARDS, 2)
    torch.testing.assert_close(adv, expected_adv, rtol=1e-6, atol=1e-7)
    leaf = LOGP.clone().requires_grad_(True)
    with_ref = trl_kwargs.get("beta", 0) > 0
    out = algorithm.loss(Score(log_prob=leaf, mask=MASK), OLD, adv, Score(log_prob=REF) if with_ref else None)
    check(out, lambda lp: trl_loss(lp, OLD, adv, MASK, ref=REF, **trl_kwargs), leaf)


def test_grpo_is_trls_grpo_loss_with_the_unbiased_std():
    token_case("grpo", {"loss_type": "grpo", "beta": 0.04})
    assert build("grpo").advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]))[0] == pytest.approx(
        0.5 / (0.5**0.5 + EPS), rel=1e-6)  # G = 2: (1 - 0.5) / std, std = sqrt(0.5) (n - 1), not 0.5 (n)


def test_dr_grpo_is_trls_dr_grpo_loss():
    token_case("dr_grpo", {"loss_type": "dr_grpo", "max_len": LOGP.shape[1]})


def test_gspo_is_trls_sequence_level_importance_sampling():
    token_case("gspo", {"loss_type": "grpo", "level": "sequence", "low": 0.05, "high": 0.08, "beta": 0.1},
               clip_low=0.05, clip_high=0.08, kl_beta=0.1)


def test_sapo_is_trls_sapo_loss():
    token_case("sapo", {"loss_type": "sapo"})


def test_dapo_one_minibatch_is_trls_dapo_loss():
    """TRL's ``dapo`` counts every token, those of zero-advantage groups included; ``update_with_signal`` leaves the
    samples with advantage 0 out of the count (and of the KL term)."""
    token_case("dapo", {"loss_type": "dapo", "high": 0.28, "num_items": MASK.sum()})
    kept = REWARDS.view(-1, 2).std(1).repeat_interleave(2) > 0  # [N]
    token_case("dapo", {"loss_type": "dapo", "high": 0.28, "num_items": (MASK & kept[:, None]).sum()},
               token_mean="update_with_signal")


# ------------------------------------------------------------------------------------ flow-matching algorithms
STEP_LOGP = torch.tensor([[0.010, -0.020], [0.005, 0.030], [-0.012, 0.001], [0.020, -0.004], [0.0, 0.0], [0.0, 0.0]])
STEP_OLD = STEP_LOGP + torch.tensor([[2e-5, -3e-4], [1e-4, 5e-5], [-2e-4, 1e-5], [3e-5, 2e-4], [0.0, 1e-5], [0.0, 0.0]])


def dance_clipped(adv, ratio, low, high):
    """The DanceGRPO-family per-sample loss: ``max(-A r, -A clamp(r, 1 - low, 1 + high))``."""
    return torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1.0 - low, 1.0 + high))


def test_flow_grpo_is_the_authors_loss_with_the_population_std():
    algorithm = build("flow_grpo", clip_low=1e-4)
    adv = algorithm.advantages(REWARDS, GROUPS)
    torch.testing.assert_close(adv, numpy_advantages(REWARDS, GROUPS, ddof=0, clip=5.0), rtol=1e-6, atol=1e-6)
    leaf = STEP_LOGP.clone().requires_grad_(True)
    out = algorithm.loss(Score(log_prob=leaf), STEP_OLD, adv)

    def flow_grpo(lp):  # train_sd3.py: one timestep j at a time, torch.mean over the batch, averaged over timesteps
        losses = [torch.mean(dance_clipped(adv, torch.exp(lp[:, j] - STEP_OLD[:, j]), 1e-4, 1e-4)) for j in range(2)]
        return sum(losses) / 2

    check(out, flow_grpo, leaf)


@pytest.mark.parametrize("name", ["flow_grpo", "e_grpo"])
def test_flow_clip_high_bounds_the_upper_side_and_defaults_to_clip_low(name):
    """``clip_high`` sets ``1 + clip_high`` and leaves the lower bound at ``1 - clip_low``; unset, it is `clip_low`."""
    options = {"sde_steps": [1, 3]} if name == "e_grpo" else {}
    adv = build(name, **options).advantages(REWARDS, GROUPS)
    log_ratio = torch.tensor([[-3e-4, 5e-5], [1.5e-4, 3e-4], [-5e-5, 1.5e-4], [3e-4, -3e-4], [0.0, 1.5e-4], [0.0, 0.0]])
    old = STEP_LOGP - log_ratio  # ratios away from the bounds: below 1 - 1e-4, between the bounds, above 1 + 2e-4
    ratio = torch.exp(log_ratio)  # [6, 2]
    for high, bound in ((2e-4, 2e-4), (None, 1e-4)):
        algorithm = build(name, clip_low=1e-4, **({} if high is None else {"clip_high": high}), **options)
        out = algorithm.loss(Score(log_prob=STEP_LOGP, mask=torch.ones(6, 2, dtype=torch.bool)), old, adv)
        expected = dance_clipped(adv[:, None], ratio, 1e-4, bound).mean()
        torch.testing.assert_close(out.loss, expected, rtol=1e-6, atol=1e-9)
        clip_frac = ((ratio < 1 - 1e-4) | (ratio > 1 + bound)).float().mean().item()
        assert out.metrics["clip_frac"] == pytest.approx(clip_frac)


def test_e_grpo_is_visualgrpos_loss_with_the_unbiased_std_per_branch():
    branch_groups = torch.tensor([0, 0, 1, 1, 2, 2])  # (prompt, SDE step) sub-groups, as the rollout re-keys them
    algorithm = build("e_grpo", sde_steps=[1, 3], clip_low=1e-4)
    adv = algorithm.advantages(REWARDS, branch_groups)
    expected = numpy_advantages(REWARDS, branch_groups, ddof=1, clip=5.0, eps=1e-8)  # VisualGRPO's 1e-8
    torch.testing.assert_close(adv, expected, rtol=1e-6, atol=1e-6)
    own = torch.tensor([0, 0, 1, 1, 0, 1])  # the entry of each sample's own SDE step
    mask = torch.nn.functional.one_hot(own, 2).bool()
    leaf = STEP_LOGP.clone().requires_grad_(True)
    out = algorithm.loss(Score(log_prob=leaf, mask=mask), STEP_OLD, adv)

    def visual_grpo(lp):  # grpo_merge: per sample at its step, loss / (accumulation * samples): a mean over samples
        rows = torch.arange(6)
        return dance_clipped(adv, torch.exp(lp[rows, own] - STEP_OLD[rows, own]), 1e-4, 1e-4).mean()

    check(out, visual_grpo, leaf)


def test_chunk_grpo_is_gcpos_chunk_loss_with_the_unbiased_std():
    algorithm = build("chunk_grpo", clip_low=1e-4, clip_high=2e-4)
    adv = algorithm.advantages(REWARDS, GROUPS)
    expected = numpy_advantages(REWARDS, GROUPS, ddof=1, clip=5.0, eps=1e-8)  # GCPO's 1e-8
    torch.testing.assert_close(adv, expected, rtol=1e-6, atol=1e-6)
    trains = torch.tensor([1, 0, 1, 1, 0, 1]).bool()  # the samples that drew this chunk
    leaf = STEP_LOGP.clone().requires_grad_(True)
    out = algorithm.loss(Score(log_prob=leaf, mask=trains[:, None].expand(6, 2)), STEP_OLD, adv)

    def gcpo(lp):  # chunk log-prob = mean of its steps; each (sample, chunk) pair weighs the same
        ratio = torch.exp(lp.mean(1) - STEP_OLD.mean(1))
        return dance_clipped(adv, ratio, 1e-4, 2e-4)[trains].sum() / trains.sum()

    check(out, gcpo, leaf)
    assert out.entries == 4  # the pairs it averages over, for the trainer's mean over the update
    assert algorithm.traits.update_mean == "entries" and build("chunk_grpo", timestep_fraction=1.0).traits.update_mean \
        == "samples"


def test_dgpo_advantages_use_the_population_std():
    adv = build("dgpo").advantages(REWARDS, GROUPS)
    torch.testing.assert_close(adv, numpy_advantages(REWARDS, GROUPS, ddof=0, clip=5.0), rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------------------- masked diffusion
TOKEN_LP = torch.tensor([[-0.5, -1.0, -0.2], [-0.9, -0.1, -2.0], [-0.3, -0.3, -0.3], [-1.5, -0.7, -0.4],
                         [-0.2, -0.6, -1.0], [-0.8, -0.05, -0.3]])
TOKEN_OLD = TOKEN_LP + torch.tensor([[0.3, -0.1, 0.0], [0.0, 0.6, -0.2], [0.1, 0.1, -0.7], [-0.2, 0.05, 0.0],
                                     [0.0, 0.0, 0.1], [0.2, -0.1, 0.0]])
TOKEN_REF = TOKEN_LP - 0.1
COMMITTED = torch.tensor([[1, 1, 0], [1, 0, 1], [0, 1, 1], [1, 1, 1], [1, 0, 0], [0, 1, 0]]).bool()


def masked_diffusion_case(name, **options):
    algorithm = build(name, clip_low=0.2, kl_beta=0.04, **options)
    adv = algorithm.advantages(REWARDS, GROUPS)
    torch.testing.assert_close(adv, numpy_advantages(REWARDS, GROUPS, ddof=1, scale=False), rtol=1e-6, atol=1e-7)
    scaled = build(name, scale_rewards="group").advantages(REWARDS, GROUPS)
    torch.testing.assert_close(scaled, numpy_advantages(REWARDS, GROUPS, ddof=1), rtol=1e-6, atol=1e-6)
    leaf = TOKEN_LP.clone().requires_grad_(True)
    step_lp = (leaf * COMMITTED).sum(-1, keepdim=True)  # [n, 1], the step's log-prob (unused at the token level)
    new = Score(log_prob=step_lp, mask=COMMITTED.any(-1, keepdim=True), token_log_prob=leaf[:, None],
                token_mask=COMMITTED[:, None], old_token_log_prob=TOKEN_OLD[:, None])
    out = algorithm.loss(new, (TOKEN_OLD * COMMITTED).sum(-1, keepdim=True), adv, Score(
        log_prob=step_lp.detach(), token_log_prob=TOKEN_REF[:, None]))

    def token_mean_over_the_batch(lp):  # EOSER-ASS-RL compute_loss per step / d1 per draw: token mean over the batch
        ratio = torch.exp(lp - TOKEN_OLD)
        a = adv[:, None]
        per_token = -torch.min(ratio * a, torch.clamp(ratio, 0.8, 1.2) * a)
        per_token = per_token + 0.04 * (torch.exp(TOKEN_REF - lp) - (TOKEN_REF - lp) - 1)
        return (per_token * COMMITTED).sum() / COMMITTED.sum()

    check(out, token_mean_over_the_batch, leaf)


def test_cj_grpo_is_the_authors_step_loss_with_centred_rewards():
    masked_diffusion_case("cj_grpo")


def test_diffu_grpo_is_d1s_loss_with_centred_rewards():
    masked_diffusion_case("diffu_grpo")


# ------------------------------------------------------------- one optimizer update over several passes (trainer)
def update_gradient(trainer, rollout, units, minibatches, adv):
    """The gradient the trainer accumulates for one update made of `minibatches` (index tensors) of `rollout`."""
    trainer.optimizer.zero_grad(set_to_none=True)
    updates.accumulate(trainer, rollout, units, minibatches, torch.ones(len(rollout), dtype=torch.bool), adv)
    return [p.grad.clone() for p in trainer.policy.trainable_parameters()]


def gradient_of(trainer, loss):
    trainer.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    return [p.grad.clone() for p in trainer.policy.trainable_parameters()]


def assert_same_gradient(ours, expected, other):
    """`ours` matches `expected` and not `other` (the combination the reference does not use)."""
    for a, b in zip(ours, expected):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)
    gap = max(float((b - c).abs().max()) for b, c in zip(expected, other))
    assert gap > 1e-3 * max(float(b.abs().max()) for b in expected)


def make_trainer(tmp_path, pipeline, algorithm, reward, data):
    return Trainer(config_mod.from_dict({
        "output_dir": str(tmp_path / "run"), "seed": 0, "pipeline": pipeline, "algorithm": algorithm,
        "reward": reward, "data": data, "train": {"prompts_per_step": 2, "group_size": 2, "minibatch_size": 2},
        "checkpoint": {"every": 0},
    }))


def rollout_of(trainer, prompts, group_size):
    batch = trainer.stream.next_batch(prompts).repeat(group_size, first_group_id=0)
    plan = trainer.algorithm.schedule(trainer.policy.num_steps, torch.Generator().manual_seed(0))
    return trainer.policy.sample(batch, plan, generator=torch.Generator().manual_seed(1)), plan


def test_dapo_update_of_two_minibatches_is_one_token_mean(tmp_path, tiny_qwen2_vl_dir):
    """``token_mean: update_with_signal`` divides each minibatch's token sum by the update's count of tokens with
    signal: the update's loss is one token mean over both minibatches, not the mean of the minibatches' token means."""
    examples = Path(__file__).resolve().parents[2] / "data" / "examples" / "vlm" / "count.jsonl"
    trainer = make_trainer(tmp_path, {"name": "qwen_vl", "pretrained": tiny_qwen2_vl_dir, "max_new_tokens": 6},
                           {"name": "dapo", "token_mean": "update_with_signal"}, {"name": "accuracy", "mode": "numeric"},
                           {"name": "vlm_jsonl", "train_file": str(examples), "eval_file": str(examples)})
    rollout, plan = rollout_of(trainer, 2, 3)
    rollout.mask[:, 1:] = True  # completions of different lengths: 6, 2, 4 / 3, 6, 5 tokens
    for row, length in enumerate([6, 2, 4, 3, 6, 5]):
        rollout.mask[row, length:] = False
    adv = torch.tensor([1.0, -0.5, 0.0, 0.8, -1.2, 0.4])  # a zero advantage: left out of the token count
    minibatches = [torch.tensor([0, 1, 2]), torch.tensor([3, 4, 5])]
    ours = update_gradient(trainer, rollout, plan.train_units, minibatches, adv)

    unit = plan.train_units[0]
    new = trainer.policy.log_prob(rollout, unit)
    old = rollout.old_log_probs[:, unit]
    mask = (new.mask & (adv != 0)[:, None]).float()
    ratio = torch.exp(new.log_prob - old)
    per_token = -torch.min(ratio * adv[:, None], torch.clamp(ratio, 0.8, 1.28) * adv[:, None]) * mask
    expected = gradient_of(trainer, per_token.sum() / mask.sum())
    new = trainer.policy.log_prob(rollout, unit)
    per_token = -torch.min(torch.exp(new.log_prob - old) * adv[:, None],
                           torch.clamp(torch.exp(new.log_prob - old), 0.8, 1.28) * adv[:, None]) * mask
    halves = [per_token[m].sum() / mask[m].sum() / 2 for m in minibatches]  # the mean of the minibatch means
    assert_same_gradient(ours, expected, gradient_of(trainer, sum(halves)))


def test_chunk_grpo_update_weighs_every_sample_chunk_pair_alike(tmp_path, tiny_sd3_dir):
    """GCPO divides each (sample, chunk) loss by the pairs of the update: a chunk three samples drew weighs three
    times the chunk one sample drew (not the same, as a mean per chunk would make it)."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\na blue square\n")
    trainer = make_trainer(tmp_path, {"name": "sd3", "pretrained": tiny_sd3_dir, "resolution": 32, "num_steps": 3,
                                      "guidance_scale": 1.0, "lora_rank": 4, "max_sequence_length": 16},
                           {"name": "chunk_grpo", "chunks": [1, 1], "timestep_fraction": 0.5, "clip_low": 0.2},
                           {"name": "jpeg"}, {"name": "prompt_file", "train_file": str(prompts)})
    rollout, plan = rollout_of(trainer, 2, 2)
    rollout.mask[:] = False
    rollout.mask[[0, 1, 2], 0] = True  # chunk [0]: three samples; chunk [1]: one
    rollout.mask[3, 1] = True
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    ours = update_gradient(trainer, rollout, plan.train_units, [torch.arange(4)], adv)

    def pair_losses():
        losses = []
        for unit in plan.train_units:
            new = trainer.policy.log_prob(rollout, unit)
            ratio = torch.exp((new.log_prob - rollout.old_log_probs[:, unit]).mean(1))
            trains = rollout.mask[:, unit].any(1)
            losses.append(dance_clipped(adv, ratio, 0.2, 0.2)[trains])
        return losses

    expected = gradient_of(trainer, torch.cat(pair_losses()).sum() / 4)
    per_chunk = gradient_of(trainer, sum(chunk.mean() / 2 for chunk in pair_losses()))
    assert_same_gradient(ours, expected, per_chunk)
