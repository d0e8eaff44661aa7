"""Scale-out on CPUs: per-process training state and step time at one process, two DDP processes and two FSDP2
processes, and what gradient checkpointing saves and costs.

**Sharding** (``train.sharding``). Three launches (one process; ``torchrun --nproc_per_node 2`` with ``ddp``; the same
with ``fsdp``; gloo on CPU) each train the same models through the trainer's own update (`Trainer._update`: forward,
backward, global clipping, AdamW step) on rollouts each process samples for its share of the batch, with fixed
advantages. Models, fully fine-tuned (every weight trained, AdamW):

- ``tiny_flow``: the shipped SD3-architecture toy (``mmgrpo:t2i_shapes_p2``, 1.7M transformer parameters);
- ``tiny_vlm``: the shipped Qwen2-VL-architecture toy (``mmgrpo:vlm_shapes``, 0.5M parameters);
- ``large_flow``: a random-weight SD3 transformer of 73M parameters (8 blocks, 8 heads x 64), with the tiny CLIP text
  encoders and VAE of the tests' builder, built here and saved next to the results.

Per process it counts the bytes of the trained **parameters**, their **gradients** (at the optimizer step) and the
**optimizer state** as stored on that process: a sharded tensor counts its local shard (``DTensor.to_local()``). The
ratios to one process show what each process holds (DDP: everything; FSDP: about ``1 / world``). DDP's reducer also
keeps gradient buckets of about the gradients' size, which are not counted. Peak RSS is the whole process (libraries,
every model component, activations), from the start of each model's case. Step time is the median wall time of the
update of the process's share
(``--steps`` timed updates after one untimed), each process taking half the batch in a two-process run.

**Gradient checkpointing** (``pipeline.gradient_checkpointing``). In one process, each model (built twice, with and
without checkpointing, from the same seed) replays one sampled rollout: ``policy.log_prob`` then the backward of a
weighted sum of the log-probs. Memory is measured by PyTorch's ``MemTracker`` (``torch.distributed._tools``, a
dispatch mode that counts the live tensor storages of every op): the peak, over forward and backward, of everything
but the model's parameters and buffers (activations kept for the backward, gradients, temporaries), and the
activations alone at that peak. Time: median of ``--repeats`` replays without the tracker.

Timings share 2 CPU cores with whatever else runs on the machine: they are noisy, the byte counts are exact.

Run from the repository root (about 5 minutes on 2 cores):

    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 OMP_NUM_THREADS=1 \\
        .venv/bin/python bench/scale.py --output outputs/bench_scale

Writes ``results.json`` and ``table.md`` under ``--output`` and prints the tables. ``--models tiny_flow`` and
``--skip-checkpointing`` / ``--skip-sharding`` select parts (the test runs the smallest case).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = {"ACCELERATE_USE_CPU": "true", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
       "TOKENIZERS_PARALLELISM": "false", "DIFFUSERS_VERBOSITY": "error", "TRANSFORMERS_VERBOSITY": "error"}
MODELS = ("tiny_flow", "tiny_vlm", "large_flow")
LAUNCHES = (("1 process", 1, "none"), ("2 x DDP", 2, "ddp"), ("2 x FSDP", 2, "fsdp"))
MIB = 1 << 20
LARGE = dict(num_layers=8, attention_head_dim=64, num_attention_heads=8)  # SD3 transformer, 73M parameters


# ----------------------------------------------------------------------------------------------------- configs
def flow_config(root: Path, pretrained: str, sharding: str, *, large: bool) -> dict:
    prompts = root / "prompts.txt"
    prompts.parent.mkdir(parents=True, exist_ok=True)
    prompts.write_text("a red circle\na blue square\na green triangle\ntwo red squares\n")
    return {
        "output_dir": str(root / f"run_{sharding}"), "seed": 0,
        "pipeline": {"name": "sd3", "pretrained": pretrained, "resolution": 32, "num_steps": 2 if large else 4,
                     "guidance_scale": 1.0, "lora_rank": 0, "max_sequence_length": 16 if large else 4},
        "algorithm": {"name": "flow_grpo", "kl_beta": 0.0},
        "reward": {"name": "jpeg"},
        "data": {"name": "prompt_file", "train_file": str(prompts), "eval_file": str(prompts)},
        "train": {"max_steps": 100, "prompts_per_step": 2 if large else 4, "group_size": 2, "minibatch_size": 8,
                  "learning_rate": 1e-4, "sharding": sharding},
        "eval": {"every": 0, "num_prompts": 2, "metric": "jpeg_kb"},
        "checkpoint": {"every": 0},
    }


def vlm_config(root: Path, sharding: str) -> dict:
    return {
        "output_dir": str(root / f"run_{sharding}"), "seed": 0,
        "pipeline": {"name": "qwen_vl", "pretrained": "mmgrpo:vlm_shapes", "max_new_tokens": 8, "lora_rank": 0,
                     "freeze_vision": False, "min_pixels": 3136, "max_pixels": 3136},
        "algorithm": {"name": "grpo", "kl_beta": 0.0},
        "reward": {"name": "format"},
        "data": {"name": "vlm_shapes", "tasks": ["count"], "n_train": 8, "n_eval": 2},
        "train": {"max_steps": 100, "prompts_per_step": 4, "group_size": 2, "minibatch_size": 8,
                  "learning_rate": 1e-4, "sharding": sharding},
        "eval": {"every": 0, "num_prompts": 2, "metric": "score"},
        "checkpoint": {"every": 0},
    }


def model_config(name: str, root: Path, sharding: str, large_dir: str | None) -> dict:
    if name == "tiny_vlm":
        return vlm_config(root / name, sharding)
    if name == "large_flow":
        return flow_config(root / name, large_dir, sharding, large=True)
    return flow_config(root / name, "mmgrpo:t2i_shapes_p2", sharding, large=False)


def build_large_flow(path: Path) -> str:
    """Saves the random-weight 73M-parameter SD3 pipeline (tests' builder, larger transformer) once."""
    if not (path / "model_index.json").is_file():
        sys.path.insert(0, str(ROOT / "tests"))
        from builders.sd3 import tiny_sd3_pipeline

        tiny_sd3_pipeline(**LARGE).save_pretrained(path)
    return str(path)


# ------------------------------------------------------------------------------------------------------ counting
def local_bytes(tensor) -> int:
    """Bytes this process stores for `tensor`: its local shard when it is a DTensor."""
    from mmgrpo import sharding

    local = tensor.to_local() if sharding.is_sharded(tensor) else tensor
    return local.numel() * local.element_size()


def optimizer_state_bytes(optimizer) -> int:
    import torch

    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper holds the torch optimizer
    return sum(local_bytes(v) for state in inner.state.values() for v in state.values()
               if torch.is_tensor(v) and v.dim())


def reset_peak_rss() -> bool:
    """Resets this process's peak resident set (Linux: ``5`` into ``/proc/self/clear_refs``); False where it cannot."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_rss_mib() -> float:
    """Peak resident memory of this process since [`reset_peak_rss`] (``VmHWM``), else since it started."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


# ------------------------------------------------------------------------------------------------- the worker
def worker_case(config: dict, steps: int) -> dict:
    """Trains `config` for one untimed and `steps` timed updates; returns this process's byte counts and times."""
    import torch

    from mmgrpo import config as config_mod
    from mmgrpo.prompt_stream import items_to_batch
    from mmgrpo.trainer import Trainer

    gc.collect()  # the previous case's models
    reset_peak_rss()
    trainer = Trainer(config_mod.from_dict(config))
    params = trainer.policy.trainable_parameters()
    counted = {}
    original_step = trainer.optimizer.step

    def step_and_count(*args, **kwargs):
        counted["grads"] = sum(local_bytes(p.grad) for p in params if p.grad is not None)
        return original_step(*args, **kwargs)

    trainer.optimizer.step = step_and_count
    cfg = trainer.config.train
    items = trainer.data.train_items()[: cfg.prompts_per_step]
    batch = items_to_batch(items).repeat(cfg.group_size)
    mine = range(trainer.rank * trainer.local_n, (trainer.rank + 1) * trainer.local_n)
    update_times, sample_times = [], []
    for step in range(steps + 1):
        plan = trainer.algorithm.schedule(trainer.policy.num_steps, torch.Generator().manual_seed(step))
        start = time.perf_counter()
        rollout = trainer.policy.sample(batch.select(mine), plan,
                                        generator=torch.Generator().manual_seed(100 + 10 * step + trainer.rank))
        sampled = time.perf_counter()
        advantages = torch.randn(len(batch), generator=torch.Generator().manual_seed(200 + step))  # [N]
        trainer.update(rollout, plan, advantages[list(mine)], torch.ones(len(batch), dtype=torch.bool),
                        torch.Generator().manual_seed(300 + step))
        if step:  # the first update (allocations, lazy initialisation) is not timed
            sample_times.append(sampled - start)
            update_times.append(time.perf_counter() - sampled)
    return {
        "world": trainer.world, "sharding": trainer.sharding, "local_samples": trainer.local_n,
        "parameters": sum(p.numel() for p in params),  # a DTensor's numel is the whole tensor's
        "param_bytes": sum(local_bytes(p) for p in params), "grad_bytes": counted.get("grads", 0),
        "optimizer_bytes": optimizer_state_bytes(trainer.optimizer),
        "update_s": statistics.median(update_times), "sample_s": statistics.median(sample_times),
        "peak_rss_mib": peak_rss_mib(),
    }


def worker(spec_file: str) -> None:
    spec = json.loads(Path(spec_file).read_text())
    rank = int(os.environ.get("RANK", "0"))
    results = {}
    for name, config in spec["cases"].items():
        results[name] = worker_case(config, spec["steps"])
    Path(spec["out"]).joinpath(f"{spec['tag']}_rank{rank}.json").write_text(json.dumps(results, indent=1))


def launch(out: Path, tag: str, world: int, cases: dict, steps: int) -> dict[int, dict]:
    """Runs the worker on `cases` in `world` processes; returns each rank's results."""
    spec = out / f"spec_{tag}.json"
    spec.write_text(json.dumps({"tag": tag, "cases": cases, "steps": steps, "out": str(out)}))
    command = [sys.executable]
    if world > 1:
        command += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world)]
    env = dict(os.environ, **ENV)
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.run(command + [str(Path(__file__).resolve()), "--worker", str(spec)], capture_output=True,
                          text=True, env=env, cwd=ROOT)
    if proc.returncode:
        first = proc.stderr.find("Traceback")
        error = proc.stderr[first:first + 5000] if first >= 0 else proc.stderr[-5000:]
        raise RuntimeError(f"the {tag} launch failed:\n{error}")
    return {r: json.loads((out / f"{tag}_rank{r}.json").read_text()) for r in range(world)}


def run_sharding(out: Path, models: list[str], steps: int) -> dict:
    large_dir = build_large_flow(out / "large_flow_model") if "large_flow" in models else None
    results = {}
    for label, world, mode in LAUNCHES:
        tag = f"w{world}_{mode}"
        cases = {m: model_config(m, out / tag, mode if world > 1 else "none", large_dir) for m in models}
        started = time.perf_counter()
        results[label] = launch(out, tag, world, cases, steps)
        print(f"{label}: {time.perf_counter() - started:.0f} s", flush=True)
    return results


# ------------------------------------------------------------------------------------------- checkpointing
def checkpoint_policy(name: str, large_dir: str | None, checkpointing: bool):
    """The fully fine-tuned policy of `name`, with or without gradient checkpointing, its batch and plan."""
    import torch

    from mmgrpo.types import PromptBatch

    torch.manual_seed(0)
    if name == "tiny_vlm":
        from PIL import Image

        from mmgrpo.algorithms.grpo import GRPO, GRPOConfig
        from mmgrpo.pipelines.qwen_vl import QwenVLConfig, QwenVLPolicy

        policy = QwenVLPolicy(QwenVLConfig(pretrained="mmgrpo:vlm_shapes", max_new_tokens=16, lora_rank=0,
                                           freeze_vision=False, min_pixels=3136, max_pixels=3136,
                                           prefix_sharing=False, gradient_checkpointing=checkpointing))
        images = [Image.new("RGB", (56, 56), (255 * (i % 2), 80, 40 * i)) for i in range(4)]
        batch = PromptBatch(["How many red shapes are there?"] * 4, conditions={"images": images}).repeat(2)
        return policy, batch, GRPO(GRPOConfig()).schedule(16), list(range(16))
    from mmgrpo.algorithms.flow_grpo import FlowGRPO, FlowGRPOConfig
    from mmgrpo.pipelines.sd3 import SD3Config, SD3Policy

    large = name == "large_flow"
    policy = SD3Policy(SD3Config(pretrained=large_dir if large else "mmgrpo:t2i_shapes_p2", resolution=32,
                                 num_steps=4, guidance_scale=1.0, lora_rank=0, max_sequence_length=16 if large else 4,
                                 gradient_checkpointing=checkpointing))
    batch = PromptBatch(["a red circle", "a blue square", "a green triangle", "two red squares"]).repeat(2)
    return policy, batch, FlowGRPO(FlowGRPOConfig()).schedule(4), [0, 1, 2, 3]


def replay_backward(policy, rollout, steps) -> None:
    import torch

    class Replay(torch.nn.Module):
        """One module around the replay: MemTracker refuses a top-level module called more than once (a flow
        replay calls the transformer once per step)."""

        def forward(self):
            return policy.log_prob(rollout, steps)

    replay = Replay()  # alive until its backward hooks have run
    score = replay()
    weights = torch.linspace(-1, 1, score.log_prob.numel()).view_as(score.log_prob)  # [n, k]
    mask = score.mask if score.mask is not None else torch.ones_like(score.log_prob, dtype=torch.bool)
    (score.log_prob * weights)[mask].sum().backward()


def measure_checkpointing(name: str, large_dir: str | None, checkpointing: bool, repeats: int) -> dict:
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    policy, batch, plan, steps = checkpoint_policy(name, large_dir, checkpointing)
    rollout = policy.sample(batch, plan, generator=torch.Generator().manual_seed(0))
    module = next(iter(policy.trainable_modules().values()))
    replay_backward(policy, rollout, steps)  # warm-up (lazy initialisation), untimed
    times = []
    for _ in range(repeats):
        module.zero_grad(set_to_none=True)
        start = time.perf_counter()
        replay_backward(policy, rollout, steps)
        times.append(time.perf_counter() - start)
    module.zero_grad(set_to_none=True)
    tracker = MemTracker()
    tracker.track_external(module)
    with tracker:
        replay_backward(policy, rollout, steps)
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    model = peak.get(_MemRefType.PARAM, 0) + peak.get(_MemRefType.BUFFER, 0)
    return {"peak_mib": (peak["Total"] - model) / MIB, "activations_mib": peak.get(_MemRefType.ACT, 0) / MIB,
            "seconds": statistics.median(times), "samples": len(batch)}


def run_checkpointing(out: Path, models: list[str], repeats: int) -> dict:
    large_dir = build_large_flow(out / "large_flow_model") if "large_flow" in models else None
    return {m: {str(c): measure_checkpointing(m, large_dir, c, repeats) for c in (False, True)} for m in models}


# ---------------------------------------------------------------------------------------------------- tables
def sharding_table(results: dict) -> str:
    rows = ["| model | launch | samples / process | trained parameters | params / process | grads / process | "
            "AdamW state / process | state ratio to 1 process | peak RSS / process | update time (median) | "
            "time ratio |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    first = results[LAUNCHES[0][0]][0]
    for model in first:
        base = first[model]
        base_state = base["param_bytes"] + base["grad_bytes"] + base["optimizer_bytes"]
        for label, world, _ in LAUNCHES:
            per_rank = [results[label][r][model] for r in range(world)]
            r0 = per_rank[0]
            state = max(r["param_bytes"] + r["grad_bytes"] + r["optimizer_bytes"] for r in per_rank)
            rows.append(
                f"| {model} | {label} | {r0['local_samples']} | {r0['parameters'] / 1e6:.2f}M"
                f" | {max(r['param_bytes'] for r in per_rank) / MIB:.1f} MiB"
                f" | {max(r['grad_bytes'] for r in per_rank) / MIB:.1f} MiB"
                f" | {max(r['optimizer_bytes'] for r in per_rank) / MIB:.1f} MiB | {state / base_state:.2f}"
                f" | {max(r['peak_rss_mib'] for r in per_rank):.0f} MiB | {r0['update_s']:.2f} s"
                f" | {r0['update_s'] / base['update_s']:.2f} |")
    return "\n".join(rows)


def checkpointing_table(results: dict) -> str:
    rows = ["| model | samples replayed | peak memory without / with (MiB) | activations at peak without / with "
            "(MiB) | saved | time without / with | extra time |", "|---|---:|---:|---:|---:|---:|---:|"]
    for model, pair in results.items():
        off, on = pair["False"], pair["True"]
        rows.append(
            f"| {model} | {off['samples']} | {off['peak_mib']:.1f} / {on['peak_mib']:.1f}"
            f" | {off['activations_mib']:.1f}"
            f" / {on['activations_mib']:.1f} | {1 - on['peak_mib'] / off['peak_mib']:.0%} | {off['seconds']:.2f} s /"
            f" {on['seconds']:.2f} s | {on['seconds'] / off['seconds'] - 1:+.0%} |")
    return "\n".join(rows)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default="outputs/bench_scale")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--steps", type=int, default=3, help="timed updates per launch and model")
    parser.add_argument("--repeats", type=int, default=3, help="timed replays per checkpointing case")
    parser.add_argument("--skip-sharding", action="store_true")
    parser.add_argument("--skip-checkpointing", action="store_true")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker)
        return {}
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 1))  # the launches' processes: OMP_NUM_THREADS
    out = Path(args.output).resolve()
    out.mkdir(parents=True, exist_ok=True)
    results, tables = {}, []
    if not args.skip_sharding:
        results["sharding"] = run_sharding(out, args.models, args.steps)
        tables.append(sharding_table(results["sharding"]))
    if not args.skip_checkpointing:
        results["checkpointing"] = run_checkpointing(out, args.models, args.repeats)
        tables.append(checkpointing_table(results["checkpointing"]))
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "table.md").write_text("\n\n".join(tables) + "\n")
    print("\n\n".join(tables))
    return results


if __name__ == "__main__":
    main()
