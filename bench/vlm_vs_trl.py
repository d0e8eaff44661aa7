"""Side-by-side with TRL's `GRPOTrainer`, in one run: VLM GRPO on the shipped tiny Qwen2-VL (`mmgrpo:vlm_shapes`).

Both trainers get the same model (full fine-tuning, float32, vision tower trained), the same `vlm_shapes` counting
questions (the same items, one 56 x 56 image each), the same number of prompts per step and group size `G`, the same
completion length (`max_new_tokens` / `max_completion_length`), temperature 1, the same reward (our `accuracy`,
numeric, read from ``<answer>``), GRPO's loss (group mean/std advantages, token ratio clipped at 0.2, per-sequence
token mean, no KL), learning rate and one optimizer update per step (one minibatch of all completions). Measured:

  * seconds per step: the median of the intervals between consecutive step ends, after `--warmup` step(s);
  * peak memory: the peak RSS (``getrusage(RUSAGE_SELF).ru_maxrss``) of a fresh subprocess per measurement, and how
    much of it came after the trainer was built (peak minus the RSS just before the first step);
  * the ratios mmgrpo / TRL; and step time against G in {2, 4, 8, 16} (`--group-sizes`).

Every measurement runs in its own subprocess (one framework, one G). TRL is not a dependency of mmgrpo: install it
for the benchmark only (the extra ``bench``), without touching the pinned stack:

    pip install --no-deps trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 pandas==3.1.1 \\
        pyarrow==26.0.1 xxhash==4.1.0
    HF_HUB_OFFLINE=1 python bench/vlm_vs_trl.py --output outputs/bench_vlm_vs_trl [--steps 4] [--prompts 16]

Writes ``<output>/results.json``, ``<output>/table.md`` and ``<output>/step_time_vs_g.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRL_VERSION = "1.16.0"
INSTALL = ("pip install --no-deps trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 pandas==3.1.1 "
           "pyarrow==26.0.1 xxhash==4.1.0")


def rss_mib() -> float:
    """The current resident set size of this process, MiB (Linux ``/proc``; 0 elsewhere)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def peak_rss_mib() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 1024 if sys.platform != "darwin" else peak / 2**20  # KiB on Linux, bytes on macOS


def step_stats(ends: list[float], start: float, warmup: int) -> dict:
    """Per-step seconds from the step end times (``start`` = when the first step began)."""
    times = [b - a for a, b in zip([start, *ends[:-1]], ends)]
    measured = times[warmup:]
    return {"step_s": statistics.median(measured), "step_times_s": [round(t, 4) for t in times],
            "warmup_steps": warmup}


# ------------------------------------------------------------------------------------------------------- workers
def items(args) -> list[dict]:
    """The training questions both trainers see: the `vlm_shapes` counting items mmgrpo's data plugin yields."""
    from mmgrpo.data.vlm_shapes import VLMShapes, VLMShapesConfig

    return VLMShapes(VLMShapesConfig(tasks=["count"], n_train=args.n_train, n_eval=1)).train_items()


def run_mmgrpo(args) -> dict:
    import torch

    from mmgrpo.config import load
    from mmgrpo.trainer import Trainer

    n = args.prompts * args.group_size
    with tempfile.TemporaryDirectory() as tmp:
        config = load(args.config, [
            f"output_dir={tmp}", f"pipeline.pretrained={args.model}", f"pipeline.max_new_tokens={args.max_new_tokens}",
            "reward={name: accuracy, mode: numeric}", f"data.n_train={args.n_train}", "data.n_eval=1",
            f"train.prompts_per_step={args.prompts}", f"train.group_size={args.group_size}",
            f"train.minibatch_size={n}", "train.updates_per_step=1", f"train.learning_rate={args.learning_rate}",
            f"train.max_steps={args.warmup + args.steps}", "train.max_seconds=0", "eval.every=0", "checkpoint.every=0",
        ])
        trainer = Trainer(config)
        before = rss_mib()
        ends, rewards = [], []
        start = time.perf_counter()
        for _ in range(args.warmup + args.steps):
            trainer.step += 1
            rewards.append(trainer.timed_train_step()["reward/mean"])
            ends.append(time.perf_counter())
    # an all-zero-advantage batch skips the update (TRL still runs forward and backward): counted, to read the times
    return {**step_stats(ends, start, args.warmup), "rss_before_steps_mib": before, "reward_mean": rewards,
            "skipped_updates": trainer.skipped_updates, "threads": torch.get_num_threads()}


def run_trl(args) -> dict:
    import torch
    import transformers
    from datasets import Dataset
    from transformers import AutoProcessor, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from mmgrpo.hub import resolve_pretrained
    from mmgrpo.rewards.accuracy import AccuracyReward

    from mmgrpo.pipelines.qwen_vl import MODEL_CLASSES

    path = resolve_pretrained(args.model)
    model_cls = getattr(transformers, MODEL_CLASSES[transformers.AutoConfig.from_pretrained(path).model_type])
    model = model_cls.from_pretrained(path, dtype=torch.float32)  # full fine-tuning in float32, as mmgrpo's config
    processor = AutoProcessor.from_pretrained(path)
    rows = items(args)
    dataset = Dataset.from_list([
        {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": it["prompt"]}]}],
         "image": it["images"][0], "answer": it["metadata"]["answer"]}
        for it in rows
    ])
    accuracy = AccuracyReward(AccuracyReward.Config(mode="numeric"))

    def accuracy_reward(completions, answer, **kwargs):
        """Our `accuracy` reward (numeric, from the last <answer> block), one float per completion."""
        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        return [accuracy.score_one(t, a, {"answer_type": "numeric"})["score"] for t, a in zip(texts, answer)]

    n = args.prompts * args.group_size

    class StepClock(TrainerCallback):
        def __init__(self):
            self.ends, self.rewards, self.start = [], [], None

        def on_train_begin(self, *a, **k):
            self.start = time.perf_counter()
            self.before = rss_mib()

        def on_step_end(self, *a, **k):
            self.ends.append(time.perf_counter())

    clock = StepClock()
    with tempfile.TemporaryDirectory() as tmp:
        config = GRPOConfig(
            output_dir=tmp, num_generations=args.group_size, max_completion_length=args.max_new_tokens,
            per_device_train_batch_size=n, gradient_accumulation_steps=1, num_iterations=1,
            max_steps=args.warmup + args.steps, learning_rate=args.learning_rate, lr_scheduler_type="constant",
            temperature=1.0, top_p=1.0, top_k=0, beta=0.0, epsilon=0.2, loss_type="grpo", scale_rewards="group",
            use_cpu=True, use_vllm=False, bf16=False, fp16=False, gradient_checkpointing=False, report_to=[],
            logging_steps=1, save_strategy="no", disable_tqdm=True, seed=0, dataloader_num_workers=0,
        )
        trainer = GRPOTrainer(model=model, reward_funcs=[accuracy_reward], args=config, train_dataset=dataset,
                              processing_class=processor, callbacks=[clock])
        trainer.train()
        rewards = [r["reward"] for r in trainer.state.log_history if "reward" in r]
    return {**step_stats(clock.ends, clock.start, args.warmup), "rss_before_steps_mib": clock.before,
            "reward_mean": rewards, "threads": torch.get_num_threads(), "trl_version": __import__("trl").__version__}


def worker(args) -> None:
    """One measurement: prints one JSON line (the result, or the error)."""
    try:
        result = (run_trl if args.worker == "trl" else run_mmgrpo)(args)
    except Exception as error:  # reported in the table: e.g. TRL failing on this model
        import traceback

        traceback.print_exc()
        result = {"error": f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:500]}
    result["peak_rss_mib"] = peak_rss_mib()
    print("RESULT " + json.dumps(result), flush=True)


# ---------------------------------------------------------------------------------------------------- the driver
def measure(args, framework: str, group_size: int) -> dict:
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", framework, "--group-size", str(group_size)]
    for key in ("model", "config", "prompts", "max_new_tokens", "steps", "warmup", "learning_rate", "n_train"):
        command += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    started = time.perf_counter()
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        result = {"error": f"exit {proc.returncode}: " + (proc.stderr.strip().splitlines() or ["no output"])[-1][:500]}
    else:
        result = json.loads(lines[-1][len("RESULT "):])
    if "error" in result:
        print(proc.stderr[-3000:], file=sys.stderr)
    result["wall_s"] = round(time.perf_counter() - started, 1)
    print(f"{framework:>6} G={group_size:<3} " + (f"{result['step_s']:.3f} s/step, peak RSS {result['peak_rss_mib']:.0f} MiB"
                                                   if "step_s" in result else result["error"]), flush=True)
    return result


def ratio(a: dict, b: dict, key: str) -> float | None:
    return round(a[key] / b[key], 3) if key in a and key in b and b[key] else None


def write_outputs(args, results: dict, out: Path) -> None:
    import torch

    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for g in args.group_sizes:
        ours, trl = results["mmgrpo"].get(str(g), {}), results["trl"].get(str(g), {})
        for r in (ours, trl):
            if "peak_rss_mib" in r and "rss_before_steps_mib" in r:
                r["train_increment_mib"] = r["peak_rss_mib"] - r["rss_before_steps_mib"]
        rows.append({"G": g, "mmgrpo": ours, "trl": trl, "speedup": ratio(trl, ours, "step_s"),
                     "time_ratio": ratio(ours, trl, "step_s"), "peak_rss_ratio": ratio(ours, trl, "peak_rss_mib"),
                     "increment_ratio": ratio(ours, trl, "train_increment_mib")})
    summary = {"settings": {k: getattr(args, k) for k in ("model", "config", "prompts", "max_new_tokens", "steps",
                                                           "warmup", "learning_rate", "group_sizes", "main_g")},
               "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(), "rows": rows}
    (out / "results.json").write_text(json.dumps(summary, indent=2), encoding="utf-8")

    def cell(r, key, fmt):
        return fmt.format(r[key]) if key in r else "error"

    lines = [f"Tiny Qwen2-VL `{args.model}`, {args.prompts} prompts x G completions per step, {args.max_new_tokens} "
             f"completion tokens, full fine-tuning, one optimizer update per step; median of {args.steps} steps after "
             f"{args.warmup} warm-up; {torch.get_num_threads()} torch threads, CPU. Peak RSS: fresh process per "
             "measurement (\"after build\": peak minus the RSS just before the first step).", "",
             "| G | mmgrpo s/step | TRL s/step | time ratio mmgrpo / TRL | speed-up TRL / mmgrpo | mmgrpo peak RSS MiB | TRL peak RSS MiB "
             "| peak ratio | mmgrpo after build MiB | TRL after build MiB | after-build ratio |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        o, t = row["mmgrpo"], row["trl"]
        mark = "**" if row["G"] == args.main_g else ""
        lines.append(
            f"| {mark}{row['G']}{mark} | {cell(o, 'step_s', '{:.3f}')} | {cell(t, 'step_s', '{:.3f}')} | "
            f"{row['time_ratio'] if row['time_ratio'] is not None else '-'} | "
            f"{str(row['speedup']) + 'x' if row['speedup'] is not None else '-'} | {cell(o, 'peak_rss_mib', '{:.0f}')} | "
            f"{cell(t, 'peak_rss_mib', '{:.0f}')} | {row['peak_rss_ratio'] if row['peak_rss_ratio'] is not None else '-'} | "
            f"{cell(o, 'train_increment_mib', '{:.0f}')} | {cell(t, 'train_increment_mib', '{:.0f}')} | "
            f"{row['increment_ratio'] if row['increment_ratio'] is not None else '-'} |")
    errors = [(fw, row["G"], row[fw]["error"]) for row in rows for fw in ("mmgrpo", "trl") if "error" in row[fw]]
    if errors:
        lines += ["", "Errors:"] + [f"- {fw} G={g}: `{e}`" for fw, g, e in errors]
    (out / "table.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for fw, label in (("mmgrpo", "mmgrpo (prefix-shared)"), ("trl", f"TRL {TRL_VERSION} GRPOTrainer")):
        points = [(row["G"], row[fw]["step_s"]) for row in rows if "step_s" in row[fw]]
        if points:
            ax.plot(*zip(*points), marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(args.group_sizes, [str(g) for g in args.group_sizes])
    ax.set_xlabel(f"group size G ({args.prompts} prompts per step)")
    ax.set_ylabel("seconds per step (median)")
    ax.set_title("VLM GRPO step time, tiny Qwen2-VL, CPU")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "step_time_vs_g.png", dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=Path("outputs/bench_vlm_vs_trl"))
    parser.add_argument("--model", default="mmgrpo:vlm_shapes")
    parser.add_argument("--config", default="configs/tiny/vlm_count.yaml")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step (the same for every G)")
    parser.add_argument("--max-new-tokens", type=int, default=20)
    parser.add_argument("--steps", type=int, default=4, help="measured steps, after the warm-up")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--learning-rate", type=float, default=2e-4)
    parser.add_argument("--group-sizes", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--main-g", type=int, default=8, help="the G of the headline comparison (the config's)")
    parser.add_argument("--frameworks", nargs="+", default=["mmgrpo", "trl"], choices=["mmgrpo", "trl"])
    parser.add_argument("--timeout", type=float, default=600, help="seconds allowed per measurement")
    parser.add_argument("--worker", choices=["mmgrpo", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--group-size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--n-train", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.n_train is None:
        args.n_train = args.prompts * (args.warmup + args.steps)  # every step sees new questions, in both trainers
    if args.worker:
        return worker(args)

    import importlib.metadata

    if "trl" in args.frameworks:
        try:
            version = importlib.metadata.version("trl")
        except importlib.metadata.PackageNotFoundError:
            sys.exit(f"bench/vlm_vs_trl.py needs TRL {TRL_VERSION}, which is not installed (it is not a dependency of "
                     f"mmgrpo). Install it for the benchmark only:\n    {INSTALL}\nor run with --frameworks mmgrpo.")
        if version != TRL_VERSION:
            print(f"warning: TRL {version} is installed; this benchmark was written for {TRL_VERSION}.", file=sys.stderr)
    results = {"mmgrpo": {}, "trl": {}}
    for g in args.group_sizes:
        for fw in args.frameworks:
            results[fw][str(g)] = measure(args, fw, g)
    write_outputs(args, results, args.output)


if __name__ == "__main__":
    main()
