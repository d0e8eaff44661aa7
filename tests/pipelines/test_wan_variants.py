"""The Wan 2.2 variants of the `wan` adapter on tiny real-class models: two experts (A14B), per-token timesteps (TI2V)
and first-frame image-to-video in both of diffusers' layouts, each checked against diffusers' own pipelines."""

import json
import shutil

import pytest
import torch
from PIL import Image

from builders.wan import WAN_TOKENS, tiny_policy as make_policy
from mmgrpo.algorithms.flow_grpo import FlowGRPO, FlowGRPOConfig
from mmgrpo.pipelines.wan import WanConfig
from mmgrpo.types import PromptBatch
from mmgrpo.plans import FlowPlan

PROMPTS = ["a red circle", "two blue squares"]


def seeded(seed):
    return torch.Generator().manual_seed(seed)


def perturb(policy, scale=0.05):
    with torch.no_grad():
        for p in policy.trainable_parameters():
            p.add_(torch.randn(p.shape, generator=seeded(p.numel())) * scale)


def record_calls(module, log, name):
    """Appends (`name`, timestep) to `log` at each forward of `module`."""
    return module.register_forward_pre_hook(
        lambda _, args, kwargs: log.append((name, kwargs["timestep"].detach().clone())), with_kwargs=True
    )


# ------------------------------------------------------------------------------------------------ two experts (A14B)
def test_each_expert_takes_its_side_of_the_boundary(tiny_wan_experts_dir):
    """sigma >= boundary_ratio (0.9) -> transformer, below -> transformer_2, boundary included on the high side."""
    policy = make_policy(tiny_wan_experts_dir)
    assert policy.boundary == 0.9 and len(policy.experts) == 2
    assert [policy.expert_index(s) for s in (1.0, 0.9, 0.8999, 0.3)] == [0, 0, 1, 1]
    log = []
    hooks = [record_calls(m, log, n) for n, m in policy.trainable_modules().items()]
    sigmas = policy.sigmas(3)
    policy.sample(PromptBatch(PROMPTS), FlowPlan.deterministic(3), generator=seeded(0))
    for hook in hooks:
        hook.remove()
    expected = ["transformer" if s >= 0.9 else "transformer_2" for s in sigmas[:-1].tolist()]
    assert [name for name, _ in log] == expected and set(expected) == {"transformer", "transformer_2"}


def test_a_second_expert_without_a_boundary_is_refused_before_loading(tiny_wan_experts_dir, tmp_path):
    folder = tmp_path / "no_boundary"
    shutil.copytree(tiny_wan_experts_dir, folder)
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, "boundary_ratio": None}))
    with pytest.raises(ValueError, match="has a transformer_2 but no boundary_ratio"):
        WanConfig(pretrained=str(folder), num_frames=5, height=32, width=32)


def test_lora_on_both_experts_each_trained_by_its_own_steps(tiny_wan_experts_dir):
    policy = make_policy(tiny_wan_experts_dir)
    modules = policy.trainable_modules()
    params = {n: [p for p in m.parameters() if p.requires_grad] for n, m in modules.items()}
    assert all(params.values()) and sum(map(len, params.values())) == len(policy.trainable_parameters())
    algorithm = FlowGRPO(FlowGRPOConfig())
    rollout = policy.sample(PromptBatch(PROMPTS).repeat(2), algorithm.schedule(3), generator=seeded(0))
    for step, trained, untouched in ((0, "transformer", "transformer_2"), (2, "transformer_2", "transformer")):
        policy.transformer.zero_grad(set_to_none=True)
        modules["transformer_2"].zero_grad(set_to_none=True)
        out = algorithm.loss(policy.log_prob(rollout, [step]), rollout.old_log_probs[:, [step]],
                             torch.tensor([1.0, -1.0, 0.5, -0.5]), None)
        out.loss.backward()
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in params[trained])
        assert all(p.grad is None or p.grad.abs().sum() == 0 for p in params[untouched])


@pytest.mark.parametrize("lora_rank", [4, 0])
def test_two_experts_save_and_reload(tiny_wan_experts_dir, tmp_path, lora_rank):
    policy = make_policy(tiny_wan_experts_dir, lora_rank=lora_rank)
    perturb(policy)
    plan, batch = FlowPlan.deterministic(3), PromptBatch(PROMPTS)
    expected = policy.sample(batch, plan, generator=seeded(5)).outputs["videos"]
    policy.save_pretrained(tmp_path / "ckpt")
    if lora_rank:
        assert (tmp_path / "ckpt" / "transformer_2" / "pytorch_lora_weights.safetensors").is_file()
    else:
        assert (tmp_path / "ckpt" / "transformer_2" / "config.json").is_file()
    reloaded = make_policy(tiny_wan_experts_dir, lora_rank=lora_rank)
    reloaded.load_trainable(tmp_path / "ckpt")
    assert torch.equal(reloaded.sample(batch, plan, generator=seeded(5)).outputs["videos"], expected)
    half = make_policy(tiny_wan_experts_dir, lora_rank=lora_rank)  # only the high-noise expert's weights
    half.experts[0].load(tmp_path / "ckpt")
    assert not torch.equal(half.sample(batch, plan, generator=seeded(5)).outputs["videos"], expected)


def test_two_experts_with_their_guidance_equal_plain_diffusers(tiny_wan_experts_dir, tmp_path):
    """ODE rollout with CFG 3.0 / 2.0 per expert and both LoRAs = WanPipeline's loop with the LoRAs loaded by diffusers
    (``load_into_transformer_2`` for the second expert's file)."""
    from diffusers import WanPipeline

    policy = make_policy(tiny_wan_experts_dir, guidance_scale=3.0, guidance_scale_2=2.0)
    perturb(policy)
    policy.save_pretrained(tmp_path / "lora")
    ours = policy.sample(PromptBatch(PROMPTS), FlowPlan.deterministic(3), generator=seeded(2)).outputs["videos"]
    pipe = WanPipeline.from_pretrained(tiny_wan_experts_dir)
    pipe.load_lora_weights(tmp_path / "lora")
    pipe.load_lora_weights(tmp_path / "lora" / "transformer_2", load_into_transformer_2=True)
    theirs = pipe(
        prompt=PROMPTS, num_frames=5, height=32, width=32, num_inference_steps=3, guidance_scale=3.0,
        guidance_scale_2=2.0, output_type="pt", max_sequence_length=WAN_TOKENS,
        latents=torch.randn(2, 16, 2, 4, 4, generator=seeded(2)),
    ).frames
    torch.testing.assert_close(ours, theirs.float(), rtol=0, atol=1e-4)


# -------------------------------------------------------------------------------------- per-token timesteps (TI2V)
def test_expand_timesteps_feeds_one_timestep_per_token(tiny_wan_dir, tmp_path):
    """Text-to-video with ``expand_timesteps``: timesteps `[n, T h w / 4]`, all 1000 sigma, and the same velocity as
    one timestep per sample."""
    folder = tmp_path / "expand"
    shutil.copytree(tiny_wan_dir, folder)
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, "expand_timesteps": True}))
    plain, expanded = make_policy(tiny_wan_dir), make_policy(str(folder))
    assert expanded.geometry.expand_timesteps and not plain.geometry.expand_timesteps
    log = []
    hook = record_calls(expanded.transformer, log, "t")
    x = torch.randn(2, 16, 2, 4, 4, generator=seeded(0))
    embeds = expanded._pick(expanded.encode(PromptBatch(PROMPTS)), None)
    with torch.no_grad():
        v_expanded = expanded.velocity(x, torch.tensor(0.6), embeds)
        v_plain = plain.velocity(x, torch.tensor(0.6), embeds)
    hook.remove()
    timestep = log[0][1]
    assert timestep.shape == (2, 2 * 2 * 2)  # latent frames x (4 / 2) x (4 / 2) tokens
    torch.testing.assert_close(timestep, torch.full((2, 8), 600.0))
    torch.testing.assert_close(v_expanded, v_plain, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------------------ image-to-video
def _images():
    colours = [(200, 30, 30), (30, 30, 200)]
    return [Image.new("RGB", (32, 32), c) for c in colours]


@pytest.mark.parametrize("fixture", ["tiny_wan_ti2v_dir", "tiny_wan_i2v_dir"])
def test_image_to_video_equals_diffusers_and_replays(fixture, request):
    """First-frame conditioning (TI2V: the image's latent in the first frame, timestep 0 on its tokens; I2V: mask and
    image latents as extra channels) gives WanImageToVideoPipeline's videos; the SDE rollout replays."""
    from diffusers import WanImageToVideoPipeline

    path = request.getfixturevalue(fixture)
    policy = make_policy(path, image_to_video=True, guidance_scale=2.0)
    images = _images()
    batch = PromptBatch(PROMPTS, conditions={"images": images})
    ours = policy.sample(batch, FlowPlan.deterministic(3), generator=seeded(4)).outputs["videos"]
    pipe = WanImageToVideoPipeline.from_pretrained(path)
    theirs = torch.cat([
        pipe(image=image, prompt=prompt, num_frames=5, height=32, width=32, num_inference_steps=3, guidance_scale=2.0,
             output_type="pt", max_sequence_length=WAN_TOKENS, latents=latents[None]).frames
        for image, prompt, latents in zip(images, PROMPTS, torch.randn(2, 16, 2, 4, 4, generator=seeded(4)))
    ])
    torch.testing.assert_close(ours, theirs.float(), rtol=0, atol=1e-4)
    plan = FlowGRPO(FlowGRPOConfig()).schedule(3)
    rollout = policy.sample(batch.repeat(2), plan, generator=seeded(1))
    with torch.no_grad():
        replay = policy.log_prob(rollout, [0, 1, 2]).log_prob
    torch.testing.assert_close(replay, rollout.old_log_probs, rtol=0, atol=1e-5)


def test_ti2v_first_frame_is_the_image_and_not_generated(tiny_wan_ti2v_dir):
    """TI2V: the condition latent is encoded once per image (a group shares it), the first latent frame's velocity is
    0 (no parameter moves it), and the decoded first frame is the image's, whatever the noise."""
    policy = make_policy(tiny_wan_ti2v_dir, image_to_video=True)
    calls = []
    hook = policy.pipe.vae.encoder.register_forward_hook(lambda *args: calls.append(1))
    batch = PromptBatch(PROMPTS, conditions={"images": _images()}).repeat(3)
    rollout = policy.sample(batch, FlowPlan.deterministic(3), generator=seeded(0))
    hook.remove()
    assert len(calls) == 2  # two images for six samples
    embeds = policy._pick(rollout.trajectory, None)
    v = policy.velocity(torch.randn(6, 16, 2, 4, 4), torch.tensor(0.5), embeds)
    assert torch.count_nonzero(v[:, :, 0]) == 0 and torch.count_nonzero(v[:, :, 1]) > 0
    other = policy.sample(batch, FlowPlan.deterministic(3), generator=seeded(9)).outputs["videos"]
    videos = rollout.outputs["videos"]
    torch.testing.assert_close(videos[:, 0], other[:, 0], rtol=0, atol=1e-5)  # first frame: the image's decoding
    assert (videos[:, -1] - other[:, -1]).abs().max() > 1e-3  # later frames: generated


def test_image_to_video_without_images_or_on_a_text_model_is_refused(tiny_wan_ti2v_dir, tiny_wan_i2v_dir, tiny_wan_dir):
    policy = make_policy(tiny_wan_ti2v_dir, image_to_video=True)
    with pytest.raises(ValueError, match=r"conditions\['images'\]"):
        policy.sample(PromptBatch(PROMPTS), FlowPlan.deterministic(3), generator=seeded(0))
    with pytest.raises(ValueError, match="it is an image-to-video model; set image_to_video: true"):
        WanConfig(pretrained=tiny_wan_i2v_dir, num_frames=5, height=32, width=32)
    with pytest.raises(ValueError, match="this model has no image input"):
        WanConfig(pretrained=tiny_wan_dir, num_frames=5, height=32, width=32, image_to_video=True)


def test_a_clip_image_encoder_model_is_refused_before_loading(tiny_wan_i2v_dir, tmp_path):
    """Wan 2.1 I2V's transformer takes CLIP image features (image_dim), which the adapter does not compute."""
    folder = tmp_path / "wan21_i2v"
    shutil.copytree(tiny_wan_i2v_dir, folder)
    config = json.loads((folder / "transformer" / "config.json").read_text())
    (folder / "transformer" / "config.json").write_text(json.dumps({**config, "image_dim": 1280}))
    with pytest.raises(ValueError, match=r"CLIP image features \(image_dim=1280, Wan 2.1 I2V\)"):
        WanConfig(pretrained=str(folder), num_frames=5, height=32, width=32, image_to_video=True)
