"""The rollout engine a config asks for (``rollout.engine``, ``rollout.mode``; see [`mmgrpo.engines`]), and the checks
of that choice that need no model: [`check_engine`] runs in preflight, before any weights load.

- ``local``: [`~mmgrpo.engines.LocalEngine`], the policy's own decode loop (the default, the reference);
- ``vllm`` with ``mode: colocate``: [`~mmgrpo.engines_vllm.VLLMColocateEngine`], vLLM in the trainer's process;
- ``vllm`` or ``sglang`` with ``mode: server``: [`~mmgrpo.engine_server.ServerEngine`], a running server.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from . import registry
from .engines import LocalEngine, RolloutEngine
from .validation import ConfigError

ENGINE_CAPABILITY = "engine_rollout"  # the capability of a pipeline an engine can sample for (see mmgrpo.engines)


def check_engine(config) -> None:
    """Refuses, before any model loads, an engine the pipeline cannot sample with, or a colocated engine whose
    package is not installed."""
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


def weights_dir(config) -> str:
    """Where the trainer writes the weights a server reloads: ``rollout.weights_dir``, or
    ``<output_dir>/engine_weights``."""
    return config.rollout.weights_dir or str(Path(config.output_dir) / "engine_weights")


def build_engine(config, policy) -> RolloutEngine:
    """The rollout engine of `config` for `policy` (see the module docstring); checked as [`check_engine`] checks."""
    check_engine(config)
    rollout = config.rollout
    if rollout.engine == "local":
        return LocalEngine(policy)
    if rollout.mode == "server":
        from .engine_server import ServerEngine

        return ServerEngine(policy, rollout.engine, rollout.server_url, rollout.timeout_s, weights_dir(config))
    from .engines_vllm import VLLMColocateEngine

    return VLLMColocateEngine(policy, rollout)
