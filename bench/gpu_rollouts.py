"""The vLLM rollout engine on a GPU, on a small real Qwen2.5-VL (e.g. Qwen/Qwen2.5-VL-3B-Instruct, a local folder):
one short script that checks what the CPU tests cannot.

1. **Prompt tokens**: for image prompts (`vlm_shapes` counting questions), the prompt tokens the colocated vLLM saw
   after its processor expanded the image placeholders (``RequestOutput.prompt_token_ids``) equal the trainer's.
2. **Sleep / wake memory**: free GPU memory (``torch.cuda.mem_get_info``) with the engine awake and asleep
   (``LLM.sleep(level=1)``), and after it wakes again.
3. **Weight sync**: greedy rollouts of the engine equal the trainer's local greedy rollouts (texts and tokens) with
   the initial weights; after the LoRA weights are perturbed (the trainer's output changes), the engine's output is
   still the old one until ``sync_weights``, then equals the trainer's new greedy output.
4. **Mismatch**: on sampled rollouts (temperature 1), the trainer's log-probs of the engine's tokens against the
   engine's (``rollout_corr/*``: KL, ratio quantiles, largest log-prob difference); and two sampled rollouts of the
   same batch with generators of the same seed give the same tokens (the engine's per-sample seeds come from the
   step's generator).
5. **Step time**: ``--steps`` GRPO trainer steps (``configs/tiny/vlm_count.yaml`` on this model, LoRA, bfloat16 base)
   with ``rollout.engine: local`` and with ``rollout.engine: vllm`` (colocated), the median step time of each.

Needs a GPU and the ``vllm`` extra (see ``docs/distributed.md``). From the repository root (a few minutes on one
H100 / H200 for a 3B model):

    HF_HUB_OFFLINE=1 python bench/gpu_rollouts.py --model /path/to/Qwen2.5-VL-3B-Instruct --output outputs/gpu_rollouts

Writes ``<output>/results.json`` and prints it. Every check is reported with its numbers; a failed equality does not
stop the later checks (the exit status is 1 when one failed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")  # the model types the engine path serves with image prompts


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a local Qwen2.5-VL folder (model + processor)")
    parser.add_argument("--output", default="outputs/gpu_rollouts")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3, help="timed trainer steps per engine (after one untimed)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.35)
    return parser.parse_args(argv)


def check_arguments(args: argparse.Namespace) -> None:
    """One-line refusals, before anything loads: the model folder, the sizes, a GPU, the vllm package."""
    import importlib.util

    config = Path(args.model) / "config.json"
    if not config.is_file():
        raise SystemExit(f"--model {args.model}: no config.json there; give a local Qwen2.5-VL folder.")
    model_type = json.loads(config.read_text(encoding="utf-8")).get("model_type")
    if model_type not in FAMILIES:
        raise SystemExit(f"--model {args.model} is a {model_type!r} model; give a Qwen-VL ({', '.join(FAMILIES)}).")
    for name in ("prompts", "group_size", "max_new_tokens", "steps"):
        if vars(args)[name] < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {vars(args)[name]}.")
    if args.group_size < 2:
        raise SystemExit("--group-size must be >= 2 (group-relative advantages).")
    if not 0 < args.gpu_memory_utilization <= 1:
        raise SystemExit(f"--gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization}.")
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("No CUDA GPU here: this script measures the vLLM engine on a GPU.")
    if importlib.util.find_spec("vllm") is None:
        raise SystemExit("The vllm package is not installed: pip install mmgrpo[vllm] (see docs/distributed.md).")


def experiment(args, output: Path, engine: str):
    from mmgrpo.config import load

    return load(ROOT / "configs/tiny/vlm_count.yaml", [
        f"output_dir={output / engine}", f"pipeline.pretrained={args.model}", "pipeline.lora_rank=16",
        "pipeline.lora_alpha=32", "pipeline.weights_dtype=bfloat16", "pipeline.freeze_vision=true",
        f"pipeline.max_new_tokens={args.max_new_tokens}", "pipeline.min_pixels=50176", "pipeline.max_pixels=50176",
        f"train.prompts_per_step={args.prompts}", f"train.group_size={args.group_size}",
        f"train.minibatch_size={args.prompts * args.group_size}", "train.updates_per_step=1",
        "train.max_seconds=0", "train.mixed_precision=bf16", "eval.every=0", "checkpoint.every=0",
        "data.size=224", f"rollout.engine={engine}",
        f"rollout.gpu_memory_utilization={args.gpu_memory_utilization}",
    ])


def free_gib() -> float:
    import torch

    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0] / 2**30


def engine_checks(trainer) -> dict:
    """Checks 1-4 on a trainer whose engine is the colocated vLLM."""
    import torch

    from mmgrpo.plans import TokenPlan
    from mmgrpo.rollout_correction import mismatch_metrics

    policy, engine = trainer.policy, trainer.engine
    batch = trainer.stream.next_batch(trainer.config.train.prompts_per_step).repeat(2)
    steps = policy.num_steps
    greedy = TokenPlan(num_steps=steps, train_units=[list(range(steps))], greedy=True)
    out = {}
    local = policy.sample(batch, greedy)
    served = engine.sample(batch, greedy)
    trainer_ids = [p.expanded_ids for p in policy.engine_prompts(batch)]
    out["prompt_tokens_equal"] = engine.seen == trainer_ids
    out["greedy_equal_initial"] = served.outputs["texts"] == local.outputs["texts"]
    out["memory_free_gib"] = {"asleep": free_gib()}
    engine.llm.wake_up()
    out["memory_free_gib"]["awake"] = free_gib()
    engine.llm.sleep(level=1)
    out["memory_free_gib"]["asleep_again"] = free_gib()
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in policy.trainable_parameters():
            param.add_(torch.randn(param.shape, generator=generator).to(param) * 0.05)
    changed = policy.sample(batch, greedy)
    out["trainer_output_changed"] = changed.outputs["texts"] != local.outputs["texts"]
    out["engine_unchanged_before_sync"] = engine.sample(batch, greedy).outputs["texts"] == served.outputs["texts"]
    engine.sync_weights(policy)
    synced = engine.sample(batch, greedy)
    out["greedy_equal_after_sync"] = synced.outputs["texts"] == changed.outputs["texts"]
    out["greedy_tokens_equal_after_sync"] = bool(torch.equal(synced.trajectory["completion_ids"],
                                                             changed.trajectory["completion_ids"]))
    plan = TokenPlan(num_steps=steps, train_units=[list(range(steps))])
    sampled = engine.sample(batch, plan, generator=torch.Generator().manual_seed(0))
    repeated = engine.sample(batch, plan, generator=torch.Generator().manual_seed(0))
    out["seeded_rollouts_equal"] = bool(torch.equal(sampled.trajectory["completion_ids"],
                                                    repeated.trajectory["completion_ids"]))
    with torch.no_grad():
        old = policy.log_prob(sampled, list(range(steps))).log_prob.float().cpu()  # [N, S]
    out["mismatch"] = mismatch_metrics(old, sampled.engine_log_probs.float(), sampled.mask, None, sampled.mask)
    return out


def step_times(trainer, steps: int) -> list[float]:
    times = []
    for step in range(1, steps + 2):
        trainer.step = step
        started = time.perf_counter()
        trainer.train_step()
        times.append(time.perf_counter() - started)
    return times[1:]  # the first step compiles and warms caches


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    check_arguments(args)
    import gc

    import torch

    from mmgrpo.trainer import Trainer

    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    results = {"model": Path(args.model).name, "prompts": args.prompts, "group_size": args.group_size,
               "max_new_tokens": args.max_new_tokens, "gpu": torch.cuda.get_device_name()}
    trainer = Trainer(experiment(args, output, "local"))
    results["local_step_s"] = statistics.median(step_times(trainer, args.steps))
    del trainer
    gc.collect()
    torch.cuda.empty_cache()
    trainer = Trainer(experiment(args, output, "vllm"))
    results["vllm_step_s"] = statistics.median(step_times(trainer, args.steps))
    results["speedup"] = results["local_step_s"] / results["vllm_step_s"]
    results.update(engine_checks(trainer))
    (output / "results.json").write_text(json.dumps(results, indent=2), encoding="utf-8")
    print(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    checks = main()
    names = ("prompt_tokens_equal", "greedy_equal_initial", "trainer_output_changed", "engine_unchanged_before_sync",
             "greedy_equal_after_sync", "greedy_tokens_equal_after_sync", "seeded_rollouts_equal")
    sys.exit(0 if all(checks[name] for name in names) else 1)
