"""Graceful stops with real signals: SIGTERM (or Ctrl-C) during training finishes the step, writes a checkpoint and
the summary, and exits with 128 + the signal number; resuming from that checkpoint continues exactly; a second signal
stops at once."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mmgrpo import config as config_mod
from mmgrpo.config_yaml import read_yaml
from mmgrpo.trainer import Trainer

from builders._runs import dgpo_config

STEPS = 6


def _config(tmp_path, tiny_sd3_dir, max_steps=STEPS):
    raw = dgpo_config(tmp_path, tiny_sd3_dir, max_steps)
    raw["checkpoint"] = {"every": 0, "keep_last": 2}  # no periodic checkpoint: only the stop writes one
    raw["log_every"] = 1
    return raw


def _launch(raw, tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(json.dumps(raw))  # JSON is YAML
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen([sys.executable, "-m", "mmgrpo.cli", "train", str(path)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_step(run: Path, proc, timeout=240.0) -> None:
    """Until the run logged its first training step (so the signal lands inside the training loop)."""
    metrics, deadline = run / "metrics.jsonl", time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metrics.is_file() and '"step": 1' in metrics.read_text():
            return
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    proc.kill()
    pytest.fail("the run logged no step in time")


def _weights(run: Path) -> dict:
    checkpoints = sorted((run / "checkpoints").glob("step_*"))
    folder = checkpoints[-1] / "weights"
    return {k: v for f in sorted(folder.rglob("*.safetensors")) for k, v in load_file(f).items()}


def test_sigterm_saves_a_checkpoint_and_the_run_resumes_exactly(tmp_path, tiny_sd3_dir):
    raw = _config(tmp_path / "stopped", tiny_sd3_dir)
    run = Path(raw["output_dir"])
    proc = _launch(raw, tmp_path / "stopped")
    _wait_for_step(run, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "SIGTERM received: finishing this step, then saving a checkpoint" in err
    summary = json.loads((run / "summary.json").read_text())
    stopped_at = summary["steps"]
    assert summary["stopped_by"] == "SIGTERM" and 1 <= stopped_at < STEPS
    assert [p.name for p in (run / "checkpoints").glob("step_*")] == [f"step_{stopped_at:07d}"]

    raw["checkpoint"]["resume_from"] = "latest"
    Trainer(config_mod.from_dict(raw)).train()  # on to STEPS steps
    straight = _config(tmp_path / "straight", tiny_sd3_dir)
    Trainer(config_mod.from_dict(straight)).train()
    resumed, reference = _weights(run), _weights(Path(straight["output_dir"]))
    assert resumed.keys() == reference.keys()
    for key in reference:
        torch.testing.assert_close(resumed[key], reference[key], rtol=0, atol=0)


def test_a_second_signal_stops_at_once(tmp_path, tiny_sd3_dir):
    raw = _config(tmp_path, tiny_sd3_dir, max_steps=10_000)
    proc = _launch(raw, tmp_path)
    _wait_for_step(Path(raw["output_dir"]), proc)
    chunks = []  # stderr, read as it comes: the second signal must land after the first one was handled
    reader = threading.Thread(target=lambda: chunks.extend(iter(lambda: proc.stderr.read(1), "")), daemon=True)
    reader.start()
    threading.Thread(target=proc.stdout.read, daemon=True).start()  # drained, so a full pipe never blocks the run
    proc.send_signal(signal.SIGINT)
    deadline = time.monotonic() + 60  # two signals before the handler runs would count as one (one graceful stop)
    while "SIGINT received" not in "".join(chunks) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.01)
    assert "SIGINT received" in "".join(chunks)
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=120)
    reader.join(timeout=30)
    err = "".join(chunks)
    assert proc.returncode == 130, err[-3000:]
    assert "stopped at once" in err, err[-3000:]


def test_every_embedded_default_checkpoints_during_training():
    """A long run loses at most one checkpoint interval to a crash, whatever stops it."""
    root = Path(__file__).resolve().parents[2] / "configs" / "tiny"
    for path in sorted(root.glob("*.yaml")):
        assert (read_yaml(path).get("checkpoint") or {}).get("every", 0) > 0, f"{path.name}: set checkpoint.every"
