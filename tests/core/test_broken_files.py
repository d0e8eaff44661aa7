"""Broken or incomplete files end a command with one line that names the file and what to do, never a traceback: a
corrupt or truncated state file on resume, a checkpoint without weights (`eval`, resume), weights that do not fit the
model, and a save that fails because the disk is full (the temporary folder is removed, earlier checkpoints stay)."""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from mmgrpo import checkpoint
from mmgrpo.cli import main
from mmgrpo.config_yaml import dump_yaml

ROOT = Path(__file__).resolve().parents[2]


def mdlm_run(pretrained, output_dir, max_steps=2, **checkpointing) -> dict:
    """A tiny masked-diffusion LM run: `max_steps` steps of two prompts x two answers, a checkpoint every step."""
    return {"output_dir": str(output_dir), "seed": 0,
            "pipeline": {"name": "mdlm", "pretrained": str(pretrained), "gen_length": 4, "steps_per_block": 2},
            "algorithm": {"name": "cj_grpo"}, "reward": {"name": "accuracy", "mode": "numeric"},
            "data": {"name": "arith", "n_train": 8, "n_eval": 2},
            "train": {"max_steps": max_steps, "prompts_per_step": 2, "group_size": 2, "minibatch_size": 4},
            "eval": {"every": 0, "num_prompts": 2, "grid_size": 0},
            "checkpoint": {"every": 1, "keep_last": 3, **checkpointing}}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, tiny_mdlm_dir):
    """A finished two-step run with checkpoints at steps 1 and 2: ``(config file, run folder)``."""
    tmp = tmp_path_factory.mktemp("finished")
    config = tmp / "run.yaml"
    config.write_text(dump_yaml(mdlm_run(tiny_mdlm_dir, tmp / "run")))
    assert main(["train", str(config)]) == 0
    return config, tmp / "run"


@pytest.fixture
def run_copy(finished_run, tmp_path):
    """A copy of the finished run and a config that trains it on: ``(config file, run folder)``."""
    config, run = finished_run
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    raw = mdlm_run(json.loads((run / "config.json").read_text())["pipeline"]["pretrained"], copy, max_steps=3)
    file = tmp_path / "run.yaml"
    file.write_text(dump_yaml(raw))
    return file, copy


def one_line(capsys) -> str:
    """The command's error: one line starting with ``mmgrpo:`` at the end of stderr (after any loading progress
    bars), and no traceback."""
    err = capsys.readouterr().err
    last = err.rstrip("\n").split("\n")[-1].split("\r")[-1]
    assert last.startswith("mmgrpo: ") and err.count("mmgrpo: ") == 1 and "Traceback" not in err, err
    return last


@pytest.mark.parametrize("name", ["optimizer.safetensors", "lr_scheduler.safetensors", "rng_rank0.safetensors",
                                  "weights/adapter_model.safetensors"])
@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_resuming_from_a_corrupt_file_names_it_and_the_checkpoint_before(run_copy, capsys, name, damage):
    file, run = run_copy
    broken = run / "checkpoints" / "step_0000002" / name
    data = broken.read_bytes()
    broken.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"\x07" * 64)
    assert main(["train", str(file), "checkpoint.resume_from=latest"]) == 2
    err = one_line(capsys)
    assert str(broken) in err and "unreadable" in err and str(run / "checkpoints" / "step_0000001") in err


@pytest.mark.parametrize("command", ["eval", "train"])
def test_a_checkpoint_without_weights_is_refused_before_loading(run_copy, capsys, command):
    file, run = run_copy
    folder = run / "checkpoints" / "step_0000002"
    shutil.rmtree(folder / "weights")
    args = ["eval", str(file), "--checkpoint", str(folder)] if command == "eval" else \
        ["train", str(file), f"checkpoint.resume_from={folder}"]
    assert main(args) == 2
    err = one_line(capsys)
    assert f"checkpoint {folder} has no weights" in err


def test_weights_that_do_not_fit_the_model_end_in_one_line(run_copy, capsys):
    from safetensors.torch import load_file, save_file

    file, run = run_copy
    adapter = run / "checkpoints" / "step_0000002" / "weights" / "adapter_model.safetensors"
    tensors = load_file(adapter)
    save_file({name: value[:, :1].contiguous() for name, value in tensors.items()}, adapter)  # well-formed, misshapen
    capsys.readouterr()
    assert main(["eval", str(file), "--checkpoint", str(adapter.parent.parent)]) == 1
    err = one_line(capsys)
    assert f"the weights of checkpoint {adapter.parent.parent} could not be loaded into this model" in err


SMALL_DISK = """
mount -t tmpfs -o size=64k tmpfs "$0" || exit 97
"$@"
code=$?
find "$0" -name "*.tmp" -printf "left: %p\\n"
ls "$0/run/checkpoints" 2>/dev/null | sed 's/^/checkpoint: /'
exit $code
"""


def with_a_small_disk(folder: Path, args: list[str]) -> subprocess.CompletedProcess:
    """Runs ``mmgrpo ARGS`` with `folder` on a 64 KiB disk of its own (a tmpfs in a private mount namespace); without
    the right to mount one, on a 64 KiB limit on file sizes instead (writes beyond fail as a full disk's do)."""
    env = dict(os.environ)
    command = [sys.executable, "-m", "mmgrpo.cli", *args]
    folder.mkdir(parents=True, exist_ok=True)
    if shutil.which("unshare"):
        proc = subprocess.run(["unshare", "-m", "sh", "-c", SMALL_DISK, str(folder), *command], env=env,
                              capture_output=True, text=True, timeout=300)
        if proc.returncode != 97:
            return proc

    def limit_file_sizes():
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write beyond the limit then fails with an error instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))

    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, preexec_fn=limit_file_sizes)
    left = "".join(f"left: {p}\n" for p in folder.rglob("*.tmp"))
    return subprocess.CompletedProcess(proc.args, proc.returncode, proc.stdout + left, proc.stderr)


def test_a_full_disk_during_a_save_ends_in_one_line_and_leaves_no_temporary_folder(tiny_mdlm_dir, tmp_path):
    disk = tmp_path / "disk"
    file = tmp_path / "run.yaml"
    file.write_text(dump_yaml(mdlm_run(tiny_mdlm_dir, disk / "run", max_steps=1)))
    proc = with_a_small_disk(disk, ["train", str(file)])
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and err[-1].startswith("mmgrpo: could not write checkpoint")
    assert "temporary folder was removed" in err[-1] and "left:" not in proc.stdout
    assert "checkpoint: step_0000001" not in proc.stdout  # no half-written checkpoint under its final name


def test_a_full_disk_during_an_export_leaves_nothing_behind(finished_run, tmp_path):
    _, run = finished_run
    disk = tmp_path / "disk"
    proc = with_a_small_disk(disk, ["export", str(run), str(disk / "exported")])
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert err[-1].startswith("mmgrpo: export: could not write the exported model") and "left:" not in proc.stdout
    assert not (disk / "exported").exists()


def test_a_checkpoint_records_the_version_that_wrote_it(finished_run):
    from mmgrpo import __version__

    meta = checkpoint.read_metadata(finished_run[1] / "checkpoints" / "step_0000002")
    assert meta["mmgrpo_version"] == __version__ and meta["format"] == checkpoint.FORMAT


def test_atomic_folder_replaces_the_target_only_when_complete(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "old.txt").write_text("old")
    with pytest.raises(checkpoint.CheckpointError, match="nothing was left there"):
        with checkpoint.atomic_folder(target, "the test folder") as tmp:
            (tmp / "new.txt").write_text("new")
            raise OSError(28, "No space left on device")
    assert (target / "old.txt").is_file() and not (tmp_path / "out.tmp").exists()
    with checkpoint.atomic_folder(target, "the test folder") as tmp:
        tmp.mkdir()
        (tmp / "new.txt").write_text("new")
    assert sorted(p.name for p in target.iterdir()) == ["new.txt"]
