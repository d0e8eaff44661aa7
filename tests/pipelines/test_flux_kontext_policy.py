"""The FLUX.1 Kontext adapter on real diffusers classes built from tiny configs (`builders/flux_kontext.py`): ODE
sampling equals the stock `FluxKontextPipeline` on the same seed and input images, the input image's latents are
encoded once per image and kept for replay, merged-LoRA exports load back in the stock pipeline, a batch without
input images is refused in one line."""

import pytest
import torch

from mmgrpo.algorithms.flow_grpo import FlowGRPO, FlowGRPOConfig
from mmgrpo.pipelines.flux_kontext import FluxKontextConfig, FluxKontextPolicy
from mmgrpo.plans import FlowPlan
from mmgrpo.types import PromptBatch
from builders._weights import perturb
from builders.flux_kontext import input_images

PROMPTS = ["make the red circle blue", "remove the square"]


def make_policy(path, **overrides):
    options = dict(pretrained=path, resolution=32, num_steps=3, lora_rank=4, lora_alpha=8, max_sequence_length=16)
    return FluxKontextPolicy(FluxKontextConfig(**{**options, **overrides}))


def stock(path, lora=None):
    from diffusers import FluxKontextPipeline

    pipe = FluxKontextPipeline.from_pretrained(str(path))
    pipe.set_progress_bar_config(disable=True)
    if lora is not None:
        pipe.load_lora_weights(str(lora))
    return pipe


def to_pil(image):
    from PIL import Image

    return Image.fromarray((image.permute(1, 2, 0) * 255).round().byte().numpy())


def stock_images(pipe, policy, images, steps=3, seed=2):
    return pipe(prompt=PROMPTS, image=[to_pil(i) for i in images], num_inference_steps=steps, height=32, width=32,
                max_area=32 * 32, _auto_resize=False, guidance_scale=policy.config.guidance_scale, output_type="pt",
                generator=torch.Generator().manual_seed(seed), max_sequence_length=16).images.float()


def ours(policy, images, steps=3, seed=2):
    batch = PromptBatch(PROMPTS, conditions={"images": [[to_pil(i)] for i in images]})
    return policy.sample(batch, FlowPlan.deterministic(steps), generator=torch.Generator().manual_seed(seed))


def test_ode_sampling_equals_stock_pipeline(tiny_flux_kontext_dir, tmp_path):
    policy = make_policy(tiny_flux_kontext_dir)
    perturb(policy, seed=1)
    policy.save_pretrained(str(tmp_path / "lora"))
    pipe = stock(tiny_flux_kontext_dir, tmp_path / "lora")
    images = input_images(2)
    expected = stock_images(pipe, policy, images)
    torch.testing.assert_close(ours(policy, images).outputs["images"], expected, rtol=0, atol=1e-4)
    other = ours(policy, input_images(2, seed=5)).outputs["images"]  # the input image conditions the output
    assert not torch.allclose(other, expected, atol=1e-3)


def test_image_latents_are_encoded_once_and_replayed(tiny_flux_kontext_dir, monkeypatch):
    policy = make_policy(tiny_flux_kontext_dir, num_steps=4)
    calls = []
    encode = policy._encode_image
    monkeypatch.setattr(policy, "_encode_image", lambda images: calls.append(1) or encode(images))
    batch = PromptBatch(PROMPTS, conditions={"images": [[image] for image in input_images(2)]}).repeat(3)
    plan = FlowGRPO(FlowGRPOConfig()).schedule(4)
    rollout = policy.sample(batch, plan, generator=torch.Generator().manual_seed(1))
    assert len(calls) == 2 and rollout.trajectory["image_latents"].shape == (6, 64, 16)
    torch.testing.assert_close(rollout.trajectory["image_latents"][0], rollout.trajectory["image_latents"][2])
    steps = plan.train_units[0]
    with torch.no_grad():
        sub = policy.log_prob(rollout.select(torch.tensor([5, 0])), steps).log_prob
    torch.testing.assert_close(sub, rollout.old_log_probs[[5, 0]][:, steps], rtol=0, atol=1e-5)


def test_merged_export_loads_in_stock_pipeline(tiny_flux_kontext_dir, tmp_path):
    policy = make_policy(tiny_flux_kontext_dir)
    perturb(policy, seed=4)
    policy.export_pretrained(str(tmp_path / "out"), merge_lora=True)
    images = input_images(2)
    expected = ours(policy, images).outputs["images"]
    torch.testing.assert_close(stock_images(stock(tmp_path / "out"), policy, images), expected, rtol=0, atol=1e-4)


def test_a_batch_without_input_images_is_refused(tiny_flux_kontext_dir):
    policy = make_policy(tiny_flux_kontext_dir)
    with pytest.raises(ValueError, match=r"conditions\['images'\].*edit_jsonl"):
        policy.sample(PromptBatch(PROMPTS), FlowPlan.deterministic(2))
    two = PromptBatch(PROMPTS[:1], conditions={"images": [input_images(2)]})
    with pytest.raises(ValueError, match="has 2 input images; it takes 1 to 1"):
        policy.sample(two, FlowPlan.deterministic(2))


def test_real_config_carries_flow_factorys_kontext_recipe(monkeypatch):
    from pathlib import Path

    from mmgrpo import config as config_mod

    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(root)
    cfg = config_mod.load(root / "configs" / "flux1_kontext_dev_flow_grpo.yaml")
    pipe, algo = cfg.pipeline.options, cfg.algorithm.options
    assert cfg.pipeline.name == "flux_kontext" and pipe.pretrained == "black-forest-labs/FLUX.1-Kontext-dev"
    assert (pipe.resolution, pipe.num_steps, pipe.eval_num_steps, pipe.guidance_scale) == (384, 10, 20, 2.5)
    assert (pipe.lora_rank, pipe.lora_alpha, pipe.weights_dtype) == (64, 128, "bfloat16")
    assert (algo.sde.noise_level, algo.clip.clip_low, algo.kl.kl_beta, algo.advantage.adv_clip_max) == (0.9, 1e-4, 0.0, 5.0)
    assert (algo.sde_window_size, algo.sde_window_range, algo.advantage.scale_rewards) == (1, [1, 4], "group")
    assert (cfg.train.prompts_per_step, cfg.train.group_size, cfg.train.learning_rate) == (48, 16, 3e-4)
    assert cfg.reward.name == "pickscore" and cfg.data.name == "edit_jsonl"


def test_trainer_runs_kontext_on_shapes_edits(tmp_path, tiny_flux_kontext_dir):
    """Two trainer steps (sampling with each prompt's input image, the edit_fidelity reward, replay, update, eval) of
    the Kontext policy on `shapes_edit`; the prompt stream carries the images to the pipeline."""
    import json

    from mmgrpo import config as config_mod
    from mmgrpo.trainer import Trainer

    raw = {
        "output_dir": str(tmp_path / "run"), "seed": 3,
        "pipeline": {"name": "flux_kontext", "pretrained": tiny_flux_kontext_dir, "resolution": 32, "num_steps": 2,
                     "lora_rank": 4, "lora_alpha": 8, "max_sequence_length": 16},
        "algorithm": {"name": "flow_grpo", "clip_low": 0.2, "noise_level": 0.9},
        "reward": {"name": "edit_fidelity"},
        "data": {"name": "shapes_edit", "n_train": 4, "n_eval": 2, "size": 32},
        "train": {"max_steps": 2, "prompts_per_step": 2, "group_size": 2, "minibatch_size": 2, "learning_rate": 1e-3},
        "eval": {"every": 2, "num_prompts": 2, "grid_size": 2, "metric": "score"},
        "checkpoint": {"every": 0},
    }
    Trainer(config_mod.from_dict(raw)).train()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward/mean"] for r in records if "reward/mean" in r]
    assert len(rewards) == 2 and all(0 <= value <= 1 for value in rewards)
    assert any("eval/score" in r for r in records)
