"""A run whose first batch cannot fit in memory is refused before it starts.

The estimate is deliberately low: only the decoded outputs (or token records) of one step's samples on this machine,
as the pipeline's ``Config.output_size()`` states them, against all of this machine's memory (RAM, plus accelerator
memory). Activations, weights, latents and caches come on top, so a refused run certainly cannot start, while an
accepted one may still be too large: the check catches sizes no real run asks for, not a tight fit.
"""

from __future__ import annotations

import os

from .config import ExperimentConfig
from .validation import ConfigError

GiB = 2**30
# the memory of one accelerator where it cannot be read without initialising CUDA (the largest sold today: 288 GB)
ACCELERATOR_ALLOWANCE = 288 * 10**9


def machine_memory() -> int:
    """Bytes of RAM of this machine (psutil, else ``/proc/meminfo``, else ``sysconf``) plus ``ACCELERATOR_ALLOWANCE``
    per visible CUDA device (counted without initialising CUDA); 0 when nothing can be read."""
    total = 0
    try:
        import psutil

        total = int(psutil.virtual_memory().total)
    except ImportError:
        try:
            with open("/proc/meminfo", encoding="ascii") as meminfo:
                total = next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemTotal:"))
        except (OSError, StopIteration, ValueError, IndexError):
            try:
                total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            except (AttributeError, OSError, ValueError):
                return 0
    import torch

    if torch.cuda.is_available():
        total += torch.cuda.device_count() * ACCELERATOR_ALLOWANCE
    return total


def samples_on_this_machine(config: ExperimentConfig) -> int:
    """The samples of one step held on this machine: all of them, or under torchrun the share of its local processes
    (``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``)."""
    samples = config.train.prompts_per_step * config.train.group_size
    try:
        world = max(int(os.environ.get("WORLD_SIZE", "1")), 1)
        local = min(max(int(os.environ.get("LOCAL_WORLD_SIZE", str(world))), 1), world)
    except ValueError:
        return samples
    return -(-samples * local // world)


def check_memory(config: ExperimentConfig, available: int | None = None) -> None:
    """Refuses `config` when one step's outputs alone exceed `available` bytes (default: [`machine_memory`]), naming the
    keys to lower."""
    available = machine_memory() if available is None else available
    per_sample, keys = config.pipeline.options.output_size()
    samples = samples_on_this_machine(config)
    need = samples * per_sample
    if available and need > available:
        raise ConfigError(
            f"train.prompts_per_step x train.group_size = {samples} samples per step on this machine, of "
            f"{per_sample / 2**20:.3g} MiB each ({keys}), need {need / GiB:.3g} GiB for their outputs alone, more "
            f"than this machine's {available / GiB:.3g} GiB of memory: lower train.prompts_per_step, "
            f"train.group_size or {keys}."
        )
