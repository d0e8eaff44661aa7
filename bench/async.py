"""Synchronous against asynchronous training (``train.async: {max_staleness: 1}``) on the tiny defaults: wall time per
training step, and the held-out reward both reach in the same training time.

Tasks (each its embedded default with the overrides of [`TASKS`]: a time budget instead of a step count, evaluations
every ``--eval-seconds`` of training time on ``--eval-prompts`` held-out prompts, no periodic checkpoint):

- ``t2i``: ``configs/tiny/t2i_shapes.yaml`` (DGPO on the shipped SD3-architecture toy; held-out ``strict``), with 8
  prompts per step instead of 16;
- ``vlm``: ``configs/tiny/vlm_count.yaml`` (GRPO on the shipped Qwen2-VL-architecture toy; held-out ``accuracy``).

Each (task, seed) runs ``mmgrpo train`` once synchronously and once with ``train.async.max_staleness=1``, one run at a
time, each for ``--seconds`` of training time (``train.max_seconds``: evaluation and start-up not counted), seeds in
the order given. With ``--nproc N`` (N > 1) each run is ``torchrun --standalone --nproc_per_node N -m mmgrpo.cli
train ...`` (gloo on CPUs; each process takes ``OMP_NUM_THREADS`` threads as the caller sets it, 1 where unset, as
torchrun does) with the same global sizes per step: ``train.prompts_per_step`` already counts prompts over all
processes, and ``train.minibatch_size`` (samples per backward pass on one process) is divided by N, so each update
averages as many samples, and each step takes as many updates, as at one process. Only rank 0 writes the run's
``metrics.jsonl``; its ``time/step_s`` is the slowest process's. The table gives per task, number of processes and
mode the median step time (``time/step_s``) over every step of every seed, the mean number of steps done in the
budget, and the mean over seeds of the held-out metric at the last evaluation (after the budget) with its range; the
ratio is the synchronous median step time over the asynchronous one at the same number of processes. It holds the runs
of every number of processes found in ``--output``.

Run from the repository root (one run at a time; 3 seeds):

    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 OMP_NUM_THREADS=1 nice -n 5 .venv/bin/python bench/async.py \\
        --output outputs/bench_async --seeds 0 1 2
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 OMP_NUM_THREADS=1 nice -n 5 .venv/bin/python bench/async.py \\
        --output outputs/bench_async --seeds 0 1 2 --nproc 2

Writes each run under ``--output/<task>_<mode>_s<seed>/`` (one process) or ``--output/<task>_<mode>_p<N>_s<seed>/``
(N processes), ``results.json`` and ``table.md``, and prints the table.
``--report-only`` rebuilds them from the runs already there.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

from mmgrpo.config import load

ROOT = Path(__file__).resolve().parents[1]
MODES = {"sync": [], "async": ["train.async.max_staleness=1"]}
TASKS = {  # task -> (config, held-out metric, overrides)
    "t2i": ("configs/tiny/t2i_shapes.yaml", "strict", ["train.prompts_per_step=8", "train.minibatch_size=64"]),
    "vlm": ("configs/tiny/vlm_count.yaml", "accuracy", []),
}


def run_name(task: str, mode: str, seed: int, nproc: int = 1) -> str:
    """A run's folder: ``<task>_<mode>_s<seed>`` at one process, ``<task>_<mode>_p<nproc>_s<seed>`` at more."""
    return f"{task}_{mode}_s{seed}" if nproc == 1 else f"{task}_{mode}_p{nproc}_s{seed}"


def per_process_sizes(task: str, nproc: int) -> list[str]:
    """The overrides that give `nproc` processes the global step of one: ``train.minibatch_size`` counts samples per
    process, so it is divided by `nproc` (``train.prompts_per_step`` already counts prompts over all processes)."""
    if nproc == 1:
        return []
    config, _, overrides = TASKS[task]
    train = load(str(ROOT / config), list(overrides)).train
    samples = train.prompts_per_step * train.group_size
    if samples % nproc or train.minibatch_size % nproc:
        raise SystemExit(f"--nproc {nproc}: task {task}'s {samples} samples per step and minibatch of "
                         f"{train.minibatch_size} must both split evenly over the processes: use a divisor of both.")
    return [f"train.minibatch_size={train.minibatch_size // nproc}"]


def command(task: str, mode: str, seed: int, args) -> list[str]:
    """The ``mmgrpo train`` command line of one run (under ``torchrun`` for ``args.nproc`` > 1)."""
    config, _, overrides = TASKS[task]
    run = Path(args.output) / run_name(task, mode, seed, args.nproc)
    launcher = [sys.executable]  # torchrun is torch.distributed.run, started from the same interpreter
    if args.nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.nproc)]
    return [*launcher, "-m", "mmgrpo.cli", "train", str(ROOT / config), f"output_dir={run}", f"seed={seed}",
            "train.max_steps=100000", f"train.max_seconds={args.seconds}", "eval.every=0",
            f"eval.every_seconds={args.eval_seconds}", f"eval.num_prompts={args.eval_prompts}", "checkpoint.every=0",
            *overrides, *per_process_sizes(task, args.nproc), *MODES[mode]]


def run_folders(output: str, task: str, mode: str, seed: int) -> dict[int, Path]:
    """The finished-or-running run folders (with a ``metrics.jsonl``) of (task, mode, seed), by number of processes."""
    name = re.compile(rf"{task}_{mode}(?:_p(\d+))?_s{seed}")
    found = {}
    for folder in sorted(Path(output).glob(f"{task}_{mode}*_s{seed}")):
        match = name.fullmatch(folder.name)
        if match and (folder / "metrics.jsonl").is_file():
            found[int(match.group(1) or 1)] = folder
    return found


def read_run(folder: Path, metric: str) -> dict:
    """Step times, steps done and the held-out metric of each evaluation (by training time) of one run folder."""
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in records if "time/step_s" in r]
    evals = [(r.get("time/train_s", 0.0), r[f"eval/{metric}"]) for r in records if f"eval/{metric}" in r]
    return {"step_s": [r["time/step_s"] for r in steps], "steps": max((r["step"] for r in steps), default=0),
            "evals": evals, "final": evals[-1][1] if evals else None}


def table(results: dict) -> str:
    """The markdown table of `results` (task -> processes -> mode -> seed -> run)."""
    lines = ["| task | processes | mode | seeds | median step (s) | steps in budget | held-out metric at the budget "
             "(range) | step-time ratio |", "|---|---|---|---|---|---|---|---|"]
    for (task, nproc), by_mode in rows(results):
        medians = {mode: statistics.median([t for run in runs.values() for t in run["step_s"]])
                   for mode, runs in by_mode.items() if any(run["step_s"] for run in runs.values())}
        for mode, runs in by_mode.items():
            finals = [run["final"] for run in runs.values() if run["final"] is not None]
            held = (f"{TASKS[task][1]} {statistics.mean(finals):.3f} ({min(finals):.3f}-{max(finals):.3f})"
                    if finals else "-")
            ratio = f"{medians['sync'] / medians[mode]:.2f}x" if mode in medians and "sync" in medians else "-"
            steps = statistics.mean(run["steps"] for run in runs.values())
            median = medians.get(mode, float("nan"))
            lines.append(f"| {task} | {nproc} | {mode} | {len(runs)} | {median:.3f} | {steps:.1f} | {held} | {ratio} |")
    return "\n".join(lines) + "\n"


def rows(results: dict):
    """((task, processes), mode -> seed -> run) of `results`, tasks in order, processes ascending."""
    for task, by_nproc in results.items():
        for nproc in sorted(by_nproc, key=int):
            yield (task, nproc), by_nproc[nproc]


def report(args) -> str:
    results = {}  # task -> processes -> mode -> seed -> run
    for task in args.tasks:
        for mode in MODES:
            for seed in args.seeds:
                for nproc, folder in run_folders(args.output, task, mode, seed).items():
                    results.setdefault(task, {}).setdefault(str(nproc), {}).setdefault(mode, {})[str(seed)] = \
                        read_run(folder, TASKS[task][1])
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
    parser.add_argument("--nproc", type=int, default=1,
                        help="processes per run; more than 1 launches each run under torchrun (CPU: gloo)")
    parser.add_argument("--report-only", action="store_true", help="rebuild the table from the runs in --output")
    args = parser.parse_args(argv)
    if args.nproc < 1:
        parser.error("--nproc must be at least 1")
    Path(args.output).mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        for task in args.tasks:
            per_process_sizes(task, args.nproc)  # refuses sizes that do not split before any run starts
        for seed in args.seeds:
            for task in args.tasks:
                for mode in MODES:  # the two modes of a (task, seed) back to back: the machine's load falls alike
                    subprocess.run(command(task, mode, seed, args), check=True, cwd=ROOT, env=env,
                                   stdout=subprocess.DEVNULL)
    print(report(args), end="")


if __name__ == "__main__":
    main()
