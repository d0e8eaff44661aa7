"""VLM prompt sources: JSONL rows with images (and their errors), and the synthetic shapes questions."""

import json

import pytest

from mmgrpo.data.vlm_jsonl import VLMJsonl, VLMJsonlConfig
from mmgrpo.data.vlm_shapes import VLMShapes, VLMShapesConfig, scene


def test_jsonl_rows_become_items_with_images_and_sizes(tmp_path):
    from PIL import Image

    Image.new("RGB", (40, 30)).save(tmp_path / "a.png")
    rows = [{"image": "a.png", "problem": "How many?", "answer": "3"},
            {"image": ["a.png", "a.png"], "question": "Where?", "boxes": [1, 2, 3, 4]}]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    items = VLMJsonl(VLMJsonlConfig(train_file=str(tmp_path / "d.jsonl"))).train_items()
    assert items[0]["prompt"].startswith("How many? Output the thinking process")
    assert items[0]["images"] == [str(tmp_path / "a.png")] and items[0]["video"] is None
    assert items[0]["metadata"] == {"answer": "3"}
    assert len(items[1]["images"]) == 2 and items[1]["metadata"]["image_size"] == [40, 30]
    (tmp_path / "bad.jsonl").write_text(json.dumps({"image": "missing.png", "problem": "?"}))
    with pytest.raises(ValueError, match="bad.jsonl:1: .*missing.png"):
        VLMJsonl(VLMJsonlConfig(train_file=str(tmp_path / "bad.jsonl"))).train_items()
    with pytest.raises(ValueError, match="question"):
        VLMJsonlConfig(train_file=str(tmp_path / "d.jsonl"), prompt_template="no placeholder")


def test_shapes_questions_are_deterministic_disjoint_and_balanced():
    data = VLMShapes(VLMShapesConfig(tasks=["count", "color"], n_train=50, n_eval=200))
    first, again = data.eval_items(), data.eval_items()
    assert [i["prompt"] for i in first] == [i["prompt"] for i in again]
    assert first[0]["images"][0].tobytes() == again[0]["images"][0].tobytes()
    assert {i["metadata"]["task"] for i in first} == {"count", "color"}
    counts = [int(i["metadata"]["answer"]) for i in first if i["metadata"]["task"] == "count"]
    assert set(counts) == {1, 2, 3, 4}
    for index in range(50):  # one shape per quadrant: never overlapping
        boxes = [s["box"] for s in scene(index)]
        for a in range(len(boxes)):
            for b in range(a + 1, len(boxes)):
                x1, y1, x2, y2 = boxes[a]
                u1, v1, u2, v2 = boxes[b]
                assert x2 <= u1 or u2 <= x1 or y2 <= v1 or v2 <= y1


def test_shipped_vlm_shapes_base_model_is_imperfect_and_answers_in_the_r1_layout():
    import json

    import torch

    from mmgrpo.hub import resolve_pretrained
    from mmgrpo.pipelines.qwen_vl import QwenVLConfig, QwenVLPolicy
    from mmgrpo.prompt_stream import items_to_batch
    from mmgrpo.rewards.format import FormatReward
    from mmgrpo.plans import TokenPlan

    path = resolve_pretrained("mmgrpo:vlm_shapes")
    metrics = json.loads(open(f"{path}/metrics.json", encoding="utf-8").read())
    assert 0.3 <= metrics["held_out_accuracy"] <= 0.6  # clearly imperfect: RL has room
    policy = QwenVLPolicy(QwenVLConfig(pretrained="mmgrpo:vlm_shapes", max_new_tokens=20, lora_rank=0,
                                       min_pixels=3136, max_pixels=3136))
    batch = items_to_batch(VLMShapes(VLMShapesConfig(n_train=0, n_eval=8)).eval_items())
    batch.group_ids = torch.arange(len(batch))
    rollout = policy.sample(batch, TokenPlan.deterministic(20))
    assert FormatReward()(rollout.outputs, batch).scores.mean() >= 0.75
