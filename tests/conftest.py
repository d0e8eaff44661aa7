"""Test set-up: offline hub, CPU threads, and the tiny real-class models of `builders/` (one module per pipeline)."""

import os

for _key, _value in {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "ACCELERATE_USE_CPU": "true",
    "TOKENIZERS_PARALLELISM": "false",
    "DIFFUSERS_VERBOSITY": "error",
    "TRANSFORMERS_VERBOSITY": "error",
}.items():
    os.environ.setdefault(_key, _value)
# model code that a test allows to run (--trust-remote-code) is copied here, not into the user's cache
os.environ.setdefault("HF_MODULES_CACHE", __import__("tempfile").mkdtemp(prefix="mmgrpo-test-modules-"))

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

# 2 threads by default; OMP_NUM_THREADS wins when set: on a shared 2-core machine, two torch threads competing with
# another job for one free core make tiny-model forwards ~50x slower (measured: 4.3 s instead of 0.07 s per rollout)
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 2))


# every tiny-model builder (one per pipeline, `builders/<pipeline>.py`) contributes its fixtures
pytest_plugins = sorted(f"builders.{p.stem}" for p in (Path(__file__).parent / "builders").glob("[!_]*.py"))


@pytest.fixture(scope="session")
def load_bench():
    """Imports a script of `bench/` by name (the folder is not a package), e.g. ``load_bench("vlm_vs_trl")``."""
    from builders._repo_files import load_repo_script

    return lambda name: load_repo_script("bench", name)
