"""Synchronous against asynchronous training (``train.async: {max_staleness: 1}``) on the tiny defaults: wall time per
training step, and the held-out reward both reach in the same training time.

Tasks (each its embedded default with the overrides of [`TASKS`]: a time budget instead of a step count, evaluations
every ``--eval-seconds`` of training time on ``--eval-prompts`` held-out prompts, no periodic checkpoint):

- ``t2i``: ``configs/tiny/t2i_shapes.yaml`` (DGPO on the shipped SD3-architecture toy; held-out ``strict``), with 8
  prompts per step instead of 16;
- ``vlm``: ``configs/tiny/vlm_count.yaml`` (GRPO on the shipped Qwen2-VL-architecture toy; held-out ``accuracy``).

Each (task, seed) runs ``mmgrpo train`` once synchronously and once with ``train.async.max_staleness=1``, one run at a
time, each for ``--seconds`` of training time (``train.max_seconds``: evaluation and start-up not counted), seeds in
the order given. The table gives per task and mode the median step time (``time/step_s``) over every step of every
seed, the mean number of steps done in the budget, and the mean over seeds of the held-out metric at the last
evaluation (after the budget) with its range; the ratio is the synchronous median step time over the asynchronous one.

Run from the repository root (one run at a time; 3 seeds):

    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 OMP_NUM_THREADS=1 nice -n 5 .venv/bin/python bench/async.py \\
        --output outputs/bench_async --seeds 0 1 2

Writes each run under ``--output/<task>_<mode>_s<seed>/``, ``results.json`` and ``table.md``, and prints the table.
``--report-only`` rebuilds them from the runs already there.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = {"sync": [], "async": ["train.async.max_staleness=1"]}
TASKS = {  # task -> (config, held-out metric, overrides)
    "t2i": ("configs/tiny/t2i_shapes.yaml", "strict", ["train.prompts_per_step=8", "train.minibatch_size=64"]),
    "vlm": ("configs/tiny/vlm_count.yaml", "accuracy", []),
}


def command(task: str, mode: str, seed: int, args) -> list[str]:
    """The ``mmgrpo train`` command line of one run."""
    config, _, overrides = TASKS[task]
    run = Path(args.output) / f"{task}_{mode}_s{seed}"
    return [sys.executable, "-m", "mmgrpo.cli", "train", str(ROOT / config), f"output_dir={run}", f"seed={seed}",
            "train.max_steps=100000", f"train.max_seconds={args.seconds}", "eval.every=0",
            f"eval.every_seconds={args.eval_seconds}", f"eval.num_prompts={args.eval_prompts}", "checkpoint.every=0",
            *overrides, *MODES[mode]]


def read_run(folder: Path, metric: str) -> dict:
    """Step times, steps done and the held-out metric of each evaluation (by training time) of one run folder."""
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in records if "time/step_s" in r]
    evals = [(r.get("time/train_s", 0.0), r[f"eval/{metric}"]) for r in records if f"eval/{metric}" in r]
    return {"step_s": [r["time/step_s"] for r in steps], "steps": max((r["step"] for r in steps), default=0),
            "evals": evals, "final": evals[-1][1] if evals else None}


def table(results: dict) -> str:
    """The markdown table of `results` (task -> mode -> seed -> run)."""
    lines = ["| task | mode | seeds | median step (s) | steps in budget | held-out metric at the budget (range) | "
             "step-time ratio |", "|---|---|---|---|---|---|---|"]
    for task, by_mode in results.items():
        medians = {mode: statistics.median([t for run in runs.values() for t in run["step_s"]])
                   for mode, runs in by_mode.items() if any(run["step_s"] for run in runs.values())}
        for mode, runs in by_mode.items():
            finals = [run["final"] for run in runs.values() if run["final"] is not None]
            held = (f"{TASKS[task][1]} {statistics.mean(finals):.3f} ({min(finals):.3f}-{max(finals):.3f})"
                    if finals else "-")
            ratio = f"{medians['sync'] / medians[mode]:.2f}x" if mode in medians and "sync" in medians else "-"
            steps = statistics.mean(run["steps"] for run in runs.values())
            lines.append(f"| {task} | {mode} | {len(runs)} | {medians.get(mode, float('nan')):.3f} | {steps:.1f} | "
                         f"{held} | {ratio} |")
    return "\n".join(lines) + "\n"


def report(args) -> str:
    results = {}
    for task in args.tasks:
        for mode in MODES:
            for seed in args.seeds:
                folder = Path(args.output) / f"{task}_{mode}_s{seed}"
                if (folder / "metrics.jsonl").is_file():
                    results.setdefault(task, {}).setdefault(mode, {})[str(seed)] = read_run(folder, TASKS[task][1])
    text = table(results)
    Path(args.output, "results.json").write_text(json.dumps({"args": vars(args), "runs": results}, indent=1))
    Path(args.output, "table.md").write_text(text)
    return text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default="outputs/bench_async")
    parser.add_argument("--tasks", nargs="+", choices=sorted(TASKS), default=["t2i", "vlm"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--seconds", type=float, default=120.0, help="training time of each run (train.max_seconds)")
    parser.add_argument("--eval-seconds", type=float, default=60.0, help="eval.every_seconds")
    parser.add_argument("--eval-prompts", type=int, default=64, help="eval.num_prompts")
    parser.add_argument("--report-only", action="store_true", help="rebuild the table from the runs in --output")
    args = parser.parse_args(argv)
    Path(args.output).mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        for seed in args.seeds:
            for task in args.tasks:
                for mode in MODES:  # the two modes of a (task, seed) back to back: the machine's load falls alike
                    subprocess.run(command(task, mode, seed, args), check=True, cwd=ROOT, env=env,
                                   stdout=subprocess.DEVNULL)
    print(report(args), end="")


if __name__ == "__main__":
    main()
