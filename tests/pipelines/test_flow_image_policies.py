"""RL correctness of the flow-matching text-to-image adapters (SD3, FLUX) with Flow-GRPO, on real diffusers classes
built from tiny configs (`builders/sd3.py`, `builders/flux.py`): the same checks for each pipeline. Checks that
concern one pipeline only live in `test_sd3_policy.py` and `test_flux_policy.py`."""

import copy
import importlib
import json

import pytest
import torch

from mmgrpo.algorithms.flow_grpo import FlowGRPO, FlowGRPOConfig
from mmgrpo.types import PromptBatch
from mmgrpo.plans import FlowPlan
from algorithm_options import algo_config

PROMPTS = ["a red circle", "two blue squares", "a green triangle left of a yellow circle"]
PIPELINES = ["sd3", "flux"]
# pipeline -> (policy class, its config class, options of the 4-step 32 x 32 LoRA test policy)
POLICIES = {
    "sd3": ("SD3Policy", "SD3Config", dict(resolution=32, num_steps=4, guidance_scale=1.0, lora_rank=4,
                                           max_sequence_length=16)),
    "flux": ("FluxPolicy", "FluxConfig", dict(resolution=32, num_steps=4, lora_rank=4, lora_alpha=8,
                                              max_sequence_length=16)),
}
# Flow-GRPO options of the replay and ratio checks (FLUX's tiny model needs more noise for a clear wrong-replay gap)
GRPO_OPTIONS = {"sd3": {}, "flux": {"noise_level": 0.9}}
# the rollout's latents per sample: [S + 1, C, h, w] for SD3; [S + 1, (32/2/2)^2 packed tokens, 4 x 4] for FLUX
LATENTS = {"sd3": (5, 4, 16, 16), "flux": (5, 64, 16)}
# diffusers classes of the whole pipeline and of its transformer
DIFFUSERS = {
    "sd3": ("StableDiffusion3Pipeline", "SD3Transformer2DModel"),
    "flux": ("FluxPipeline", "FluxTransformer2DModel"),
}


@pytest.fixture(params=PIPELINES)
def tiny(request):
    """``(pipeline name, tiny model folder)`` from the pipeline's builder."""
    return request.param, request.getfixturevalue(f"tiny_{request.param}_dir")


def make_policy(name, path, **overrides):
    policy_cls, config_cls, options = POLICIES[name]
    module = importlib.import_module(f"mmgrpo.pipelines.{name}")
    return getattr(module, policy_cls)(getattr(module, config_cls)(pretrained=path, **{**options, **overrides}))


def trained_steps(plan):
    return [s for unit in plan.train_units for s in unit]


def perturb(policy, scale=0.05):
    with torch.no_grad():
        for p in policy.trainable_parameters():
            p.add_(torch.randn_like(p) * scale)


REPLAY_CASES = [("sd3", {"guidance_scale": 1.0}), ("sd3", {"guidance_scale": 3.0}), ("flux", {})]


@pytest.mark.parametrize("window", [0, 2])
@pytest.mark.parametrize("num_prompts", [1, 3])
@pytest.mark.parametrize("name, overrides", REPLAY_CASES, ids=["sd3-cfg1", "sd3-cfg3", "flux"])
def test_replay_consistency(request, name, overrides, window, num_prompts):
    policy = make_policy(name, request.getfixturevalue(f"tiny_{name}_dir"), **overrides)
    algorithm = FlowGRPO(algo_config(FlowGRPOConfig, sde_window_size=window, **GRPO_OPTIONS[name]))
    plan = algorithm.schedule(4, torch.Generator().manual_seed(0))
    batch = PromptBatch(PROMPTS[:num_prompts]).repeat(2)
    rollout = policy.sample(batch, plan, generator=torch.Generator().manual_seed(3))
    assert rollout.old_log_probs.shape == (2 * num_prompts, 4)
    assert rollout.outputs["images"].shape == (2 * num_prompts, 3, 32, 32)
    assert rollout.trajectory["latents"].shape == (2 * num_prompts, *LATENTS[name])
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


def _grad_of_loss(policy, algorithm, rollout, steps, advantages):
    policy.transformer.zero_grad(set_to_none=True)
    for unit in [[s] for s in steps]:
        new = policy.log_prob(rollout, unit)
        algorithm.loss(new, rollout.old_log_probs[:, unit], advantages, None).loss.backward()
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in policy.trainable_parameters()]


def test_ratio_is_one_on_policy_and_zero_advantage_gives_zero_gradient(tiny):
    name, path = tiny
    policy = make_policy(name, path)
    algorithm = FlowGRPO(algo_config(FlowGRPOConfig, **GRPO_OPTIONS[name]))
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


def test_optimizer_step_moves_lora_and_leaves_reference(tiny):
    name, path = tiny
    policy = make_policy(name, path)
    algorithm = FlowGRPO(algo_config(FlowGRPOConfig, kl_beta=0.1))
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
        with policy.reference():
            ref_after = policy.log_prob(rollout, [1])
        current = policy.log_prob(rollout, [1])
    assert torch.equal(ref_before.mean, ref_after.mean)
    assert not torch.equal(current.mean, ref_after.mean)


def test_full_finetune_reference_is_frozen_copy(tiny):
    name, path = tiny
    policy = make_policy(name, path, lora_rank=0)
    assert all(p.dtype == torch.float32 for p in policy.trainable_parameters())
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


@pytest.mark.parametrize("lora_rank", [4, 0])
def test_save_and_reload_reproduce_samples(tiny, tmp_path, lora_rank):
    name, path = tiny
    policy = make_policy(name, path, lora_rank=lora_rank)
    perturb(policy)
    plan = FlowPlan.deterministic(4)
    batch = PromptBatch(PROMPTS)
    expected = policy.sample(batch, plan, generator=torch.Generator().manual_seed(5)).outputs["images"]
    policy.save_pretrained(tmp_path / "ckpt")
    reloaded = make_policy(name, path, lora_rank=lora_rank)
    reloaded.load_trainable(tmp_path / "ckpt")
    got = reloaded.sample(batch, plan, generator=torch.Generator().manual_seed(5)).outputs["images"]
    assert torch.equal(expected, got)
    if lora_rank == 0:  # the full transformer is a diffusers folder that loads on its own, with the trained weights
        import diffusers

        transformer_cls = getattr(diffusers, DIFFUSERS[name][1])
        loaded = transformer_cls.from_pretrained(tmp_path / "ckpt" / "transformer").state_dict()
        trained = policy.transformer.state_dict()
        assert loaded.keys() == trained.keys() and all(torch.equal(loaded[k], trained[k]) for k in trained)


def test_lora_checkpoint_loads_in_plain_diffusers(tiny, tmp_path):
    """The saved LoRA is a standard diffusers LoRA with adapter metadata: the diffusers pipeline's `from_pretrained` +
    `load_lora_weights` gives our samples (same initial noise from the same generator, same sigmas, same guidance)."""
    import diffusers
    from safetensors import safe_open

    from mmgrpo.hub import load_diffusers_pipeline

    name, path = tiny
    guidance = {"sd3": 1.0, "flux": 3.5}[name]
    policy = make_policy(name, path, guidance_scale=guidance)
    perturb(policy)
    policy.save_pretrained(tmp_path / "lora")
    with safe_open(str(tmp_path / "lora" / "pytorch_lora_weights.safetensors"), "pt") as f:
        metadata = json.loads(f.metadata()["lora_adapter_metadata"])
    assert metadata["transformer.r"] == 4 and metadata["transformer.lora_alpha"] == policy.config.lora_alpha
    assert metadata["transformer.base_model_name_or_path"] == path  # the base model as configured
    plan = FlowPlan.deterministic(4)
    ours = policy.sample(PromptBatch(PROMPTS[:2]), plan, generator=torch.Generator().manual_seed(2))
    pipe = load_diffusers_pipeline(getattr(diffusers, DIFFUSERS[name][0]), path)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(tmp_path / "lora")
    theirs = pipe(
        prompt=PROMPTS[:2], num_inference_steps=4, guidance_scale=guidance, height=32, width=32, output_type="pt",
        generator=torch.Generator().manual_seed(2), max_sequence_length=16,
    ).images
    torch.testing.assert_close(ours.outputs["images"], theirs.float(), rtol=0, atol=1e-4)
    torch.testing.assert_close(pipe.scheduler.sigmas, policy.sigmas(4), rtol=0, atol=0)
