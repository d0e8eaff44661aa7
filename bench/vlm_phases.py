"""Where mmgrpo's VLM training step spends its time: wall-clock phases of `bench/vlm_vs_trl.py`'s mmgrpo side.

One process, one trainer per G (the benchmark's settings: `--prompts` x G completions of up to `--max-new-tokens`
tokens, full fine-tuning, one update per step, fused AdamW; `--mmgrpo-override` as there). After `--warmup` steps,
`--steps` steps are timed with wall-clock wrappers around the functions of each phase, in ms per step:

  * processor: `PromptEncoder.encode_many` (chat template, tokenizer, image processor);
  * prompt forward: `GroupForward.prompt_states` called by sampling (the prompt and images forwarded once per group);
  * decode loop: the loop of `_qwen_vl_decode.decode`, and within it the decode steps (`LeanStep` / `ModelStep`
    calls, with their number per step), the loop's set-up (`LeanStep.__init__`: static cache, masks, rotary tables)
    and the token choice (`TokenSampler`);
  * training forward: `QwenVLPolicy.log_prob` (with the prompt forward unless sampling's is shared);
  * backward, gradient clip (`mmgrpo.sharding.clip`), optimizer step;
  * other: the rest of the step (rewards, advantages, the decode of token ids to text, bookkeeping).

A phase called inside another timed phase counts toward the outer one only (the prompt forward of the training
forward is training forward), so the phases and "other" add up to the step. The wrappers cost about a microsecond
per call. A step whose groups all have equal rewards takes no update (no training forward, backward or optimizer
step): "updates per step" says how many were taken. The benchmark's model and questions come from `bench/vlm_vs_trl.py`.

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 python bench/vlm_phases.py --prompts 4 --max-new-tokens 32 --group-sizes 2 4 \\
        --mmgrpo-override pipeline.compile_decode=true --output outputs/bench_vlm_phases

Writes ``<output>/results.json`` and ``<output>/table.md``.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is not a package: the benchmark beside it
from vlm_vs_trl import check_workload, mmgrpo_trainer, workload_arguments  # noqa: E402

PHASES = ("processor", "prompt forward", "decode loop", "training forward", "backward", "gradient clip",
          "optimizer step")  # exclusive; "other" is the rest of the step
DECODE_PARTS = ("decode steps", "decode set-up", "token choice")  # inside the decode loop


class PhaseClock:
    """Wall-clock totals of wrapped functions while ``on``; a top-level phase entered inside another counts for the
    outer one only. [`restore`] puts the original functions back."""

    def __init__(self):
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.calls: collections.Counter = collections.Counter()
        self.depth, self.on = 0, False
        self.wrapped: list[tuple] = []  # (owner, name, original), in wrapping order

    def wrap(self, owner, name: str, phase: str, top: bool = True) -> None:
        """Replaces `owner.name` by a timed call of itself, counted under `phase`."""
        original = getattr(owner, name)
        self.wrapped.append((owner, name, original))

        def timed(*args, **kwargs):
            if not self.on or (top and self.depth):
                return original(*args, **kwargs)
            self.depth += top
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[phase] += time.perf_counter() - start
                self.calls[phase] += 1
                self.depth -= top

        setattr(owner, name, timed)

    def restore(self) -> None:
        """Puts back every wrapped function (the last wrapped first)."""
        while self.wrapped:
            owner, name, original = self.wrapped.pop()
            setattr(owner, name, original)


def instrument(clock: PhaseClock) -> None:
    """Wraps the functions of every phase but the optimizer step (classes and modules the trainer calls through; each
    trainer's optimizer is wrapped in [`measure`])."""
    import torch

    import mmgrpo.pipelines._qwen_vl_decode as decoding
    import mmgrpo.pipelines.qwen_vl as qwen_vl
    from mmgrpo import sharding
    from mmgrpo.pipelines._qwen_vl_forward import GroupForward
    from mmgrpo.pipelines._qwen_vl_inputs import PromptEncoder

    clock.wrap(PromptEncoder, "encode_many", "processor")
    clock.wrap(GroupForward, "prompt_states", "prompt forward")
    clock.wrap(qwen_vl, "decode", "decode loop")
    clock.wrap(decoding.LeanStep, "__call__", "decode steps", top=False)
    clock.wrap(decoding.ModelStep, "__call__", "decode steps", top=False)
    clock.wrap(decoding.LeanStep, "__init__", "decode set-up", top=False)
    clock.wrap(decoding.TokenSampler, "__call__", "token choice", top=False)
    clock.wrap(qwen_vl.QwenVLPolicy, "log_prob", "training forward")
    clock.wrap(torch.Tensor, "backward", "backward")
    clock.wrap(sharding, "clip", "gradient clip")


def measure(args, clock: PhaseClock) -> dict:
    """The phases of one G: ms per step over the timed steps, decode steps per training step, the step itself. Compiled
    graphs of an earlier G are dropped first, so a compiled decode step has static shapes, as in a fresh process."""
    import torch

    torch._dynamo.reset()
    clock.seconds.clear()
    clock.calls.clear()
    with tempfile.TemporaryDirectory() as tmp:
        trainer = mmgrpo_trainer(args, tmp)
        clock.wrap(trainer.optimizer, "step", "optimizer step")
        step_seconds = 0.0
        for index in range(args.warmup + args.steps):
            clock.on = index >= args.warmup
            start = time.perf_counter()
            trainer.step += 1
            trainer.timed_train_step()
            step_seconds += (time.perf_counter() - start) if clock.on else 0.0
        clock.on = False
    per_step = {phase: 1000 * clock.seconds[phase] / args.steps for phase in (*PHASES, *DECODE_PARTS)}
    per_step["other"] = 1000 * step_seconds / args.steps - sum(per_step[p] for p in PHASES)
    return {"ms_per_step": per_step, "step_ms": 1000 * step_seconds / args.steps,
            "decode_steps_per_step": clock.calls["decode steps"] / args.steps,
            "updates_per_step": clock.calls["optimizer step"] / args.steps}


def write_outputs(args, rows: dict[int, dict], output: Path) -> str:
    """results.json and table.md (a column per G)."""
    output.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k != "output"}
    (output / "results.json").write_text(json.dumps({"settings": settings, "rows": rows}, indent=2), encoding="utf-8")
    sizes = list(rows)
    lines = [f"mmgrpo's VLM step by phase (ms per step; {args.prompts} prompts x G, {args.max_new_tokens} completion "
             f"tokens, {args.steps} steps after {args.warmup}; overrides: "
             f"{' '.join(args.mmgrpo_override) or 'none'})", "",
             "| phase | " + " | ".join(f"G={g}" for g in sizes) + " |", "|---|" + "---|" * len(sizes)]
    for phase in (*PHASES, "other"):
        lines.append(f"| {phase} | " + " | ".join(f"{rows[g]['ms_per_step'][phase]:.1f}" for g in sizes) + " |")
        if phase == "decode loop":
            lines += [f"| - of which {part} | " + " | ".join(f"{rows[g]['ms_per_step'][part]:.1f}" for g in sizes)
                      + " |" for part in DECODE_PARTS]
    lines.append("| **step** | " + " | ".join(f"**{rows[g]['step_ms']:.1f}**" for g in sizes) + " |")
    for key, label in (("decode_steps_per_step", "decode steps per step"), ("updates_per_step", "updates per step")):
        lines.append(f"| {label} | " + " | ".join(f"{rows[g][key]:.2f}" for g in sizes) + " |")
    table = "\n".join(lines) + "\n"
    (output / "table.md").write_text(table, encoding="utf-8")
    return table


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    workload_arguments(parser, output="outputs/bench_vlm_phases", prompts=4, max_new_tokens=32, steps=30, warmup=4,
                       group_sizes=[2, 4])
    args = parser.parse_args(argv)
    args.n_train = None  # new questions every step, as in the benchmark
    check_workload(parser, args)
    clock = PhaseClock()
    instrument(clock)
    rows = {}
    try:
        for g in args.group_sizes:
            args.group_size = g
            rows[g] = measure(args, clock)
            print(f"G={g}: {rows[g]['step_ms']:.1f} ms per step", flush=True)
    finally:
        clock.restore()
    print(write_outputs(args, rows, args.output))


if __name__ == "__main__":
    main()
