"""Masked-diffusion decoding and RL on the embedded addition task (``mmgrpo:mdlm_arith``).

Two parts, both written under ``--output`` (``table.md``, ``curves.png``, ``results.json``):

  * decoding: held-out accuracy (200 prompts) and decoding steps of the shipped base model for fixed-step schedules
    and ASS, with and without EOSER; greedy (temperature 0) and sampled (temperature 1, the RL rollout setting);
  * learning curves: ``configs/tiny/mdlm_arith.yaml`` trained with CJ-GRPO, diffu-GRPO (d1) and GDPO (ELBO by
    semi-deterministic Monte Carlo) for the same budget, one after the other, each in a fresh ``mmgrpo train``
    process; held-out greedy accuracy against training seconds and steps. The budget is training seconds
    (``--budget-s``) or, load-independent on a shared machine, training steps (``--budget-steps``: the same rollouts
    for every algorithm, whatever each costs).

Run from the repository root on an otherwise idle machine (runs are timed):

    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 OMP_NUM_THREADS=1 .venv/bin/python bench/mdlm_decoding.py --budget-s 300

``--skip-curves`` runs the decoding part only (a minute), ``--skip-decoding`` the curves only; ``--algorithms`` picks
some of them and ``--seed`` sets the training seed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from mmgrpo.metrics_log import read_records

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "configs/tiny/mdlm_arith.yaml"
VARIANTS = {  # name -> pipeline options on top of the embedded config's (gen_length 4)
    "fixed, 4 steps (1 token/step)": {"steps_per_block": 4},
    "fixed, 2 steps (2 tokens/step)": {"steps_per_block": 2},
    "fixed, 4 steps + EOSER": {"steps_per_block": 4, "eoser": True},
    "ASS (1, 2, 1 tokens)": {"schedule": "ass"},
    "ASS + EOSER": {"schedule": "ass", "eoser": True, "eoser_gamma_min": 0.01},
}
# each on top of the embedded config's options (clip_low 0.2, kl_beta 0); GDPO with the pipeline's default ELBO
# (2 Gauss-Legendre masking ratios, one mask each)
ALGORITHMS = {"cj_grpo": [], "diffu_grpo": ["algorithm.name=diffu_grpo"], "gdpo": ["algorithm.name=gdpo"]}


def decoding_table(seed: int = 0) -> list[dict]:
    """Accuracy and steps of each decoding variant on the held-out prompts."""
    from mmgrpo import registry
    from mmgrpo.config import load
    from mmgrpo.prompt_stream import items_to_batch
    from mmgrpo.plans import MaskedPlan

    cfg = load(ROOT / CONFIG)
    reward = registry.get("reward", cfg.reward.name)(cfg.reward.options)
    items = registry.get("data", cfg.data.name)(cfg.data.options).eval_items()
    batch = items_to_batch(items)
    rows = []
    for name, options in VARIANTS.items():
        policy_cls = registry.get("pipeline", "mdlm")
        policy = policy_cls(policy_cls.Config(**{"pretrained": "mmgrpo:mdlm_arith", "gen_length": 4, "lora_rank": 0, **options}))
        row = {"decoding": name, "steps": policy.num_steps}
        for label, plan in (("greedy", MaskedPlan.deterministic(policy.num_steps)),
                            ("sampled", MaskedPlan(policy.num_steps, []))):
            rollout = policy.sample(batch, plan, generator=torch.Generator().manual_seed(seed))
            row[label] = float(reward(rollout.outputs, batch).scores.mean())
        rows.append(row)
        print(row, flush=True)
    return rows


def run_curve(algorithm: str, args) -> list[tuple[float, float, int]]:
    """Trains one algorithm for the budget; returns ``(training seconds, held-out accuracy, step)`` points."""
    out = Path(args.output) / algorithm
    shutil.rmtree(out, ignore_errors=True)
    if args.budget_steps:
        budget = [f"train.max_steps={args.budget_steps}", "train.max_seconds=0",
                  f"eval.every={max(1, args.budget_steps // 6)}", "eval.every_seconds=0"]
    else:
        budget = [f"train.max_seconds={args.budget_s}", f"eval.every_seconds={args.budget_s / 6:.3f}",
                  "train.max_steps=100000", "eval.every=0"]
    command = [sys.executable, "-m", "mmgrpo.cli", "train", CONFIG, f"output_dir={out}", f"seed={args.seed}", *budget,
               *ALGORITHMS[algorithm]]
    subprocess.run(command, cwd=ROOT, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    records = read_records(out / "metrics.jsonl")  # a torn last line (a run killed mid-write) is skipped
    return [(r.get("time/train_s", 0.0), r["eval/score"], r.get("step", 0)) for r in records if "eval/score" in r]


def write_report(rows: list[dict], curves: dict, output: Path) -> None:
    lines = []
    if rows:
        lines += ["| decoding | steps | greedy accuracy | sampled accuracy (T=1) |", "|---|---|---|---|"]
        lines += [f"| {r['decoding']} | {r['steps']} | {r['greedy']:.3f} | {r['sampled']:.3f} |" for r in rows]
    if curves:
        lines += ["", "| algorithm | base | final | best | training steps | training seconds |", "|---|---|---|---|---|---|"]
        for name, points in curves.items():
            scores = [p[1] for p in points]
            lines.append(f"| {name} | {scores[0]:.3f} | {scores[-1]:.3f} | {max(scores):.3f} | {points[-1][2]} | "
                         f"{points[-1][0]:.0f} |")
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.6))
        for name, points in curves.items():
            ax.plot([p[0] for p in points], [p[1] for p in points], "o-", label=name)
        ax.set_xlabel("training seconds")
        ax.set_ylabel("held-out accuracy (greedy)")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(output / "curves.png", dpi=110)
        plt.close(fig)
    (output / "table.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (output / "results.json").write_text(json.dumps({"decoding": rows, "curves": curves}, indent=2), encoding="utf-8")
    print("\n".join(lines))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="outputs/bench_mdlm")
    parser.add_argument("--budget-s", type=float, default=300.0)
    parser.add_argument("--budget-steps", type=int, default=0, help="train this many steps instead of --budget-s")
    parser.add_argument("--algorithms", default=",".join(ALGORITHMS), help="comma-separated, among " + ", ".join(ALGORITHMS))
    parser.add_argument("--seed", type=int, default=0, help="training seed")
    parser.add_argument("--skip-curves", action="store_true")
    parser.add_argument("--skip-decoding", action="store_true")
    args = parser.parse_args(argv)
    chosen = args.algorithms.split(",")
    unknown = sorted(set(chosen) - set(ALGORITHMS))
    if unknown:
        parser.error(f"unknown algorithms {unknown}: choose among {sorted(ALGORITHMS)}")
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    rows = [] if args.skip_decoding else decoding_table()
    curves = {} if args.skip_curves else {name: run_curve(name, args) for name in chosen}
    write_report(rows, curves, output)


if __name__ == "__main__":
    main()
