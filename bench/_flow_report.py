"""The report of `bench/flow_algorithms.py`: reading each run's held-out curve, comparing every run of a seed with the
reference run of the same seed (time to reach its final reward), aggregating over seeds (mean and range), the table,
and the figure. Pure functions of the runs' ``metrics.jsonl`` and ``config.json``; nothing here trains."""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

from mmgrpo.metrics_log import read_records

ROOT = Path(__file__).resolve().parents[1]
LABELS = {
    "flow_grpo": "Flow-GRPO", "e_grpo": "E-GRPO", "chunk_grpo": "Chunk-GRPO", "dgpo": "DGPO",
    "diffusion_nft": "DiffusionNFT", "awm": "AWM", "grpo_guard": "Flow-GRPO + GRPO-Guard", "flow_dppo": "Flow-DPPO",
    "mix_grpo": "MixGRPO", "dance_grpo": "DanceGRPO", "branch_grpo": "BranchGRPO",
}
REFERENCE = "flow_grpo"
CLAIM = ("dgpo", 5.0)  # the DGPO paper: Flow-GRPO's final reward reached at least 5x sooner


def label(name: str) -> str:
    return LABELS.get(name, name)


# ------------------------------------------------------------------------------------------------------- reading
def read_run(run_dir: str | Path) -> dict:
    """Reads one run's held-out curve from its ``metrics.jsonl`` (and the metric's name from its ``config.json``).

    Training time at a step is ``time/train_s`` (the cumulated time of training steps) or, in logs without it, the sum
    of ``time/step_s`` so far (which needs every step logged: ``log_every=1``).

    Returns:
        `dict`: ``metric`` (the headline eval metric), ``curve`` (a list of ``{"step", "train_s", "samples_seen",
        "value"}``, one per evaluation, the base model's at step 0 / 0 s / 0 images), ``steps``, ``samples_seen`` and
        ``train_s`` (at the last step), and ``settings`` (the run's budget and evaluation settings) and ``seed``.
    """
    run_dir = Path(run_dir)
    config = json.loads((run_dir / "config.json").read_text(encoding="utf-8"))
    metric = config["eval"]["metric"]
    settings = {
        "budget_s": config["train"].get("max_seconds"), "eval_prompts": config["eval"]["num_prompts"],
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
    return {"metric": metric, "curve": curve, "steps": step, "samples_seen": samples, "train_s": train_s,
            "settings": settings, "seed": config["seed"]}


def common_settings(runs: dict[str, dict]) -> dict:
    """The settings every run shares (budget, evaluation, base model, metric); raises if any run differs, since runs at
    different budgets or on different prompts do not compare."""
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


# ----------------------------------------------------------------------------------------------------- comparing
def time_to_reach(curve: list[dict], target: float) -> dict | None:
    """The first evaluation of `curve` at or above `target` (to float tolerance), or `None` if none is."""
    return next((point for point in curve if point["value"] >= target - 1e-9), None)


def _speedup(reference: float, value: float) -> float | None:
    """``reference / value`` (how many times sooner than the reference), or `None` when either is 0."""
    return reference / value if reference > 0 and value > 0 else None


def compare(runs: dict[str, dict], reference: str = REFERENCE) -> dict:
    """One seed's numbers: each run against the reference's final held-out reward.

    Args:
        runs (`dict[str, dict]`): algorithm -> [`read_run`]'s result, all of one seed; must contain `reference`.

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
    """Whether, in one seed's comparison, the run named by `claim` reached the reference's final reward at least
    `claim[1]` times sooner, judged on training seconds.

    Returns:
        `dict`: ``held`` (`True`, `False`, or `None` when it cannot be judged) and ``text`` (one plain sentence).
    """
    name, factor = claim
    mine, ref = label(name), label(comparison["reference"])
    claim_text = f"the DGPO paper's claim ({mine} reaches {ref}'s final reward >= {factor:g}x sooner)"
    if name not in comparison["rows"]:
        return {"held": None, "text": f"Not measured: {mine} was not run, so {claim_text} was not tested."}
    if comparison["reference_reached_at_base"]:
        return {"held": None, "text": (
            f"Cannot be judged: {ref} ended no better than the base model ({comparison['target']:.3f}), so there is no "
            f"gain to reach sooner; {claim_text} was not tested. Use a longer budget.")}
    row = comparison["rows"][name]
    if row["reached"] is None:
        return {"held": False, "text": (
            f"No: {mine} never reached {ref}'s final held-out reward ({comparison['target']:.3f}) within the budget "
            f"(its best: {row['best']:.3f}), so {claim_text} did not hold here.")}
    reached = row["reached"]
    speedup = reached["speedup_s"]
    if speedup is None:  # reached at the base evaluation while the reference needed training
        return {"held": True, "text": f"Yes: {mine}'s base evaluation already matched {ref}'s final reward; {claim_text} held trivially."}
    held = speedup >= factor
    images = reached["speedup_images"]
    return {"held": held, "text": (
        f"{'Yes' if held else 'No'}: {mine} reached {ref}'s final held-out reward ({comparison['target']:.3f}) after "
        f"{reached['train_s']:.1f} s of training, {speedup:.2f}x sooner than {ref} did"
        + (f" ({images:.2f}x in sampled images)" if images is not None else "")
        + f", so {claim_text} {'held' if held else 'did not hold'} here.")}


def spread(values: list[float]) -> dict | None:
    """``{"mean", "min", "max", "n"}`` of `values`, or `None` when there are none."""
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values), "n": len(values)} if values else None


def aggregate(per_seed: dict[int, dict]) -> dict:
    """Every algorithm over the seeds: mean and range of its base, final and best reward, of its steps and sampled
    images, and of its time-to-target speed-ups (over the seeds where it reached its seed's target).

    Args:
        per_seed (`dict[int, dict]`): seed -> [`compare`]'s result of that seed's runs.

    Returns:
        `dict`: algorithm -> ``{"seeds", "base", "final", "best", "gain", "steps", "samples_seen", "reached",
        "speedup_s", "speedup_images"}``, each a [`spread`] except ``seeds`` and ``reached`` (counts).
    """
    names = list(dict.fromkeys(name for comparison in per_seed.values() for name in comparison["rows"]))
    table = {}
    for name in names:
        rows = [c["rows"][name] for c in per_seed.values() if name in c["rows"]]
        hits = [row["reached"] for row in rows if row["reached"] is not None]
        table[name] = {
            "seeds": len(rows),
            "base": spread([r["base"] for r in rows if r["base"] is not None]),
            "final": spread([r["final"] for r in rows]),
            "best": spread([r["best"] for r in rows]),
            "gain": spread([r["final"] - r["base"] for r in rows if r["base"] is not None]),
            "steps": spread([r["steps"] for r in rows]),
            "samples_seen": spread([r["samples_seen"] for r in rows]),
            "reached": len(hits),
            "speedup_s": spread([h["speedup_s"] for h in hits if h["speedup_s"] is not None]),
            "speedup_images": spread([h["speedup_images"] for h in hits if h["speedup_images"] is not None]),
        }
    return table


# ------------------------------------------------------------------------------------------------------- writing
def _fmt(value, spec: str, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{suffix}"


def _range(stat: dict | None, spec: str, suffix: str = "") -> str:
    """``mean (min-max)`` of a [`spread`], just the value for one number, ``n/a`` for none."""
    if stat is None:
        return "n/a"
    if stat["n"] == 1 or stat["min"] == stat["max"]:
        return _fmt(stat["mean"], spec, suffix)
    return f"{stat['mean']:{spec}}{suffix} ({stat['min']:{spec}}-{stat['max']:{spec}}{suffix})"


def markdown_table(per_seed: dict[int, dict], settings: dict) -> str:
    """The report: settings, one row per algorithm (mean and range over seeds), the verdict on the DGPO claim per
    seed, and how to read the columns.

    Args:
        per_seed (`dict[int, dict]`): seed -> [`compare`]'s result.
        settings (`dict`): ``metric``, ``budget_s``, ``eval_prompts``, ``eval_every_s``, ``pretrained``, ``threads``.
    """
    seeds = sorted(per_seed)
    ref = label(next(iter(per_seed.values()))["reference"])
    targets = ", ".join(f"{per_seed[s]['target']:.3f}" for s in seeds)
    lines = [
        f"# Flow algorithms at the same training budget ({settings['budget_s']:g} s)",
        "",
        f"Embedded text-to-image task (`{settings['pretrained']}`, `configs/tiny/t2i_shapes*.yaml`), training seeds "
        f"{', '.join(map(str, seeds))}, held-out `{settings['metric']}` on {settings['eval_prompts']} prompts, evaluated "
        f"every {settings['eval_every_s']:g} s of training, threads per run: {settings['threads'] or 'inherited'}. "
        f"Target of each seed: {ref}'s final held-out reward of that seed ({targets}).",
        "",
        "| algorithm | seeds | base | final at equal time | gain | best | steps | sampled images | seeds reaching target "
        f"| time to target, {ref} / this (s) | same in images |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in aggregate(per_seed).items():
        lines.append(
            f"| {label(name)} | {row['seeds']} | {_range(row['base'], '.3f')} | {_range(row['final'], '.3f')} | "
            f"{_range(row['gain'], '+.3f')} | {_range(row['best'], '.3f')} | {_range(row['steps'], '.0f')} | "
            f"{_range(row['samples_seen'], '.0f')} | {row['reached']}/{row['seeds']} | "
            f"{_range(row['speedup_s'], '.2f', 'x')} | {_range(row['speedup_images'], '.2f', 'x')} |"
        )
    lines += ["", f"**DGPO claim (>= {CLAIM[1]:g}x sooner), per seed:**", ""]
    lines += [f"- seed {s}: {per_seed[s]['claim']['text']}" for s in seeds]
    lines += [
        "",
        f"Reading it: values are the mean over seeds with the range in brackets. \"Time to target\" is {ref}'s own "
        f"training time to first reach its final value divided by this algorithm's time to first reach it, in the same "
        f"seed (> 1: sooner), averaged over the seeds where it did. Times are known only at evaluations, one every "
        f"{settings['eval_every_s']:g} s, so a ratio is measured to that resolution. Training seconds count training "
        "steps only (rollout, reward, updates), never evaluation; each run stops after the step that spent the budget.",
        "",
    ]
    return "\n".join(lines)


def plot_curves(runs: dict[tuple[str, int], dict], path: str | Path) -> None:
    """Two panels: held-out reward against training seconds and against sampled images, one curve per algorithm (the
    mean over seeds at each evaluation index), the seeds' curves faint behind it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric = next(iter(runs.values()))["metric"]
    names = list(dict.fromkeys(name for name, _ in runs))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for axis, key, title in ((axes[0], "train_s", "training wall-clock (s)"), (axes[1], "samples_seen", "sampled images")):
        for index, name in enumerate(names):
            color, style = f"C{index % 10}", "o-" if index < 10 else "s--"  # 10 colours, then dashed lines
            curves = [run["curve"] for (n, _), run in runs.items() if n == name]
            for curve in curves:
                axis.plot([p[key] for p in curve], [p["value"] for p in curve], "-", color=color, alpha=0.2, lw=1)
            length = min(len(c) for c in curves)
            axis.plot([statistics.fmean(c[i][key] for c in curves) for i in range(length)],
                      [statistics.fmean(c[i]["value"] for c in curves) for i in range(length)],
                      style, color=color, ms=3, label=label(name))
        axis.set_xlabel(title)
        axis.grid(alpha=0.3)
    axes[0].set_ylabel(f"held-out {metric}")
    axes[0].legend(fontsize=7, ncol=2)
    fig.suptitle("Held-out reward at the same training budget (mean over seeds; seeds faint)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
