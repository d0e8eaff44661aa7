"""The HunyuanVideo 1.5 adapter on real diffusers classes built from tiny configs (`builders/hunyuan_video15.py`):
ODE sampling equals the stock `HunyuanVideo15Pipeline` (CFG with a negative prompt, and none), the noise levels are the
stock ones, replay reproduces the rollout, LoRA and full exports load back in the stock pipeline."""

import pytest
import torch

from builders._weights import perturb
from builders.hunyuan_video15 import tiny_policy as make_policy
from mmgrpo.algorithms.flow_grpo import FlowGRPO, FlowGRPOConfig
from mmgrpo.pipelines.hunyuan_video15 import HunyuanVideo15Config
from mmgrpo.plans import FlowPlan
from mmgrpo.types import PromptBatch
from algorithm_options import algo_config

PROMPTS = ['a red circle with the text "hi"', "two blue squares"]
FIXTURE = "tiny_hunyuan_video15_dir"


def stock(path, policy, lora=None):
    from diffusers import HunyuanVideo15Pipeline
    from diffusers.guiders import ClassifierFreeGuidance

    pipe = HunyuanVideo15Pipeline.from_pretrained(str(path))
    pipe.set_progress_bar_config(disable=True)
    pipe.guider = ClassifierFreeGuidance(guidance_scale=policy.config.guidance_scale)
    pipe.tokenizer_max_length = policy.config.max_sequence_length
    pipe.tokenizer_2_max_length = policy.config.glyph_max_length
    if lora is not None:
        pipe.transformer.load_lora_adapter(str(lora), prefix=None, use_safetensors=True)  # the pipeline has no LoRA loader
    return pipe


def stock_run(pipe, policy, prompts, output_type="pt", seed=2):
    c = policy.config
    return pipe(prompt=list(prompts), negative_prompt=[c.negative_prompt] * len(prompts), height=c.height,
                width=c.width, num_frames=c.num_frames, num_inference_steps=3, output_type=output_type,
                generator=torch.Generator().manual_seed(seed)).frames.float()


def ours(policy, prompts, seed=2):
    plan = FlowPlan.deterministic(3)
    return policy.sample(PromptBatch(list(prompts)), plan, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("guidance", [3.0, 1.0], ids=["cfg", "no-cfg"])
def test_ode_sampling_equals_stock_pipeline(tiny_hunyuan_video15_dir, tmp_path, guidance):
    """Same final latents for a batch of two prompts (one quoting glyph text), same decoded clip for one (the VAE of
    diffusers 0.42 decodes one clip per call); the saved LoRA loads with the transformer's
    `load_lora_adapter`."""
    policy = make_policy(tiny_hunyuan_video15_dir, guidance_scale=guidance, negative_prompt="blurry")
    perturb(policy, seed=1)
    policy.save_pretrained(tmp_path / "lora")
    pipe = stock(tiny_hunyuan_video15_dir, policy, tmp_path / "lora")
    rollout = ours(policy, PROMPTS)
    assert rollout.outputs["videos"].shape == (2, 3, 3, 16, 16)
    latents = stock_run(pipe, policy, PROMPTS, output_type="latent")  # [2, 4, 2, 4, 4]
    torch.testing.assert_close(rollout.trajectory["latents"][:, -1], latents, rtol=0, atol=1e-4)
    torch.testing.assert_close(ours(policy, PROMPTS[:1]).outputs["videos"], stock_run(pipe, policy, PROMPTS[:1]),
                               rtol=0, atol=1e-4)
    torch.testing.assert_close(policy.sigmas(3), pipe.scheduler.sigmas, rtol=0, atol=0)


def test_sigmas_are_the_shifted_stock_table(tiny_hunyuan_video15_dir):
    base = torch.linspace(1, 0, 4, dtype=torch.float64)[:-1]
    for shift in (7.0, 5.0):
        policy = make_policy(tiny_hunyuan_video15_dir, flow_shift=shift if shift != 7.0 else None)
        expected = torch.cat([shift * base / (1 + (shift - 1) * base), torch.zeros(1, dtype=torch.float64)])
        torch.testing.assert_close(policy.sigmas(3).double(), expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("guidance", [1.0, 3.0], ids=["no-cfg", "cfg"])
def test_replay_matches_rollout(tiny_hunyuan_video15_dir, guidance):
    policy = make_policy(tiny_hunyuan_video15_dir, guidance_scale=guidance)
    plan = FlowGRPO(algo_config(FlowGRPOConfig, noise_level=0.9)).schedule(3)
    rollout = policy.sample(PromptBatch(PROMPTS).repeat(2), plan, generator=torch.Generator().manual_seed(1))
    assert rollout.trajectory["latents"].shape == (4, 4, 4, 2, 4, 4)
    assert rollout.trajectory["shared_embeds"].shape[0] == 2  # once per distinct prompt
    with torch.no_grad():
        full = policy.log_prob(rollout, [0, 2]).log_prob
        sub = policy.log_prob(rollout.select(torch.tensor([3, 0])), [0, 2]).log_prob
    torch.testing.assert_close(full, rollout.old_log_probs[:, [0, 2]], rtol=0, atol=1e-5)
    torch.testing.assert_close(sub, rollout.old_log_probs[[3, 0]][:, [0, 2]], rtol=0, atol=1e-5)


@pytest.mark.parametrize("lora_rank, merge", [(4, True), (4, False), (0, False)], ids=["lora-merged", "lora", "full"])
def test_export_loads_in_stock_pipeline_with_identical_outputs(tiny_hunyuan_video15_dir, tmp_path, lora_rank, merge):
    """Merged LoRA and full exports load as they are; an unmerged one with the transformer's `load_lora_adapter` on
    ``lora/``, the line the model card gives for this pipeline."""
    from mmgrpo.export import LORA_FOLDER, model_card

    policy = make_policy(tiny_hunyuan_video15_dir, lora_rank=lora_rank)
    perturb(policy, seed=4)
    policy.export_pretrained(str(tmp_path / "out"), merge_lora=merge)
    expected = ours(policy, PROMPTS[:1]).outputs["videos"]
    lora = tmp_path / "out" / LORA_FOLDER if lora_rank and not merge else None
    torch.testing.assert_close(stock_run(stock(tmp_path / "out", policy, lora), policy, PROMPTS[:1]), expected,
                               rtol=0, atol=1e-4)
    config = {"pipeline": {"name": "hunyuan_video15"}, "algorithm": {"name": "flow_grpo"},
              "reward": {"name": "jpeg"}, "data": {"name": "prompt_file"}}
    card = model_card(config, 1, {}, lora=bool(lora_rank), merged=merge, loading=("HunyuanVideo15Pipeline", ""))
    assert ("load_lora_adapter(" in card) == (lora is not None) and "load_lora_weights" not in card
    base = stock_run(stock(tiny_hunyuan_video15_dir, policy), policy, PROMPTS[:1])
    assert not torch.allclose(base, expected, atol=1e-3)


@pytest.mark.parametrize(("key", "value", "fragment"), [
    ("num_frames", 4, r"num_frames must be 1 mod 2 .*use 3 or 5"), ("height", 18, "height must be a multiple of 4"),
    ("guidance_scale", 0.5, "guidance_scale"), ("flow_shift", 0.0, "flow_shift"),
])
def test_bad_options_are_refused(tiny_hunyuan_video15_dir, key, value, fragment):
    with pytest.raises(ValueError, match=fragment):
        make_policy(tiny_hunyuan_video15_dir, **{key: value})


def test_config_defaults_check_without_weights():
    config = HunyuanVideo15Config(pretrained="hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v")
    assert config.output_size()[0] == 33 * 3 * 480 * 848 * 4


def test_real_config_carries_unirls_recipe(monkeypatch):
    from pathlib import Path

    from mmgrpo import config as config_mod

    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(root)
    cfg = config_mod.load(root / "configs" / "hunyuan_video15_flow_grpo.yaml")
    pipe, algo = cfg.pipeline.options, cfg.algorithm.options
    assert cfg.pipeline.name == "hunyuan_video15"
    assert (pipe.height, pipe.width, pipe.num_frames, pipe.num_steps, pipe.flow_shift) == (480, 480, 5, 16, 5.0)
    assert (pipe.guidance_scale, pipe.lora_rank, pipe.lora_alpha, len(pipe.lora_targets)) == (1.0, 64, 64, 12)
    assert (algo.sde.noise_level, algo.clip.clip_low, algo.kl.kl_beta) == (0.25, 1e-4, 0.0)
    assert (algo.sde_window_size, algo.sde_window_range, algo.advantage.scale_rewards) == (8, [0, 2], "batch")
    assert (cfg.train.prompts_per_step, cfg.train.group_size, cfg.train.updates_per_step) == (16, 16, 2)
    assert (cfg.train.learning_rate, cfg.train.weight_decay) == (1e-5, 1e-4)


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
