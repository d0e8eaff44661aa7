"""The rollout engine a config asks for (``rollout.engine``, ``rollout.mode``; see [`mmgrpo.engines`]), and the checks
of that choice that need no model: [`check_engine`] runs in preflight, before any weights load.

- ``local``: [`~mmgrpo.engines.LocalEngine`], the policy's own decode loop (the default, the reference);
- ``vllm`` with ``mode: colocate``: [`~mmgrpo.engines_vllm.VLLMColocateEngine`], vLLM in the trainer's process;
- ``vllm`` or ``sglang`` with ``mode: server``: [`~mmgrpo.engine_server.ServerEngine`], a running server.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from . import registry
from .engines import LocalEngine, RolloutEngine
from .validation import ConfigError

ENGINE_CAPABILITY = "engine_rollout"  # the capability of a pipeline an engine can sample for (see mmgrpo.engines)


def check_engine(config) -> None:
    """Refuses, before any model loads, an engine the pipeline cannot sample with, a colocated engine whose package
    is not installed, or one that cannot take the weights of this launch's processes (``WORLD_SIZE``, as torchrun
    and accelerate set it; see [`check_world`])."""
    rollout = config.rollout
    if rollout.engine == "local":
        return
    pipeline = registry.get("pipeline", config.pipeline.name)
    if ENGINE_CAPABILITY not in pipeline.capabilities:
        raise ConfigError(f"rollout.engine: {rollout.engine} samples token policies only (pipelines declaring "
                          f"{ENGINE_CAPABILITY}, e.g. qwen_vl); pipeline {config.pipeline.name} samples with its own "
                          "sampler: set rollout.engine: local.")
    if rollout.mode == "colocate" and importlib.util.find_spec(rollout.engine) is None:
        raise ConfigError(f"rollout.engine: {rollout.engine} with rollout.mode: colocate needs the {rollout.engine} "
                          f"package in this environment: pip install mmgrpo[{rollout.engine}] (see "
                          "docs/distributed.md), or run it as a server (rollout.mode: server).")
    check_world(config, int(os.environ.get("WORLD_SIZE", "1")))


def weights_dir(config) -> str:
    """Where the trainer writes the weights a server reloads: ``rollout.weights_dir``, or
    ``<output_dir>/engine_weights``."""
    return config.rollout.weights_dir or str(Path(config.output_dir) / "engine_weights")


def check_world(config, world: int) -> None:
    """Refuses an engine that cannot take the weights of a run over `world` processes: a server (every process would
    push its own copy) and, under FSDP, the colocated vLLM (each process holds a shard of the weights, not all)."""
    rollout = config.rollout
    if world == 1 or rollout.engine == "local":
        return
    if rollout.mode == "server":
        raise ConfigError(f"rollout.mode: server takes the weights of a one-process run; this run has {world} "
                          "processes: train on one process, or use rollout.mode: colocate (one vLLM per process).")
    if config.train.sharding in ("fsdp", "hybrid"):
        raise ConfigError(f"rollout.mode: colocate loads each process's whole weights into its vLLM; train.sharding: "
                          f"{config.train.sharding} holds a shard per process: use train.sharding: ddp.")


def build_engine(config, policy) -> RolloutEngine:
    """The rollout engine of `config` for `policy` (see the module docstring); checked as [`check_engine`] and
    [`check_world`] check."""
    import torch

    check_engine(config)
    rollout = config.rollout
    if rollout.engine == "local":
        return LocalEngine(policy)
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    check_world(config, torch.distributed.get_world_size() if distributed else 1)
    if rollout.mode == "server":
        from .engine_server import ServerEngine

        return ServerEngine(policy, rollout.engine, rollout.server_url, rollout.timeout_s, weights_dir(config))
    from .engines_vllm import VLLMColocateEngine

    return VLLMColocateEngine(policy, rollout)
