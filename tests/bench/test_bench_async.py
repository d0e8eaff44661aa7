"""bench/async.py: its command lines load as configs (the asynchronous one with one step of staleness), and its
table reads run folders as the trainer leaves them (no model runs)."""

import json
from pathlib import Path

import pytest

from mmgrpo import config as config_mod


@pytest.fixture(scope="module")
def bench(load_bench):
    return load_bench("async")


def test_every_run_loads_as_a_config(bench, tmp_path):
    args = type("Args", (), {"output": str(tmp_path), "seconds": 30.0, "eval_seconds": 10.0, "eval_prompts": 8})
    for task in bench.TASKS:
        for mode in bench.MODES:
            line = bench.command(task, mode, 1, args)
            config = config_mod.load(line[4], line[5:])
            assert config.seed == 1 and config.train.max_seconds == 30.0 and config.eval.every_seconds == 10.0
            assert (config.train.async_ is None) == (mode == "sync")
            if mode == "async":
                assert config.train.async_.max_staleness == 1


def write_run(folder: Path, step_s: float, evals: list[float]) -> None:
    folder.mkdir(parents=True)
    lines = [{"step": 0, "eval/strict": evals[0]}]
    lines += [{"step": s, "time/step_s": step_s, "time/train_s": step_s * s} for s in (1, 2, 3)]
    lines[-1]["eval/strict"] = evals[1]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_table_of_runs(bench, tmp_path):
    write_run(tmp_path / "t2i_sync_s0", 2.0, [0.5, 0.6])
    write_run(tmp_path / "t2i_async_s0", 1.0, [0.5, 0.7])
    write_run(tmp_path / "t2i_async_s1", 1.0, [0.5, 0.8])
    bench.main(["--report-only", "--output", str(tmp_path), "--tasks", "t2i", "--seeds", "0", "1"])
    lines = (tmp_path / "table.md").read_text().splitlines()
    assert lines[2] == "| t2i | sync | 1 | 2.000 | 3.0 | strict 0.600 (0.600-0.600) | 1.00x |"
    assert lines[3] == "| t2i | async | 2 | 1.000 | 3.0 | strict 0.750 (0.700-0.800) | 2.00x |"
    assert json.loads((tmp_path / "results.json").read_text())["runs"]["t2i"]["async"]["1"]["final"] == 0.8
