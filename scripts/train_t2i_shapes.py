"""Trains the embedded tiny text-to-image model (SD3 architecture) from scratch on the synthetic shapes task.

Steps: (1) a 2x-downsampling VAE is trained as an autoencoder on rendered images, and its `shift_factor` /
`scaling_factor` are set so latents have zero mean and unit std; (2) both CLIP text encoders and the SD3
transformer are trained jointly with the rectified-flow loss of SD3 (``x_s = (1 - s) x_0 + s noise``, target
``noise - x_0``, `s` logit-normal) on images rendered on the fly for the train prompts of `ShapesPrompts`, with
10% empty prompts (so classifier-free guidance is possible); (3) from `--eval-start` on, the held-out strict
accuracy of the EMA weights (MiniGenEval, sampling with the pipeline itself: 10 steps, no guidance) is measured
every `--eval-every` steps, and training stops once it reaches `--target` (RL needs an imperfect start). The
result is written with `save_pretrained`, with ``metrics.json`` (accuracies overall and per prompt kind, sampling
settings, history) and ``samples.png`` (held-out samples with their prompts) beside it.

The model has no T5: the pipeline appends `max_sequence_length` zero tokens to the 12 CLIP tokens, and this model
was trained with 4 (``--pad-length``), so sample it with ``max_sequence_length=4`` (``metrics.json["sampling"]``).

Run (deterministic from ``--seed``; about 15-20 minutes on one CPU core; a killed run continues from its last
checkpoint when started again with the same arguments)::

    HF_HUB_OFFLINE=1 python scripts/train_t2i_shapes.py --output data/weights/t2i_shapes
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tiny-model builders (tests/builders/)
sys.path.insert(0, str(Path(__file__).resolve().parent))  # _shapes_common, when imported from elsewhere

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw, ImageFont

from mmgrpo.data.shapes import KINDS, VOCABULARY, ShapesPrompts, prompt_from_metadata, render
from mmgrpo.rewards.mini_geneval import MiniGenEval
from mmgrpo.state_io import save_state
from mmgrpo.types import PromptBatch

import _shapes_common as common  # the scaffolding shared with train_t2v_shapes.py
from _shapes_common import learning_rate  # the warm-up + cosine schedule (a module name tests can replace)
from builders.sd3 import tiny_sd3_pipeline


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_run_arguments(parser)
    parser.add_argument("--device", default="cpu", help="torch device (results differ slightly from CPU)")
    # model
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--text-hidden", type=int, default=64)
    parser.add_argument("--vae-channels", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--vae-downsample", type=int, default=2)
    parser.add_argument("--latent-channels", type=int, default=4)
    parser.add_argument("--patch-size", type=int, default=4)
    parser.add_argument("--clip-length", type=int, default=12, help="CLIP token length (tokenizer.model_max_length)")
    parser.add_argument("--pad-length", type=int, default=4,
                        help="zero tokens the pipeline appends without T5: its `max_sequence_length`")
    parser.add_argument("--shift", type=float, default=1.0, help="`shift` of the saved sampling scheduler")
    # VAE stage
    parser.add_argument("--vae-steps", type=int, default=600)
    parser.add_argument("--vae-batch", type=int, default=32)
    parser.add_argument("--vae-lr", type=float, default=4e-3)
    parser.add_argument("--vae-kl", type=float, default=1e-6)
    # flow-matching stage
    common.add_flow_arguments(parser, steps=4800)
    parser.add_argument("--t-sampling", choices=["logit_normal", "uniform"], default="logit_normal",
                        help="distribution of the training noise level s")
    parser.add_argument("--kind-weights", type=float, nargs=4, default=[2.0, 2.0, 1.0, 1.0],
                        help=f"train sampling weights of the prompt kinds {KINDS}")
    # selection / evaluation
    common.add_selection_arguments(parser, eval_start=3000, n_select=300, n_eval=600, target=[0.36, 0.6],
                                   checkpoint_every=250)
    return parser.parse_args(argv)


def build_pipeline(args):
    return tiny_sd3_pipeline(
        num_layers=args.layers,
        attention_head_dim=args.head_dim,
        num_attention_heads=args.heads,
        sample_size=32,
        vae_downsample=args.vae_downsample,
        vae_channels=tuple(args.vae_channels),
        latent_channels=args.latent_channels,
        patch_size=args.patch_size,
        text_hidden_size=args.text_hidden,
        text_layers=2,
        text_projection_dim=args.text_hidden,
        text_max_length=args.clip_length,
        vocab_words=VOCABULARY,
        scheduler_shift=args.shift,
        seed=args.seed,
    )


def render_batch(metadata: list[dict], rng: np.random.Generator, device="cpu") -> torch.Tensor:
    """Renders correct images for `metadata`; returns `[B, 3, 32, 32]` in [-1, 1] (the VAE's range)."""
    arrays = np.stack([np.asarray(render(m, rng, 32)) for m in metadata])  # [B, 32, 32, 3] uint8
    return (torch.from_numpy(arrays).permute(0, 3, 1, 2).float() / 127.5 - 1.0).to(device)


def sample_metadata(pools: dict[str, list[dict]], weights: np.ndarray, n: int, rng: np.random.Generator) -> list:
    kinds = list(pools)
    picks = rng.choice(len(kinds), size=n, p=weights / weights.sum())
    return [pools[kinds[k]][rng.integers(len(pools[kinds[k]]))] for k in picks]


def train_vae(vae, pools, args, rng, log) -> None:
    """Trains `vae` as a (barely regularised) KL autoencoder on rendered images."""
    vae.train()
    opt = torch.optim.AdamW(vae.parameters(), lr=args.vae_lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(args.seed)
    weights = np.ones(len(pools))
    for step in range(args.vae_steps):
        x = render_batch(sample_metadata(pools, weights, args.vae_batch, rng), rng, vae.device)  # [B, 3, 32, 32]
        posterior = vae.encode(x).latent_dist
        recon = vae.decode(posterior.sample(gen)).sample  # [B, 3, 32, 32]
        loss = F.mse_loss(recon, x) + 0.5 * F.l1_loss(recon, x) + args.vae_kl * posterior.kl().mean()
        for group in opt.param_groups:
            group["lr"] = args.vae_lr * min(1.0, (step + 1) / 50) * (0.1 if step > 0.8 * args.vae_steps else 1.0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 100 == 0 or step == args.vae_steps - 1:
            log(f"vae step {step} loss {loss.item():.4f}")
    vae.eval()


@torch.no_grad()
def calibrate_latents(vae, pools, rng, n: int = 1024) -> tuple[float, float]:
    """Sets the VAE's `shift_factor`/`scaling_factor` to the mean and 1/std of the latents of `n` images."""
    weights = np.ones(len(pools))
    latents = torch.cat([
        vae.encode(render_batch(sample_metadata(pools, weights, 128, rng), rng, vae.device)).latent_dist.mean
        for _ in range(n // 128)
    ])  # [n, 4, 16, 16]
    shift, scale = latents.mean().item(), 1.0 / latents.std().item()
    vae.register_to_config(shift_factor=shift, scaling_factor=scale)
    return shift, scale


@torch.no_grad()
def reconstruction_accuracy(vae, items: list[dict], reward: MiniGenEval, seed: int) -> float:
    """Strict accuracy of VAE reconstructions of correct images (how much the VAE alone loses)."""
    rng = np.random.default_rng(seed)
    metadata = [it["metadata"] for it in items]
    x = render_batch(metadata, rng, vae.device)  # [B, 3, 32, 32]
    recon = vae.decode(vae.encode(x).latent_dist.mode()).sample  # [B, 3, 32, 32]
    images = (recon / 2 + 0.5).clamp(0, 1)
    result = reward({"images": images}, PromptBatch([it["prompt"] for it in items], metadata))
    return result.components["strict"].mean().item()


@torch.no_grad()
def evaluate(pipe, items: list[dict], reward: MiniGenEval, seed: int, steps: int, pad_length: int,
             batch_size: int = 100):
    """Samples one image per item with the pipeline (no guidance) and scores it.

    Returns:
        `tuple[dict, torch.Tensor]`: accuracies (``strict``, ``partial``, ``strict_<kind>``) and images `[N, 3, H, W]`.
    """
    generator = torch.Generator().manual_seed(seed)
    pipe.set_progress_bar_config(disable=True)
    images = torch.cat([
        pipe(
            prompt=[it["prompt"] for it in items[i : i + batch_size]],
            num_inference_steps=steps,
            guidance_scale=1.0,
            height=32,
            width=32,
            output_type="pt",
            generator=generator,
            max_sequence_length=pad_length,
        ).images
        for i in range(0, len(items), batch_size)
    ])  # [N, 3, 32, 32] in [0, 1]
    result = reward({"images": images}, PromptBatch([it["prompt"] for it in items], [it["metadata"] for it in items]))
    strict, partial = result.components["strict"], result.components["partial"]
    kinds = np.array([it["metadata"]["kind"] for it in items])
    metrics = {"strict": strict.mean().item(), "partial": partial.mean().item()}
    for kind in KINDS:
        if (kinds == kind).any():
            metrics[f"strict_{kind}"] = strict[torch.from_numpy(kinds == kind)].mean().item()
    return metrics, images


def train_flow(pipe, pools, select_items, reward, args, rng, log, checkpoint=None) -> tuple[dict, list[dict]]:
    """Trains both text encoders and the transformer with the rectified-flow loss on images rendered for the train
    prompts, `args.dropout` of them empty; the EMA weights are evaluated on `select_items` and training stops inside
    `args.target` (see [`_shapes_common.train_selected`], which also resumes from `checkpoint`).

    Returns:
        `tuple[dict, list[dict]]`: the chosen checkpoint ``{"step", "strict", "state"}`` (already loaded into the
        pipeline) and the evaluation history.
    """
    shift, scale = pipe.vae.config.shift_factor, pipe.vae.config.scaling_factor
    device = pipe.transformer.device
    modules = {name: getattr(pipe, name) for name in ("transformer", "text_encoder", "text_encoder_2")}
    gen = torch.Generator().manual_seed(args.seed + 1)
    weights = np.asarray(args.kind_weights, dtype=np.float64)
    pools = {kind: pools[kind] for kind in KINDS if kind in pools}

    def batch_loss() -> torch.Tensor:
        metadata = sample_metadata(pools, weights, args.batch, rng)
        prompts = [("" if rng.random() < args.dropout else prompt_from_metadata(m)) for m in metadata]
        with torch.no_grad():
            x0 = pipe.vae.encode(render_batch(metadata, rng, device)).latent_dist.sample(gen)  # [B, 4, 16, 16]
            x0 = (x0 - shift) * scale
        embeds, _, pooled, _ = pipe.encode_prompt(
            prompt=prompts, prompt_2=None, prompt_3=None, do_classifier_free_guidance=False,
            max_sequence_length=args.pad_length,
        )  # [B, clip_length + pad_length, 2 x text_hidden], [B, 2 x text_hidden]
        if args.t_sampling == "uniform":
            s = torch.rand(args.batch, generator=gen).to(device)  # [B] noise level
        else:
            s = torch.sigmoid(torch.randn(args.batch, generator=gen)).to(device)  # [B] logit-normal noise level
        noise = torch.randn(x0.shape, generator=gen).to(device)  # [B, 4, 16, 16]
        xs = (1 - s[:, None, None, None]) * x0 + s[:, None, None, None] * noise
        pred = pipe.transformer(
            hidden_states=xs, timestep=s * 1000, encoder_hidden_states=embeds, pooled_projections=pooled,
            return_dict=False,
        )[0]  # [B, 4, 16, 16]
        return F.mse_loss(pred, noise - x0)

    def select() -> dict:
        return evaluate(pipe, select_items, reward, args.seed + 7, args.eval_steps, args.pad_length)[0]

    return common.train_selected(modules, batch_loss, select, args, rng, gen, log, checkpoint, rate=learning_rate)


@torch.no_grad()
def forward_ms(pipe, args, batch: int = 32, repeats: int = 10) -> float:
    """Median wall time (ms) of one transformer forward at `batch` (as during sampling)."""
    cfg = pipe.transformer.config
    side = 32 // args.vae_downsample
    latents = torch.randn(batch, cfg.in_channels, side, side, device=pipe.transformer.device)
    text = torch.randn(batch, args.clip_length + args.pad_length, cfg.joint_attention_dim, device=latents.device)
    pooled = torch.randn(batch, cfg.pooled_projection_dim, device=latents.device)
    timestep = torch.full((batch,), 500.0, device=latents.device)
    times = []
    for _ in range(repeats + 2):
        start = time.perf_counter()
        pipe.transformer(
            hidden_states=latents, timestep=timestep, encoder_hidden_states=text, pooled_projections=pooled
        )
        times.append(time.perf_counter() - start)
    return float(np.median(times[2:]) * 1000)


def save_grid(images: torch.Tensor, prompts: list[str], scores: list[float], path: str, cols: int = 4) -> None:
    """Writes a PNG grid: each sample at 3x with its prompt and strict score to its right."""
    cell_w, cell_h, scale = 330, 100, 3
    rows = (len(prompts) + cols - 1) // cols
    grid = Image.new("RGB", (cols * cell_w, rows * cell_h), (255, 255, 255))
    draw = ImageDraw.Draw(grid)
    font = ImageFont.load_default()
    for i, (image, prompt, score) in enumerate(zip(images, prompts, scores)):
        x, y = (i % cols) * cell_w, (i // cols) * cell_h
        array = (image.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)  # [H, W, 3]
        tile = Image.fromarray(array).resize((32 * scale, 32 * scale), Image.NEAREST)
        grid.paste(tile, (x + 2, y + 2))
        text = "\n".join(textwrap.wrap(prompt, 28) + [f"strict={score:.0f}"])
        draw.multiline_text((x + 32 * scale + 8, y + 8), text, fill=(0, 0, 0), font=font)
    grid.save(path)


def main(argv=None) -> None:
    args = parse_args(argv)
    rng, log, start = common.start_run(args)
    source = ShapesPrompts(ShapesPrompts.Config(seed=args.seed, n_eval=args.n_select))
    select_items = source.eval_items()
    final_items = ShapesPrompts(ShapesPrompts.Config(seed=args.seed + 1000, n_eval=args.n_eval)).eval_items()
    reward = MiniGenEval(MiniGenEval.Config(score="strict"))
    pipe = build_pipeline(args).to(args.device)
    sizes = common.parameter_counts(pipe, ("transformer", "text_encoder", "text_encoder_2", "vae"))
    log(f"parameters {sizes}")
    resume_path, state = common.open_resume(args.output)
    elapsed_before = state["seconds"] if state else 0.0

    # ---- (1) VAE
    if state is None:
        train_vae(pipe.vae, source.train_pools, args, rng, log)
        shift, scale = calibrate_latents(pipe.vae, source.train_pools, rng)
        vae_accuracy = reconstruction_accuracy(pipe.vae, final_items, reward, args.seed)
    else:
        pipe.vae.load_state_dict(state["vae"])
        shift, scale, vae_accuracy = state["shift"], state["scale"], state["vae_accuracy"]
        pipe.vae.register_to_config(shift_factor=shift, scaling_factor=scale)
    pipe.vae.eval()
    log(f"vae: shift_factor {shift:.4f} scaling_factor {scale:.4f}; strict accuracy of reconstructions "
        f"{vae_accuracy:.3f}")
    pipe.vae.requires_grad_(False)

    def save(flow_state: dict) -> None:
        flow_state.update(vae=pipe.vae.state_dict(), shift=shift, scale=scale, vae_accuracy=vae_accuracy,
                          seconds=elapsed_before + time.time() - start)
        save_state(flow_state, resume_path)  # atomic: a kill leaves the previous state whole

    # ---- (2) text encoders + transformer, rectified flow; keeps the selected EMA weights
    chosen, history = train_flow(pipe, source.train_pools, select_items, reward, args, rng, log, (state, save))
    train_seconds = elapsed_before + time.time() - start

    # ---- (3) final held-out measurement, save
    pipe.save_pretrained(args.output)
    metrics, images = evaluate(pipe, final_items, reward, args.seed + 11, args.eval_steps, args.pad_length)
    log(f"final held-out eval: {json.dumps({k: round(v, 3) for k, v in metrics.items()})}")
    strict = reward({"images": images}, PromptBatch([it["prompt"] for it in final_items],
                                                     [it["metadata"] for it in final_items])).components["strict"]
    show = list(range(0, min(len(final_items), 32)))
    save_grid(images[show], [final_items[i]["prompt"] for i in show], strict[show].tolist(),
              os.path.join(args.output, "samples.png"))
    report = {
        "heldout": metrics,
        "heldout_n": len(final_items),
        "sampling": {"num_inference_steps": args.eval_steps, "guidance_scale": 1.0, "height": 32, "width": 32,
                     "max_sequence_length": args.pad_length, "scheduler_shift": args.shift},
        **common.run_record(args.output, chosen, history, vae_accuracy, train_seconds, sizes),
        "transformer_forward_ms_batch32": round(forward_ms(pipe, args), 1),
        "args": {k: v for k, v in vars(args).items() if k != "output"},
    }
    common.write_report(args.output, report, resume_path, log)


if __name__ == "__main__":
    main()
