"""RL correctness of the SD3 adapter with Flow-GRPO, on real diffusers classes built from tiny configs."""

import copy

import pytest
import torch

from mmgrpo.algorithms.flow_grpo import FlowGRPO, FlowGRPOConfig
from mmgrpo.pipelines.sd3 import SD3Config, SD3Policy
from mmgrpo.types import FlowPlan, PromptBatch

PROMPTS = ["a red circle", "two blue squares", "a green triangle left of a yellow circle"]


def make_policy(path, **overrides):
    options = dict(pretrained=path, resolution=32, num_steps=4, guidance_scale=1.0, lora_rank=4, max_sequence_length=16)
    options.update(overrides)
    return SD3Policy(SD3Config(**options))


def trained_steps(plan):
    return [s for unit in plan.train_units for s in unit]


@pytest.mark.parametrize("guidance_scale", [1.0, 3.0])
@pytest.mark.parametrize("window", [0, 2])
@pytest.mark.parametrize("num_prompts", [1, 3])
def test_replay_consistency(tiny_sd3_dir, guidance_scale, window, num_prompts):
    policy = make_policy(tiny_sd3_dir, guidance_scale=guidance_scale)
    plan = FlowGRPO(FlowGRPOConfig(sde_window_size=window)).schedule(4, torch.Generator().manual_seed(0))
    batch = PromptBatch(PROMPTS[:num_prompts]).repeat(2)
    rollout = policy.sample(batch, plan, generator=torch.Generator().manual_seed(3))
    assert rollout.old_log_probs.shape == (2 * num_prompts, 4)
    assert rollout.outputs["images"].shape == (2 * num_prompts, 3, 32, 32)
    steps = trained_steps(plan)
    with torch.no_grad():
        replay = policy.log_prob(rollout, steps).log_prob
    torch.testing.assert_close(replay, rollout.old_log_probs[:, steps], rtol=0, atol=1e-5)
    # a different (wrong) next latent must NOT replay to the same log-prob: the check can fail
    broken = copy.copy(rollout)
    broken.trajectory = dict(rollout.trajectory, latents=rollout.trajectory["latents"].flip(0))
    with torch.no_grad():
        wrong = policy.log_prob(broken, steps).log_prob
    assert (wrong - rollout.old_log_probs[:, steps]).abs().max() > 1e-3


def test_window_plan_marks_only_window_steps(tiny_sd3_dir):
    policy = make_policy(tiny_sd3_dir)
    plan = FlowGRPO(FlowGRPOConfig(sde_window_size=2, sde_window_range=[1, 3])).schedule(4, torch.Generator().manual_seed(0))
    rollout = policy.sample(PromptBatch(PROMPTS[:2]).repeat(2), plan, generator=torch.Generator().manual_seed(0))
    assert rollout.mask.sum(1).tolist() == [2] * 4
    ode = [i for i in range(4) if i not in plan.sde_steps]
    assert torch.equal(rollout.old_log_probs[:, ode], torch.zeros(4, len(ode)))


def _grad_of_loss(policy, algorithm, rollout, steps, advantages):
    policy.transformer.zero_grad(set_to_none=True)
    for unit in [[s] for s in steps]:
        new = policy.log_prob(rollout, unit)
        algorithm.loss(new, rollout.old_log_probs[:, unit], advantages, None).loss.backward()
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in policy.trainable_parameters()]


def test_ratio_is_one_on_policy_and_zero_advantage_gives_zero_gradient(tiny_sd3_dir):
    policy = make_policy(tiny_sd3_dir)
    algorithm = FlowGRPO(FlowGRPOConfig())
    plan = algorithm.schedule(4)
    rollout = policy.sample(PromptBatch(PROMPTS).repeat(2), plan, generator=torch.Generator().manual_seed(0))
    new = policy.log_prob(rollout, [0, 1])
    out = algorithm.loss(new, rollout.old_log_probs[:, [0, 1]], torch.randn(6), None)
    assert out.metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert out.metrics["clip_frac"] == 0.0
    grads = _grad_of_loss(policy, algorithm, rollout, [0, 1], torch.zeros(6))
    assert all(torch.count_nonzero(g) == 0 for g in grads)
    grads = _grad_of_loss(policy, algorithm, rollout, [0, 1], torch.randn(6))
    assert any(torch.count_nonzero(g) > 0 for g in grads)


def test_optimizer_step_moves_lora_and_leaves_reference(tiny_sd3_dir):
    policy = make_policy(tiny_sd3_dir)
    algorithm = FlowGRPO(FlowGRPOConfig(kl_beta=0.1))
    plan = algorithm.schedule(4)
    rollout = policy.sample(PromptBatch(PROMPTS).repeat(2), plan, generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), policy.reference():
        ref_before = policy.log_prob(rollout, [1])
    before = [p.detach().clone() for p in policy.trainable_parameters()]
    optimizer = torch.optim.AdamW(policy.trainable_parameters(), lr=1e-2)
    new = policy.log_prob(rollout, [1])
    with torch.no_grad(), policy.reference():
        ref = policy.log_prob(rollout, [1])
    algorithm.loss(new, rollout.old_log_probs[:, [1]], torch.randn(6), ref).loss.backward()
    optimizer.step()
    assert any(not torch.equal(a, b) for a, b in zip(before, policy.trainable_parameters()))
    with torch.no_grad():
        ref_after_ctx = policy.reference()
        with ref_after_ctx:
            ref_after = policy.log_prob(rollout, [1])
        current = policy.log_prob(rollout, [1])
    assert torch.equal(ref_before.mean, ref_after.mean)
    assert not torch.equal(current.mean, ref_after.mean)


def test_full_finetune_reference_is_frozen_copy(tiny_sd3_dir):
    policy = make_policy(tiny_sd3_dir, lora_rank=0)
    plan = FlowGRPO(FlowGRPOConfig()).schedule(4)
    rollout = policy.sample(PromptBatch(PROMPTS[:1]).repeat(2), plan, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for p in policy.trainable_parameters():
            p.add_(0.01)
        with policy.reference():
            ref = policy.log_prob(rollout, [0]).log_prob
        cur = policy.log_prob(rollout, [0]).log_prob
    torch.testing.assert_close(ref, rollout.old_log_probs[:, [0]], rtol=0, atol=1e-5)
    assert not torch.allclose(cur, ref)


def test_gradient_accumulation_1x4_equals_4x1(tiny_sd3_dir):
    policy = make_policy(tiny_sd3_dir)
    algorithm = FlowGRPO(FlowGRPOConfig(clip_low=0.2))
    plan = algorithm.schedule(4)
    rollout = policy.sample(PromptBatch(PROMPTS[:2]).repeat(2), plan, generator=torch.Generator().manual_seed(0))
    advantages = torch.tensor([1.0, -0.5, 2.0, -1.0])
    params = policy.trainable_parameters()

    def accumulate(chunks):
        for p in params:
            p.grad = None
        for index in torch.arange(4).split(4 // chunks):
            sub = rollout.select(index)
            out = algorithm.loss(policy.log_prob(sub, [2]), sub.old_log_probs[:, [2]], advantages[index], None)
            (out.loss * len(index) / 4).backward()
        return [p.grad.clone() for p in params]

    for a, b in zip(accumulate(1), accumulate(4)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("lora_rank", [4, 0])
def test_save_and_reload_reproduce_samples(tiny_sd3_dir, tmp_path, lora_rank):
    policy = make_policy(tiny_sd3_dir, lora_rank=lora_rank)
    with torch.no_grad():
        for p in policy.trainable_parameters():
            p.add_(torch.randn_like(p) * 0.05)
    plan = FlowPlan.deterministic(4)
    batch = PromptBatch(PROMPTS)
    expected = policy.sample(batch, plan, generator=torch.Generator().manual_seed(5)).outputs["images"]
    policy.save_pretrained(tmp_path / "ckpt")
    reloaded = make_policy(tiny_sd3_dir, lora_rank=lora_rank)
    reloaded.load_trainable(tmp_path / "ckpt")
    got = reloaded.sample(batch, plan, generator=torch.Generator().manual_seed(5)).outputs["images"]
    assert torch.equal(expected, got)


def test_lora_checkpoint_loads_in_plain_diffusers(tiny_sd3_dir, tmp_path):
    """The saved LoRA is a standard diffusers LoRA: `from_pretrained` + `load_lora_weights` gives our samples."""
    from diffusers import StableDiffusion3Pipeline

    from mmgrpo.hub import load_diffusers_pipeline

    policy = make_policy(tiny_sd3_dir)
    with torch.no_grad():
        for p in policy.trainable_parameters():
            p.add_(torch.randn_like(p) * 0.05)
    policy.save_pretrained(tmp_path / "lora")
    ours = policy.sample(PromptBatch(PROMPTS[:2]), FlowPlan.deterministic(4), generator=torch.Generator().manual_seed(2))
    pipe = load_diffusers_pipeline(StableDiffusion3Pipeline, tiny_sd3_dir)
    pipe.load_lora_weights(tmp_path / "lora")
    theirs = pipe(
        prompt=PROMPTS[:2], num_inference_steps=4, guidance_scale=1.0, height=32, width=32, output_type="pt",
        latents=torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(2)), max_sequence_length=16,
    ).images
    torch.testing.assert_close(ours.outputs["images"], theirs.float(), rtol=0, atol=1e-4)
