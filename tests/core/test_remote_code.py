"""A model's own code runs only when the command line says so (``--trust-remote-code``), whatever a config, a run
folder or a model folder says: `check`, `train`, `eval`, `sft` and `export` refuse a config with
``trust_remote_code: true`` without the flag, before anything loads. Base models whose weights are pickles only are
refused with the conversion to do."""

import json
import shutil

import pytest
import torch

from mmgrpo.cli import main
from mmgrpo.config_yaml import dump_yaml

MARKER = "remote_code_ran.txt"
EVIL = '''
from pathlib import Path
from transformers import LlamaConfig

Path({marker!r}).write_text("ran")  # what an attacker's code could do


class EvilConfig(LlamaConfig):
    model_type = "llada_evil"
'''


@pytest.fixture
def evil_model(tiny_mdlm_dir, tmp_path):
    """The tiny masked-diffusion LM, with a config that maps AutoConfig to code in the folder (``auto_map``); the
    code writes a marker file into the test's folder when imported."""
    folder = tmp_path / "evil_model"
    shutil.copytree(tiny_mdlm_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "evil.EvilConfig"}
    config["model_type"] = "llada_evil"
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "evil.py").write_text(EVIL.format(marker=str(tmp_path / MARKER)))
    return folder


def code_ran(tmp_path) -> bool:
    return (tmp_path / MARKER).is_file()


def mdlm_config(pretrained, output_dir, **pipeline) -> dict:
    return {"output_dir": str(output_dir), "seed": 0,
            "pipeline": {"name": "mdlm", "pretrained": str(pretrained), "gen_length": 4, "steps_per_block": 2,
                         **pipeline},
            "algorithm": {"name": "cj_grpo"}, "reward": {"name": "accuracy", "mode": "numeric"},
            "data": {"name": "arith", "n_train": 8, "n_eval": 2},
            "train": {"max_steps": 1, "prompts_per_step": 2, "group_size": 2, "minibatch_size": 4},
            "eval": {"every": 0}}


@pytest.mark.parametrize("command", [["check"], ["train"], ["sft"], ["eval"]])
def test_a_config_asking_for_remote_code_is_refused_without_the_flag(command, evil_model, tmp_path, capsys):
    file = tmp_path / "run.yaml"
    file.write_text(dump_yaml(mdlm_config(evil_model, tmp_path / "out", trust_remote_code=True)))
    assert main([*command, str(file)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pipeline.trust_remote_code" in err and "--trust-remote-code" in err
    assert not code_ran(tmp_path)


def test_check_accepts_remote_code_with_the_flag_and_loads_nothing(evil_model, tmp_path, capsys):
    file = tmp_path / "run.yaml"
    file.write_text(dump_yaml(mdlm_config(evil_model, tmp_path / "out", trust_remote_code=True)))
    assert main(["check", str(file), "--trust-remote-code"]) == 0
    assert capsys.readouterr().out.endswith("ok\n")


def fake_run(evil_model, tiny_mdlm_dir, run) -> None:
    """A run folder as someone else could hand it over: a config asking for remote code and one checkpoint."""
    run.mkdir()
    (run / "config.json").write_text(json.dumps(mdlm_config(evil_model, run, trust_remote_code=True)))
    step = run / "checkpoints" / "step_0000001"
    shutil.copytree(tiny_mdlm_dir, step / "weights")
    (step / "trainer_state.json").write_text(json.dumps({"step": 1, "format": 2}))


def test_export_of_a_run_folder_runs_no_code_unless_the_command_line_allows_it(evil_model, tiny_mdlm_dir, tmp_path,
                                                                                 capsys):
    run = tmp_path / "run"
    fake_run(evil_model, tiny_mdlm_dir, run)
    assert main(["export", str(run), str(tmp_path / "exported")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--trust-remote-code" in err
    assert not code_ran(tmp_path) and not (tmp_path / "exported").exists()
    # the same folder with the flag: the model's code is imported (the check above can fail)
    main(["export", str(run), str(tmp_path / "exported"), "--trust-remote-code"])
    assert code_ran(tmp_path)


def save_pickled(tiny_mdlm_dir, folder):
    """The tiny model's folder with its weights as a pickle (``pytorch_model.bin``) instead of safetensors."""
    from safetensors.torch import load_file

    shutil.copytree(tiny_mdlm_dir, folder)
    for weights in folder.glob("*.safetensors"):
        torch.save(load_file(weights), folder / "pytorch_model.bin")
        weights.unlink()
    return folder


@pytest.mark.parametrize("name", ["pytorch_model.bin", ""])
def test_a_base_model_with_pickle_weights_is_refused_in_one_line(name, tiny_mdlm_dir, tmp_path, capsys):
    folder = save_pickled(tiny_mdlm_dir, tmp_path / "pickled")
    file = tmp_path / "run.yaml"
    file.write_text(dump_yaml(mdlm_config(folder / name if name else folder, tmp_path / "out")))
    assert main(["train", str(file)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mmgrpo: config error: pipeline.pretrained") and err.count("\n") == 1
    assert ("is a file" in err) if name else ("pytorch_model.bin is a pickle" in err and "safetensors" in err)
