"""The Qwen-Image-Edit adapter on real diffusers classes built from tiny configs (`builders/qwen_image_edit.py`): ODE
sampling equals the stock `QwenImageEditPipeline` (true CFG with the image-aware negative prompt, or none) on the
same seed and input images, each (instruction, image) is encoded once and replayed, a merged-LoRA export loads back
in the stock pipeline."""

import pytest
import torch

from mmgrpo.algorithms.flow_grpo import FlowGRPO, FlowGRPOConfig
from mmgrpo.pipelines.qwen_image_edit import QwenImageEditConfig, QwenImageEditPolicy
from mmgrpo.plans import FlowPlan
from mmgrpo.types import PromptBatch
from builders._weights import perturb
from builders.flux_kontext import input_images
from builders.qwen_image_edit import CONDITION_AREA

PROMPTS = ["make the red circle blue", "remove the square"]


def make_policy(path, **overrides):
    options = dict(pretrained=path, resolution=32, num_steps=3, true_cfg_scale=2.0, lora_rank=4, lora_alpha=8,
                   max_sequence_length=32, weights_dtype="float32", condition_area=CONDITION_AREA)
    return QwenImageEditPolicy(QwenImageEditConfig(**{**options, **overrides}))


def to_pil(image):
    from PIL import Image

    return Image.fromarray((image.permute(1, 2, 0) * 255).round().byte().numpy())


def stock_images(path, policy, images, monkeypatch, lora=None, steps=3, seed=2):
    """The stock pipeline's images, its input-image size (1024 x 1024 in the stock code) set to the policy's."""
    from diffusers import QwenImageEditPipeline
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit

    side = policy.condition_size
    monkeypatch.setattr(pipeline_qwenimage_edit, "calculate_dimensions", lambda area, ratio: (side, side, None))
    pipe = QwenImageEditPipeline.from_pretrained(str(path))
    pipe.set_progress_bar_config(disable=True)
    if lora is not None:
        pipe.load_lora_weights(str(lora))
    c = policy.config
    negative = [c.negative_prompt] * len(PROMPTS) if c.true_cfg_scale > 1 else None
    return pipe(prompt=PROMPTS, image=[to_pil(i) for i in images], negative_prompt=negative,
                true_cfg_scale=c.true_cfg_scale, num_inference_steps=steps, height=32, width=32, output_type="pt",
                generator=torch.Generator().manual_seed(seed), max_sequence_length=32).images.float()


def ours(policy, images, steps=3, seed=2):
    batch = PromptBatch(PROMPTS, conditions={"images": [[to_pil(i)] for i in images]})
    return policy.sample(batch, FlowPlan.deterministic(steps), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("cfg", [2.0, 1.0], ids=["true-cfg", "no-cfg"])
def test_ode_sampling_equals_stock_pipeline(tiny_qwen_image_edit_dir, tmp_path, monkeypatch, cfg):
    policy = make_policy(tiny_qwen_image_edit_dir, true_cfg_scale=cfg)
    perturb(policy, seed=1)
    policy.save_pretrained(str(tmp_path / "lora"))
    images = input_images(2)
    expected = stock_images(tiny_qwen_image_edit_dir, policy, images, monkeypatch, lora=tmp_path / "lora")
    torch.testing.assert_close(ours(policy, images).outputs["images"], expected, rtol=0, atol=1e-4)
    first, other = ours(policy, images).trajectory, ours(policy, input_images(2, seed=5)).trajectory
    for key in ("image_latents", "prompt_embeds"):  # the input image conditions the transformer and the text states
        assert not torch.allclose(first[key], other[key], atol=1e-3), key


def test_each_edit_is_encoded_once_and_replayed(tiny_qwen_image_edit_dir, monkeypatch):
    policy = make_policy(tiny_qwen_image_edit_dir, num_steps=4)
    calls = []
    encode = policy._encode_with
    monkeypatch.setattr(policy, "_encode_with", lambda p, i: calls.append(len(p)) or encode(p, i))
    batch = PromptBatch(PROMPTS, conditions={"images": [[image] for image in input_images(2)]}).repeat(3)
    plan = FlowGRPO(FlowGRPOConfig()).schedule(4)
    rollout = policy.sample(batch, plan, generator=torch.Generator().manual_seed(1))
    assert calls == [2, 2]  # the instructions, then the negative prompt, each once per distinct edit
    assert rollout.trajectory["image_latents"].shape == (6, 64, 16)
    steps = plan.train_units[0]
    with torch.no_grad():
        sub = policy.log_prob(rollout.select(torch.tensor([5, 0])), steps).log_prob
    torch.testing.assert_close(sub, rollout.old_log_probs[[5, 0]][:, steps], rtol=0, atol=1e-5)


def test_merged_export_loads_in_stock_pipeline(tiny_qwen_image_edit_dir, tmp_path, monkeypatch):
    policy = make_policy(tiny_qwen_image_edit_dir)
    perturb(policy, seed=4)
    policy.export_pretrained(str(tmp_path / "out"), merge_lora=True)
    images = input_images(2)
    expected = ours(policy, images).outputs["images"]
    torch.testing.assert_close(stock_images(tmp_path / "out", policy, images, monkeypatch), expected, rtol=0, atol=1e-4)


def test_config_errors_name_the_fix(tiny_qwen_image_edit_dir):
    with pytest.raises(ValueError, match="condition_area"):
        QwenImageEditConfig(pretrained=tiny_qwen_image_edit_dir, condition_area=10)


def test_edit_plus_with_two_input_images_equals_stock_pipeline(tiny_qwen_image_edit_plus_dir, tmp_path, monkeypatch):
    """Qwen-Image-Edit-Plus: two input images per prompt (``Picture 1``, ``Picture 2`` read by Qwen2.5-VL at the
    vision size, both VAE-encoded side by side); ODE sampling with true CFG equals the stock pipeline (its 384 x 384 and
    1024 x 1024 sizes set to the policy's), prompt by prompt as the stock pipeline runs them."""
    from diffusers import QwenImageEditPlusPipeline
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as plus

    policy = make_policy(tiny_qwen_image_edit_plus_dir, vision_area=48 * 48)
    assert policy.plus
    perturb(policy, seed=1)
    policy.save_pretrained(str(tmp_path / "lora"))
    monkeypatch.setattr(plus, "CONDITION_IMAGE_SIZE", 48 * 48)
    monkeypatch.setattr(plus, "VAE_IMAGE_SIZE", CONDITION_AREA)
    pipe = QwenImageEditPlusPipeline.from_pretrained(tiny_qwen_image_edit_plus_dir)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(tmp_path / "lora"))
    rows = [[to_pil(i) for i in input_images(2, seed=s)] for s in (0, 1)]
    batch = PromptBatch(PROMPTS, conditions={"images": rows})
    ours_images = policy.sample(batch, FlowPlan.deterministic(3), generator=torch.Generator().manual_seed(2))
    assert ours_images.trajectory["image_latents"].shape == (2, 128, 16)  # two 8 x 8 grids per prompt
    for k, (prompt, row) in enumerate(zip(PROMPTS, rows)):
        noise = policy._noise(2, torch.Generator().manual_seed(2))[k:k + 1]  # the rollout's initial noise of row k
        expected = pipe(prompt=prompt, image=row, negative_prompt=" ", true_cfg_scale=2.0, num_inference_steps=3,
                        height=32, width=32, output_type="pt", latents=noise, max_sequence_length=32).images.float()
        torch.testing.assert_close(ours_images.outputs["images"][k:k + 1], expected, rtol=0, atol=1e-4)


def test_real_config_carries_flow_factorys_edit_plus_recipe(monkeypatch, tiny_qwen_image_edit_plus_dir):
    """`configs/qwen_image_edit_plus_flow_grpo.yaml` holds Flow-Factory's Edit-Plus LoRA recipe, and its LoRA targets
    (attention and both MLPs) exist in the Qwen-Image transformer."""
    from builders._stock_equality import load_flow_factory_config

    cfg = load_flow_factory_config(monkeypatch, "qwen_image_edit_plus_flow_grpo", noise_level=1.0)
    pipe, algo = cfg.pipeline.options, cfg.algorithm.options
    assert cfg.pipeline.name == "qwen_image_edit" and pipe.pretrained == "Qwen/Qwen-Image-Edit-2509"
    assert pipe.pipeline_name() == "QwenImageEditPlusPipeline"
    assert (pipe.resolution, pipe.condition_area, pipe.vision_area) == (384, 384 * 384, 384 * 384)
    assert (pipe.num_steps, pipe.eval_num_steps, pipe.true_cfg_scale, pipe.negative_prompt) == (10, 40, 4.0, " ")
    assert (pipe.lora_rank, pipe.lora_alpha, pipe.gradient_checkpointing, cfg.train.sharding) == (64, 128, True, "fsdp")
    assert (algo.advantage.adv_clip_max, algo.advantage.scale_rewards, cfg.train.updates_per_step) == (5.0, "group", 2)
    assert cfg.reward.name == "pickscore" and cfg.data.name == "edit_jsonl"
    policy = make_policy(tiny_qwen_image_edit_plus_dir, lora_targets=pipe.lora_targets)
    adapted = {name.split(".lora_A")[0] for name, _ in policy.transformer.named_parameters() if ".lora_A" in name}
    for target in pipe.lora_targets:
        assert any(name.endswith(target) for name in adapted), target
    assert any("img_mlp" in name for name in adapted) and any("txt_mlp" in name for name in adapted)
