"""The in-distribution counting base (``mmgrpo:vlm_shapes_in_dist``, trained by ``scripts/train_vlm_shapes.py
--max-objects 3``): its training scenes are drawn with the RL configs' ``data.max_objects``, so the ``ood`` split
(scenes with more shapes) and counts above it were never trained; it was stopped by the script's rule, imperfect."""

import json
import re
from pathlib import Path

import pytest

from mmgrpo import config as config_mod
from mmgrpo.data.vlm_shapes import VLMShapes, VLMShapesConfig
from mmgrpo.hub import resolve_pretrained
from builders._repo_files import load_repo_script

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = [ROOT / "configs" / "tiny" / "vlm_count_in_dist.yaml", ROOT / "configs" / "tiny" / "vlm_count_in_dist_sft.yaml"]


def _script():
    return load_repo_script("scripts", "train_vlm_shapes")


def _shapes_in(target: str) -> int:
    """The number of quadrants a target's thought names a colour for (``<think>red none blue red</think>`` -> 3)."""
    thought = re.fullmatch(r"<think>(.*)</think><answer>(\d)</answer>", target).group(1).split()
    assert len(thought) == 4
    return sum(word != "none" for word in thought)


@pytest.mark.parametrize("max_objects", [2, 3, 4])
def test_training_scenes_have_at_most_max_objects_shapes(max_objects):
    script = _script()
    source = VLMShapes(VLMShapesConfig(n_train=0, n_eval=0, max_objects=max_objects))
    seen_shapes, seen_answers = set(), set()
    for step in range(1, 6):
        items, targets = script.training_batch(source, step, 16)
        for item, target in zip(items, targets):
            seen_shapes.add(_shapes_in(target))
            seen_answers.add(int(item["metadata"]["answer"]))
            assert target.endswith(f"<answer>{item['metadata']['answer']}</answer>")
    assert max(seen_shapes) == max_objects and max(seen_answers) == max_objects  # reached, never passed


def test_the_in_dist_base_was_trained_as_the_comparison_configs_train_and_is_imperfect():
    metrics = json.loads(Path(resolve_pretrained("mmgrpo:vlm_shapes_in_dist"), "metrics.json").read_text("utf-8"))
    for path in CONFIGS:
        cfg = config_mod.load(path)
        assert cfg.pipeline.options.pretrained == "mmgrpo:vlm_shapes_in_dist"
        assert cfg.data.options.max_objects == metrics["args"]["max_objects"] == 3
        assert cfg.data.options.ood and cfg.eval.splits == ["eval", "ood"]
    # the script's stop: the first evaluation at or above --stop-accuracy ends training; clearly imperfect
    history = metrics["history"]
    assert history[-1]["held_out_accuracy"] >= metrics["args"]["stop_accuracy"]
    assert all(h["held_out_accuracy"] < metrics["args"]["stop_accuracy"] for h in history[:-1])
    assert 0.3 <= metrics["held_out_accuracy"] <= 0.6
    assert metrics["held_out_ood_accuracy"] < metrics["held_out_accuracy"]
