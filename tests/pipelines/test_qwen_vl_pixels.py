"""One pixel budget decides what a Qwen-VL model sees (tiny real-class models saved and reloaded with
`from_pretrained`): qwen-vl-utils resizes each image (or video frame) once, within the configured budget or, when it
is unset, within the processor's saved one; the processor does not resize again, the vision tower receives that grid,
the recorded ``input_size`` is that frame, and a saved processor carries the budget. Also the validation of every
value of the pipeline's Config."""

import math

import pytest
import torch
from PIL import Image
from qwen_vl_utils import fetch_video, smart_resize
from transformers import AutoProcessor

from mmgrpo.pipelines.qwen_vl import QwenVLConfig, QwenVLPolicy
from mmgrpo.types import PromptBatch
from mmgrpo.plans import TokenPlan

PATCH, FACTOR = 14, 28  # the tiny models' patch size; patch x spatial merge
SAVED = (56 * 56, 112 * 112)  # the budget the tiny processors were saved with (builders/qwen_vl.py)
SIZES = [(200, 90), (64, 300), (333, 222)]  # (width, height), none square
# (min_pixels, max_pixels); None: the processor's saved budget. Every budget but None differs from the saved one.
BUDGETS = [None, (784, 5000), (1000, 100_000), (40_000, 200_000)]


def make_policy(request, fixture="tiny_qwen2_5_vl_dir", **options):
    options = {"max_new_tokens": 1, "lora_rank": 4, "lora_alpha": 8, **options}
    return QwenVLPolicy(QwenVLConfig(pretrained=request.getfixturevalue(fixture), **options))


def capture_vision_grids(policy) -> list[dict]:
    """Records what the vision tower receives on each call: ``grid`` `[items, 3]` and the number of patch rows."""
    calls = []

    def hook(module, args, kwargs):
        calls.append({"grid": kwargs["grid_thw"].tolist(), "patches": int(args[0].shape[0])})

    policy.model.model.visual.register_forward_pre_hook(hook, with_kwargs=True)
    return calls


def image_batch() -> PromptBatch:
    images = [Image.new("RGB", size, (40 * i, 200, 90)) for i, size in enumerate(SIZES)]
    metadata = [{"image_size": list(size)} for size in SIZES]
    metadata[0]["input_size"] = [1, 1]  # stale: not the frame this model sees
    batch = PromptBatch([f"where is shape {i}?" for i in range(len(SIZES))], metadata=metadata,
                        conditions={"images": images})
    batch.group_ids = torch.arange(len(SIZES))
    return batch


@pytest.mark.parametrize("fixture, budget", [("tiny_qwen2_5_vl_dir", b) for b in BUDGETS]
                         + [("tiny_qwen2_vl_dir", b) for b in (None, BUDGETS[-1])])
def test_images_are_resized_once_within_the_configured_budget(request, fixture, budget, tmp_path):
    """For each image: the grid the vision tower receives x the patch size == qwen-vl-utils' resize within the
    budget == the recorded ``input_size`` (a stale one from the prompt source replaced), and its area lies in the
    budget."""
    options = {} if budget is None else {"min_pixels": budget[0], "max_pixels": budget[1]}
    pol = make_policy(request, fixture, **options)
    low, high = budget or SAVED
    calls = capture_vision_grids(pol)
    batch = image_batch()
    pol.sample(batch, TokenPlan.deterministic(1))
    assert len(calls) == 1 and calls[0]["patches"] == sum(t * h * w for t, h, w in calls[0]["grid"])
    for (width, height), grid, metadata in zip(SIZES, calls[0]["grid"], batch.metadata):
        expected_h, expected_w = smart_resize(height, width, factor=FACTOR, min_pixels=low, max_pixels=high)
        assert grid == [1, expected_h // PATCH, expected_w // PATCH], (width, height)
        assert metadata["input_size"] == [expected_w, expected_h]
        assert low <= expected_w * expected_h <= high
    # the budget travels with the checkpoint: a saved processor resizes the same way
    pol.save_pretrained(str(tmp_path))
    saved = AutoProcessor.from_pretrained(str(tmp_path))
    for part in (saved.image_processor, saved.video_processor) if budget is None else (saved.image_processor,):
        assert (part.size["shortest_edge"], part.size["longest_edge"]) == (low, high)


def test_budgets_cover_downscaling_upscaling_and_rounding_only():
    """The cases above exercise all three: an image shrunk to fit, one enlarged, one only rounded to the grid."""
    kinds = set()
    for low, high in [b or SAVED for b in BUDGETS]:
        for width, height in SIZES:
            h, w = smart_resize(height, width, factor=FACTOR, min_pixels=low, max_pixels=high)
            rounded = (round(height / FACTOR) * FACTOR, round(width / FACTOR) * FACTOR)
            kinds.add("down" if h * w < height * width and (h, w) != rounded else
                      "up" if h * w > height * width and (h, w) != rounded else "round")
    assert kinds == {"down", "up", "round"}


@pytest.mark.parametrize("budget", [None, (3136, 8000), (20_000, 60_000)])
def test_video_frames_are_resized_once_within_the_configured_budget(request, budget):
    """A non-square frame list: the video grid the vision tower receives is qwen-vl-utils' frame size within the
    per-frame budget (the processor's saved one when unset)."""
    options = {} if budget is None else {"video_min_pixels": budget[0], "video_max_pixels": budget[1]}
    pol = make_policy(request, **options)
    low, high = budget or SAVED
    frames = [Image.new("RGB", (200, 90), (0, 50 * i, 120)) for i in range(4)]
    expected = fetch_video({"video": frames, "min_pixels": low, "max_pixels": high}, image_patch_size=PATCH)
    _, _, height, width = expected.shape  # [frames, 3, H, W]
    calls = capture_vision_grids(pol)
    batch = PromptBatch(["what moves?"], metadata=[{}], conditions={"video": [frames]})
    pol.sample(batch, TokenPlan.deterministic(1))
    assert len(calls) == 1 and calls[0]["grid"] == [[2, height // PATCH, width // PATCH]]
    assert low <= height * width <= high


@pytest.mark.parametrize("key", ["max_new_tokens", "min_pixels", "max_pixels", "video_min_pixels", "lora_rank"])
@pytest.mark.parametrize("value", [0, -3, 2.5, True, "12"])
def test_config_refuses_non_positive_or_non_integer_counts(tmp_path, key, value):
    if key == "lora_rank" and value == 0:
        return  # rank 0 means full fine-tuning
    with pytest.raises(ValueError, match=rf"^{key}\b"):
        QwenVLConfig(pretrained=str(tmp_path), **{key: value})


@pytest.mark.parametrize("options, key", [
    ({"min_pixels": 5000, "max_pixels": 4000}, "min_pixels"),
    ({"video_min_pixels": 5000, "video_max_pixels": 4000}, "video_min_pixels"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"temperature": 0.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": float("nan")}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"eval_max_new_tokens": 0}, "eval_max_new_tokens"),
    ({"video_fps": 0.0}, "video_fps"),
    ({"video_fps": math.inf}, "video_fps"),
    ({"lora_alpha": 0}, "lora_alpha"),
    ({"lora_dropout": 1.0}, "lora_dropout"),
    ({"lora_dropout": -0.1}, "lora_dropout"),
    ({"lora_targets": []}, "lora_targets"),
    ({"lora_targets": "q_proj"}, "lora_targets"),
    ({"weights_dtype": "fp8"}, "weights_dtype"),
    ({"attn_implementation": "fast"}, "attn_implementation"),
    ({"system_prompt": 3}, "system_prompt"),
    ({"freeze_vision": "no"}, "freeze_vision"),
    ({"prefix_sharing": 1}, "prefix_sharing"),
])
def test_config_refuses_out_of_range_values_naming_the_key(tmp_path, options, key):
    with pytest.raises(ValueError, match=rf"^{key}\b"):
        QwenVLConfig(pretrained=str(tmp_path), **options)


def test_config_errors_name_the_pipeline_key_when_read_from_a_config_file(tmp_path):
    from mmgrpo.validation import build_dataclass

    with pytest.raises(ValueError, match=r"^pipeline\.min_pixels must be <= 4000, got 5000; lower it or raise max"):
        build_dataclass(QwenVLConfig, {"pretrained": str(tmp_path), "min_pixels": 5000, "max_pixels": 4000}, "pipeline")


def test_config_accepts_its_defaults_and_a_full_budget(tmp_path):
    config = QwenVLConfig(pretrained=str(tmp_path), min_pixels=3136, max_pixels=3136, video_min_pixels=784,
                          video_max_pixels=5000, top_p=1.0, top_k=5, lora_rank=0, lora_dropout=0.1)
    assert (config.min_pixels, config.max_pixels) == (3136, 3136)


def test_a_budget_too_small_for_an_image_shape_names_the_key(request):
    """qwen-vl-utils floors a downscaled side to a multiple of 28 without a lower bound: a clear error, not PIL's."""
    pol = make_policy(request, min_pixels=784, max_pixels=2000)
    batch = PromptBatch(["where?"], metadata=[{}], conditions={"images": [Image.new("RGB", (300, 10))]})
    with pytest.raises(ValueError, match=r"zero pixels.*pipeline\.max_pixels=2000"):
        pol.sample(batch, TokenPlan.deterministic(1))


def test_budget_below_one_cell_of_the_resize_grid_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"^max_pixels must be >= 784"):
        QwenVLConfig(pretrained=str(tmp_path), min_pixels=500, max_pixels=700)
    with pytest.raises(ValueError, match=r"^video_max_pixels must be >= 3136"):
        QwenVLConfig(pretrained=str(tmp_path), video_max_pixels=3000)


def test_a_configured_bound_beyond_the_saved_other_bound_is_refused_at_load(request):
    """min_pixels set above the processor's saved max_pixels (max_pixels unset): the fix is to set both."""
    with pytest.raises(ValueError, match=r"pipeline\.min_pixels=20000 is above pipeline\.max_pixels=12544.*set "
                                         r"pipeline\.max_pixels >= 20000"):
        make_policy(request, min_pixels=20_000)
    with pytest.raises(ValueError, match=r"pipeline\.min_pixels=3136 is above pipeline\.max_pixels=2000.*set "
                                         r"pipeline\.min_pixels <= 2000"):
        make_policy(request, max_pixels=2000)  # below the processor's saved min_pixels, with min_pixels unset


@pytest.mark.parametrize("fixture", ["tiny_qwen2_5_vl_dir", "tiny_qwen3_vl_dir"])
def test_prompts_encoded_in_one_processor_call_equal_each_encoded_alone(request, fixture):
    """`PromptEncoder.encode_many` (one processor call for the prompts without video) gives each prompt the tensors of
    its own `encode`: text only, one image, two images, different lengths; a video prompt encoded alone."""
    policy = make_policy(request, fixture)
    images = [Image.new("RGB", size, (40 * i, 200, 90)) for i, size in enumerate(SIZES)]
    frames = [Image.new("RGB", (64, 64), (0, 40 * i, 200)) for i in range(4)]
    prompts = [("no image here, a longer question than the others", [], []), ("one?", [images[0]], []),
               ("two of them?", images[1:], []), ("what moves?", [], [frames]), ("and this one?", [images[2]], [])]
    together = policy.inputs.encode_many(prompts, torch.float32)
    for prompt, encoded in zip(prompts, together):
        alone = policy.inputs.encode(*prompt, torch.float32)
        assert encoded.keys() == alone.keys()
        for key, value in alone.items():
            assert encoded[key].dtype == value.dtype and torch.equal(encoded[key], value), key
