"""A SIGTERM while a run is still being set up (models built, first batch) stops it at once: exit status 143 and one
line on stderr, no checkpoint written, also when the set-up is stuck in a long native call that never returns to the
interpreter (where Python's own signal handlers cannot run)."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MARK = "set-up is running"
# `mmgrpo train` of a tiny config whose component building never ends: a Python loop, or one long matrix product (a
# native call that holds no Python frame of its own: the interpreter runs no signal handler until it returns)
SCRIPT = textwrap.dedent("""
    import sys, time
    import torch
    import mmgrpo.trainer as trainer

    def stuck(config):
        print({mark!r}, file=sys.stderr, flush=True)
        if {native}:
            torch.set_num_threads(1)
            a = torch.ones(8192, 8192)
            a @ a  # seconds to minutes on one core
        while True:
            time.sleep(0.05)

    trainer.build_components = stuck
    from mmgrpo.cli import main
    sys.exit(main(["train", {config!r}, "output_dir=" + {out!r}, "eval.every=0"]))
""")


def _stop_during_setup(tmp_path, native: bool) -> tuple[int, str, float]:
    out = tmp_path / "run"
    code = SCRIPT.format(mark=MARK, native=native, config=str(ROOT / "configs" / "tiny" / "t2i_shapes.yaml"),
                         out=str(out))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    lines = []
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        if MARK in line:
            break
    assert MARK in "".join(lines), "".join(lines)[-3000:]
    time.sleep(1.0)  # inside the loop / the matrix product
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        rest = proc.communicate(timeout=30)[1]
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("SIGTERM did not stop the set-up within 30 s")
    assert not (out / "checkpoints").exists()
    return proc.returncode, "".join(lines) + rest, time.monotonic() - sent


def test_sigterm_during_setup_stops_at_once(tmp_path):
    code, err, took = _stop_during_setup(tmp_path, native=False)
    assert code == 128 + signal.SIGTERM, err[-3000:]
    assert took < 5, took
    assert "SIGTERM received during set-up: stopped at once (no checkpoint written)." in err
    assert "Traceback" not in err, err[-3000:]


def test_sigterm_stops_a_setup_stuck_in_native_code(tmp_path):
    code, err, took = _stop_during_setup(tmp_path, native=True)
    assert code == 128 + signal.SIGTERM, err[-3000:]
    assert took < 10, took
    assert "SIGTERM received" in err and "stopped at once" in err, err[-3000:]
