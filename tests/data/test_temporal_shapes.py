"""temporal_shapes: the true span is where the target's pixels move, spans sit on the frame-step grid, the question
names exactly one shape, the supervised target scores tIoU 1, and the tiny Qwen2-VL policy reads the clip as a video."""

import numpy as np
import pytest
import torch

from mmgrpo.data.temporal_shapes import COLOURS, TemporalShapes, TemporalShapesConfig, scene, timeline
from mmgrpo.rewards.step_rar import StepRARConfig, StepRARReward
from mmgrpo.rewards.tiou import TIoU
from mmgrpo.types import PromptBatch


def moving_frames(frames, lane: int, lanes: int) -> list[int]:
    """Frames `i` whose lane differs from frame `i - 1` (the lane holds only one shape)."""
    arrays = [np.asarray(f, dtype=np.int16) for f in frames]
    height = arrays[0].shape[0] // lanes
    rows = slice(lane * height, (lane + 1) * height)
    return [i for i in range(1, len(arrays)) if (arrays[i][rows] != arrays[i - 1][rows]).any()]


@pytest.mark.parametrize("distractors", [0, 1, 2])
def test_the_true_span_is_where_the_target_moves(distractors):
    config = TemporalShapesConfig(n_train=40, n_eval=0, distractors=distractors, with_targets=True)
    source = TemporalShapes(config)
    for index in range(40):
        item = source.item(index)
        target = scene(index, config)[0]
        moved = moving_frames(item["video"], target["lane"], 1 + distractors)
        start, end = item["metadata"]["span"]
        # moving between frames a and b changes frames a + 1 .. b
        assert moved == list(range(round(start * config.fps) + 1, round(end * config.fps) + 1))
        assert start * config.fps % config.frame_step == 0 and end * config.fps % config.frame_step == 0
        assert 0 <= start < end <= item["metadata"]["duration"]
        # the question names the target's colour and shape, and no other shape has both
        others = scene(index, config)[1:]
        assert f"the {target['colour']} {target['shape']} move" in item["prompt"]
        assert all((s["colour"], s["shape"]) != (target["colour"], target["shape"]) for s in others)
        # frames hold only black and the palette (no anti-aliasing that would blur the motion)
        colours = {tuple(p) for p in np.asarray(item["video"][0]).reshape(-1, 3)}
        assert colours <= {(0, 0, 0), *COLOURS.values()}


def test_the_supervised_target_scores_one_and_items_are_deterministic():
    source = TemporalShapes(TemporalShapesConfig(n_train=8, n_eval=8, with_targets=True))
    items = source.train_items()
    completions = [item["metadata"]["completion"] for item in items]
    batch = PromptBatch([item["prompt"] for item in items], metadata=[item["metadata"] for item in items])
    assert TIoU()({"texts": completions}, batch).scores.tolist() == [1.0] * len(items)
    again = TemporalShapes(TemporalShapesConfig(n_train=8, n_eval=8, with_targets=True)).train_items()
    assert [i["metadata"] for i in again] == [i["metadata"] for i in items]
    assert [np.asarray(f).tobytes() for f in again[3]["video"]] == [np.asarray(f).tobytes() for f in items[3]["video"]]


@pytest.mark.parametrize("distractors", [0, 1])
def test_visible_event_draws_each_shape_only_during_its_span(distractors):
    config = TemporalShapesConfig(n_train=30, n_eval=0, distractors=distractors, event="visible")
    source = TemporalShapes(config)
    lane_height = config.size // (1 + distractors)
    for index in range(30):
        item = source.item(index)
        target = scene(index, config)[0]
        assert item["prompt"].startswith(f"When is the {target['colour']} {target['shape']} on screen?")
        rows = slice(target["lane"] * lane_height, (target["lane"] + 1) * lane_height)
        shown = [f for f, frame in enumerate(item["video"]) if np.asarray(frame)[rows].any()]
        start, end = item["metadata"]["span"]
        assert shown == list(range(round(start * config.fps), round(end * config.fps)))


def test_timeline_by_hand():
    config = TemporalShapesConfig(num_frames=8, fps=2.0, frame_step=2, distractors=1)
    shapes = [{"colour": "red", "shape": "circle", "frames": [2, 6]},
              {"colour": "blue", "shape": "square", "frames": [4, 6]}]
    assert timeline(shapes, config) == "0s none. 1s red circle. 2s red circle, blue square. 3s none."
    config = TemporalShapesConfig(num_frames=12, fps=4.0, frame_step=3, distractors=0, speed=3)
    shapes = [{"colour": "green", "shape": "triangle", "frames": [0, 3]}]
    assert timeline(shapes, config) == "0s green triangle. 0.75s none. 1.5s none. 2.25s none."


@pytest.mark.parametrize("distractors", [0, 1, 2])
def test_timeline_targets_name_the_moving_shapes_and_score_one(distractors):
    config = TemporalShapesConfig(n_train=30, n_eval=0, distractors=distractors, with_targets=True, thought="timeline",
                                  speed=4)
    items = TemporalShapes(config).train_items()
    for index, item in enumerate(items):
        target = scene(index, config)[0]
        thought = item["metadata"]["completion"].split("<think>")[1].split("</think>")[0]
        entries = thought.split(". ")
        assert len(entries) == config.num_frames // config.frame_step
        name = f"{target['colour']} {target['shape']}"
        blocks = [k for k, entry in enumerate(entries) if name in entry]
        start, end = item["metadata"]["span"]  # the target moves exactly in the blocks of its span
        frames = [round(start * config.fps), round(end * config.fps)]
        assert blocks == list(range(frames[0] // config.frame_step, frames[1] // config.frame_step))
    batch = PromptBatch([i["prompt"] for i in items], metadata=[i["metadata"] for i in items])
    completions = [i["metadata"]["completion"] for i in items]
    assert TIoU()({"texts": completions}, batch).scores.tolist() == [1.0] * len(items)


def test_key_steps_are_the_timeline_entries_and_step_rar_counts_them():
    config = TemporalShapesConfig(n_train=12, n_eval=0, distractors=1, with_targets=True, thought="timeline",
                                  event="visible")
    items = TemporalShapes(config).train_items()
    for index, item in enumerate(items):
        assert " ".join(item["metadata"]["key_steps"]) == timeline(scene(index, config), config)
    batch = PromptBatch([i["prompt"] for i in items], metadata=[i["metadata"] for i in items])
    completions = [i["metadata"]["completion"] for i in items]
    step_rar = StepRARReward(StepRARConfig(scope="think"))  # the timeline is the thought, not R1-VL's step sections
    assert step_rar({"texts": completions}, batch).scores.tolist() == [1.0] * len(items)
    # one wrong entry (a shape on screen where the truth says none, or the reverse) costs exactly 1/4 of the score
    wrong = []
    for item, text in zip(items, completions):
        first = item["metadata"]["key_steps"][0]
        swapped = "0s green triangle." if first == "0s none." else "0s none."
        wrong.append(text.replace(first, swapped, 1))
    assert step_rar({"texts": wrong}, batch).scores.tolist() == [0.75] * len(items)


@pytest.mark.parametrize("options, message", [
    ({"num_frames": 7}, "num_frames must be a multiple"),
    ({"speed": 10}, "leaves a 56-pixel frame"),
    ({"distractors": 3}, "distractors"),
    ({"size": 28}, "56-pixel grid"),
    ({"thought": "frames"}, "data.thought must be one of"),
    ({"event": "appear"}, "data.event must be one of"),
])
def test_bad_options_name_the_problem(options, message):
    with pytest.raises(Exception, match=message):
        TemporalShapesConfig(**options)


def test_the_tiny_qwen_vl_policy_reads_the_clip_as_a_video(tiny_qwen2_vl_dir):
    from mmgrpo.algorithms.grpo import GRPO, GRPOConfig
    from mmgrpo.pipelines.qwen_vl import QwenVLConfig, QwenVLPolicy
    from mmgrpo.prompt_stream import items_to_batch

    items = TemporalShapes(TemporalShapesConfig(n_train=2, n_eval=0)).train_items()
    batch = items_to_batch(items).repeat(2)
    assert len(batch.conditions["video"][0]) == 8
    policy = QwenVLPolicy(QwenVLConfig(pretrained=tiny_qwen2_vl_dir, max_new_tokens=6, lora_rank=4, lora_alpha=8,
                                       video_fps=2.0))
    policy.model.eval()
    steps = list(range(policy.num_steps))
    rollout = policy.sample(batch, GRPO(GRPOConfig()).schedule(policy.num_steps),
                            generator=torch.Generator().manual_seed(0))
    encoded = policy.encode_prompt(items[0]["prompt"], [], [items[0]["video"]])
    assert "pixel_values_videos" in encoded and "pixel_values" not in encoded  # a video, not images
    replay = policy.log_prob(rollout, steps).log_prob
    torch.testing.assert_close(replay, rollout.old_log_probs, rtol=0, atol=1e-5)
