"""The Qwen-VL adapter on the Qwen3 families (tiny real-class Qwen3-VL, Qwen3-VL-MoE, Qwen3.5 and Qwen3.5-MoE models
saved and reloaded with `from_pretrained`): the prefix-shared group forward equals the naive one (log-probs and
gradients, LoRA and full fine-tuning; images, several images, timestamped video; Qwen3.5's linear-attention states),
16-pixel patches on a 32-pixel grid, the frames' timestamps, the box frame each family declares, the token-algorithm
contract, and the export loaded by stock transformers / peft with identical outputs."""

from functools import partial

import pytest
import torch
from qwen_vl_utils import smart_resize

from mmgrpo import registry
from mmgrpo.algorithms.grpo import GRPO, GRPOConfig
from mmgrpo.pipelines.qwen_vl import QwenVLConfig, QwenVLPolicy
from mmgrpo.plans import TokenPlan
from mmgrpo.types import PromptBatch
from builders._qwen_vl_batches import image, scored_grads, vision_batch, vl_policy

# Qwen3.5's Gated DeltaNet decays (exp of cumulative sums of -exp(A_log) * softplus(a + dt_bias), a = in_proj_a(x)) are
# summed in another chunking when the completion continues the cached prompt: the small gradients of what makes them
# agree to float32 cancellation
DECAY_PARAMETERS = ("A_log", "dt_bias", "in_proj_a.weight")


policy = partial(vl_policy, max_new_tokens=6)


@pytest.mark.parametrize("fixture, lora", [("tiny_qwen3_vl_dir", True), ("tiny_qwen3_vl_moe_dir", True),
                                          ("tiny_qwen3_5_moe_dir", True), ("tiny_qwen3_vl_dir", False),
                                          ("tiny_qwen3_5_dir", False)])
def test_prefix_shared_forward_equals_naive(request, fixture, lora):
    options = {} if lora else {"lora_rank": 0, "freeze_vision": False}
    pol = policy(request, fixture, **options)
    rollout = pol.sample(vision_batch(2, image_and_video=True), GRPO(GRPOConfig()).schedule(pol.num_steps),
                         generator=torch.Generator().manual_seed(0))
    steps = list(range(pol.num_steps))
    shared, shared_grads = scored_grads(pol, rollout, steps, shared=True)
    naive, naive_grads = scored_grads(pol, rollout, steps, shared=False)
    torch.testing.assert_close(shared, naive, rtol=0, atol=1e-5)
    torch.testing.assert_close(shared[rollout.mask], rollout.old_log_probs[rollout.mask], rtol=0, atol=1e-5)
    assert shared_grads.keys() == naive_grads.keys() and shared_grads
    if not lora:
        assert any(".visual." in f".{name}" for name in shared_grads)  # gradients reach the (shared) vision tower
    for name, grad in shared_grads.items():  # equal up to float32 summation order, relative to the tensor's scale
        rel = 5e-3 if name.endswith(DECAY_PARAMETERS) else 1e-5
        assert (grad - naive_grads[name]).abs().max() <= rel * naive_grads[name].abs().max() + 1e-7, name


def test_images_are_resized_on_the_32_pixel_grid_and_the_box_frame_is_declared(request):
    """16-pixel patches merged 2 x 2: qwen-vl-utils resizes to multiples of 32 and the vision tower gets that grid;
    the recorded ``input_size`` is that frame, and the prompt's metadata carries the family's box frame."""
    pol = policy(request, "tiny_qwen3_vl_dir", max_new_tokens=1, min_pixels=1024, max_pixels=20_000)
    grids = []
    pol.model.model.visual.register_forward_pre_hook(
        lambda module, args, kwargs: grids.append(kwargs["grid_thw"].tolist()), with_kwargs=True)
    batch = PromptBatch(["where?"], metadata=[{"image_size": [200, 90]}],
                        conditions={"images": [image(200, 90, (9, 99, 9))]})
    pol.sample(batch, TokenPlan.deterministic(1))
    h, w = smart_resize(90, 200, factor=32, min_pixels=1024, max_pixels=20_000)
    assert grids == [[[1, h // 16, w // 16]]]
    assert batch.metadata[0]["input_size"] == [w, h] and batch.metadata[0]["coords"] == "norm1000"


@pytest.mark.parametrize("fixture, frame", [("tiny_qwen2_vl_dir", "norm1000"), ("tiny_qwen2_5_vl_dir", "resized"),
                                            ("tiny_qwen3_5_dir", "norm1000")])
def test_each_family_declares_its_box_frame(request, fixture, frame):
    pol = policy(request, fixture, max_new_tokens=1)
    batch = PromptBatch(["where?", "and here?"], conditions={"images": [image(64, 64, (1, 2, 3)), None]})
    pol.sample(batch, TokenPlan.deterministic(1))
    assert pol.box_frame == frame and [m["coords"] for m in batch.metadata] == [frame, frame]


@pytest.mark.parametrize("fps", [2.0, 4.0])
def test_video_frames_carry_their_timestamps(request, fps):
    """Qwen3-VL writes ``<t seconds>`` before each merged frame: the mean time of its 2 frames at ``video_fps``."""
    pol = policy(request, "tiny_qwen3_vl_dir", max_new_tokens=1, video_fps=fps)
    frames = [image(64, 64, (0, 50 * i, 120)) for i in range(4)]
    encoded = pol.encode_prompt("what moves?", [], [frames])
    text = pol.processor.tokenizer.decode(encoded["input_ids"])
    stamps = [f"<{(2 * k + 0.5) / fps:.1f} seconds>" for k in range(2)]  # frames (0, 1) and (2, 3)
    assert all(stamp in text for stamp in stamps) and text.count("seconds>") == 2, text
    assert encoded["video_grid_thw"].tolist() == [[2, 4, 4]]  # 64 x 64 frames: 4 x 4 patches of 16, 2 time steps


def test_frame_list_fps_sets_qwen2_5_temporal_spacing(request):
    """A frame list is played at ``video_fps`` for Qwen2.5-VL too (its ``second_per_grid_ts`` = 2 / fps)."""
    pol = policy(request, "tiny_qwen2_5_vl_dir", max_new_tokens=1, video_fps=4.0)
    encoded = pol.encode_prompt("what moves?", [], [[image(64, 64, (0, 9, 9))] * 4])
    assert encoded["second_per_grid_ts"].tolist() == [0.5]


TOKEN_ALGORITHMS = sorted(n for n in registry.available("algorithm")
                          if registry.get("algorithm", n).plan_family == "token")


@pytest.fixture(scope="module")
def contract_policy(tiny_qwen3_vl_dir):
    """One tiny Qwen3-VL LoRA policy for the contract of every token algorithm (its LoRA is reset by each test)."""
    return QwenVLPolicy(QwenVLConfig(pretrained=tiny_qwen3_vl_dir, max_new_tokens=6, lora_rank=4, lora_alpha=8))


@pytest.mark.parametrize("algorithm_name", TOKEN_ALGORITHMS)
def test_token_algorithm_contract_on_qwen3_vl(contract_policy, algorithm_name, request, monkeypatch):
    """The registry contract (`tests/core/test_contracts.py`), unchanged, with the Qwen3-VL policy as `qwen_vl`'s."""
    from core import test_contracts

    with torch.no_grad():
        for name, param in contract_policy.model.named_parameters():
            if "lora_B" in name:
                param.zero_()  # the initial adapter: its reference equals the policy
    contract_policy.model.zero_grad(set_to_none=True)
    monkeypatch.setattr(test_contracts, "_build_policy", lambda name, request: contract_policy)
    test_contracts.test_pipeline_contract("qwen_vl", algorithm_name, request)


# (model, LoRA rank (0: fully fine-tuned), merged): LoRA merged by peft or beside the base model in lora/, a full model
EXPORTS = [("tiny_qwen3_vl_dir", 4, True), ("tiny_qwen3_vl_dir", 4, False), ("tiny_qwen3_5_dir", 4, False),
           ("tiny_qwen3_vl_moe_dir", 0, False)]


@pytest.mark.parametrize("fixture, lora_rank, merge", EXPORTS)
def test_export_loads_in_stock_transformers_and_peft_with_identical_outputs(request, tmp_path, fixture, lora_rank,
                                                                           merge):
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    from mmgrpo.export import LORA_FOLDER

    pol = policy(request, fixture, max_new_tokens=1, lora_rank=lora_rank)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(4)
        for param in pol.trainable_parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    pol.export_pretrained(str(tmp_path / "out"), merge_lora=merge)
    model = AutoModelForImageTextToText.from_pretrained(str(tmp_path / "out")).eval()
    assert type(model) is type(pol.model)
    if lora_rank and not merge:
        model = PeftModel.from_pretrained(model, str(tmp_path / "out" / LORA_FOLDER)).eval()
    inputs = pol.encode_prompt("how many circles?", [image(100, 80, (255, 0, 0))], [])
    batch = {k: v[None] if k in ("input_ids", "mm_token_type_ids") else v for k, v in inputs.items()}
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).logits, pol.model.eval()(**batch).logits, rtol=0, atol=1e-5)


def test_grounding_run_with_the_model_frame_then_mmgrpo_export(tmp_path, tiny_qwen3_vl_dir):
    """The trainer, unchanged, on the tiny Qwen3-VL: grounding with ``box_iou`` in the frame the pipeline declares
    (``coords: model``) and a checkpoint; its adapter moved off zero (a random tiny model earns no reward, so the step
    does not update), then ``mmgrpo export``: stock transformers + peft load the adapter beside the base model and give
    the logits of the policy the checkpoint holds."""
    from pathlib import Path

    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    from mmgrpo import cli
    from mmgrpo import config as config_mod
    from mmgrpo.checkpoint import WEIGHTS
    from mmgrpo.export import LORA_FOLDER
    from mmgrpo.trainer import Trainer

    examples = Path(__file__).resolve().parents[2] / "data" / "examples" / "vlm" / "grounding.jsonl"
    raw = {
        "output_dir": str(tmp_path / "run"), "seed": 0,
        "pipeline": {"name": "qwen_vl", "pretrained": tiny_qwen3_vl_dir, "max_new_tokens": 4, "lora_rank": 4,
                     "lora_alpha": 8},
        "algorithm": {"name": "grpo", "kl_beta": 0.0},
        "reward": {"name": "box_iou", "coords": "model"},
        "data": {"name": "vlm_jsonl", "train_file": str(examples), "eval_file": str(examples)},
        "train": {"max_steps": 1, "prompts_per_step": 2, "group_size": 2, "minibatch_size": 2, "learning_rate": 1e-2},
        "eval": {"every": 0, "num_prompts": 2, "metric": "score"},
        "checkpoint": {"every": 1, "keep_last": 1},
    }
    trainer = Trainer(config_mod.from_dict(raw))
    trainer.train()
    assert {item["metadata"]["coords"] for item in trainer.stream.items if "coords" in item["metadata"]} == {"norm1000"}
    checkpoint = next((tmp_path / "run" / "checkpoints").glob("step_*"))
    pol = QwenVLPolicy(QwenVLConfig(pretrained=tiny_qwen3_vl_dir, max_new_tokens=4, lora_rank=4, lora_alpha=8))
    pol.load_trainable(str(checkpoint / WEIGHTS))
    inputs = pol.encode_prompt("where is the red box?", [image(90, 70, (200, 10, 10))], [])
    batch = {k: v[None] if k in ("input_ids", "mm_token_type_ids") else v for k, v in inputs.items()}
    with torch.no_grad():
        base = pol.model.eval()(**batch).logits
        generator = torch.Generator().manual_seed(5)
        for param in pol.trainable_parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
        ours = pol.model(**batch).logits
    assert not torch.allclose(base, ours, atol=1e-4)
    pol.save_pretrained(str(checkpoint / WEIGHTS))
    assert cli.main(["export", str(tmp_path / "run"), str(tmp_path / "out")]) == 0
    model = AutoModelForImageTextToText.from_pretrained(str(tmp_path / "out")).eval()
    model = PeftModel.from_pretrained(model, str(tmp_path / "out" / LORA_FOLDER)).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).logits, ours, rtol=0, atol=1e-5)


def test_pixel_budgets_are_checked_against_the_32_pixel_cell(tiny_qwen3_vl_dir):
    """The config reads the checkpoint's patch x merge: one 32 x 32 cell (64 x 64 for frame lists) at least."""
    with pytest.raises(ValueError, match=r"^max_pixels must be >= 1024"):
        QwenVLConfig(pretrained=tiny_qwen3_vl_dir, min_pixels=784, max_pixels=900)
    with pytest.raises(ValueError, match=r"^video_max_pixels must be >= 4096"):
        QwenVLConfig(pretrained=tiny_qwen3_vl_dir, video_max_pixels=4000)
    assert QwenVLConfig(pretrained=tiny_qwen3_vl_dir, min_pixels=1024, max_pixels=1024).max_pixels == 1024
