"""One Flow-GRPO step on an SD3.5-Medium-sized transformer (random weights) on a GPU: time and peak memory of LoRA
and full fine-tuning, with and without gradient checkpointing.

The transformer has SD3.5 Medium's configuration (MMDiT-X: 24 blocks of 24 heads x 64, dual attention in the first
13, RMS q/k norm, 16 latent channels, 2.5B parameters) and random weights; the text encoders and the VAE are the
tests' tiny ones (CLIP embeddings zero-padded to the transformer's 4096-wide context, as diffusers does without T5,
and a tiny 8x VAE), so what is measured is the transformer's training step. The pipeline is built in memory and
handed to `SD3Policy` in place of a folder; everything else is mmgrpo's own code: the trainer's update
(`Trainer._update`: replay of the trained steps, Flow-GRPO loss with its KL to the reference, backward, clipping,
AdamW step), LoRA through peft, the frozen reference copy of full fine-tuning, ``train.mixed_precision``.

Per case (``lora`` / ``full`` x checkpointing off / on) it samples one batch of rollouts (SDE steps, no gradients)
and runs one untimed and ``--steps`` timed updates on it with fixed advantages; it reports the median update time,
the sampling time and ``torch.cuda.max_memory_allocated`` over the updates (weights, gradients, optimizer state,
activations). A case that runs out of memory is reported as such and the others still run.

On a GPU machine, from the repository root (about 5 minutes on one H100 / H200):

    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 .venv/bin/python bench/gpu_flow_grpo_sd35.py --output outputs/gpu_sd35

``--tiny`` runs the same code on a 2-block transformer on the CPU in a few seconds (the test checks it does not
crash); ``--cases lora:0 full:1`` picks cases (``mode:checkpointing``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
SD35_MEDIUM = dict(  # stabilityai/stable-diffusion-3.5-medium transformer/config.json
    patch_size=2, in_channels=16, out_channels=16, num_layers=24, attention_head_dim=64, num_attention_heads=24,
    joint_attention_dim=4096, caption_projection_dim=1536, pooled_projection_dim=2048, pos_embed_max_size=384,
    dual_attention_layers=tuple(range(13)), qk_norm="rms_norm",
)
TINY = dict(SD35_MEDIUM, num_layers=2, attention_head_dim=8, num_attention_heads=4, joint_attention_dim=64,
            caption_projection_dim=32, pooled_projection_dim=64, pos_embed_max_size=16, dual_attention_layers=(0,))
CASES = ("lora:0", "lora:1", "full:0", "full:1")


def build_pipeline(transformer_config: dict, resolution: int, device: str):
    """A `StableDiffusion3Pipeline` with a random transformer of `transformer_config` (built on `device`) and the
    tests' tiny text encoders and 8x VAE."""
    import torch
    from diffusers import SD3Transformer2DModel

    sys.path.insert(0, str(ROOT / "tests"))
    from builders.sd3 import tiny_sd3_pipeline

    pooled = transformer_config["pooled_projection_dim"]
    pipe = tiny_sd3_pipeline(sample_size=resolution, vae_downsample=8, vae_channels=(8,),
                             latent_channels=transformer_config["in_channels"], text_projection_dim=pooled // 2)
    torch.manual_seed(0)
    with torch.device(device):
        pipe.transformer = SD3Transformer2DModel(sample_size=resolution // 8, **transformer_config).eval()
    return pipe


def experiment(root: Path, args, lora: bool, checkpointing: bool) -> dict:
    prompts = root / "prompts.txt"
    prompts.write_text("a red circle\na blue square\na green triangle\ntwo red squares\n")
    return {
        "output_dir": str(root / "run"), "seed": 0,
        "pipeline": {"name": "sd3", "pretrained": str(root / "placeholder"), "resolution": args.resolution,
                     "num_steps": args.num_steps, "guidance_scale": 1.0, "lora_rank": 32 if lora else 0,
                     "lora_alpha": 64, "max_sequence_length": args.text_tokens,
                     "weights_dtype": "bfloat16" if lora and args.bf16 else "float32",
                     "gradient_checkpointing": checkpointing},
        "algorithm": {"name": "flow_grpo", "kl_beta": 0.04, "clip_low": 1e-4, "noise_level": 0.7},
        "reward": {"name": "jpeg"},
        "data": {"name": "prompt_file", "train_file": str(prompts), "eval_file": str(prompts)},
        "train": {"max_steps": 10, "prompts_per_step": args.batch // 4, "group_size": 4,
                  "minibatch_size": args.minibatch, "learning_rate": 1e-5,
                  "mixed_precision": "bf16" if args.bf16 else "no"},
        "eval": {"every": 0, "num_prompts": 2, "metric": "jpeg_kb"},
        "checkpoint": {"every": 0},
    }


def run_case(root: Path, args, pipe_factory, lora: bool, checkpointing: bool) -> dict:
    import torch

    from mmgrpo import config as config_mod
    from mmgrpo.pipelines import _flow_policy
    from mmgrpo.prompt_stream import items_to_batch
    from mmgrpo.trainer import Trainer

    cuda = torch.cuda.is_available()
    case_root = root / f"{'lora' if lora else 'full'}_{int(checkpointing)}"
    (case_root / "placeholder").mkdir(parents=True, exist_ok=True)  # pretrained must name a folder
    raw = experiment(case_root, args, lora, checkpointing)

    def loader(cls, location, dtype=None, **kwargs):  # the in-memory pipeline instead of a folder
        pipe = pipe_factory()
        return pipe if dtype in (None, torch.float32) else pipe.to(dtype=dtype)

    with mock.patch.object(_flow_policy, "load_diffusers_pipeline", loader):  # where the flow adapters load
        trainer = Trainer(config_mod.from_dict(raw))
    params = trainer.policy.trainable_parameters()
    total = sum(p.numel() for p in trainer.policy.transformer.parameters())
    items = trainer.data.train_items()[: trainer.config.train.prompts_per_step]
    batch = items_to_batch(items).repeat(trainer.config.train.group_size)
    plan = trainer.algorithm.schedule(trainer.policy.num_steps, torch.Generator().manual_seed(0))
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    rollout = trainer.policy.sample(batch, plan, generator=torch.Generator().manual_seed(1))
    sync()
    sample_s = time.perf_counter() - start
    advantages = torch.randn(len(batch), generator=torch.Generator().manual_seed(2))  # [N]
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for step in range(args.steps + 1):
        sync()
        start = time.perf_counter()
        trainer.update(rollout, plan, advantages, torch.ones(len(batch), dtype=torch.bool),
                        torch.Generator().manual_seed(3 + step))
        sync()
        if step:
            times.append(time.perf_counter() - start)
    return {"transformer_parameters": total, "trained_parameters": sum(p.numel() for p in params),
            "samples": len(batch), "minibatch": args.minibatch, "trained_steps": len(plan.train_units),
            "sample_s": sample_s, "update_s": statistics.median(times),
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}


def table(results: dict) -> str:
    rows = ["| case | trained of all transformer parameters | update time | sampling time | peak GPU memory |",
            "|---|---:|---:|---:|---:|"]
    for name, r in results.items():
        if "error" in r:
            rows.append(f"| {name} | | {r['error']} | | |")
            continue
        peak = f"{r['peak_gib']:.1f} GiB" if r["peak_gib"] is not None else "n/a (CPU)"
        rows.append(f"| {name} | {r['trained_parameters'] / 1e6:.4g}M of {r['transformer_parameters'] / 1e6:.4g}M"
                    f" | {r['update_s']:.2f} s | {r['sample_s']:.2f} s | {peak} |")
    return "\n".join(rows)


def main(argv=None) -> dict:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default="outputs/gpu_sd35")
    parser.add_argument("--tiny", action="store_true", help="a 2-block transformer on the CPU (a smoke test)")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    parser.add_argument("--resolution", type=int, default=512)
    parser.add_argument("--num-steps", type=int, default=10, help="sampling steps (Flow-GRPO trains on each)")
    parser.add_argument("--text-tokens", type=int, default=256, help="zero T5 tokens after the 16 CLIP tokens")
    parser.add_argument("--batch", type=int, default=8, help="samples per step (groups of 4)")
    parser.add_argument("--minibatch", type=int, default=4, help="samples per backward pass")
    parser.add_argument("--steps", type=int, default=2, help="timed updates per case")
    args = parser.parse_args(argv)
    if args.tiny:
        args.resolution, args.num_steps, args.text_tokens, args.batch, args.minibatch, args.steps = 64, 2, 8, 4, 2, 1
    if not args.tiny and not torch.cuda.is_available():
        parser.error("no GPU here: run with --tiny to check the script on the CPU")
    args.bf16 = not args.tiny
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    config = TINY if args.tiny else SD35_MEDIUM
    out = Path(args.output).resolve()
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for case in args.cases:
        mode, checkpointing = case.split(":")
        name = f"{'LoRA r32' if mode == 'lora' else 'full'}, checkpointing {'on' if checkpointing == '1' else 'off'}"
        try:
            results[name] = run_case(out, args, lambda: build_pipeline(config, args.resolution, device),
                                     mode == "lora", checkpointing == "1")
        except torch.OutOfMemoryError as err:
            results[name] = {"error": f"out of memory ({str(err).splitlines()[0][:80]})"}
        with contextlib.suppress(Exception):
            torch.cuda.empty_cache()
        print(name, json.dumps(results[name]), flush=True)
    (out / "results.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    print(table(results))
    return results


if __name__ == "__main__":
    main()
