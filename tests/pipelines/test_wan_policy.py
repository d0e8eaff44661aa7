"""RL correctness of the Wan (video) adapter with Flow-GRPO, on real diffusers classes built from tiny configs:
shapes, refusals before loading, replay, ratio 1, zero advantage, checkpoints, agreement with plain diffusers."""

import copy
import json
import shutil

import pytest
import torch

from builders.wan import WAN_TOKENS, tiny_policy as make_policy
from mmgrpo.algorithms.flow_grpo import FlowGRPO, FlowGRPOConfig
from mmgrpo.pipelines.wan import WanConfig
from mmgrpo.types import PromptBatch
from mmgrpo.plans import FlowPlan
from algorithm_options import algo_config

PROMPTS = ["a red circle", "two blue squares", "a green triangle left of a yellow circle"]


def seeded(seed):
    return torch.Generator().manual_seed(seed)


def trained_steps(plan):
    return [s for unit in plan.train_units for s in unit]


def test_latent_and_video_shapes(tiny_wan_dir):
    """Latents [N, z, (F - 1) / 4 + 1, H / 8, W / 8] at every step; videos [N, F, 3, H, W] in [0, 1]."""
    policy = make_policy(tiny_wan_dir, num_frames=9, height=48, width=32)
    rollout = policy.sample(PromptBatch(PROMPTS[:2]), FlowPlan.deterministic(3), generator=seeded(0))
    assert rollout.trajectory["latents"].shape == (2, 4, 16, 3, 6, 4)
    videos = rollout.outputs["videos"]
    assert videos.shape == (2, 9, 3, 48, 32) and videos.min() >= 0 and videos.max() <= 1
    assert videos.std() > 0  # a decoded clip, not a constant


def test_sigmas_are_the_shifted_flow_table(tiny_wan_dir):
    """Wan's UniPC flow sigmas: ``u = linspace(1, 1/1000, S + 1)[:-1]`` shifted by ``s u / (1 + (s - 1) u)`` (s = 3),
    then 0; the first stays exactly 1 (UniPC's own table has 1 - 1e-6 there, a noise scale of 1000 for the SDE)."""
    policy = make_policy(tiny_wan_dir)
    u = torch.linspace(1, 1 / 1000, 4, dtype=torch.float64)[:-1]  # [1, 0.667, 0.334]

    def table(s):
        return torch.cat([s * u / (1 + (s - 1) * u), torch.zeros(1, dtype=torch.float64)]).float()

    torch.testing.assert_close(policy.sigmas(3), table(3.0), rtol=0, atol=1e-6)
    torch.testing.assert_close(make_policy(tiny_wan_dir, flow_shift=5.0).sigmas(3), table(5.0), rtol=0, atol=1e-6)
    assert policy.pipe.scheduler.sigmas[0] < 1  # the scheduler's own first sigma, which the policy takes as 1


@pytest.mark.parametrize(("frames", "height", "width", "fragment"), [
    (6, 32, 32, r"num_frames must be 1 mod 4 .*got 6; use 5 or 9"),
    (5, 40, 32, r"height must be a positive multiple of 16 \(VAE downsampling 8 x transformer patch 2"),
    (5, 32, 24, r"width must be a positive multiple of 16"),
])
def test_bad_video_sizes_are_refused_before_loading(tiny_wan_dir, frames, height, width, fragment, monkeypatch):
    import diffusers

    monkeypatch.setattr(diffusers.WanPipeline, "from_pretrained", lambda *a, **k: pytest.fail("loaded a model"))
    with pytest.raises(ValueError, match=fragment):
        WanConfig(pretrained=tiny_wan_dir, num_frames=frames, height=height, width=width)


def test_the_rule_comes_from_the_model_folder(tiny_wan_dir, tmp_path):
    """A model whose VAE compresses time by 2 and space by 4 accepts 3 frames of 8 x 8 (refused for Wan 2.1)."""
    folder = tmp_path / "other"
    shutil.copytree(tiny_wan_dir, folder)
    config = json.loads((folder / "vae" / "config.json").read_text())
    config.update(scale_factor_temporal=2, scale_factor_spatial=4)
    (folder / "vae" / "config.json").write_text(json.dumps(config))
    WanConfig(pretrained=str(folder), num_frames=3, height=8, width=8)
    with pytest.raises(ValueError, match="1 mod 4"):
        WanConfig(pretrained=tiny_wan_dir, num_frames=3, height=16, width=16)
    hub = WanConfig(pretrained="Wan-AI/Wan2.1-T2V-1.3B-Diffusers", num_frames=33, height=240, width=416)  # no lookup
    assert hub.pretrained == "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"
    # a hub id's model checks wait for its configs: an I2V model with guidance for two experts is accepted here
    WanConfig(pretrained="Wan-AI/Wan2.2-I2V-A14B-Diffusers", num_frames=5, height=480, width=480, image_to_video=True,
              guidance_scale_2=3.0)


@pytest.mark.parametrize(("key", "value", "fragment"), [
    ("guidance_scale", 0.5, "guidance_scale"), ("lora_rank", -1, "lora_rank"), ("flow_shift", 0.0, "flow_shift"),
    ("guidance_scale_2", 3.0, "guidance_scale_2 is the low-noise expert's guidance"),
    ("image_to_video", True, "image_to_video: this model has no image input"),
])
def test_bad_options_are_refused(tiny_wan_dir, key, value, fragment):
    with pytest.raises(ValueError, match=fragment):
        WanConfig(pretrained=tiny_wan_dir, num_frames=5, height=32, width=32, **{key: value})


@pytest.mark.parametrize("guidance_scale", [1.0, 3.0])
@pytest.mark.parametrize("window", [0, 2])
def test_replay_consistency(tiny_wan_dir, guidance_scale, window):
    policy = make_policy(tiny_wan_dir, guidance_scale=guidance_scale)
    plan = FlowGRPO(algo_config(FlowGRPOConfig, sde_window_size=window)).schedule(3, torch.Generator().manual_seed(0))
    rollout = policy.sample(PromptBatch(PROMPTS).repeat(2), plan, generator=torch.Generator().manual_seed(3))
    assert rollout.old_log_probs.shape == (6, 3)
    steps = trained_steps(plan)
    for step in steps:  # step by step
        with torch.no_grad():
            replay = policy.log_prob(rollout, [step]).log_prob
        torch.testing.assert_close(replay, rollout.old_log_probs[:, [step]], rtol=0, atol=1e-5)
    broken = copy.copy(rollout)  # a wrong next latent must NOT replay to the same log-prob
    broken.trajectory = dict(rollout.trajectory, latents=rollout.trajectory["latents"].flip(0))
    with torch.no_grad():
        wrong = policy.log_prob(broken, steps).log_prob
    assert (wrong - rollout.old_log_probs[:, steps]).abs().max() > 1e-3


def test_ratio_is_one_on_policy_and_zero_advantage_gives_zero_gradient(tiny_wan_dir):
    policy = make_policy(tiny_wan_dir)
    algorithm = FlowGRPO(FlowGRPOConfig())
    rollout = policy.sample(PromptBatch(PROMPTS).repeat(2), algorithm.schedule(3), generator=seeded(0))

    def grads(advantages):
        policy.transformer.zero_grad(set_to_none=True)
        out = algorithm.loss(policy.log_prob(rollout, [1]), rollout.old_log_probs[:, [1]], advantages, None)
        out.loss.backward()
        return out, [p.grad if p.grad is not None else torch.zeros_like(p) for p in policy.trainable_parameters()]

    out, zero = grads(torch.zeros(6))
    assert out.metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-6) and out.metrics["clip_frac"] == 0.0
    assert all(torch.count_nonzero(g) == 0 for g in zero)
    _, some = grads(torch.randn(6, generator=torch.Generator().manual_seed(0)))
    assert any(torch.count_nonzero(g) > 0 for g in some)


def test_optimizer_step_moves_lora_and_leaves_reference(tiny_wan_dir):
    policy = make_policy(tiny_wan_dir)
    algorithm = FlowGRPO(algo_config(FlowGRPOConfig, kl_beta=0.1))
    rollout = policy.sample(PromptBatch(PROMPTS).repeat(2), algorithm.schedule(3), generator=seeded(0))
    with torch.no_grad(), policy.reference():
        ref_before = policy.log_prob(rollout, [1])
    optimizer = torch.optim.AdamW(policy.trainable_parameters(), lr=1e-2)
    new = policy.log_prob(rollout, [1])
    with torch.no_grad(), policy.reference():
        ref = policy.log_prob(rollout, [1])
    algorithm.loss(new, rollout.old_log_probs[:, [1]], torch.randn(6), ref).loss.backward()
    optimizer.step()
    with torch.no_grad():
        with policy.reference():
            ref_after = policy.log_prob(rollout, [1])
        current = policy.log_prob(rollout, [1])
    assert torch.equal(ref_before.mean, ref_after.mean)
    assert not torch.equal(current.mean, ref_after.mean)


@pytest.mark.parametrize("lora_rank", [4, 0])
def test_save_and_reload_reproduce_samples(tiny_wan_dir, tmp_path, lora_rank):
    policy = make_policy(tiny_wan_dir, lora_rank=lora_rank)
    with torch.no_grad():
        for p in policy.trainable_parameters():
            p.add_(torch.randn_like(p) * 0.05)
    plan, batch = FlowPlan.deterministic(3), PromptBatch(PROMPTS)
    expected = policy.sample(batch, plan, generator=torch.Generator().manual_seed(5)).outputs["videos"]
    policy.save_pretrained(tmp_path / "ckpt")
    reloaded = make_policy(tiny_wan_dir, lora_rank=lora_rank)
    before = reloaded.sample(batch, plan, generator=torch.Generator().manual_seed(5)).outputs["videos"]
    assert not torch.equal(before, expected)  # the saved weights make the difference
    reloaded.load_trainable(tmp_path / "ckpt")
    got = reloaded.sample(batch, plan, generator=torch.Generator().manual_seed(5)).outputs["videos"]
    assert torch.equal(expected, got)


def test_ode_sampling_equals_plain_diffusers_with_lora(tiny_wan_euler_dir, tmp_path):
    """With a flow-matching Euler scheduler our deterministic rollout is WanPipeline's own loop: the same videos,
    with CFG, from the same initial latents; the saved LoRA loads with diffusers' `load_lora_weights`."""
    from diffusers import WanPipeline

    policy = make_policy(tiny_wan_euler_dir, guidance_scale=3.0, negative_prompt="blurry")
    with torch.no_grad():
        for p in policy.trainable_parameters():
            p.add_(torch.randn_like(p) * 0.05)
    policy.save_pretrained(tmp_path / "lora")
    ours = policy.sample(PromptBatch(PROMPTS[:2]), FlowPlan.deterministic(3), generator=seeded(2))
    pipe = WanPipeline.from_pretrained(tiny_wan_euler_dir)
    pipe.load_lora_weights(tmp_path / "lora")
    theirs = pipe(
        prompt=PROMPTS[:2], negative_prompt="blurry", num_frames=5, height=32, width=32, num_inference_steps=3,
        guidance_scale=3.0, output_type="pt", max_sequence_length=WAN_TOKENS,
        latents=torch.randn(2, 16, 2, 4, 4, generator=torch.Generator().manual_seed(2)),
    ).frames
    assert theirs.shape == ours.outputs["videos"].shape
    torch.testing.assert_close(ours.outputs["videos"], theirs.float(), rtol=0, atol=1e-4)


def test_real_wan_configs_carry_their_recipes(monkeypatch):
    """The real-model configs load without weights (hub ids are not looked up) with the peers' settings."""
    from pathlib import Path

    from mmgrpo import config as config_mod

    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(root)
    cfg = config_mod.load(root / "configs" / "wan2_1_t2v_1_3b_flow_grpo.yaml")
    pipe, algo = cfg.pipeline.options, cfg.algorithm.options
    assert cfg.pipeline.name == "wan" and pipe.pretrained == "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"
    assert (pipe.num_frames, pipe.height, pipe.width, pipe.num_steps, pipe.eval_num_steps) == (33, 240, 416, 20, 50)
    assert (pipe.guidance_scale, algo.sde.noise_level, algo.clip.clip_low, algo.kl.kl_beta) == (4.5, 0.7, 1e-3, 0.004)
    assert cfg.train.group_size == 4 and cfg.train.learning_rate == 1e-4 and cfg.reward.options.modality == "video"
    cfg = config_mod.load(root / "configs" / "wan2_2_t2v_a14b_flow_grpo.yaml")
    pipe, algo = cfg.pipeline.options, cfg.algorithm.options
    assert (pipe.guidance_scale, pipe.guidance_scale_2, pipe.flow_shift, pipe.num_steps) == (4.0, 3.0, 3.0, 10)
    assert (pipe.lora_rank, pipe.lora_alpha, cfg.train.group_size) == (64, 128, 16)
    assert (algo.sde.noise_level, algo.kl.kl_beta, algo.clip.clip_low) == (0.9, 0.0, 1e-4)
    starts = {tuple(FlowGRPO(algo).schedule(10, seeded(seed)).sde_steps) for seed in range(40)}
    assert starts == {(1,), (2,), (3,)}  # one SDE step, drawn from steps 1-3
