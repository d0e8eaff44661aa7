"""Soak test: each embedded default trained for a few hundred steps while its memory and open files are watched.

Each config runs as a real ``mmgrpo train`` process with overrides that make a step cheap but keep every code path
that could leak: small batches, evaluations and checkpoints (``keep_last=2``, so old ones are deleted) every
``--every`` steps, a metrics line and a TensorBoard write every step. From outside, every ``--sample-every`` seconds,
the process is sampled: resident memory (``VmRSS``, summed over the process and its children), open file descriptors
(``/proc/PID/fd``) and threads. Each sample is mapped to the step of the last complete line of the run's
``metrics.jsonl`` (a torn last line is skipped).

Growth is the slope of a least-squares line, per 100 steps, with its standard error: one value per step (the median
of that step's samples), then one per block of ``--every`` steps (the median of the block: one evaluation / checkpoint
cycle), fitted from step ``--warmup`` to the step before the last; it counts as growth only when it exceeds both three
standard errors and a floor (``--rss-floor`` MiB, ``--fd-floor`` descriptors per 100 steps). Writes under ``--output``:
``samples.json`` (every sample, saved as each run ends; ``--report-only`` reports it again), ``results.json`` (the
rows), ``table.md`` and ``soak.png`` (RSS and descriptors against step, one column per config); prints the table.

Run from the repository root:

    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 \\
        .venv/bin/python bench/soak.py --steps 600 --sample-every 0.5
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ["configs/tiny/t2i_shapes.yaml", "configs/tiny/vlm_count.yaml", "configs/tiny/mdlm_arith.yaml"]
SMALL = {  # config stem -> overrides that make a step cheap (B = 4 prompts, G = 4 samples) and keep its code paths
    "t2i_shapes": ["train.minibatch_size=16", "eval.grid_size=4"],
    "vlm_count": ["train.minibatch_size=8", "train.updates_per_step=2"],
    "mdlm_arith": ["train.minibatch_size=8", "train.updates_per_step=2"],
}
PAGE = 1 << 20  # bytes per MiB


# ------------------------------------------------------------------------------------------------ the process
def read_step(metrics: Path) -> int | None:
    """The ``step`` of the last complete record of a ``metrics.jsonl``, or None before the first one.

    Only the file's tail is read; a torn (partly written) last line is skipped.
    """
    try:
        with metrics.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 65536))
            tail = f.read().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return None
    for line in reversed(tail.splitlines()):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            return record["step"]
    return None


def process_tree(pid: int) -> list[int]:
    """`pid` and all its live descendants (from the parent ids in ``/proc/*/stat``)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])  # the name may hold spaces or parentheses
    tree, frontier = [pid], [pid]
    while frontier:
        frontier = [child for child, parent in parents.items() if parent in frontier]
        tree += frontier
    return tree


def _status(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "Threads"):
            fields[key] = int(value.split()[0])
    return fields


def sample_process(pid: int) -> dict | None:
    """RSS in MiB (the process and its children), open descriptors (the process; its children's apart) and threads.
    None once the process has exited."""
    rss_kib = threads = child_fds = 0
    try:
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        if "VmRSS" not in _status(pid):
            return None  # exited, not yet reaped: a zombie has no memory left to measure
    except OSError:
        return None
    for member in process_tree(pid):
        try:
            status = _status(member)
            rss_kib += status.get("VmRSS", 0)
            threads += status.get("Threads", 0)
            if member != pid:
                child_fds += len(os.listdir(f"/proc/{member}/fd"))
        except OSError:
            continue  # a child that ended between listing and reading
    return {"rss_mib": rss_kib / 1024, "fds": fds, "child_fds": child_fds, "threads": threads}


def overrides(config: str, steps: int, every: int, out: Path) -> list[str]:
    """Cheap steps that still evaluate, checkpoint (and delete old checkpoints) and log every step."""
    return [
        f"output_dir={out}", "log_every=1", f"train.max_steps={steps}", "train.max_seconds=0",
        "train.prompts_per_step=4", "train.group_size=4", f"eval.every={every}", "eval.every_seconds=0",
        "eval.num_prompts=8", f"checkpoint.every={every}", "checkpoint.keep_last=2", *SMALL.get(Path(config).stem, []),
    ]


def run_config(config: str, args) -> dict:
    """Trains `config` in a child process, sampling it every ``args.sample_every`` seconds; returns the samples."""
    name = Path(config).stem
    out = Path(args.output) / "runs" / name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    command = [sys.executable, "-m", "mmgrpo.cli", "train", config, *overrides(config, args.steps, args.every, out)]
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false", **os.environ}
    git = ["git", "-C", str(ROOT)]
    commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    changed = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True)
    samples, start = [], time.monotonic()
    with (out / "stdout.log").open("w") as log:
        child = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        while child.poll() is None:
            sample = sample_process(child.pid)
            if sample is not None:
                step = read_step(out / "metrics.jsonl")
                samples.append({"t": round(time.monotonic() - start, 2), "step": step, **sample})
            time.sleep(args.sample_every)
    wall = time.monotonic() - start
    if child.returncode != 0:
        tail = (out / "stdout.log").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"`{' '.join(command)}` exited with {child.returncode}; the end of its output:\n{tail}")
    return {"config": config, "command": command, "commit": commit,
            "uncommitted_files": len(changed.stdout.splitlines()), "wall_s": round(wall, 1),
            "steps": read_step(out / "metrics.jsonl"), "samples": samples}


# ---------------------------------------------------------------------------------------------------- analysis
def per_step(samples: list[dict], key: str) -> tuple[list[int], list[float]]:
    """One value per step: the median of the samples taken while that step was the last logged one."""
    by_step: dict[int, list[float]] = {}
    for sample in samples:
        if sample["step"] is not None:
            by_step.setdefault(sample["step"], []).append(sample[key])
    steps = sorted(by_step)
    return steps, [statistics.median(by_step[s]) for s in steps]


def block_medians(steps: list[int], values: list[float], start: int, stop: int, block: int) -> list[tuple]:
    """``(median step, median value)`` of each block of `block` steps in ``[start, stop)``; with ``block`` the
    evaluation / checkpoint interval, each block holds one whole cycle, so what a cycle does once (an evaluation, a
    save) weighs the same in every block and a bump that lasts a few dozen steps counts once, not once per step."""
    blocks: dict[int, list[tuple[int, float]]] = {}
    for step, value in zip(steps, values):
        if start <= step < stop:
            blocks.setdefault((step - start) // block, []).append((step, value))
    return [(statistics.median(s for s, _ in b), statistics.median(v for _, v in b)) for _, b in sorted(blocks.items())]


def fit_growth(steps: list[int], values: list[float], warmup: int, stop: int, block: int, floor: float) -> dict:
    """Least-squares slope through the block medians of `values` (steps ``[warmup, stop)``), per 100 steps, with its
    standard error and the residual standard deviation of the blocks; ``growth`` is True when the slope exceeds
    both 3 standard errors and `floor` (per 100 steps)."""
    points = block_medians(steps, values, warmup, stop, block)
    n = len(points)
    if n < 3:
        raise ValueError(f"only {n} blocks of {block} sampled steps in steps [{warmup}, {stop}): run more steps "
                         f"(--steps), or lower --warmup or --every.")
    mean_x = sum(s for s, _ in points) / n
    mean_y = sum(v for _, v in points) / n
    sxx = sum((s - mean_x) ** 2 for s, _ in points)
    slope = sum((s - mean_x) * (v - mean_y) for s, v in points) / sxx
    ssr = sum((v - mean_y - slope * (s - mean_x)) ** 2 for s, v in points)
    per100, se100 = 100 * slope, 100 * math.sqrt(ssr / (n - 2) / sxx)
    return {"per_100_steps": per100, "se_per_100_steps": se100, "residual_std": math.sqrt(ssr / (n - 2)),
            "blocks": n, "from_step": warmup, "to_step": stop - 1, "growth": per100 > 3 * se100 and per100 > floor}


def verdict(fit: dict, unit: str) -> str:
    """``"no growth beyond noise"`` or the growth with its standard error."""
    if not fit["growth"]:
        return "no growth beyond noise"
    return f"grows {fit['per_100_steps']:.2f} +- {fit['se_per_100_steps']:.2f} {unit} / 100 steps"


def summarize(run: dict, warmup: int, block: int, rss_floor: float, fd_floor: float) -> dict:
    """The row of one config: RSS and descriptors in the first and last block after the warm-up (medians), their
    maxima, and the growth fits. The last step is left out: its samples include the closing evaluation, save and
    plot, and the exit."""
    samples, stop = run["samples"], run["steps"]
    rows = {}
    for key, floor in (("rss_mib", rss_floor), ("fds", fd_floor)):
        steps, values = per_step(samples, key)
        blocks = block_medians(steps, values, warmup, stop, block)
        rows[key] = {"first_block": blocks[0][1] if blocks else None, "last_block": blocks[-1][1] if blocks else None,
                     "max": max(s[key] for s in samples), **fit_growth(steps, values, warmup, stop, block, floor)}
    return {"config": run["config"], "commit": run.get("commit"), "steps": run["steps"], "wall_s": run["wall_s"],
            "samples": len(samples), "threads_max": max(s["threads"] for s in samples), "rss": rows["rss_mib"],
            "fd": rows["fds"]}


def markdown_table(rows: list[dict]) -> str:
    lines = ["| config | steps | wall (s) | RSS first / last block (MiB) | RSS max (MiB) | "
             "RSS growth (MiB / 100 steps, +- s.e.) | RSS block residual std (MiB) | fds first / last block, max | "
             "fd growth (/ 100 steps) | verdict |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        rss, fd = r["rss"], r["fd"]
        both = [v for v in (verdict(rss, "MiB"), verdict(fd, "fds")) if v != "no growth beyond noise"]
        lines.append(
            f"| {Path(r['config']).stem} | {r['steps']} | {r['wall_s']:.0f} | {rss['first_block']:.0f} / "
            f"{rss['last_block']:.0f} | {rss['max']:.0f} | "
            f"{rss['per_100_steps']:+.2f} +- {rss['se_per_100_steps']:.2f} | "
            f"{rss['residual_std']:.1f} | {fd['first_block']:g} / {fd['last_block']:g}, {fd['max']} | "
            f"{fd['per_100_steps']:+.2f} +- {fd['se_per_100_steps']:.2f} | "
            f"{'; '.join(both) or 'no growth beyond noise'} |"
        )
    return "\n".join(lines)


def plot(runs: list[dict], rows: list[dict], path: Path, warmup: int, block: int) -> None:
    """RSS (top) and open descriptors (bottom) against step, one column per config: every sample, the block medians
    and the fitted line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(runs), figsize=(4.2 * len(runs), 5.4), squeeze=False, sharex="col")
    for col, (run, summary) in enumerate(zip(runs, rows)):
        kept = [s for s in run["samples"] if s["step"] is not None]
        panels = (("rss_mib", "rss", "RSS (MiB)"), ("fds", "fd", "open file descriptors"))
        for row, (key, fit, label) in enumerate(panels):
            ax = axes[row][col]
            ax.plot([s["step"] for s in kept], [s[key] for s in kept], ".", ms=2, alpha=0.3, label="samples")
            blocks = block_medians(*per_step(kept, key), warmup, run["steps"], block)
            ax.plot(*zip(*blocks), "o", ms=4, label=f"median of {block} steps")
            slope, mean_x = summary[fit]["per_100_steps"] / 100, sum(s for s, _ in blocks) / len(blocks)
            mean_y = sum(v for _, v in blocks) / len(blocks)
            ax.plot([warmup, run["steps"]], [mean_y + slope * (x - mean_x) for x in (warmup, run["steps"])], "-",
                    lw=1.2, label=f"fit: {100 * slope:+.2f} / 100 steps")
            ax.axvline(warmup, color="grey", ls=":", lw=1)
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        axes[0][col].set_title(Path(run["config"]).stem)
        axes[1][col].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=CONFIGS)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--every", type=int, default=50, help="evaluate and checkpoint every this many steps")
    parser.add_argument("--warmup", type=int, default=100, help="steps left out of the growth fit (the first "
                        "checkpoint save allocates buffers once: let the fit start after two --every cycles)")
    parser.add_argument("--sample-every", type=float, default=1.0, help="seconds between samples")
    parser.add_argument("--rss-floor", type=float, default=1.0, help="MiB / 100 steps below which RSS growth is noise")
    parser.add_argument("--fd-floor", type=float, default=0.5,
                        help="descriptors / 100 steps below which growth is noise")
    parser.add_argument("--output", type=Path, default=Path("outputs/bench_soak"))
    parser.add_argument("--report-only", action="store_true", help="report the samples of --output/samples.json again")
    args = parser.parse_args(argv)
    if args.steps - args.warmup < 3 * args.every:
        parser.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup}) by at least 3 x --every "
                     f"({args.every}): the growth is fitted through one point per --every steps after the warm-up.")
    args.output.mkdir(parents=True, exist_ok=True)
    raw = args.output / "samples.json"
    if args.report_only:
        runs = json.loads(raw.read_text(encoding="utf-8"))
    else:
        runs = []
        for config in args.configs:
            runs.append(run_config(config, args))
            print(f"{config}: {runs[-1]['steps']} steps in {runs[-1]['wall_s']:.0f} s", flush=True)
            raw.write_text(json.dumps(runs), encoding="utf-8")  # kept as soon as measured (--report-only rereads it)
    rows = [summarize(run, args.warmup, args.every, args.rss_floor, args.fd_floor) for run in runs]
    table = markdown_table(rows)
    (args.output / "table.md").write_text(table + "\n", encoding="utf-8")
    (args.output / "results.json").write_text(json.dumps({"settings": {k: str(v) for k, v in vars(args).items()},
                                                          "rows": rows}, indent=1), encoding="utf-8")
    plot(runs, rows, args.output / "soak.png", args.warmup, args.every)
    print(table)
    return rows


if __name__ == "__main__":
    main()
