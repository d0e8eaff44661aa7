"""What the shapes base-model scripts (`train_t2i_shapes.py`, `train_t2v_shapes.py`, `train_edit_shapes.py`) share:
their common command-line options, the learning-rate schedule, the flow-matching loop around a script's own batch loss
(EMA weights, selection evaluations that stop training inside a target range, resumable checkpoints), and the run's
set-up and report.

Not a script: the scripts import it from their folder.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time
from typing import Callable

import numpy as np
import torch

from mmgrpo.state_io import load_state


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """``--output``, ``--seed`` and ``--threads``."""
    parser.add_argument("--output", required=True, help="folder for the pipeline, metrics.json and samples.png")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 is fastest on a busy machine)")


def add_flow_arguments(parser: argparse.ArgumentParser, steps: int) -> None:
    """The flow-matching stage's options (at most `steps` steps)."""
    parser.add_argument("--steps", type=int, default=steps, help="most flow-matching steps")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--schedule", choices=["cosine", "constant"], default="cosine",
                        help="learning rate after warm-up: cosine decay to 10%% at --steps, or constant")
    parser.add_argument("--ema", type=float, default=0.99, help="EMA decay of the evaluated weights (0: none)")
    parser.add_argument("--dropout", type=float, default=0.1, help="empty-prompt probability (for CFG)")


def add_selection_arguments(parser: argparse.ArgumentParser, *, eval_start: int, n_select: int, n_eval: int,
                            target: list[float], checkpoint_every: int) -> None:
    """The options of the selection evaluations, the final measurement and the resumable checkpoints."""
    parser.add_argument("--eval-every", type=int, default=250)
    parser.add_argument("--eval-start", type=int, default=eval_start, help="first step of the selection evaluations")
    parser.add_argument("--n-select", type=int, default=n_select, help="held-out items used to pick the checkpoint")
    parser.add_argument("--n-eval", type=int, default=n_eval, help="held-out items of the final measurement")
    parser.add_argument("--target", type=float, nargs=2, default=target,
                        help="strict-accuracy range: training stops once the mean of the last two evals is in it")
    parser.add_argument("--eval-steps", type=int, default=10)
    parser.add_argument("--checkpoint-every", type=int, default=checkpoint_every,
                        help="steps between resumable checkpoints (<output>/resume.safetensors, deleted at the end)")


def learning_rate(step: int, args) -> float:
    """Linear warm-up, then constant or cosine decay to 10% of `args.lr` at `args.steps`."""
    if step < args.warmup:
        return args.lr * step / args.warmup
    if args.schedule == "constant":
        return args.lr
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * progress)))


def start_run(args) -> tuple[np.random.Generator, Callable[[str], None], float]:
    """Sets torch's threads and seed; returns the run's numpy generator, a log function printing the elapsed time,
    and the start time."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    start = time.time()

    def log(message: str) -> None:
        print(f"[{time.time() - start:7.1f}s] {message}", flush=True)

    return rng, log, start


def parameter_counts(pipe, names: tuple[str, ...]) -> dict[str, int]:
    """Parameters of each named component of a diffusers pipeline."""
    return {name: sum(p.numel() for p in getattr(pipe, name).parameters()) for name in names}


def open_resume(output: str) -> tuple[str, dict | None]:
    """Creates `output` and returns the path of its resumable state (tensors + JSON, no pickle) with the state saved
    there by an interrupted run, or None."""
    os.makedirs(output, exist_ok=True)
    resume_path = os.path.join(output, "resume.safetensors")
    if os.path.isfile(os.path.join(output, "resume.pt")) and not os.path.isfile(resume_path):
        raise SystemExit(f"{output}/resume.pt is a pickled state of an older version of this script, which is not "
                         "loaded (it could run code): delete it to start over.")
    return resume_path, load_state(resume_path) if os.path.isfile(resume_path) else None


def _restore(state: dict, modules: dict, opt, rng: np.random.Generator, gen: torch.Generator) -> tuple:
    """Loads a saved training state into the modules, the optimizer and the generators; returns ``(ema, history,
    chosen, first step)``."""
    for name, m in modules.items():
        m.load_state_dict(state["modules"][name])
    opt.load_state_dict(state["optimizer"])
    rng.bit_generator.state = state["rng"]
    gen.set_state(state["generator"])
    if "torch_rng" in state:
        torch.set_rng_state(state["torch_rng"])  # dropout in the text encoders
    return state["ema"], state["history"], state["chosen"], state["step"] + 1


def _select(modules: dict, ema: dict, select: Callable[[], dict], step: int, history: list, chosen, args, log):
    """Evaluates the EMA weights (then puts the live ones back), appends to `history` and updates the chosen
    checkpoint; returns ``(chosen, stop)``: training stops once the mean of the last two evaluations is inside
    `args.target` or above it."""
    live = {name: copy.deepcopy(m.state_dict()) for name, m in modules.items()}
    for name, m in modules.items():
        m.load_state_dict(ema[name])
        m.eval()
    metrics = select()
    history.append({"step": step, **metrics})
    log(f"select eval step {step}: {json.dumps({k: round(v, 3) for k, v in metrics.items()})}")
    smoothed = float(np.mean([h["strict"] for h in history[-2:]]))  # the last two evaluations: chase noise less
    in_range = args.target[0] <= smoothed <= args.target[1]
    overshoot = smoothed > args.target[1]
    if chosen is None or in_range or (chosen["strict"] < smoothed and not overshoot):
        weights = {n: copy.deepcopy(m.state_dict()) for n, m in modules.items()}
        chosen = {"step": step, "strict": smoothed, "state": weights}
    for name, m in modules.items():
        m.load_state_dict(live[name])
    return chosen, in_range or overshoot


def train_selected(modules: dict[str, torch.nn.Module], batch_loss: Callable[[], torch.Tensor],
                   select: Callable[[], dict], args, rng: np.random.Generator, gen: torch.Generator, log,
                   checkpoint=None, rate: Callable = learning_rate, log_every: int = 50) -> tuple[dict, list[dict]]:
    """Trains `modules` on `batch_loss()` (one batch's loss, drawn from `rng` / `gen`) with AdamW, gradients clipped
    to norm 1 and an EMA of the weights; evaluates the EMA weights with `select()` (metrics with ``strict``) every
    `args.eval_every` steps from `args.eval_start` and at the last step, and stops once the mean of the last two
    evaluations is inside `args.target` (or above it).

    `checkpoint` (*optional*) is a `(state, save)` pair: a state saved earlier to resume from (or None), and a
    function called with the complete training state every `args.checkpoint_every` steps. Resuming gives exactly the
    same result as an uninterrupted run. `rate(step, args)` is the learning rate of a step.

    Returns:
        `tuple[dict, list[dict]]`: the chosen checkpoint ``{"step", "strict", "state"}`` (already loaded into the
        modules, in eval mode) and the evaluation history.
    """
    params = [p for m in modules.values() for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)
    ema = {name: copy.deepcopy(m.state_dict()) for name, m in modules.items()}
    history, chosen, first_step = [], None, 1
    state, save = checkpoint or (None, None)
    if state is not None:
        ema, history, chosen, first_step = _restore(state, modules, opt, rng, gen)
        log(f"resumed at step {first_step}")
    for step in range(first_step, args.steps + 1):
        for m in modules.values():
            m.train()
        loss = batch_loss()
        for group in opt.param_groups:
            group["lr"] = rate(step, args)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        with torch.no_grad():
            decay = min(args.ema, (1 + step) / (10 + step))
            for name, m in modules.items():
                for key, value in m.state_dict().items():
                    if value.dtype.is_floating_point:
                        ema[name][key].mul_(decay).add_(value, alpha=1 - decay)
        if step % log_every == 0:
            log(f"step {step} loss {loss.item():.4f}")
        if (step >= args.eval_start and step % args.eval_every == 0) or step == args.steps:
            chosen, stop = _select(modules, ema, select, step, history, chosen, args, log)
            if stop:
                break
        if save is not None and step % args.checkpoint_every == 0:
            save({"step": step, "modules": {n: m.state_dict() for n, m in modules.items()},
                  "optimizer": opt.state_dict(), "ema": ema, "history": history, "chosen": chosen,
                  "rng": rng.bit_generator.state, "generator": gen.get_state(), "torch_rng": torch.get_rng_state()})
    log(f"keeping the EMA weights of step {chosen['step']} (smoothed selection strict {chosen['strict']:.3f})")
    for name, m in modules.items():
        m.load_state_dict(chosen["state"][name])
        m.eval()
    return chosen, history


def run_record(output: str, chosen: dict, history: list[dict], vae_accuracy: float, train_seconds: float,
               sizes: dict[str, int]) -> dict:
    """The report's account of the run: the selected step and the selection history, the VAE's reconstruction
    accuracy, the training time, the bytes of the weights saved in `output` (its ``*.safetensors``, the resumable
    state excepted) and the parameters per component."""
    weights = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(output) for f in fs
                  if f.endswith(".safetensors") and f != "resume.safetensors")
    return {"selected_step": chosen["step"], "selection_history": history, "vae_reconstruction_strict": vae_accuracy,
            "train_seconds": round(train_seconds, 1), "weights_bytes": weights, "parameters": sizes}


def write_report(output: str, report: dict, resume_path: str, log) -> None:
    """Writes ``metrics.json`` and removes the resumable state: the run is complete."""
    with open(os.path.join(output, "metrics.json"), "w") as f:
        json.dump(report, f, indent=2)
    if os.path.isfile(resume_path):
        os.remove(resume_path)
    log(f"saved to {output} ({report['weights_bytes'] / 1e6:.2f} MB of weights)")
