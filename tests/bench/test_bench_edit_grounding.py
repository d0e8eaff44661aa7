"""bench/edit_grounding.py: the centred cosines on embeddings whose answer is known, which edits a scene determines on
a hand-made scene, the breakdown of a real evaluation JSON, and the encoder measurement on a tiny Kontext pipeline."""

import json

import pytest
import torch

from mmgrpo.visualize import write_per_prompt_scores

RED_CIRCLE = {"shape": "circle", "colour": "red", "box": [2, 2, 12, 12], "main": True, "cell": 0}  # top left
BLUE_SQUARE = {"shape": "square", "colour": "blue", "box": [18, 18, 28, 28], "main": False, "cell": 3}  # bottom right


def item(prompt: str, kind: str, scene: list[dict]) -> dict:
    word = "" if kind == "remove" else prompt.split()[-1]  # as `shapes_edit` items carry it
    return {"prompt": prompt, "metadata": {"kind": kind, "word": word, "scene": scene,
                                           "source_image": torch.zeros(3, 32, 32)}}


def test_separation_reads_which_words_the_embedding_ignores(load_bench):
    bench = load_bench("edit_grounding")
    instructions = bench.all_instructions()
    labels = [label for _, label in instructions]
    assert len(instructions) == 3 * 4 * (1 + 3 + 4)  # shapes x colours x (remove, 3 new colours, 4 directions)
    assert ("make the red circle blue", {"kind": "recolor", "shape": "circle", "colour": "red", "word": "blue"}) \
        in instructions
    vocabulary = sorted({label[name] for label in labels for name in ("kind", "colour", "word")})
    # an embedding of the kind, the colour and the word, blind to the named shape: [B, V]
    blind = torch.tensor([[float(label["kind"] == w or label["colour"] == w or label["word"] == w) for w in vocabulary]
                          for label in labels])
    measured = bench.separation(blind, labels)
    assert measured["recolor/shape"] == pytest.approx(1.0) and measured["move/shape"] == pytest.approx(1.0)
    assert measured["move/word"] < 0.9 and measured["remove/colour"] < 0.9  # words it encodes: told apart
    assert "remove/word" not in measured  # a removal has no word: no such pair


def test_scene_choices_counts_the_edits_the_scene_allows(load_bench):
    bench = load_bench("edit_grounding")
    scene = [RED_CIRCLE, BLUE_SQUARE]
    assert bench.scene_choices(item("move the circle right", "move", scene)) == 1  # the square is at the right edge
    assert bench.scene_choices(item("move the square up", "move", scene)) == 1
    assert bench.scene_choices(item("move the circle down", "move", scene)) == 1  # the square cannot move down
    assert bench.scene_choices(item("remove the circle", "remove", scene)) == 2  # the name decides
    assert bench.scene_choices(item("make the circle green", "recolor", scene)) == 2
    assert bench.scene_choices(item("make the square red", "recolor", scene)) == 1  # the circle is red already


def test_breakdown_of_an_evaluation_json_and_the_tables(load_bench, tmp_path):
    bench = load_bench("edit_grounding")
    scene = [RED_CIRCLE, BLUE_SQUARE]
    items = [item("move the circle right", "move", scene), item("remove the circle", "remove", scene),
             item("remove the square", "remove", scene), item("make the square red", "recolor", scene)]
    values = [1.0, 0.0, 1.0, float("nan")]
    per_item = [(it["prompt"], 0.0, value, i) for i, (it, value) in enumerate(zip(items, values))]
    path = tmp_path / "eval" / "step_00000.json"
    write_per_prompt_scores(per_item, path, "strict")
    values = bench.per_item_values(path)
    assert values == {0: 1.0, 1: 0.0, 2: 1.0}  # the unscorable item is left out
    breakdown = bench.determined_breakdown(values, items)
    assert breakdown == {"move/determined": (1.0, 1), "remove/named": (0.5, 2)}
    text = bench.tables(None, {"base": breakdown})
    assert "| move/determined (n=1) | remove/named (n=2) |" in text and "| base | 1.000 | 0.500 |" in text


def test_main_measures_a_tiny_kontext_pipeline_and_an_evaluation(load_bench, tiny_flux_kontext_dir, tmp_path):
    bench = load_bench("edit_grounding")
    items = bench.held_out_items("configs/tiny/edit_shapes.yaml", 6)
    path = tmp_path / "step_00000.json"
    write_per_prompt_scores([(it["prompt"], 0.0, float(i % 2), i) for i, it in enumerate(items)], path, "strict")
    bench.main(["--model", tiny_flux_kontext_dir, "--eval", f"base={path}", "--n-eval", "6",
                "--output", str(tmp_path / "out")])
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    t5 = results["encoders"]["T5 token states"]
    assert set(t5) == {"recolor/shape", "recolor/colour", "recolor/word", "remove/shape", "remove/colour",
                       "move/shape", "move/colour", "move/word"}
    assert all(abs(value) <= 1.0 + 1e-9 for value in t5.values())
    assert sum(n for _, n in results["breakdowns"]["base"].values()) == 6
    with pytest.raises(SystemExit, match="NAME=PATH"):
        bench.main(["--eval", str(path), "--output", str(tmp_path / "bad")])
