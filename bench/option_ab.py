"""Paired step times of one config with and without an option: two trainers in one process, their steps alternating.

Both trainers are built from the same config (the same seed, prompts and rollouts) and differ only by the overrides
given with ``--b``. After ``--warmup`` steps each, they take ``--steps`` steps in alternation (A, B, A, B, ...; which
one goes first alternates too), so a change of load on the machine hits both alike. Reported per setting: the median
step time, and the median of the per-pair ratios A / B (> 1: B is faster). Each trainer's metrics are kept, so the
table also shows whether both did the same work (mean reward, gradient norm).

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 python bench/option_ab.py configs/tiny/vlm_count.yaml \\
        --common pipeline.compile_decode=true train.prompts_per_step=4 train.group_size=2 train.minibatch_size=8 \\
        --b pipeline.share_prompt_forward=true --steps 40 --output outputs/bench_option_ab

Writes ``<output>/results.json`` and ``<output>/table.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path


def build(config_path: str, overrides: list[str], output_dir: str):
    from mmgrpo.config import load
    from mmgrpo.trainer import Trainer

    fixed = [f"output_dir={output_dir}", "train.max_seconds=0", "eval.every=0", "checkpoint.every=0"]
    return Trainer(load(config_path, [*fixed, *overrides]))


def timed(trainer) -> tuple[float, dict]:
    start = time.perf_counter()
    trainer.step += 1
    metrics = trainer.timed_train_step()
    return time.perf_counter() - start, metrics


def run(args) -> dict:
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        steps = args.warmup + args.steps
        common = [f"train.max_steps={steps}", *args.common]
        trainers = {"A": build(args.config, common, f"{tmp}/a"), "B": build(args.config, [*common, *args.b], f"{tmp}/b")}
        times = {"A": [], "B": [], "pairs": []}
        logs = {"A": [], "B": []}
        for step in range(steps):
            order = ("A", "B") if step % 2 == 0 else ("B", "A")
            took = {}
            for name in order:
                took[name], metrics = timed(trainers[name])
                logs[name].append(metrics)
            if step >= args.warmup:
                times["A"].append(took["A"])
                times["B"].append(took["B"])
                times["pairs"].append(took["A"] / took["B"])
    summary = {name: {"step_s": statistics.median(times[name]),
                      "reward_mean": statistics.fmean(m["reward/mean"] for m in logs[name]),
                      "grad_norm": statistics.fmean(m.get("train/grad_norm", 0.0) for m in logs[name])}
               for name in ("A", "B")}
    quartiles = statistics.quantiles(times["pairs"], n=4)
    return {"config": args.config, "common": args.common, "b": args.b, "warmup": args.warmup, "steps": args.steps,
            "threads": torch.get_num_threads(), "times": times, "summary": summary,
            "ratio_median": statistics.median(times["pairs"]), "ratio_quartiles": [quartiles[0], quartiles[2]]}


def table(result: dict) -> str:
    a, b = result["summary"]["A"], result["summary"]["B"]
    low, high = result["ratio_quartiles"]
    lines = [
        f"`{result['config']}` with {' '.join(result['common']) or 'no common overrides'}; B adds "
        f"{' '.join(result['b'])}. {result['steps']} steps each after {result['warmup']}, alternating; "
        f"{result['threads']} torch thread(s).",
        "",
        "| setting | s/step (median) | mean reward | mean grad norm |",
        "|---|---|---|---|",
        f"| A | {a['step_s']:.4f} | {a['reward_mean']:.4f} | {a['grad_norm']:.4f} |",
        f"| B | {b['step_s']:.4f} | {b['reward_mean']:.4f} | {b['grad_norm']:.4f} |",
        "",
        f"Paired ratio A / B (median of the pairs): **{result['ratio_median']:.3f}x** (quartiles {low:.3f}-{high:.3f}).",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--common", nargs="*", default=[], metavar="KEY=VALUE", help="overrides of both trainers")
    parser.add_argument("--b", nargs="+", required=True, metavar="KEY=VALUE", help="overrides of trainer B only")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--output", type=Path, default=Path("outputs/bench_option_ab"))
    args = parser.parse_args(argv)
    if args.steps < 4:
        parser.error("--steps must be at least 4 (the ratio's quartiles)")
    result = run(args)
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "results.json").write_text(json.dumps(result, indent=1), encoding="utf-8")
    text = table(result)
    (args.output / "table.md").write_text(text, encoding="utf-8")
    sys.stdout.write(text)


if __name__ == "__main__":
    main()
