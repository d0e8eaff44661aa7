"""Every flow-matching algorithm on the embedded text-to-image task, at the same wall-clock budget, over several
training seeds.

Each algorithm trains from the same base model (``mmgrpo:t2i_shapes``) with its own tiny config
(``configs/tiny/t2i_shapes_<algorithm>.yaml``), one run after another, each in a fresh ``mmgrpo train`` process, for the
same budget of training time (``train.max_seconds``: only training steps count; start-up, evaluations and checkpoints
do not), once per seed. Held-out evaluations are spaced in training time (``eval.every_seconds``), so every run gets the
same ~10 points whatever its speed per step. Then, from each run's ``metrics.jsonl`` (see `bench/_flow_report.py`), it
writes under ``--output``:

  * ``table.md``: per algorithm, mean and range over seeds of the base / final / best held-out reward, steps and
    sampled images, and of the time to first reach Flow-GRPO's final held-out reward of the same seed, as a ratio to
    Flow-GRPO's own time to reach it (in training seconds and in sampled images); plus the DGPO paper's claim
    (Flow-GRPO's final reward reached >= 5x sooner) judged per seed;
  * ``curves.png``: held-out reward against training seconds and against sampled images, one curve per algorithm;
  * ``results.json``: the settings, the commands, the raw curves and the table's numbers.

Run from the repository root, on an otherwise idle machine (the runs are timed, so any other load skews them):

    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 .venv/bin/python bench/flow_algorithms.py --budget-s 300 --threads 2

``--dry-run`` prints the commands; ``--report-only`` rebuilds the table and figure from runs already in ``--output``.
Each run's folder ``<output>/<algorithm>_s<seed>`` is deleted before it starts (metrics.jsonl is appended to, so a
stale one would mix two runs). ``train.max_steps`` is raised to ``--max-steps`` so that the budget, not the step count,
ends every run; a learning-rate schedule keyed to ``max_steps`` (``lr_schedule: cosine``) then barely decays within the
budget.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is not a package: its report module beside it
from _flow_report import (  # noqa: E402
    REFERENCE, aggregate, common_settings, compare, markdown_table, plot_curves, read_run,
)

ROOT = Path(__file__).resolve().parents[1]
ALGORITHMS = (  # the reference first
    "flow_grpo", "grpo_guard", "flow_dppo", "mix_grpo", "dance_grpo", "branch_grpo", "e_grpo", "chunk_grpo", "dgpo",
    "diffusion_nft", "awm",
)
CONFIGS = {name: f"configs/tiny/t2i_shapes_{name}.yaml" for name in ALGORITHMS}
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


# ------------------------------------------------------------------------------------------------------- running
def eval_interval(budget_s: float, points: int) -> float:
    """``eval.every_seconds`` for `points` evaluations after the base one, rounded up (to ms) so that the last one
    falls on the run's final step rather than just before it."""
    return math.ceil(budget_s / points * 1000) / 1000


def run_name(algorithm: str, seed: int) -> str:
    """The folder (under ``--output``) of one run: ``<algorithm>_s<seed>``."""
    return f"{algorithm}_s{seed}"


def train_command(algorithm: str, seed: int, args: argparse.Namespace) -> list[str]:
    """The ``mmgrpo train`` command line of one run, with paths relative to the repository root (its working folder).

    Args:
        algorithm (`str`): a key of `CONFIGS`.
        seed (`int`): the training seed.
        args (`argparse.Namespace`): the parsed options (budget, seed, evaluation prompts and points, output...).

    Returns:
        `list[str]`: ``["python", "-m", "mmgrpo.cli", "train", CONFIG, key=value...]``; replace ``"python"`` by the
        interpreter to run it.
    """
    run_dir = os.path.relpath(Path(args.output).resolve() / run_name(algorithm, seed), ROOT)
    overrides = {
        "output_dir": run_dir,
        "seed": seed,
        "train.max_steps": args.max_steps,
        "train.max_seconds": args.budget_s,
        "eval.every": 0,
        "eval.every_seconds": eval_interval(args.budget_s, args.eval_points),
        "eval.num_prompts": args.eval_prompts,
        "checkpoint.every": 0,
        "checkpoint.keep_last": 1,
        "log_every": 1,
    }
    return ["python", "-m", "mmgrpo.cli", "train", CONFIGS[algorithm], *(f"{k}={v}" for k, v in overrides.items())]


def run_training(name: str, command: list[str], output: Path, threads: int | None) -> float:
    """Runs one training command in a fresh process (its output goes to ``<output>/<name>.log``).

    Args:
        name (`str`): the run's name ([`run_name`]); its folder ``<output>/<name>`` is emptied first.
        command (`list[str]`): from [`train_command`].
        output (`Path`): the benchmark's output folder.
        threads (`int`, *optional*): ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS`` of the process (torch takes its
            thread count from them); inherited when `None`.

    Returns:
        `float`: the process's wall-clock seconds (start-up, training, evaluations and saving).
    """
    shutil.rmtree(output / name, ignore_errors=True)
    env = {**os.environ, **{k: os.environ.get(k, v) for k, v in OFFLINE.items()}, "TOKENIZERS_PARALLELISM": "false"}
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    log = output / f"{name}.log"
    start = time.perf_counter()
    with log.open("w", encoding="utf-8") as handle:
        code = subprocess.run([sys.executable, *command[1:]], cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT).returncode
    seconds = time.perf_counter() - start
    if code:
        tail = "".join(log.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)[-20:])
        raise RuntimeError(f"{name} failed (exit code {code}); the end of {log.name}:\n{tail}")
    return seconds


# ---------------------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget-s", type=float, default=300.0, help="training seconds per algorithm (train.max_seconds)")
    parser.add_argument("--algorithms", nargs="+", choices=list(CONFIGS), default=list(CONFIGS),
                        help=f"a subset to run (the table compares against {REFERENCE}, which must be among them)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="training seeds, one run each")
    parser.add_argument("--eval-prompts", type=int, default=200, help="held-out prompts per evaluation")
    parser.add_argument("--eval-points", type=int, default=9, help="evaluations after the base one (spaced in training time)")
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS / torch threads of each run (default: inherited)")
    parser.add_argument("--max-steps", type=int, default=100_000, help="train.max_steps: high, so that the budget ends the runs")
    parser.add_argument("--output", type=Path, default=Path("bench/results/flow_algorithms"))
    parser.add_argument("--dry-run", action="store_true", help="print the commands and exit")
    parser.add_argument("--report-only", action="store_true", help="only rebuild the table and figure from runs in --output")
    args = parser.parse_args(argv)
    if REFERENCE not in args.algorithms:
        parser.error(f"--algorithms must include {REFERENCE}: its final reward is the target every run is timed to")
    if args.budget_s <= 0 or args.eval_points < 1 or args.eval_prompts < 1:
        parser.error("--budget-s, --eval-points and --eval-prompts must be positive")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    commands = {run_name(name, seed): train_command(name, seed, args) for seed in args.seeds for name in args.algorithms}
    if args.dry_run:
        print(f"# from the repository root, with OMP_NUM_THREADS={args.threads or '(inherited)'}")
        for command in commands.values():
            print(" ".join(command))
        return
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    record = {"commands": {name: " ".join(c) for name, c in commands.items()}, "process_s": {}, "threads": args.threads}
    if args.report_only:
        if (output / "results.json").is_file():  # keep what the runs were started with, not today's options
            previous = json.loads((output / "results.json").read_text(encoding="utf-8"))
            record = {
                "commands": {k: v for k, v in previous["commands"].items() if k in commands},
                "process_s": {k: v for k, v in previous["process_s"].items() if k in commands},
                "threads": previous["settings"].get("threads"),
            }
    else:
        for name, command in commands.items():
            print(f"[{name}] {' '.join(command)}", flush=True)
            record["process_s"][name] = run_training(name, command, output, args.threads)
            print(f"[{name}] done in {record['process_s'][name]:.0f} s (start-up, training, evaluations)", flush=True)
    runs = {(name, seed): read_run(output / run_name(name, seed)) for seed in args.seeds for name in args.algorithms}
    settings = {**common_settings({run_name(*key): run for key, run in runs.items()}), "threads": record["threads"]}
    per_seed = {seed: compare({name: runs[name, seed] for name in args.algorithms}) for seed in args.seeds}
    table = markdown_table(per_seed, settings)
    (output / "table.md").write_text(table, encoding="utf-8")
    plot_curves(runs, output / "curves.png")
    results = {"settings": settings, "commands": record["commands"], "process_s": record["process_s"],
               "runs": {run_name(*key): run for key, run in runs.items()}, "per_seed": per_seed}
    (output / "results.json").write_text(json.dumps(results, indent=2), encoding="utf-8")
    print(table)


if __name__ == "__main__":
    main()
