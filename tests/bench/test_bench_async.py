"""bench/async.py: its command lines load as configs (the asynchronous one with one step of staleness; under torchrun
with the global sizes of one process), and its table reads run folders of one and two processes as the trainer leaves
them (no model runs)."""

import json
import sys
from pathlib import Path

import pytest

from mmgrpo import config as config_mod


@pytest.fixture(scope="module")
def bench(load_bench):
    return load_bench("async")


def bench_args(output: Path, nproc: int):
    return type("Args", (), {"output": str(output), "seconds": 30.0, "eval_seconds": 10.0, "eval_prompts": 8,
                             "nproc": nproc})


def test_every_run_loads_as_a_config(bench, tmp_path):
    args = bench_args(tmp_path, 1)
    for task in bench.TASKS:
        for mode in bench.MODES:
            line = bench.command(task, mode, 1, args)
            assert line[:4] == [sys.executable, "-m", "mmgrpo.cli", "train"]
            config = config_mod.load(line[4], line[5:])
            assert config.output_dir == str(tmp_path / f"{task}_{mode}_s1")  # the names of the runs already measured
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
    write_run(tmp_path / "t2i_sync_p2_s0", 1.5, [0.5, 0.65])
    write_run(tmp_path / "t2i_async_p2_s0", 0.5, [0.5, 0.55])
    write_run(tmp_path / "t2i_async_p2_s7", 9.0, [0.5, 0.9])  # a seed not asked for
    bench.main(["--report-only", "--output", str(tmp_path), "--tasks", "t2i", "--seeds", "0", "1"])
    lines = (tmp_path / "table.md").read_text().splitlines()
    assert lines[0].startswith("| task | processes | mode | seeds |") and len(lines) == 6
    assert lines[2] == "| t2i | 1 | sync | 1 | 2.000 | 3.0 | strict 0.600 (0.600-0.600) | 1.00x |"
    assert lines[3] == "| t2i | 1 | async | 2 | 1.000 | 3.0 | strict 0.750 (0.700-0.800) | 2.00x |"
    assert lines[4] == "| t2i | 2 | sync | 1 | 1.500 | 3.0 | strict 0.650 (0.650-0.650) | 1.00x |"
    assert lines[5] == "| t2i | 2 | async | 1 | 0.500 | 3.0 | strict 0.550 (0.550-0.550) | 3.00x |"
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]["t2i"]
    assert runs["1"]["async"]["1"]["final"] == 0.8 and runs["2"]["async"]["0"]["final"] == 0.55


def test_two_process_runs_launch_under_torchrun_with_the_global_step_of_one(bench, tmp_path):
    """Under torchrun each process holds half of each step: the same prompts per step (a global count), half the
    minibatch (a per-process count), so every update averages as many samples as at one process."""
    for task in bench.TASKS:
        for mode in bench.MODES:
            single = bench.command(task, mode, 0, bench_args(tmp_path, 1))
            line = bench.command(task, mode, 0, bench_args(tmp_path, 2))
            start = line.index("train")
            assert line[:start] == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                                    "2", "-m", "mmgrpo.cli"]
            one, two = config_mod.load(single[4], single[5:]), config_mod.load(line[start + 1], line[start + 2:])
            assert two.output_dir == str(tmp_path / f"{task}_{mode}_p2_s0")
            assert two.train.prompts_per_step == one.train.prompts_per_step
            assert two.train.group_size == one.train.group_size
            assert two.train.minibatch_size * 2 == one.train.minibatch_size
            assert two.train.updates_per_step == one.train.updates_per_step
            assert (two.train.async_ is None) == (mode == "sync") and two.eval.num_prompts == 8


def test_a_process_count_that_does_not_split_a_step_is_refused(bench, tmp_path):
    with pytest.raises(SystemExit, match="--nproc 3: task vlm's 128 samples per step"):
        bench.main(["--output", str(tmp_path), "--tasks", "vlm", "--nproc", "3"])
    assert not list(tmp_path.iterdir())  # refused before any run
