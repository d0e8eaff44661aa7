"""Held-out reward of a flow model under the evaluation's sampler and under the sampler its algorithm trains.

`mmgrpo eval` samples with the pipeline's deterministic ODE (``evaluation_plan``). The SDE algorithms (Flow-GRPO,
GRPO-Guard, DanceGRPO, ...) train a stochastic sampler instead: the plan ``algorithm.schedule`` draws for a training
step (which steps are SDE steps, their noise level). This script scores the same held-out prompts, with the same
initial noise, once with the evaluation's plan and once per ``--plan-seeds`` seed with the training plan, for the base
model and for each ``--checkpoint``, so that a gain under the trained sampler that the ODE evaluation would not show
can be seen.

Run from the repository root::

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 .venv/bin/python bench/train_sampler_eval.py configs/tiny/t2i_shapes_grpo_guard.yaml \\
        --checkpoint s0=outputs/t2i_shapes_grpo_guard/checkpoints/step_0000800 --output outputs/bench_train_sampler

Writes ``results.json`` and ``table.md`` under ``--output`` and prints the table (the reward component ``eval.metric``
names, e.g. ``strict``, per model and sampler).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def build_trainer(config_path: str, checkpoint: str | None, output: Path):
    """A trainer as `mmgrpo train` builds it for `config_path`, with the weights of `checkpoint` (the base without)."""
    from mmgrpo.config import load
    from mmgrpo.trainer import Trainer

    overrides = [f"output_dir={output}", "eval.every=0"]
    if checkpoint is not None:
        overrides.append(f"checkpoint.resume_from={checkpoint}")
    return Trainer(load(config_path, overrides))


def score_under_plans(trainer, num_prompts: int, plan_seeds: list[int], noise_seed: int) -> dict[str, float]:
    """The mean of ``eval.metric`` over the first `num_prompts` held-out prompts: under the evaluation's ODE plan
    (``"eval"``) and under the algorithm's training plan drawn with each of `plan_seeds` (``"train/<seed>"``); every
    sampler starts from the same initial noise (`noise_seed`)."""
    from mmgrpo.evaluation import evaluation_plan, sample_and_score

    policy, metric = trainer.policy, trainer.config.eval.metric
    items = trainer.eval_items["eval"][:num_prompts]
    plans = {"eval": evaluation_plan(policy)}
    for seed in plan_seeds:
        plans[f"train/{seed}"] = trainer.algorithm.schedule(policy.num_steps, torch.Generator().manual_seed(seed))
    means = {}
    for name, plan in plans.items():
        result, _ = sample_and_score(policy, trainer.eval_reward, items, plan, torch.Generator().manual_seed(noise_seed),
                                     [])
        means[name] = result.components.get(metric, result.scores).float().mean().item()
    return means


def table(results: dict[str, dict[str, float]]) -> str:
    samplers = list(next(iter(results.values())))
    lines = ["| model | " + " | ".join(samplers) + " |", "|---" * (len(samplers) + 1) + "|"]
    lines += [f"| {model} | " + " | ".join(f"{means[s]:.3f}" for s in samplers) + " |"
              for model, means in results.items()]
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("config", help="the training config (its algorithm's training plan is the trained sampler)")
    parser.add_argument("--checkpoint", action="append", default=[], metavar="NAME=PATH",
                        help="a checkpoint folder of a run of the config (repeatable)")
    parser.add_argument("--num-prompts", type=int, default=200, help="held-out prompts (the first ones)")
    parser.add_argument("--plan-seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--noise-seed", type=int, default=1234)
    parser.add_argument("--output", type=Path, default=Path("outputs/bench_train_sampler"))
    args = parser.parse_args(argv)
    models = {"base": None}
    for entry in args.checkpoint:
        name, sep, path = entry.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--checkpoint {entry!r}: write NAME=PATH, e.g. s0=outputs/run/checkpoints/step_0000100")
        models[name] = path
    args.output.mkdir(parents=True, exist_ok=True)
    results = {}
    for name, checkpoint in models.items():
        trainer = build_trainer(args.config, checkpoint, args.output / "runs" / name)
        results[name] = score_under_plans(trainer, args.num_prompts, args.plan_seeds, args.noise_seed)
        trainer.scoring.close()
    (args.output / "results.json").write_text(json.dumps({"config": args.config, "models": models,
                                                          "results": results}, indent=2), encoding="utf-8")
    text = table(results)
    (args.output / "table.md").write_text(text + "\n", encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
