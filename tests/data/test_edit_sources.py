"""The editing prompt sources: `edit_jsonl` (rows with input images, instruction, optional target and mask; paths
relative to the file, headers size-checked, one-line errors naming file and row) and `shapes_edit` (recolour / remove
edits on shapes scenes whose target is exactly the edited scene, moves, and held-out unseen combinations)."""

import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from mmgrpo.data.edit_jsonl import EditJsonl, EditJsonlConfig
from mmgrpo.data.shapes_edit import HELD_OUT, KINDS, ShapesEdit, ShapesEditConfig, combination
from mmgrpo.prompt_stream import items_to_batch
from mmgrpo.rewards.edit_fidelity import EditFidelityReward

EXAMPLE = Path(__file__).resolve().parents[2] / "data" / "examples" / "edit" / "edits.jsonl"


def write(tmp_path, rows, size=(8, 8)):
    Image.new("RGB", size).save(tmp_path / "in.png")
    file = tmp_path / "edits.jsonl"
    file.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(file)


def test_example_rows_become_items_with_images_and_truth():
    items = EditJsonl(EditJsonlConfig(train_file=str(EXAMPLE))).train_items()
    assert len(items) == 4 and items[0]["prompt"] == "make the yellow square blue"
    first = items[0]
    assert first["images"] == [str(EXAMPLE.parent / "scene_0.png")]
    assert first["metadata"]["source_image"] == first["images"][0] and first["metadata"]["kind"] == "recolor"
    assert first["metadata"]["target_image"] == str(EXAMPLE.parent / "scene_0_target.png")
    batch = items_to_batch(items)  # the reward opens the paths: the target scores 1
    target = torch.stack([torch.from_numpy(__import__("numpy").array(Image.open(m["target_image"]).convert("RGB")))
                          .permute(2, 0, 1).float() / 255 for m in batch.metadata])
    scores = EditFidelityReward()({"images": target}, batch).scores
    torch.testing.assert_close(scores, torch.ones(4))


@pytest.mark.parametrize("row, message", [
    ({"image": "in.png"}, r"edits.jsonl:2: .*no instruction: add 'instruction' or 'prompt'"),
    ({"instruction": "x"}, r"edits.jsonl:2: .*no input image: add 'image' or 'images'"),
    ({"image": "gone.png", "instruction": "x"}, r"edits.jsonl:2: .*'gone.png' not found"),
    ({"image": "in.png", "instruction": "x", "target_image": "gone.png"}, r"edits.jsonl:2: .*'gone.png' not found"),
    ({"image": "in.png", "instruction": "  "}, r"edits.jsonl:2: the instruction must be a non-empty string"),
])
def test_bad_rows_are_refused_naming_the_row_and_the_fix(tmp_path, row, message):
    file = write(tmp_path, [{"image": "in.png", "instruction": "ok"}, row])
    with pytest.raises(ValueError, match=message):
        EditJsonl(EditJsonlConfig(train_file=file)).train_items()


def test_images_over_the_pixel_limit_are_refused_before_decoding(tmp_path):
    file = write(tmp_path, [{"images": ["in.png", "in.png"], "prompt": "x", "edit_mask": "in.png"}], size=(20, 10))
    with pytest.raises(ValueError, match=r"edits.jsonl:1: image .*in.png is 20x10 \(200 pixels\).*max_image_pixels"):
        EditJsonl(EditJsonlConfig(train_file=file, max_image_pixels=100)).train_items()
    item = EditJsonl(EditJsonlConfig(train_file=file)).train_items()[0]
    assert len(item["images"]) == 2 and item["metadata"]["edit_mask"].endswith("in.png")


def test_shapes_edits_change_exactly_the_named_shape():
    source = ShapesEdit(ShapesEditConfig(n_train=8, n_eval=4, size=32))
    items = source.train_items()
    assert [i["metadata"]["kind"] for i in items[:2]] == ["recolor", "remove"]
    reward = EditFidelityReward()
    for item in items:
        m = item["metadata"]
        assert torch.equal(m["source_image"], torch.from_numpy(__import__("numpy").array(item["images"][0]))
                           .permute(2, 0, 1))
        changed = (m["source_image"] != m["target_image"]).any(0)  # [H, W]
        assert changed.any()  # the edit is visible
        if m["kind"] == "remove":
            assert len(m["target_scene"]) == len(m["scene"]) - 1 and item["prompt"].startswith("remove the ")
            assert m["word"] == ""
        elif m["kind"] == "recolor":
            assert item["prompt"].split()[-1] == m["word"] in {s["colour"] for s in m["target_scene"]}
        batch = items_to_batch([item, item])
        outputs = torch.stack([m["target_image"], m["source_image"]]).float() / 255
        scores = reward({"images": outputs}, batch).scores
        assert float(scores[0]) == pytest.approx(1.0) and float(scores[1]) < 0.9  # one channel of a recolour: >= 0.8 / 3 off
    held_out = {repr(i["metadata"]["scene"]) for i in source.eval_items()}
    assert not held_out & {repr(i["metadata"]["scene"]) for i in items}


def combo_of(item) -> tuple[str, str, str]:
    """The (kind, shape, colour) of an item's edit, read back from its scenes."""
    m = item["metadata"]
    before, after = m["scene"], m["target_scene"]
    if m["kind"] == "remove":
        (edited,) = [s for s in before if s not in after]
        return combination("remove", edited, "")
    (k,) = [k for k, (a, b) in enumerate(zip(before, after)) if a != b]
    return combination(m["kind"], before[k], after[k]["colour"])


def test_moves_shift_the_named_shape_into_the_empty_quadrant_beside_it():
    items = ShapesEdit(ShapesEditConfig(n_train=30, n_eval=0, size=32, kinds=("move",))).train_items()
    steps = {"left": (-16, 0), "right": (16, 0), "up": (0, -16), "down": (0, 16)}
    for item in items:
        before, after = item["metadata"]["scene"], item["metadata"]["target_scene"]
        (k,) = [k for k, (a, b) in enumerate(zip(before, after)) if a != b]
        dx, dy = steps[item["prompt"].split()[-1]]
        assert after[k]["box"] == [before[k]["box"][0] + dx, before[k]["box"][1] + dy, before[k]["box"][2] + dx,
                                   before[k]["box"][3] + dy]
        assert after[k]["cell"] not in {s["cell"] for s in before}  # into an empty quadrant
        assert item["prompt"].startswith("move the ") and before[k]["shape"] in item["prompt"]
        assert item["metadata"]["word"] == item["prompt"].split()[-1]
    assert {i["prompt"].split()[-1] for i in items} == set(steps)


def test_unseen_split_holds_out_combinations_and_trains_every_kind_shape_and_colour():
    source = ShapesEdit(ShapesEditConfig(n_train=300, n_eval=60, size=32))
    train = [combo_of(i) for i in source.train_items()]
    held = [combo_of(i) for i in source.eval_items()]
    assert set(held) <= HELD_OUT and not set(train) & HELD_OUT
    assert {c[0] for c in held} == set(KINDS)
    for position in range(3):  # each kind, shape and colour alone is trained on
        assert {c[position] for c in train} == {c[position] for c in HELD_OUT}
    scenes = ShapesEdit(ShapesEditConfig(n_train=0, n_eval=60, size=32, held_out="scenes")).eval_items()
    assert set(combo_of(i) for i in scenes) - HELD_OUT  # scenes only: any combination


def test_shapes_edit_config_errors():
    with pytest.raises(ValueError, match="kinds"):
        ShapesEditConfig(kinds=("blur",))
    with pytest.raises(ValueError, match="max_objects"):
        ShapesEditConfig(max_objects=5)
    with pytest.raises(ValueError, match="held_out"):
        ShapesEditConfig(held_out="none")


def test_scene_edits_give_every_allowed_edit_of_a_scene_with_distinct_targets():
    source = ShapesEdit(ShapesEditConfig(n_train=0, n_eval=0, size=32))
    for index in (0, 2, 4, 1, 3):  # training scenes (even) and held-out ones (odd)
        edits = source.scene_edits(index)
        drawn = [source.item(index, kind) for kind in KINDS]
        prompts = [e["prompt"] for e in edits]
        assert len(set(prompts)) == len(prompts)  # one item per instruction
        assert {d["prompt"] for d in drawn if d is not None} <= set(prompts)  # `item` draws one of them
        assert {e["metadata"]["kind"] for e in edits} == {d["metadata"]["kind"] for d in drawn if d is not None}
        assert all((combo_of(e) in HELD_OUT) == (index % 2 == 1) for e in edits)  # the split's combinations only
        sources = {e["metadata"]["source_image"].numpy().tobytes() for e in edits}
        targets = {e["metadata"]["target_image"].numpy().tobytes() for e in edits}
        assert len(sources) == 1 and len(targets) == len(edits)  # one input scene, a different target per edit
