"""Side-by-side with TRL's `GRPOTrainer`, in one run: VLM GRPO on the shipped tiny Qwen2-VL (`mmgrpo:vlm_shapes`).

Both trainers get the same model (full fine-tuning, float32, vision tower trained), the same `vlm_shapes` counting
questions (the same items, one N x N image each, `--image-size`, 56 by default), the same number of prompts per step
and group size `G`, the same completion length (`max_new_tokens` / `max_completion_length`), temperature 1, the same
reward (our `accuracy`, numeric, read from ``<answer>``), GRPO's loss (group mean/std advantages, token ratio clipped
at 0.2, per-sequence token mean, no KL), learning rate, optimizer (torch's fused AdamW, transformers' default:
``train.optim: adamw_torch_fused`` on mmgrpo's side) and one optimizer update per step (one minibatch of all
completions). Measured:

  * seconds per step: the median of the intervals between consecutive step ends, after `--warmup` step(s);
  * peak memory: the peak RSS (``getrusage(RUSAGE_SELF).ru_maxrss``) of a fresh subprocess per measurement, and how
    much of it came after the trainer was built (peak minus the RSS just before the first step);
  * the ratios mmgrpo / TRL; and step time against G in {2, 4, 8, 16} (`--group-sizes`). With ``--rounds R`` every
    measurement is repeated R times in interleaved rounds (each round measures every G and both frameworks, their
    order alternating between rounds), so that a load on the machine hits both alike: the step time reported is the
    median over the rounds, the speed-up the median of the per-round ratios;
  * checks that both do the same work: vision tokens per image and prompt tokens (each framework's own encoding of the
    first question), mean completion length, mean reward, the share of groups whose rewards are all equal, the
    gradient norm and skipped updates; and images through the vision tower per step (with its forward seconds).

`--image-size N` (a multiple of 28) renders the `vlm_shapes` images at N x N for both (the same scenes and answers) and
sets the processor's pixel budget to N^2 for both (a copy of the model folder whose ``processor_config.json`` says
so; mmgrpo's ``pipeline.min_pixels`` / ``max_pixels`` = N^2 too), so each image gives (N / 28)^2 vision tokens after
the 2 x 2 merge of 14-pixel patches: 4 at 56, 64 at 224, 144 at 336. The shipped model was trained at 56 x 56:
larger images are out of its training distribution, which the reward and completion-length columns show.

Every measurement runs in its own subprocess (one framework, one G). TRL is not a dependency of mmgrpo: install it
for the benchmark only (the extra ``bench``), without touching the pinned stack:

    pip install --no-deps trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 pandas==3.1.1 \\
        pyarrow==26.0.1 xxhash==4.1.0
    HF_HUB_OFFLINE=1 python bench/vlm_vs_trl.py --output outputs/bench_vlm_vs_trl [--steps 4] [--prompts 16] \\
        [--image-size 224] [--mmgrpo-override pipeline.compile_decode=true] [--device cuda]

On a machine shared with other jobs, ``OMP_NUM_THREADS=1`` (one torch thread per measurement) keeps the times stable.

Writes ``<output>/results.json``, ``<output>/table.md`` and ``<output>/step_time_vs_g.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is not a package: its report module beside it
from _vlm_report import TRL_VERSION, median_round, write_outputs  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_IMAGE_SIZE = 56  # what the shipped vlm_shapes model was trained on (4 vision tokens per image)
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

    config = VLMShapesConfig(tasks=["count"], n_train=args.n_train, n_eval=1, size=args.image_size)
    return VLMShapes(config).train_items()


def model_dir(args, tmp: str) -> str:
    """The model folder both trainers load: the given one, or (when its processor's pixel budget is not
    ``image_size``^2) a copy of it whose image processor keeps ``image_size`` x ``image_size`` images (min = max
    pixels = ``image_size``^2). The weights are the same."""
    from mmgrpo.hub import resolve_pretrained

    path = Path(resolve_pretrained(args.model))
    pixels = args.image_size**2
    config = json.loads((path / "processor_config.json").read_text(encoding="utf-8"))
    budget = {"shortest_edge": pixels, "longest_edge": pixels}
    if config["image_processor"].get("size") == budget:
        return str(path)
    copy = Path(tmp) / "model"
    shutil.copytree(path, copy)
    config["image_processor"]["size"] = budget
    (copy / "processor_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return str(copy)


class VisionCounter:
    """Counts what goes through the Qwen2-VL vision tower (every instance: patched on the class), in both trainers:
    images (rows of ``grid_thw``) and forward seconds."""

    def __init__(self):
        from transformers.models.qwen2_vl import modeling_qwen2_vl

        self.images, self.seconds = 0, 0.0
        cls = modeling_qwen2_vl.Qwen2VisionTransformerPretrainedModel
        original, counter = cls.forward, self

        def forward(module, hidden_states, grid_thw, **kwargs):
            start = time.perf_counter()
            out = original(module, hidden_states, grid_thw, **kwargs)
            counter.seconds += time.perf_counter() - start
            counter.images += int(grid_thw.shape[0])
            return out

        cls.forward = forward

    def per_step(self, steps: int) -> dict:
        return {"vision_images_per_step": self.images / steps, "vision_forward_s_per_step": self.seconds / steps}


def encoded_sizes(input_ids, image_token_id: int) -> dict:
    """Prompt tokens and vision (image-pad) tokens of one encoded prompt."""
    ids = [int(i) for i in input_ids]
    return {"prompt_tokens": len(ids), "vision_tokens_per_image": ids.count(image_token_id)}


def mmgrpo_trainer(args, tmp: str):
    """mmgrpo's `Trainer` with the benchmark's settings (`args`: model, prompts, G, completion length, image size,
    learning rate, steps; ``mmgrpo_override`` last), its outputs and model copy in `tmp`."""
    from mmgrpo.config import load
    from mmgrpo.trainer import Trainer

    n = args.prompts * args.group_size
    pixels = args.image_size**2
    return Trainer(load(args.config, [
        f"output_dir={tmp}", f"pipeline.pretrained={model_dir(args, tmp)}",
        f"pipeline.max_new_tokens={args.max_new_tokens}", f"pipeline.min_pixels={pixels}",
        f"pipeline.max_pixels={pixels}", f"data.size={args.image_size}",
        "reward={name: accuracy, mode: numeric}", f"data.n_train={args.n_train}", "data.n_eval=1",
        f"train.prompts_per_step={args.prompts}", f"train.group_size={args.group_size}",
        f"train.minibatch_size={n}", "train.updates_per_step=1", f"train.learning_rate={args.learning_rate}",
        "train.optim=adamw_torch_fused",
        f"train.max_steps={args.warmup + args.steps}", "train.max_seconds=0", "eval.every=0", "checkpoint.every=0",
        *args.mmgrpo_override,
    ]))


def run_mmgrpo(args) -> dict:
    import torch

    vision = VisionCounter()
    with tempfile.TemporaryDirectory() as tmp:
        trainer = mmgrpo_trainer(args, tmp)
        policy = trainer.policy
        first = items(args)[0]
        sizes = encoded_sizes(policy.encode_prompt(first["prompt"], first["images"], [])["input_ids"],
                              policy.model.config.image_token_id)
        lengths = []
        sample = policy.sample

        def counted_sample(*a, **k):  # records the mean completion length (tokens up to and including the end)
            rollout = sample(*a, **k)
            lengths.append(rollout.outputs["num_tokens"].float().mean().item())
            return rollout

        policy.sample = counted_sample
        vision.images, vision.seconds = 0, 0.0  # only the steps count
        before = rss_mib()
        ends, logs = [], []
        start = time.perf_counter()
        for _ in range(args.warmup + args.steps):
            trainer.step += 1
            logs.append(trainer.timed_train_step())
            ends.append(time.perf_counter())
    # an all-zero-advantage batch skips the update (TRL still runs forward and backward): counted, to read the times
    return {**step_stats(ends, start, args.warmup), "rss_before_steps_mib": before,
            "reward_mean": [m["reward/mean"] for m in logs],
            "zero_std_groups": [m["reward/zero_std_groups"] for m in logs],
            "grad_norm": [m.get("train/grad_norm") for m in logs], "completion_length": lengths,
            "skipped_updates": trainer.skipped_updates, "threads": torch.get_num_threads(), **sizes,
            **vision.per_step(args.warmup + args.steps)}


def run_trl(args) -> dict:
    import torch
    import transformers
    from datasets import Dataset
    from transformers import AutoProcessor, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from mmgrpo.pipelines.qwen_vl import MODEL_CLASSES
    from mmgrpo.rewards.accuracy import AccuracyReward

    vision = VisionCounter()
    tmp_model = tempfile.TemporaryDirectory()
    path = model_dir(args, tmp_model.name)
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
    text = processor.apply_chat_template(dataset[0]["prompt"], tokenize=False, add_generation_prompt=True)
    sizes = encoded_sizes(processor(text=[text], images=[rows[0]["images"][0]], return_tensors="pt")["input_ids"][0],
                          model.config.image_token_id)

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
            vision.images, vision.seconds = 0, 0.0  # only the steps count

        def on_step_end(self, *a, **k):
            self.ends.append(time.perf_counter())

    clock = StepClock()
    with tempfile.TemporaryDirectory() as tmp:
        config = GRPOConfig(
            output_dir=tmp, num_generations=args.group_size, max_completion_length=args.max_new_tokens,
            per_device_train_batch_size=n, gradient_accumulation_steps=1, num_iterations=1,
            max_steps=args.warmup + args.steps, learning_rate=args.learning_rate, lr_scheduler_type="constant",
            optim="adamw_torch_fused",
            temperature=1.0, top_p=1.0, top_k=0, beta=0.0, epsilon=0.2, loss_type="grpo", scale_rewards="group",
            use_cpu=args.device == "cpu", use_vllm=False, bf16=False, fp16=False, gradient_checkpointing=False, report_to=[],
            logging_steps=1, save_strategy="no", disable_tqdm=True, seed=0, dataloader_num_workers=0,
        )
        trainer = GRPOTrainer(model=model, reward_funcs=[accuracy_reward], args=config, train_dataset=dataset,
                              processing_class=processor, callbacks=[clock])
        trainer.train()
        logs = [r for r in trainer.state.log_history if "reward" in r]
    tmp_model.cleanup()
    return {**step_stats(clock.ends, clock.start, args.warmup), "rss_before_steps_mib": clock.before,
            "reward_mean": [r["reward"] for r in logs],
            "zero_std_groups": [r.get("frac_reward_zero_std") for r in logs],
            "grad_norm": [r.get("grad_norm") for r in logs],
            "completion_length": [r.get("completions/mean_length") for r in logs],
            "threads": torch.get_num_threads(), "trl_version": __import__("trl").__version__, **sizes,
            **vision.per_step(args.warmup + args.steps)}


def worker(args) -> None:
    """One measurement: prints one JSON line (the result, or the error)."""
    try:
        result = (run_trl if args.worker == "trl" else run_mmgrpo)(args)
    except Exception as error:  # reported in the table: e.g. TRL failing on this model
        import traceback

        traceback.print_exc()
        result = {"error": f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:500]}
    result["peak_rss_mib"] = peak_rss_mib()
    if args.device == "cuda":
        import torch

        result["peak_gpu_mib"] = torch.cuda.max_memory_allocated() / 2**20  # weights, optimizer state, activations
    print("RESULT " + json.dumps(result), flush=True)


# ---------------------------------------------------------------------------------------------------- the driver
def measure(args, framework: str, group_size: int) -> dict:
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", framework, "--group-size", str(group_size)]
    for key in ("model", "config", "prompts", "max_new_tokens", "steps", "warmup", "learning_rate", "n_train",
                "image_size", "device"):
        command += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    for override in args.mmgrpo_override:
        command += ["--mmgrpo-override", override]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", **({"CUDA_VISIBLE_DEVICES": ""} if args.device == "cpu" else {}),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
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


def workload_arguments(parser: argparse.ArgumentParser, *, output: str, prompts: int, max_new_tokens: int, steps: int,
                       warmup: int, group_sizes: list[int]) -> None:
    """Adds the model, questions and step-shape options both VLM benchmarks take (this one and `vlm_phases.py`), with
    the given defaults."""
    parser.add_argument("--output", type=Path, default=Path(output))
    parser.add_argument("--model", default="mmgrpo:vlm_shapes")
    parser.add_argument("--config", default="configs/tiny/vlm_count.yaml")
    parser.add_argument("--prompts", type=int, default=prompts, help="prompts per step (the same for every G)")
    parser.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    parser.add_argument("--steps", type=int, default=steps, help="measured steps, after the warm-up")
    parser.add_argument("--warmup", type=int, default=warmup)
    parser.add_argument("--learning-rate", type=float, default=2e-4)
    parser.add_argument("--image-size", type=int, default=DEFAULT_IMAGE_SIZE,
                        help="image side in pixels (a multiple of 28), the same for both: (N / 28)^2 vision tokens")
    parser.add_argument("--group-sizes", type=int, nargs="+", default=group_sizes)
    parser.add_argument("--mmgrpo-override", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override of mmgrpo's side, after the benchmark's own (repeatable), e.g. "
                        "pipeline.compile_decode=true")


def check_workload(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuses out-of-range workload options (one line naming the fix) and sets `args.n_train` where it is `None`."""
    if args.image_size < 28 or args.image_size % 28:
        parser.error(f"--image-size must be a positive multiple of 28 (14-pixel patches, 2 x 2 merge), "
                     f"got {args.image_size}.")
    if args.steps < 1 or args.warmup < 0:
        parser.error(f"--steps must be at least 1 and --warmup at least 0, got {args.steps} and {args.warmup}.")
    if args.n_train is None:
        args.n_train = args.prompts * (args.warmup + args.steps)  # every step sees new questions, in both trainers


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    workload_arguments(parser, output="outputs/bench_vlm_vs_trl", prompts=16, max_new_tokens=20, steps=4, warmup=1,
                       group_sizes=[2, 4, 8, 16])
    parser.add_argument("--main-g", type=int, default=8, help="the G of the headline comparison (the config's)")
    parser.add_argument("--frameworks", nargs="+", default=["mmgrpo", "trl"], choices=["mmgrpo", "trl"])
    parser.add_argument("--timeout", type=float, default=600, help="seconds allowed per measurement")
    parser.add_argument("--rounds", type=int, default=1,
                        help="interleaved rounds of every measurement (median step times and per-round ratios)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="where both trainers run (cuda: the first GPU, float32 on both sides)")
    parser.add_argument("--worker", choices=["mmgrpo", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--group-size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--n-train", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    check_workload(parser, args)
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
    runs = {"mmgrpo": {}, "trl": {}}
    for r in range(args.rounds):  # interleaved: every G and framework per round, the framework order alternating
        for g in args.group_sizes:
            for fw in (args.frameworks if r % 2 == 0 else args.frameworks[::-1]):
                runs[fw].setdefault(str(g), []).append(measure(args, fw, g))
    results = {fw: {g: median_round(measured) for g, measured in by_g.items()} for fw, by_g in runs.items()}
    write_outputs(args, results, args.output)


if __name__ == "__main__":
    main()
