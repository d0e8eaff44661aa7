"""An editing pipeline (capability ``input_images``) refuses, before any model loads, a prompt source whose items
carry no input image, in one line naming the problem and the fix."""

import json
from pathlib import Path

import pytest
import yaml

from mmgrpo import config as config_mod
from mmgrpo.preflight import preflight
from mmgrpo.validation import ConfigError

ROOT = Path(__file__).resolve().parents[2]
EDITS = ROOT / "data" / "examples" / "edit" / "edits.jsonl"


def edit_config(tmp_path, data, **pipeline):
    return {
        "output_dir": str(tmp_path / "out"),
        "pipeline": {"name": "flux_kontext", "pretrained": "org/kontext", "resolution": 32, "num_steps": 2, **pipeline},
        "algorithm": {"name": "flow_grpo"},
        "reward": {"name": "jpeg"},
        "data": data,
        "eval": {"every": 0},
    }


@pytest.mark.parametrize("pipeline", [{}, {"name": "qwen_image_edit", "pipeline_class": "QwenImageEditPipeline"}],
                         ids=["flux_kontext", "qwen_image_edit"])
def test_text_only_prompts_are_refused_by_an_editing_pipeline(tmp_path, capsys, pipeline):
    from mmgrpo.cli import main

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("make the red circle blue\n")
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(edit_config(tmp_path, {"name": "prompt_file", "train_file": str(prompts)},
                                               **pipeline)))
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err
    name = pipeline.get("name", "flux_kontext")
    assert (f"pipeline {name!r} edits input images, but training item 0 ('make the red circle blue') of prompt source "
            "'prompt_file' has none") in err
    assert "use a prompt source whose items carry input images (data: edit_jsonl or shapes_edit)" in err
    assert err.count("\n") == 1 and "Traceback" not in err and not (tmp_path / "out").exists()


def test_edit_rows_pass_and_a_row_without_an_image_is_named(tmp_path):
    ok = config_mod.from_dict(edit_config(tmp_path, {"name": "edit_jsonl", "train_file": str(EDITS)}))
    preflight(ok)  # every row carries its input image
    rows = tmp_path / "rows.jsonl"  # vlm_jsonl rows carry images where the row names one
    image = str(EDITS.parent / "scene_0.png")
    rows.write_text("\n".join(json.dumps(r) for r in [{"image": image, "problem": "make it blue", "answer": "x"},
                                                       {"problem": "remove the square", "answer": "y"}]) + "\n")
    raw = edit_config(tmp_path, {"name": "vlm_jsonl", "train_file": str(rows), "eval_file": str(rows)})
    raw["eval"] = {"every": 5, "num_prompts": 2}
    with pytest.raises(ConfigError, match=r"^data\.name: .*but training item 1 \('.*remove the square.*'\) of prompt "
                                          r"source 'vlm_jsonl' has none"):
        preflight(config_mod.from_dict(raw))


def test_text_to_image_pipelines_take_text_only_prompts(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\n")
    raw = edit_config(tmp_path, {"name": "prompt_file", "train_file": str(prompts)}, name="flux")
    preflight(config_mod.from_dict(raw))


@pytest.mark.parametrize("data", [{"name": "edit_jsonl", "train_file": str(EDITS)},
                                  {"name": "shapes_edit", "n_train": 4, "n_eval": 2, "size": 32}],
                         ids=["edit_jsonl", "shapes_edit"])
def test_edits_are_refused_by_a_pipeline_that_reads_no_input_image(tmp_path, data):
    """The reverse: edit rows (an instruction and the image it changes) given to a text-to-image pipeline, which would
    train on the instruction alone."""
    raw = edit_config(tmp_path, data, name="flux")
    with pytest.raises(ConfigError, match=rf"^pipeline\.name: prompt source '{data['name']}' gives edits \(an "
                                          r"instruction and the input image it changes, training item 0\), but pipeline "
                                          r"'flux' reads no input image .*use an editing pipeline \(flux_kontext or "
                                          r"qwen_image_edit\)\.$"):
        preflight(config_mod.from_dict(raw))
