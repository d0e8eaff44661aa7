"""The report of `bench/vlm_vs_trl.py` from its measurements: the merge of interleaved rounds, the ratios, and the
files it writes (``results.json``, ``table.md``, ``step_time_vs_g.png``).

Not a benchmark itself: `bench/vlm_vs_trl.py` imports it (bench/ is not a package).
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

TRL_VERSION = "1.16.0"  # the TRL release the benchmark was written for


def ratio(a: dict, b: dict, key: str) -> float | None:
    return round(a[key] / b[key], 3) if key in a and key in b and b[key] else None


def median_round(runs: list[dict]) -> dict:
    """One framework's measurements of one G over the rounds: the run of median step time (the first error when no
    run finished), with every round's step time as ``round_step_s``."""
    done = sorted((r for r in runs if "step_s" in r), key=lambda r: r["step_s"])
    if not done:
        return runs[0]
    return {**done[(len(done) - 1) // 2], "round_step_s": [r.get("step_s") for r in runs]}


def round_speedup(ours: dict, trl: dict) -> float | None:
    """The median over the rounds of TRL's step time / mmgrpo's, each pair from the same round."""
    pairs = [t / o for o, t in zip(ours.get("round_step_s", []), trl.get("round_step_s", [])) if o and t]
    return round(statistics.median(pairs), 3) if pairs else None


def write_outputs(args, results: dict, out: Path) -> None:
    import torch

    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for g in args.group_sizes:
        ours, trl = results["mmgrpo"].get(str(g), {}), results["trl"].get(str(g), {})
        for r in (ours, trl):
            if "peak_rss_mib" in r and "rss_before_steps_mib" in r:
                r["train_increment_mib"] = r["peak_rss_mib"] - r["rss_before_steps_mib"]
        rows.append({"G": g, "mmgrpo": ours, "trl": trl, "speedup": round_speedup(ours, trl) or ratio(trl, ours, "step_s"),
                     "time_ratio": ratio(ours, trl, "step_s"), "peak_rss_ratio": ratio(ours, trl, "peak_rss_mib"),
                     "increment_ratio": ratio(ours, trl, "train_increment_mib")})
    image_size = args.image_size
    settings = {k: getattr(args, k) for k in ("model", "config", "prompts", "max_new_tokens", "steps", "warmup",
                                              "learning_rate", "group_sizes", "main_g", "rounds", "device")}
    summary = {"settings": {**settings, "image_size": image_size},
               "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(), "rows": rows}
    (out / "results.json").write_text(json.dumps(summary, indent=2), encoding="utf-8")

    def cell(r, key, fmt):
        return fmt.format(r[key]) if key in r else "error"

    lines = [f"Tiny Qwen2-VL `{args.model}`, {image_size} x {image_size} images, {args.prompts} prompts x G "
             f"completions per step, {args.max_new_tokens} completion tokens, full fine-tuning, one optimizer update per step; median of {args.steps} steps after "
             f"{args.warmup} warm-up" + (f", median over {args.rounds} interleaved rounds (speed-up: median of the "
                                        "per-round ratios)" if args.rounds > 1 else "") +
             f"; {torch.get_num_threads()} torch threads, " + ("CPU" if args.device == "cpu" else "one GPU (float32)") +
             ". Peak RSS: fresh process per "
             "measurement (\"after build\": peak minus the RSS just before the first step).", "",
             "| G | mmgrpo s/step | TRL s/step | time ratio mmgrpo / TRL | speed-up TRL / mmgrpo | mmgrpo peak RSS MiB | TRL peak RSS MiB "
             "| peak ratio | mmgrpo after build MiB | TRL after build MiB | after-build ratio |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        o, t = row["mmgrpo"], row["trl"]
        mark = "**" if row["G"] == args.main_g else ""
        lines.append(
            f"| {mark}{row['G']}{mark} | {cell(o, 'step_s', '{:.3f}')} | {cell(t, 'step_s', '{:.3f}')} | "
            f"{row['time_ratio'] if row['time_ratio'] is not None else '-'} | "
            f"{str(row['speedup']) + 'x' if row['speedup'] is not None else '-'} | {cell(o, 'peak_rss_mib', '{:.0f}')} | "
            f"{cell(t, 'peak_rss_mib', '{:.0f}')} | {row['peak_rss_ratio'] if row['peak_rss_ratio'] is not None else '-'} | "
            f"{cell(o, 'train_increment_mib', '{:.0f}')} | {cell(t, 'train_increment_mib', '{:.0f}')} | "
            f"{row['increment_ratio'] if row['increment_ratio'] is not None else '-'} |")

    def mean(r, key, fmt):
        values = [v for v in r.get(key, []) if v is not None]
        return fmt.format(sum(values) / len(values)) if values else "-"

    def pair(row, key, fmt, average=False):
        return " / ".join((mean if average else cell)(row[fw], key, fmt) if (average or key in row[fw]) else "-"
                          for fw in ("mmgrpo", "trl"))

    lines += ["", "Same work on both sides (mmgrpo / TRL): each framework's own encoding of the first question; "
              "means over all steps (warm-up included); vision tower = images through it per step and its forward "
              "seconds per step.", "",
              "| G | vision tokens per image | prompt tokens | vision-tower images per step | vision forward s/step "
              "| mean completion tokens | mean reward | groups with equal rewards | grad norm "
              "| mmgrpo skipped updates |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        o = row["mmgrpo"]
        lines.append(
            f"| {row['G']} | {pair(row, 'vision_tokens_per_image', '{}')} | {pair(row, 'prompt_tokens', '{}')} | "
            f"{pair(row, 'vision_images_per_step', '{:.0f}')} | {pair(row, 'vision_forward_s_per_step', '{:.3f}')} | "
            f"{pair(row, 'completion_length', '{:.1f}', True)} | {pair(row, 'reward_mean', '{:.2f}', True)} | "
            f"{pair(row, 'zero_std_groups', '{:.2f}', True)} | {pair(row, 'grad_norm', '{:.2f}', True)} | "
            f"{o.get('skipped_updates', '-')} |")
    if args.device == "cuda":
        lines += ["", "Peak GPU memory (`torch.cuda.max_memory_allocated`, MiB), mmgrpo / TRL: "
                  + ", ".join(f"G={row['G']}: {pair(row, 'peak_gpu_mib', '{:.0f}')}" for row in rows)]
    errors = [(fw, row["G"], row[fw]["error"]) for row in rows for fw in ("mmgrpo", "trl") if "error" in row[fw]]
    if errors:
        lines += ["", "Errors:"] + [f"- {fw} G={g}: `{e}`" for fw, g, e in errors]
    (out / "table.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tokens = next((r["vision_tokens_per_image"] for row in rows for r in (row["mmgrpo"], row["trl"])
                   if "vision_tokens_per_image" in r), None)
    fig, axes = plt.subplots(1, 2, figsize=(9.5, 3.6))
    for ax, key, ylabel in ((axes[0], "step_s", "seconds per step (median)"),
                            (axes[1], "train_increment_mib", "peak RSS after build (MiB)")):
        for fw, label in (("mmgrpo", "mmgrpo (prefix-shared)"), ("trl", f"TRL {TRL_VERSION} GRPOTrainer")):
            points = [(row["G"], row[fw][key]) for row in rows if key in row[fw]]
            if points:
                ax.plot(*zip(*points), marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(args.group_sizes, [str(g) for g in args.group_sizes])
        ax.set_xlabel(f"group size G ({args.prompts} prompts per step)")
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0].legend()
    vision = f", {tokens} vision tokens per image" if tokens is not None else ""
    fig.suptitle(f"VLM GRPO, tiny Qwen2-VL, {image_size} x {image_size} images{vision}, {args.device.upper()}")
    fig.tight_layout()
    fig.savefig(out / "step_time_vs_g.png", dpi=120)
