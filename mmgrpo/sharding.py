"""Sharded training on PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``), applied by mmgrpo itself.

``train.sharding`` chooses how the trained module is distributed over the processes of a ``torchrun`` /
``accelerate launch`` run:

- ``ddp`` (default): accelerate wraps it in DDP (every process holds all weights, gradients and optimizer state);
- ``fsdp``: [`shard`] applies ``fully_shard`` to each transformer block of the trained module, then to the module
  itself: parameters, gradients and optimizer state are split over the processes (``Shard(0)`` DTensors), blocks are
  all-gathered for their forward and backward, gradients reduce-scattered. The same code runs under gloo on CPUs and
  NCCL on GPUs. With ``train.mixed_precision: bf16`` the blocks compute in bf16 and gradients are reduced in fp32
  (``MixedPrecisionPolicy``), while the sharded weights and optimizer state stay fp32;
- ``hybrid``: HSDP, FSDP2 over a 2-D device mesh ``("replicate", "shard")``: each node holds one copy of the
  model sharded over its own processes (the shard dimension is the local world size, ``LOCAL_WORLD_SIZE``), and the
  nodes replicate it (gradients are reduce-scattered within a node, then all-reduced across nodes). The parameter
  all-gathers of every block stay on the fast links inside a node; per process it holds ``1 / local world`` of the
  state instead of ``1 / world``;
- ``none``: a single process (a multi-process launch is refused).

With one process ``ddp``, ``fsdp`` and ``hybrid`` run unsharded (the sharded ones warn), so a config written for
many GPUs runs and evaluates as it is on one.

Blocks are found generically ([`find_blocks`]): modules whose class a model names in ``_no_split_modules``
(transformers decoder layers and vision blocks, diffusers transformer blocks) and the members of module lists named
``transformer_blocks``, ``single_transformer_blocks``, ``blocks`` or ``layers``.

A sharded module's state is consolidated for checkpoints ([`full_tensors`], [`full_parameters`]): the files are the
same as an unsharded run's, so a run resumes at any world size and the exported weights load in stock libraries.
"""

from __future__ import annotations

import contextlib
import math
import os
import warnings

import torch
import torch.distributed as dist

SHARDINGS = ("none", "ddp", "fsdp", "hybrid")
SHARDED = ("fsdp", "hybrid")  # the modes in which mmgrpo applies FSDP2 itself
BLOCK_LISTS = ("transformer_blocks", "single_transformer_blocks", "blocks", "layers")


def _dtensor_cls():
    from torch.distributed.tensor import DTensor

    return DTensor


def is_sharded(value) -> bool:
    """Whether `value` is a DTensor (a sharded parameter, its gradient or optimizer state)."""
    return isinstance(value, _dtensor_cls())


def check_world(sharding: str, world: int, local_world: int | None = None) -> str:
    """The sharding a run of `world` processes uses: `sharding`, or ``"none"`` for one process (``fsdp`` and
    ``hybrid`` warn). `local_world` (default: ``LOCAL_WORLD_SIZE``, else `world`) is the number of processes per
    node, the shard dimension of ``hybrid``.

    Raises:
        `ValueError`: ``sharding: none`` under a multi-process launch, a launch through accelerate's FSDP plugin
            (``distributed_type: FSDP``), which would wrap the model a second time, in its own way, or ``hybrid``
            with a world that is not a whole number of nodes of `local_world` processes.
    """
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() in ("1", "true"):
        raise ValueError("accelerate was launched with its FSDP plugin (distributed_type: FSDP), but mmgrpo shards the "
                         "model itself: launch with a multi-GPU config (configs/accelerate/fsdp_8gpu.yaml) or torchrun "
                         "and set train.sharding: fsdp.")
    if world > 1 and sharding == "none":
        raise ValueError(f"train.sharding is none but the run was launched with {world} processes: set ddp (each "
                         "process holds all weights) or fsdp (weights, gradients and optimizer state sharded).")
    if world == 1 and sharding in SHARDED:
        warnings.warn(f"train.sharding: {sharding} with a single process: the model is not sharded (launch with "
                      "torchrun --nproc_per_node N to shard it over N processes).", stacklevel=2)
    if sharding == "hybrid" and world > 1:
        local = local_world or int(os.environ.get("LOCAL_WORLD_SIZE", world))
        if local < 1 or world % local:
            raise ValueError(f"train.sharding: hybrid shards within a node of {local} processes, but the run has "
                             f"{world} processes, not a whole number of such nodes: launch the same --nproc_per_node "
                             "on every node, or use fsdp.")
    return sharding if world > 1 else "none"


def end_processes() -> None:
    """Ends a multi-process run cleanly: every process waits for the others, then the process group is destroyed.
    Without it, a process that exits first closes its gloo / NCCL connections while a peer's transport still holds
    them, which can abort that peer (SIGABRT) after a run that succeeded. Call it only where every process arrives
    (after a finished run, not on an error path, where the barrier would wait for a process that is gone)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def check_group_placement(train_config, world: int, traits) -> None:
    """Refuses ``train.group_placement: contiguous`` where a process would not hold whole groups (``prompts_per_step``
    not a multiple of `world`), or where the algorithm's advantages read the whole batch (its [`AlgorithmTraits`]
    `traits` say ``group_local_advantages=False``: each process would normalise by its own share)."""
    if train_config.group_placement != "contiguous":
        return
    if train_config.prompts_per_step % world:
        raise ValueError(f"train.group_placement: contiguous keeps every group on one process, but prompts_per_step "
                         f"{train_config.prompts_per_step} does not split over {world} processes: make it a multiple "
                         "of the number of processes, or use spread.")
    if world > 1 and not traits.group_local_advantages:
        raise ValueError("train.group_placement: contiguous computes advantages on each process's groups, but the "
                         "algorithm normalises them over the whole batch (scale_rewards: batch): use "
                         "spread, or normalise per group.")


def autocast_precision(train_config) -> str:
    """The mixed precision accelerate's autocast should use: ``train.mixed_precision``, or ``"no"`` for a sharded
    multi-process run (launched with ``WORLD_SIZE`` > 1), whose bf16 is FSDP2's ``MixedPrecisionPolicy`` instead."""
    if train_config.sharding in SHARDED and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return "no"
    return train_config.mixed_precision


def find_blocks(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of `module`, outermost first and never nested: every submodule whose class a model of
    the tree names in ``_no_split_modules`` and every member of a module list named as in ``BLOCK_LISTS``."""
    names = {n for m in module.modules() for n in (getattr(m, "_no_split_modules", None) or [])}
    blocks = []

    def visit(parent: torch.nn.Module, parent_name: str) -> None:
        listed = isinstance(parent, torch.nn.ModuleList) and parent_name in BLOCK_LISTS
        for name, child in parent.named_children():
            if (listed or type(child).__name__ in names) and any(True for _ in child.parameters()):
                blocks.append(child)
            else:
                visit(child, name)

    visit(module, "")
    return blocks


def shard_root(module: torch.nn.Module) -> torch.nn.Module:
    """The module whose forward every call of `module` goes through and that holds all its parameters: `module`,
    or, through wrappers without parameters of their own and with one child (a peft model, the VLM's group
    forward), that child. Its forward is where FSDP gathers the parameters outside the blocks."""
    while not any(True for _ in module.parameters(recurse=False)):
        children = [c for c in module.children() if any(True for _ in c.parameters())]
        if len(children) != 1:
            break
        module = children[0]
    return module


def device_mesh(device: torch.device, sharding: str = "fsdp"):
    """The device mesh FSDP2 shards over: 1-D over every process (``fsdp``), or 2-D ``("replicate", "shard")`` of
    nodes x processes per node (``hybrid``; the shard dimension is ``LOCAL_WORLD_SIZE``)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if sharding != "hybrid":
        return init_device_mesh(device.type, (world,))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    check_world("hybrid", world, local)
    return init_device_mesh(device.type, (world // local, local), mesh_dim_names=("replicate", "shard"))


def shard(module: torch.nn.Module, device: torch.device, mixed_precision: str = "no",
          sharding: str = "fsdp") -> torch.nn.Module:
    """Applies FSDP2 to `module` in place over every process of the default group: ``fully_shard`` on each block
    ([`find_blocks`]), then on [`shard_root`]. Returns `module` (its parameters are now sharded DTensors).

    Args:
        module (`torch.nn.Module`): the trained module, set up for training (adapter added or weights trainable).
        device (`torch.device`): this process's device (its type names the device mesh).
        mixed_precision (`str`): ``"bf16"``: blocks compute in bf16, gradients are reduced in fp32; anything else
            computes in the parameters' own dtypes.
        sharding (`str`): ``"fsdp"`` (sharded over every process) or ``"hybrid"`` (sharded within a node,
            replicated across nodes; see [`device_mesh`]).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = device_mesh(device, sharding)
    policy = MixedPrecisionPolicy()
    if mixed_precision == "bf16":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    module.to(device)
    root = shard_root(module)
    for block in find_blocks(root):
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(root, mesh=mesh, mp_policy=policy)
    return module


class ShardingAccelerator:
    """The accelerator as a policy's ``prepare`` sees it when ``train.sharding`` is ``fsdp`` or ``hybrid``:
    everything is the accelerator's, except ``prepare_model``, which applies [`shard`] instead of accelerate's DDP
    wrapper, and ``prepare_frozen`` (read by [`~mmgrpo.reference.ReferenceSwitch`]), which shards a frozen reference
    copy."""

    def __init__(self, accelerator, mixed_precision: str = "no", sharding: str = "fsdp"):
        self._accelerator = accelerator
        self._mixed_precision = mixed_precision
        self._sharding = sharding

    def __getattr__(self, name: str):
        if name.startswith("_"):  # its own attributes, before __init__ set them (copies): never the accelerator's
            raise AttributeError(name)
        return getattr(self._accelerator, name)

    def prepare_model(self, module: torch.nn.Module, *args, **kwargs) -> torch.nn.Module:
        return shard(module, self._accelerator.device, self._mixed_precision, self._sharding)

    def prepare_frozen(self, module: torch.nn.Module) -> torch.nn.Module:
        """A frozen module (full fine-tuning's reference copy) sharded like the trained one: each process holds its
        share, and its forwards, run on every process alike, compute in the same precision as the policy's."""
        return shard(module, self._accelerator.device, self._mixed_precision, self._sharding)


def prepare(policy, accelerator, sharding: str, mixed_precision: str = "no") -> list[torch.nn.Module]:
    """``policy.prepare``, with its trained module(s) sharded when `sharding` is ``fsdp`` or ``hybrid`` (see
    [`check_world`])."""
    if sharding in SHARDED:
        return policy.prepare(ShardingAccelerator(accelerator, mixed_precision, sharding))
    return policy.prepare(accelerator)


def any_process(flag: bool, module: torch.nn.Module) -> bool:
    """`flag` or, when `module` is sharded, whether it holds on any process: a loop that calls a sharded module must
    run the same number of times on every process (each call gathers parameters from all of them)."""
    if not (dist.is_available() and dist.is_initialized()) or not any(is_sharded(p) for p in module.parameters()):
        return flag
    value = torch.tensor([float(flag)], device=next(module.parameters()).device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float) -> torch.Tensor:
    """Scales the gradients of `parameters` so that their global L2 norm is at most `max_norm`; returns that norm
    (the same on every process; NaN or inf when a gradient is not finite, then nothing is scaled).

    A sharded gradient contributes the squares of this process's shard, summed over the processes and divided by
    the number of copies of that shard (``hybrid``: one per node); an unsharded one (replicated on every process)
    counts once."""
    grads = [p.grad for p in parameters if p.grad is not None]
    sharded = [g.to_local() for g in grads if is_sharded(g)]
    copies = [_copies(g) for g in grads if is_sharded(g)]
    local = [g for g in grads if not is_sharded(g)]
    device = (sharded or local or [torch.zeros(())])[0].device
    squares = torch.zeros((), dtype=torch.float64, device=device)
    for g, n in zip(sharded, copies):
        squares += g.double().square().sum() / n
    if sharded and dist.is_initialized():
        dist.all_reduce(squares)
    for g in local:
        squares += g.double().square().sum().to(device)
    norm = squares.sqrt().float()
    if math.isfinite(norm.item()):
        scale = min(1.0, max_norm / (norm.item() + 1e-6))
        for g in sharded + local:
            g.mul_(scale)
    return norm


def _copies(tensor) -> int:
    """How many processes hold each shard of the DTensor `tensor`: the sizes of its mesh's replicated dimensions."""
    return math.prod(tensor.device_mesh.size(i) for i, p in enumerate(tensor.placements) if p.is_replicate())


def clip(accelerator, sharding: str, parameters, train_config) -> torch.Tensor:
    """The gradient clipping of a run: [`clip_grad_norm_`] when sharded, accelerate's otherwise (it unscales fp16
    gradients first); both return the global norm before clipping, the same on every process."""
    if sharding in SHARDED:
        return clip_grad_norm_(parameters, train_config.max_grad_norm)
    return accelerator.clip_grad_norm_(parameters, train_config.max_grad_norm)


def full_tensors(state, keep: bool = True):
    """`state` (nested dicts, lists, tuples of tensors and other values) with each DTensor gathered into the full
    tensor on the CPU. Every process must call it in the same order (each DTensor is all-gathered); `keep=False`
    drops the gathered values (returns `None`) on processes that do not write them."""

    def walk(value):
        if is_sharded(value):
            full = value.full_tensor()
            return full.cpu() if keep else None
        if isinstance(value, dict):
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(walk(v) for v in value)
        return value

    out = walk(state)
    return out if keep else None


def like(full: torch.Tensor, reference) -> torch.Tensor:
    """The full tensor `full` in the layout of `reference`: this process's shard when `reference` is a DTensor (as
    a DTensor of the same mesh and placements), else `full` on `reference`'s device."""
    if not is_sharded(reference):
        return full.to(reference.device)
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full.to(reference.device, reference.dtype), reference.device_mesh, reference.placements,
                             src_data_rank=None)  # every process holds `full`: each keeps its shard, no messages


def optimizer_to_layout(state: dict, optimizer) -> dict:
    """A full optimizer state dict (as [`full_tensors`] wrote it) with each per-parameter tensor the shape of its
    parameter put in that parameter's layout ([`like`]), ready for ``optimizer.load_state_dict``."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    out = dict(state, state={})
    for index, entry in state["state"].items():
        param = params[index]
        out["state"][index] = {
            k: like(v, param) if torch.is_tensor(v) and tuple(v.shape) == tuple(param.shape) and v.dim() else v
            for k, v in entry.items()
        }
    return out


def _adapter_only(modules: list[torch.nn.Module]) -> bool:
    return any(hasattr(m, "peft_config") for module in modules for m in module.modules())


@contextlib.contextmanager
def full_parameters(modules: list[torch.nn.Module], *, here: bool = True):
    """Inside, the sharded parameters of `modules` are plain full tensors (on the CPU) where `here` is true, so that a
    policy's ``save_pretrained`` reads them as if nothing were sharded. Every process must enter it (each parameter
    is all-gathered). With a peft adapter only the trainable parameters are gathered (an adapter's files hold nothing
    else). Nothing may be written into them: loading goes into the module before it is sharded. Unsharded modules
    are left as they are.
    """
    trainable_only = _adapter_only(modules)
    swaps, gathered = [], {}
    for module in modules:
        for owner in module.modules():
            for name, param in list(owner._parameters.items()):
                if not is_sharded(param) or (trainable_only and not param.requires_grad):
                    continue
                if id(param) not in gathered:  # a tied parameter is gathered once
                    gathered[id(param)] = torch.nn.Parameter(param.full_tensor().cpu(), param.requires_grad)
                swaps.append((owner, name, param))
    try:
        if here:
            for owner, name, param in swaps:
                owner._parameters[name] = gathered[id(param)]
        yield
    finally:
        if here:
            for owner, name, param in swaps:
                owner._parameters[name] = param


def check_unsharded(modules: list[torch.nn.Module], what: str) -> None:
    """Refuses to load weights into sharded `modules` (FSDP2 parameters are loaded before sharding)."""
    if any(is_sharded(p) for module in modules for p in module.parameters()):
        raise RuntimeError(f"{what} cannot load weights into a sharded model: resume through checkpoint.resume_from "
                           "(weights load before sharding), or evaluate with train.sharding: ddp or one process.")
