"""The shipped temporal-grounding base (``mmgrpo:vlm_temporal``, trained by ``mmgrpo sft
configs/tiny/temporal_shapes_sft.yaml``) reads held-out clips as the RL config sets them up: it writes a timeline of
the four temporal patches and a span that the `tiou` reward parses, its answers depend on the clip, and it is clearly
imperfect (RL has room)."""

import json
import re
from pathlib import Path

import torch

from mmgrpo import config as config_mod
from mmgrpo.hub import resolve_pretrained
from mmgrpo.prompt_stream import items_to_batch
from mmgrpo.plans import TokenPlan

ROOT = Path(__file__).resolve().parents[2]
RL = ROOT / "configs" / "tiny" / "temporal_shapes.yaml"
SFT = ROOT / "configs" / "tiny" / "temporal_shapes_sft.yaml"


def test_the_base_was_trained_on_the_clips_rl_trains_on_and_is_imperfect():
    rl, sft = config_mod.load(RL), config_mod.load(SFT)
    metrics = json.loads(Path(resolve_pretrained("mmgrpo:vlm_temporal"), "metrics.json").read_text(encoding="utf-8"))
    assert 0.4 <= metrics["held_out_tiou"] <= 0.7  # reads some clips, far from 1: RL has room
    assert metrics["steps"] == sft.train.max_steps
    for key in ("size", "num_frames", "fps", "frame_step", "distractors", "speed", "shape_size", "event"):
        assert getattr(rl.data.options, key) == getattr(sft.data.options, key), key
    assert sft.data.options.thought == "timeline"
    for key in ("video_fps", "video_min_pixels", "video_max_pixels"):
        assert getattr(rl.pipeline.options, key) == getattr(sft.pipeline.options, key), key


def test_the_base_writes_timelines_and_spans_that_depend_on_the_clip():
    from mmgrpo import registry
    from mmgrpo.pipelines.qwen_vl import QwenVLConfig, QwenVLPolicy
    from mmgrpo.rewards.tiou import TIoU

    rl = config_mod.load(RL)
    options = rl.pipeline.options
    policy = QwenVLPolicy(QwenVLConfig(pretrained="mmgrpo:vlm_temporal", max_new_tokens=options.max_new_tokens,
                                       lora_rank=0, video_fps=options.video_fps,
                                       video_min_pixels=options.video_min_pixels,
                                       video_max_pixels=options.video_max_pixels))
    source_cls = registry.get("data", "temporal_shapes")
    data = {k: v for k, v in vars(rl.data.options).items()}
    data.update(n_train=0, n_eval=12)
    items = source_cls(source_cls.Config(**data)).eval_items()
    batch = items_to_batch(items)
    batch.group_ids = torch.arange(len(batch))
    rollout = policy.sample(batch, TokenPlan.deterministic(options.max_new_tokens))
    texts = rollout.outputs["texts"]
    entries = r"0s [a-z, ]+\. 1s [a-z, ]+\. 2s [a-z, ]+\. 3s [a-z, ]+\."
    timeline = re.compile(rf"<think>{entries}</think><answer>\[[0-9.]+, [0-9.]+\]</answer>")
    assert all(timeline.fullmatch(t) for t in texts), texts
    result = TIoU()({"texts": texts}, batch)
    assert float(result.components["no_span"].sum()) == 0.0
    assert float(result.scores.mean()) > 0.3
    assert len({t.split("<answer>")[1] for t in texts}) >= 3  # not one constant span
