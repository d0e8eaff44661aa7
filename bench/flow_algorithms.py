"""Flow-GRPO, E-GRPO, Chunk-GRPO and DGPO on the embedded text-to-image task, at the same wall-clock budget.

Each algorithm trains from the same base model (``mmgrpo:t2i_shapes``) and seed with its own tiny config
(``configs/tiny/t2i_shapes*.yaml``), one after another, each in a fresh ``mmgrpo train`` process, for the same budget
of training time (``train.max_seconds``: only training steps count; start-up, evaluations and checkpoints do not).
Held-out evaluations are spaced in training time (``eval.every_seconds``), so every run gets the same ~10 points
whatever its speed per step. Then, from each run's ``metrics.jsonl``, it writes under ``--output``:

  * ``table.md``: per algorithm, base / final / best held-out reward, steps, sampled images, training seconds, and the
    time (training seconds and sampled images) to first reach Flow-GRPO's final held-out reward, with the speed-up
    over Flow-GRPO's own time to reach it; plus a plain answer on the DGPO paper's claim (Flow-GRPO's final reward
    reached >= 5x sooner);
  * ``curves.png``: held-out reward against training seconds and against sampled images, one curve per algorithm;
  * ``results.json``: the settings, the commands, the raw curves and the table's numbers.

Run from the repository root, on an otherwise idle machine (the runs are timed, so any other load skews them):

    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 .venv/bin/python bench/flow_algorithms.py --budget-s 300 --threads 2

``--dry-run`` prints the four commands; ``--report-only`` rebuilds the table and figure from runs already in
``--output``. Each run's folder ``<output>/<algorithm>`` is deleted before it starts (metrics.jsonl is appended to, so
a stale one would mix two runs). ``train.max_steps`` is raised to ``--max-steps`` so that the budget, not the step
count, ends every run; a learning-rate schedule keyed to ``max_steps`` (``lr_schedule: cosine``) then barely decays
within the budget.
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

from mmgrpo.metrics_log import read_records

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {
    "flow_grpo": "configs/tiny/t2i_shapes_flow_grpo.yaml",
    "e_grpo": "configs/tiny/t2i_shapes_e_grpo.yaml",
    "chunk_grpo": "configs/tiny/t2i_shapes_chunk_grpo.yaml",
    "dgpo": "configs/tiny/t2i_shapes_dgpo.yaml",
}
LABELS = {"flow_grpo": "Flow-GRPO", "e_grpo": "E-GRPO", "chunk_grpo": "Chunk-GRPO", "dgpo": "DGPO"}
REFERENCE = "flow_grpo"
CLAIM = ("dgpo", 5.0)  # the DGPO paper: Flow-GRPO's final reward reached at least 5x sooner
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


# ------------------------------------------------------------------------------------------------------- running
def eval_interval(budget_s: float, points: int) -> float:
    """``eval.every_seconds`` for `points` evaluations after the base one, rounded up (to ms) so that the last one
    falls on the run's final step rather than just before it."""
    return math.ceil(budget_s / points * 1000) / 1000


def train_command(algorithm: str, args: argparse.Namespace) -> list[str]:
    """The ``mmgrpo train`` command line of one run, with paths relative to the repository root (its working folder).

    Args:
        algorithm (`str`): a key of `CONFIGS`.
        args (`argparse.Namespace`): the parsed options (budget, seed, evaluation prompts and points, output...).

    Returns:
        `list[str]`: ``["python", "-m", "mmgrpo.cli", "train", CONFIG, key=value...]``; replace ``"python"`` by the
        interpreter to run it.
    """
    run_dir = os.path.relpath(Path(args.output).resolve() / algorithm, ROOT)
    overrides = {
        "output_dir": run_dir,
        "seed": args.seed,
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


def run_training(algorithm: str, command: list[str], output: Path, threads: int | None) -> float:
    """Runs one training command in a fresh process (its output goes to ``<output>/<algorithm>.log``).

    Args:
        algorithm (`str`): the run's name; its folder ``<output>/<algorithm>`` is emptied first.
        command (`list[str]`): from [`train_command`].
        output (`Path`): the benchmark's output folder.
        threads (`int`, *optional*): ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS`` of the process (torch takes its
            thread count from them); inherited when `None`.

    Returns:
        `float`: the process's wall-clock seconds (start-up, training, evaluations and saving).
    """
    shutil.rmtree(output / algorithm, ignore_errors=True)
    env = {**os.environ, **{k: os.environ.get(k, v) for k, v in OFFLINE.items()}, "TOKENIZERS_PARALLELISM": "false"}
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    log = output / f"{algorithm}.log"
    start = time.perf_counter()
    with log.open("w", encoding="utf-8") as handle:
        code = subprocess.run([sys.executable, *command[1:]], cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT).returncode
    seconds = time.perf_counter() - start
    if code:
        tail = "".join(log.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)[-20:])
        raise RuntimeError(f"{algorithm} failed (exit code {code}); the end of {log.name}:\n{tail}")
    return seconds


# ------------------------------------------------------------------------------------------------------- reading
def read_run(run_dir: str | Path) -> dict:
    """Reads one run's held-out curve from its ``metrics.jsonl`` (and the metric's name from its ``config.json``).

    Training time at a step is ``time/train_s`` (the cumulated time of training steps) or, in logs without it, the sum
    of ``time/step_s`` so far (which needs every step logged: ``log_every=1``).

    Args:
        run_dir (`str` or `Path`): the run's ``output_dir``.

    Returns:
        `dict`: ``metric`` (the headline eval metric), ``curve`` (a list of ``{"step", "train_s", "samples_seen",
        "value"}``, one per evaluation, the base model's at step 0 / 0 s / 0 images), ``steps``, ``samples_seen`` and
        ``train_s`` (at the last step), and ``settings`` (the run's seed, budget and evaluation settings).
    """
    run_dir = Path(run_dir)
    config = json.loads((run_dir / "config.json").read_text(encoding="utf-8"))
    metric = config["eval"]["metric"]
    settings = {
        "seed": config["seed"], "budget_s": config["train"].get("max_seconds"), "eval_prompts": config["eval"]["num_prompts"],
        "eval_every_s": config["eval"].get("every_seconds"), "pretrained": _short(config["pipeline"].get("pretrained")),
    }
    records = read_records(run_dir / "metrics.jsonl")  # a torn last line (a run killed mid-write) is skipped
    curve, train_s, samples, step = [], 0.0, 0, 0
    for record in records:
        step = record["step"]
        if "time/step_s" in record:
            train_s = record.get("time/train_s", train_s + record["time/step_s"])
        samples = record.get("samples_seen", samples)
        if f"eval/{metric}" in record:
            curve.append({"step": step, "train_s": train_s, "samples_seen": samples, "value": record[f"eval/{metric}"]})
    if not curve:
        raise ValueError(f"{run_dir / 'metrics.jsonl'} has no eval/{metric} record: was evaluation disabled?")
    return {"metric": metric, "curve": curve, "steps": step, "samples_seen": samples, "train_s": train_s, "settings": settings}


def common_settings(runs: dict[str, dict]) -> dict:
    """The settings every run shares (seed, budget, evaluation, base model, metric); raises if any run differs, since
    runs at different budgets or on different prompts do not compare."""
    first = {**next(iter(runs.values()))["settings"], "metric": next(iter(runs.values()))["metric"]}
    for name, run in runs.items():
        mine = {**run["settings"], "metric": run["metric"]}
        if mine != first:
            differ = sorted(k for k in first if first[k] != mine.get(k))
            raise ValueError(f"run {name!r} differs from the others in {differ}: rerun it with the same options.")
    return first


def _short(path: str | None) -> str | None:
    """A model path as the report shows it: relative to the repository when inside it, else its last part (hub ids
    and ``mmgrpo:`` names unchanged), so that no machine's folder layout is written into the results."""
    if not path or not os.path.isabs(path):
        return path
    try:
        return Path(path).resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return Path(path).name


def time_to_reach(curve: list[dict], target: float) -> dict | None:
    """The first evaluation of `curve` at or above `target` (to float tolerance), or `None` if none is."""
    return next((point for point in curve if point["value"] >= target - 1e-9), None)


def _speedup(reference: float, value: float) -> float | None:
    """``reference / value`` (how many times sooner than the reference), or `None` when either is 0."""
    return reference / value if reference > 0 and value > 0 else None


def compare(runs: dict[str, dict], reference: str = REFERENCE) -> dict:
    """The table's numbers: each run against the reference's final held-out reward.

    Args:
        runs (`dict[str, dict]`): algorithm -> [`read_run`]'s result; must contain `reference`.
        reference (`str`): the baseline whose final reward is the target.

    Returns:
        `dict`: ``target`` (the reference's final reward), ``rows`` (algorithm -> base, final, best, steps,
        samples_seen, train_s, and ``reached`` (`None` or the reaching evaluation's ``step``, ``train_s``,
        ``samples_seen``, and ``speedup_s`` / ``speedup_images``: the reference's time to reach its own final reward
        divided by this run's, `None` when a time is 0)), and ``claim`` (see [`claim_verdict`]).
    """
    target = runs[reference]["curve"][-1]["value"]
    own = time_to_reach(runs[reference]["curve"], target)
    rows = {}
    for name, run in runs.items():
        values = [p["value"] for p in run["curve"]]
        hit = time_to_reach(run["curve"], target)
        reached = None
        if hit is not None:
            reached = {
                "step": hit["step"], "train_s": hit["train_s"], "samples_seen": hit["samples_seen"],
                "speedup_s": _speedup(own["train_s"], hit["train_s"]),
                "speedup_images": _speedup(own["samples_seen"], hit["samples_seen"]),
            }
        base = run["curve"][0]["value"] if run["curve"][0]["step"] == 0 else None
        rows[name] = {
            "base": base, "final": values[-1], "best": max(values), "steps": run["steps"],
            "samples_seen": run["samples_seen"], "train_s": run["train_s"], "reached": reached,
        }
    result = {"reference": reference, "target": target, "reference_reached_at_base": own["step"] == 0, "rows": rows}
    result["claim"] = claim_verdict(result)
    return result


def claim_verdict(comparison: dict, claim: tuple[str, float] = CLAIM) -> dict:
    """Whether the run named by `claim` reached the reference's final reward at least `claim[1]` times sooner.

    Judged on training seconds (the budget both runs had); sampled images are reported beside.

    Returns:
        `dict`: ``held`` (`True`, `False`, or `None` when it cannot be judged) and ``text`` (one plain sentence).
    """
    name, factor = claim
    label, ref = LABELS.get(name, name), LABELS.get(comparison["reference"], comparison["reference"])
    claim_text = f"the DGPO paper's claim ({label} reaches {ref}'s final reward >= {factor:g}x sooner)"
    if name not in comparison["rows"]:
        return {"held": None, "text": f"Not measured: {label} was not run, so {claim_text} was not tested."}
    if comparison["reference_reached_at_base"]:
        return {"held": None, "text": (
            f"Cannot be judged: {ref} ended no better than the base model ({comparison['target']:.3f}), so there is no "
            f"gain to reach sooner; {claim_text} was not tested. Use a longer budget.")}
    row = comparison["rows"][name]
    if row["reached"] is None:
        return {"held": False, "text": (
            f"No: {label} never reached {ref}'s final held-out reward ({comparison['target']:.3f}) within the budget "
            f"(its best: {row['best']:.3f}), so {claim_text} did not hold here.")}
    reached, own = row["reached"], comparison["rows"][comparison["reference"]]
    speedup = reached["speedup_s"]
    if speedup is None:  # reached at the base evaluation while the reference needed training
        return {"held": True, "text": f"Yes: {label}'s base evaluation already matched {ref}'s final reward; {claim_text} held trivially."}
    held = speedup >= factor
    images = reached["speedup_images"]
    return {"held": held, "text": (
        f"{'Yes' if held else 'No'}: {label} reached {ref}'s final held-out reward ({comparison['target']:.3f}) after "
        f"{reached['train_s']:.1f} s of training, {speedup:.2f}x sooner than {ref} did"
        + (f" ({images:.2f}x in sampled images)" if images is not None else "")
        + f", so {claim_text} {'held' if held else 'did not hold'} here.")}


# ------------------------------------------------------------------------------------------------------- writing
def _fmt(value, spec: str, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{suffix}"


def markdown_table(comparison: dict, settings: dict) -> str:
    """The report: settings, one row per algorithm, the verdict on the DGPO claim, and how to read the columns.

    Args:
        comparison (`dict`): from [`compare`].
        settings (`dict`): ``metric``, ``budget_s``, ``seed``, ``eval_prompts``, ``eval_every_s``, ``pretrained``,
            ``threads``.
    """
    ref = LABELS.get(comparison["reference"], comparison["reference"])
    lines = [
        f"# Flow algorithms at the same training budget ({settings['budget_s']:g} s)",
        "",
        f"Embedded text-to-image task (`{settings['pretrained']}`, `configs/tiny/t2i_shapes*.yaml`), seed {settings['seed']}, "
        f"held-out `{settings['metric']}` on {settings['eval_prompts']} prompts, evaluated every "
        f"{settings['eval_every_s']:g} s of training, threads per run: {settings['threads'] or 'inherited'}. "
        f"Target: {ref}'s final held-out reward, **{comparison['target']:.3f}**.",
        "",
        "| algorithm | base | final | best | steps | sampled images | training s | reached target at (s) "
        f"| reached target at (images) | speed-up vs {ref} (s) | speed-up vs {ref} (images) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in comparison["rows"].items():
        reached = row["reached"] or {}
        lines.append(
            f"| {LABELS.get(name, name)} | {_fmt(row['base'], '.3f')} | {row['final']:.3f} | {row['best']:.3f} | "
            f"{row['steps']} | {row['samples_seen']} | {row['train_s']:.1f} | {_fmt(reached.get('train_s'), '.1f')} | "
            f"{_fmt(reached.get('samples_seen'), 'd')} | {_fmt(reached.get('speedup_s'), '.2f', 'x')} | "
            f"{_fmt(reached.get('speedup_images'), '.2f', 'x')} |"
        )
    lines += [
        "",
        f"**DGPO claim (>= {CLAIM[1]:g}x sooner):** {comparison['claim']['text']}",
        "",
        f"Reading it: \"reached target\" is the first evaluation at or above {ref}'s final value (n/a: never within the "
        f"budget); speed-up is {ref}'s own time to first reach that value divided by this algorithm's (> 1: sooner; "
        f"n/a when either is 0, i.e. reached at the base evaluation). Times are known only at evaluations, one every "
        f"{settings['eval_every_s']:g} s, so a speed-up is measured to that resolution. Training seconds count "
        "training steps only (rollout, reward, updates), never evaluation; each run stops after the step that spent "
        "the budget.",
        "",
    ]
    return "\n".join(lines)


def plot_curves(runs: dict[str, dict], target: float | None, path: str | Path) -> None:
    """Two panels: held-out reward against training seconds and against sampled images, one labelled curve per run,
    and the target (the reference's final reward) as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric = next(iter(runs.values()))["metric"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for axis, key, label in ((axes[0], "train_s", "training wall-clock (s)"), (axes[1], "samples_seen", "sampled images")):
        for name, run in runs.items():
            axis.plot([p[key] for p in run["curve"]], [p["value"] for p in run["curve"]], "o-", ms=3, label=LABELS.get(name, name))
        if target is not None:
            axis.axhline(target, color="gray", ls="--", lw=1, label=f"{LABELS[REFERENCE]} final")
        axis.set_xlabel(label)
        axis.grid(alpha=0.3)
    axes[0].set_ylabel(f"held-out {metric}")
    axes[0].legend(fontsize=8)
    fig.suptitle("Held-out reward at the same training budget")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget-s", type=float, default=300.0, help="training seconds per algorithm (train.max_seconds)")
    parser.add_argument("--algorithms", nargs="+", choices=list(CONFIGS), default=list(CONFIGS),
                        help=f"a subset to run (the table compares against {REFERENCE}, which must be among them)")
    parser.add_argument("--seed", type=int, default=0)
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
    commands = {name: train_command(name, args) for name in args.algorithms}
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
                "commands": {k: v for k, v in previous["commands"].items() if k in args.algorithms},
                "process_s": {k: v for k, v in previous["process_s"].items() if k in args.algorithms},
                "threads": previous["settings"].get("threads"),
            }
    else:
        for name, command in commands.items():
            print(f"[{name}] {' '.join(command)}", flush=True)
            record["process_s"][name] = run_training(name, command, output, args.threads)
            print(f"[{name}] done in {record['process_s'][name]:.0f} s (start-up, training, evaluations)", flush=True)
    runs = {name: read_run(output / name) for name in args.algorithms}
    settings = {**common_settings(runs), "threads": record["threads"]}  # from the runs' own configs
    comparison = compare(runs)
    table = markdown_table(comparison, settings)
    (output / "table.md").write_text(table, encoding="utf-8")
    plot_curves(runs, comparison["target"], output / "curves.png")
    results = {"settings": settings, "commands": record["commands"], "process_s": record["process_s"], "runs": runs,
               "comparison": comparison}
    (output / "results.json").write_text(json.dumps(results, indent=2), encoding="utf-8")
    print(table)


if __name__ == "__main__":
    main()
