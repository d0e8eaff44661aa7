"""The LTX-2 adapter on real diffusers classes built from tiny configs (`builders/ltx2.py`): ODE sampling equals the
stock `LTX2Pipeline` (called without its STG, modality guidance and rescaling, which the adapter does not implement),
with CFG on both modalities and without; the noise levels are the stock ones; replay reproduces the rollout; LoRA and
full exports load back in the stock pipeline."""

import pytest
import torch

from builders._weights import perturb
from builders.ltx2 import tiny_policy as make_policy
from mmgrpo.algorithms.flow_grpo import FlowGRPO, FlowGRPOConfig
from mmgrpo.pipelines.ltx2 import LTX2Config
from mmgrpo.plans import FlowPlan
from mmgrpo.types import PromptBatch
from algorithm_options import algo_config

PROMPTS = ["a red circle", "two blue squares"]
FIXTURE = "tiny_ltx2_dir"


def stock(path, lora=None):
    from diffusers import LTX2Pipeline

    pipe = LTX2Pipeline.from_pretrained(str(path))
    pipe.set_progress_bar_config(disable=True)
    if lora is not None:
        pipe.load_lora_weights(str(lora))
    return pipe


def stock_videos(pipe, policy, prompts=PROMPTS, seed=2):
    c = policy.config
    off = dict(stg_scale=0.0, modality_scale=1.0, guidance_rescale=0.0, audio_stg_scale=0.0, audio_modality_scale=1.0,
               audio_guidance_rescale=0.0, spatio_temporal_guidance_blocks=None)
    return pipe(prompt=list(prompts), negative_prompt=[c.negative_prompt] * len(prompts), height=c.height,
                width=c.width, num_frames=c.num_frames, frame_rate=c.frame_rate, num_inference_steps=3,
                guidance_scale=c.guidance_scale, audio_guidance_scale=c.audio_guidance_scale,
                use_cross_timestep=c.use_cross_timestep, max_sequence_length=c.max_sequence_length, output_type="pt",
                generator=torch.Generator().manual_seed(seed), **off).frames.float()


def ours(policy, prompts=PROMPTS, seed=2):
    plan = FlowPlan.deterministic(3)
    return policy.sample(PromptBatch(list(prompts)), plan, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("overrides", [dict(guidance_scale=3.0, audio_guidance_scale=5.0, negative_prompt="blurry"),
                                       dict(guidance_scale=1.0, audio_guidance_scale=1.0, use_cross_timestep=False)],
                         ids=["cfg", "no-cfg"])
def test_ode_sampling_equals_stock_pipeline(tiny_ltx2_dir, tmp_path, overrides):
    """Same clips from the same seed (the policy draws the video then the audio noise, as the pipeline); the saved
    LoRA loads with `load_lora_weights`."""
    policy = make_policy(tiny_ltx2_dir, **overrides)
    perturb(policy, seed=1)
    policy.save_pretrained(tmp_path / "lora")
    pipe = stock(tiny_ltx2_dir, tmp_path / "lora")
    rollout = ours(policy)
    assert rollout.outputs["videos"].shape == (2, 5, 3, 32, 32)
    assert rollout.trajectory["latents"].shape == (2, 4, 3 * 16 * 16 * 4 + 5 * 4)  # video tokens, then audio tokens
    torch.testing.assert_close(rollout.outputs["videos"], stock_videos(pipe, policy), rtol=0, atol=1e-4)
    torch.testing.assert_close(policy.sigmas(3), pipe.scheduler.sigmas, rtol=0, atol=0)


@pytest.mark.parametrize("guidance", [1.0, 3.0], ids=["no-cfg", "cfg"])
def test_replay_matches_rollout(tiny_ltx2_dir, guidance):
    policy = make_policy(tiny_ltx2_dir, guidance_scale=guidance, audio_guidance_scale=guidance)
    plan = FlowGRPO(algo_config(FlowGRPOConfig, noise_level=0.9)).schedule(3)
    rollout = policy.sample(PromptBatch(PROMPTS).repeat(2), plan, generator=torch.Generator().manual_seed(1))
    assert rollout.trajectory["shared_video_embeds"].shape[0] == 2  # once per distinct prompt
    with torch.no_grad():
        full = policy.log_prob(rollout, [0, 2]).log_prob
        sub = policy.log_prob(rollout.select(torch.tensor([3, 0])), [0, 2]).log_prob
    torch.testing.assert_close(full, rollout.old_log_probs[:, [0, 2]], rtol=0, atol=1e-5)
    torch.testing.assert_close(sub, rollout.old_log_probs[[3, 0]][:, [0, 2]], rtol=0, atol=1e-5)


@pytest.mark.parametrize("lora_rank, merge", [(4, True), (0, False)], ids=["lora-merged", "full"])
def test_export_loads_in_stock_pipeline_with_identical_outputs(tiny_ltx2_dir, tmp_path, lora_rank, merge):
    policy = make_policy(tiny_ltx2_dir, lora_rank=lora_rank)
    perturb(policy, seed=4)
    policy.export_pretrained(str(tmp_path / "out"), merge_lora=merge)
    expected = ours(policy).outputs["videos"]
    torch.testing.assert_close(stock_videos(stock(tmp_path / "out"), policy), expected, rtol=0, atol=1e-4)
    assert not torch.allclose(stock_videos(stock(tiny_ltx2_dir), policy), expected, atol=1e-3)


@pytest.mark.parametrize(("key", "value", "fragment"), [
    ("num_frames", 4, r"num_frames must be 1 mod 2 .*use 3 or 5"), ("height", 33, "height must be a multiple of 2"),
    ("guidance_scale", 0.5, "guidance_scale"), ("frame_rate", 0.0, "frame_rate"),
])
def test_bad_options_are_refused(tiny_ltx2_dir, key, value, fragment):
    with pytest.raises(ValueError, match=fragment):
        make_policy(tiny_ltx2_dir, **{key: value})


def test_config_defaults_check_without_weights():
    config = LTX2Config(pretrained="Lightricks/LTX-2")
    assert config.output_size()[0] == 121 * 3 * 512 * 768 * 4


def test_real_config_carries_flow_factorys_recipe(monkeypatch):
    from pathlib import Path

    from mmgrpo import config as config_mod

    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(root)
    cfg = config_mod.load(root / "configs" / "ltx2_flow_grpo.yaml")
    pipe, algo = cfg.pipeline.options, cfg.algorithm.options
    assert cfg.pipeline.name == "ltx2" and pipe.pretrained == "Lightricks/LTX-2"
    assert (pipe.height, pipe.width, pipe.num_frames, pipe.frame_rate) == (512, 768, 121, 24.0)
    assert (pipe.num_steps, pipe.eval_num_steps, pipe.guidance_scale, pipe.audio_guidance_scale) == (24, 50, 1.0, 1.0)
    assert (pipe.lora_rank, pipe.lora_alpha, len(pipe.lora_targets)) == (64, 128, 8)
    assert (algo.sde.noise_level, algo.sde.sde_type, algo.clip.clip_low, algo.kl.kl_beta) == (0.8, "cps", 1e-4, 0.0)
    assert (algo.sde_window_size, algo.sde_window_range, algo.advantage.scale_rewards) == (3, [0, 8], "batch")
    assert (cfg.train.prompts_per_step, cfg.train.group_size, cfg.train.updates_per_step) == (48, 16, 2)
    assert (cfg.train.learning_rate, cfg.train.weight_decay) == (3e-4, 1e-4)


def test_all_28_linear_layers_of_a_block_get_lora_under_the_real_targets(tiny_ltx2_dir):
    """The real config's suffixes match every linear layer of a block (video, audio, cross-modal), as Flow-Factory's
    ``default`` targets; the adapter's default keeps to the video stream."""
    targets = ["to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2", "audio_ff.net.0.proj", "audio_ff.net.2"]

    def adapted(policy):
        return {n.split(".lora_A")[0] for n, _ in policy.transformer.named_parameters()
                if n.startswith("transformer_blocks.0.") and ".lora_A" in n}

    assert len(adapted(make_policy(tiny_ltx2_dir, lora_targets=targets))) == 28
    assert not any("audio" in n for n in adapted(make_policy(tiny_ltx2_dir)))


def test_gradient_checkpointing_gives_the_same_replay_and_gradient(request):
    """``gradient_checkpointing`` recomputes the transformer's blocks in the backward pass: same log-probs, same
    gradients (same LoRA initialisation and perturbation for both policies)."""
    path = request.getfixturevalue(FIXTURE)
    plan = FlowGRPO(FlowGRPOConfig()).schedule(3)
    results = []
    for checkpointing in (False, True):
        torch.manual_seed(0)  # the LoRA initialisation
        policy = make_policy(path, gradient_checkpointing=checkpointing)
        perturb(policy, seed=5)
        rollout = policy.sample(PromptBatch(PROMPTS), plan, generator=torch.Generator().manual_seed(0))
        score = policy.log_prob(rollout, [0, 2]).log_prob
        score.sum().backward()
        results.append((score.detach(), [p.grad for p in policy.trainable_parameters()]))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=1e-6)
    assert any(g is not None for g in results[0][1])
    for plain, checkpointed in zip(results[0][1], results[1][1]):
        assert (plain is None) == (checkpointed is None)
        if plain is not None:
            torch.testing.assert_close(plain, checkpointed, rtol=1e-4, atol=1e-6)
