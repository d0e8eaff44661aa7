"""Run by `test_fsdp.py`, under torchrun (2 processes, ``train.sharding: fsdp``) or alone (1 process): trains each
case of a spec on the same rollouts, whatever the number of processes, and writes what the test compares.

Every process samples the whole batch with the same generator (so the rollouts are identical at any world size,
and every process runs the sharded forwards in step), takes its slice, and runs the trainer's own update
(`mmgrpo.updates.update`: backward passes, global gradient clipping, NaN-skip, optimizer step, the algorithm's hook) with
fixed advantages. Per step it records the update's metrics averaged over processes (each process holds an equal
slice, so this is the mean over the batch) and, at the end, the trainable weights gathered whole.

Usage: ``fsdp_worker.py SPEC_JSON OUT_DIR``; the spec maps case names to ``{"config": raw config, "steps": int,
"save_at": int | null, "nan_step": int | null, "evaluate": bool, "die": {"rank": int, "step": int} | null}`` plus
``"tag"``.
"""

import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from mmgrpo import config as config_mod
from mmgrpo import sharding
from mmgrpo.prompt_stream import items_to_batch
from mmgrpo.run_loop import sum_over_processes
from mmgrpo.trainer import Trainer


def fixed_step(trainer: Trainer, step: int, nan: bool, die: dict | None = None) -> dict[str, float]:
    """One update on rollouts and advantages that depend on `step` only (not on the process or world size).
    `die` (``{"rank": r, "step": s}``): process `r` exits abruptly at step `s`, after sampling, as if it crashed."""
    cfg = trainer.config.train
    items = trainer.data.train_items()[: cfg.prompts_per_step]
    batch = items_to_batch(items).repeat(cfg.group_size)
    plan = trainer.algorithm.schedule(trainer.policy.num_steps, torch.Generator().manual_seed(step))
    rollout = trainer.policy.sample(batch, plan, generator=torch.Generator().manual_seed(100 + step))
    n = len(batch)
    if die and die["rank"] == trainer.rank and die["step"] == step:
        os._exit(3)  # no clean-up, no message: the others are about to gather parameters from this process
    advantages = torch.randn(n, generator=torch.Generator().manual_seed(200 + step))  # [N]
    if nan:
        advantages[-1] = float("nan")  # the last sample: on the last process only
    mine = torch.arange(trainer.rank * trainer.local_n, (trainer.rank + 1) * trainer.local_n)
    trainer.step = step
    metrics = trainer.update(rollout.select(mine), plan, advantages[mine], torch.ones(n, dtype=torch.bool),
                              torch.Generator().manual_seed(300 + step))
    out = {}
    for key in sorted(metrics):  # every process has the same keys: a process holds samples of every update
        out[key] = sum_over_processes(trainer.accelerator, float(metrics[key])) / trainer.world
    return out


def gathered_weights(trainer: Trainer) -> torch.Tensor:
    """The trainable weights, whole, flattened `[P]` (every process takes part in gathering them)."""
    with sharding.full_parameters(trainer.wrapped):
        return torch.cat([p.detach().float().flatten().cpu() for p in trainer.policy.trainable_parameters()])


def run_case(name: str, case: dict, out: Path, tag: str) -> dict:
    trainer = Trainer(config_mod.from_dict(case["config"]))
    record = {"world": trainer.world, "sharding": trainer.sharding, "start": trainer.step, "steps": {}}
    sharded = [p for p in trainer.policy.trainable_parameters() if sharding.is_sharded(p)]
    record["sharded"] = bool(sharded)
    if sharded:  # the device mesh FSDP2 shards over: 1-D (fsdp) or 2-D replicate x shard (hybrid)
        mesh = sharded[0].device_mesh
        record["mesh"] = {"shape": list(mesh.shape), "names": list(mesh.mesh_dim_names or [])}
    policy = trainer.policy  # its ReferenceSwitch (wan: one per expert, the first here)
    switch = getattr(policy, "switch", None) or (policy.experts[0] if hasattr(policy, "experts") else
                                                 policy.trainable).switch
    if switch.frozen is not None:  # full fine-tuning: is the frozen reference copy sharded too?
        record["reference_sharded"] = all(sharding.is_sharded(p) for p in switch.frozen.parameters())
    before, initial = None, gathered_weights(trainer)
    for step in range(trainer.step + 1, case["steps"] + 1):
        if step == case.get("nan_step"):
            before = gathered_weights(trainer)
        record["steps"][step] = fixed_step(trainer, step, nan=step == case.get("nan_step"), die=case.get("die"))
        if step == case.get("nan_step"):
            record["nan_step_unchanged"] = bool(torch.equal(before, gathered_weights(trainer)))
        if step == case.get("save_at"):
            record["checkpoint"] = str(trainer.save())
    weights = gathered_weights(trainer)
    record["skipped_updates"] = trainer.skipped_updates
    record["max_move"] = float((weights - initial).abs().max())
    if case.get("evaluate"):
        record["eval"] = trainer.evaluate(99)
    if record.get("checkpoint") and record["sharded"]:  # weights load before sharding; after it, a clear refusal
        try:
            trainer.load_weights(record["checkpoint"])
        except RuntimeError as err:
            record["load_weights_error"] = str(err)
    if trainer.accelerator.is_main_process:
        save_file({"weights": weights.contiguous()}, str(out / f"{name}_{tag}.safetensors"))
    return record


def main(spec_file: str, out_dir: str) -> None:
    spec = json.loads(Path(spec_file).read_text())
    out = Path(out_dir)
    import torch.distributed as dist

    results = {}
    for name, case in spec["cases"].items():
        results[name] = run_case(name, case, out, spec["tag"])
        if not dist.is_initialized() or dist.get_rank() == 0:  # after each case: a later case may fail on purpose
            (out / f"result_{spec['tag']}.json").write_text(json.dumps(results, indent=1))
    from mmgrpo.sharding import end_processes

    end_processes()  # no process tears down its connections while another still uses them


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
