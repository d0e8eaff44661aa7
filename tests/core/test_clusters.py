"""Cluster jobs: ``checkpoint.resume_from: auto`` serves the first run and every requeue; a scheduler's early warning
(``checkpoint.warning_signal``, SIGUSR1 as SLURM's ``--signal`` sends) saves and exits with 128 + its number; past
``checkpoint.stop_deadline`` after the first signal, a step still running is not waited for."""

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from mmgrpo import checkpoint, config as config_mod
from mmgrpo.cli import main
from mmgrpo.config_yaml import dump_yaml
from mmgrpo.stop_signals import SIGNALS, StopSignals, stop_signals
from mmgrpo.trainer import Trainer
from mmgrpo.validation import ConfigError

from builders._runs import dgpo_config
from test_graceful_stop import _config, _launch, _wait_for_step


def test_resume_from_auto_starts_fresh_then_continues_the_latest_checkpoint(tmp_path, tiny_sd3_dir, capsys):
    raw = dgpo_config(tmp_path, tiny_sd3_dir, 2)
    raw["checkpoint"]["resume_from"] = "auto"
    file = tmp_path / "run.yaml"
    file.write_text(dump_yaml(raw))
    assert main(["check", str(file)]) == 0, capsys.readouterr().err  # no checkpoint yet: a fresh start
    first = Trainer(config_mod.from_dict(raw))
    assert first.step == 0
    first.train()
    raw["train"]["max_steps"] = 3  # the same command after a requeue
    again = Trainer(config_mod.from_dict(raw))
    assert again.step == 2 and again.train()["steps"] == 3
    latest = checkpoint.complete_checkpoints(Path(raw["output_dir"]) / "checkpoints")[-1]
    assert latest.name == "step_0000003"


def test_warning_signals_are_checked():
    assert stop_signals(None) == SIGNALS
    assert stop_signals("USR1") == stop_signals("SIGUSR1") == (*SIGNALS, signal.SIGUSR1)
    with pytest.raises(ConfigError, match="checkpoint.warning_signal must be one of SIGUSR1"):
        config_mod.build_dataclass(config_mod.CheckpointConfig, {"warning_signal": "SIGKILL"}, "checkpoint")
    with pytest.raises(ConfigError, match="checkpoint.stop_deadline must be >= 0"):
        config_mod.build_dataclass(config_mod.CheckpointConfig, {"stop_deadline": -1}, "checkpoint")


def test_sigusr1_saves_a_checkpoint_and_exits_for_a_requeue(tmp_path, tiny_sd3_dir):
    raw = _config(tmp_path, tiny_sd3_dir, max_steps=10_000)
    raw["checkpoint"].update(warning_signal="SIGUSR1", resume_from="auto")
    run = Path(raw["output_dir"])
    proc = _launch(raw, tmp_path)
    _wait_for_step(run, proc)
    proc.send_signal(signal.SIGUSR1)
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 128 + signal.SIGUSR1, err[-3000:]
    assert "SIGUSR1 received: finishing this step, then saving a checkpoint" in err
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stopped_by"] == "SIGUSR1"
    assert [p.name for p in (run / "checkpoints").glob("step_*")] == [f"step_{summary['steps']:07d}"]


def test_past_the_deadline_a_long_step_is_not_waited_for():
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        with StopSignals(announce=False, deadline=0.2):
            os.kill(os.getpid(), signal.SIGINT)  # the first signal: the step may go on for 0.2 s
            threading.Event().wait(20)  # a step far longer than the deadline
    assert time.monotonic() - started < 10
    with StopSignals(announce=False, deadline=0.2) as stop:  # a step that ends in time: a graceful stop
        os.kill(os.getpid(), signal.SIGINT)
    threading.Event().wait(0.4)  # the deadline would have passed by now: nothing happens after the context
    assert stop.received == signal.SIGINT
