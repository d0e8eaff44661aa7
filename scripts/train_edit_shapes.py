"""Trains the embedded tiny image-editing model (FLUX.1 Kontext architecture) from scratch on shapes edits.

The task is `mmgrpo.data.shapes_edit` at 32 x 32 pixels: an input scene of 1-3 shapes and an instruction ("make the
red circle blue", "remove the square", "move the triangle left"), the edited scene as target. Steps: (1) a
2x-downsampling VAE is trained as an autoencoder on rendered scenes (inputs and targets), and its `shift_factor` /
`scaling_factor` are set so latents have zero mean and unit std; (2) both text encoders (CLIP for the pooled vector,
T5 for the token states) and the `FluxTransformer2DModel` are trained jointly with the rectified-flow loss on the
target's packed latents (``x_s = (1 - s) x_0 + s noise``, target ``noise - x_0``, `s` logit-normal), the input
scene's packed latents appended to the transformer's tokens exactly as `FluxKontextPipeline` does it (VAE mode,
position ids with first axis 1), on one drawn edit per training scene, or with `--all-edits-per-scene` on every
edit of the same scenes (each kind drawn equally often); (3) from `--eval-start` on, the held-out strict accuracy of
the EMA weights (`edit_fidelity`'s strict rule, on edits of combinations never trained on, sampled with the stock
pipeline: 10 steps) is measured every `--eval-every` steps, and training stops once it reaches `--target` (RL needs an
imperfect start). The result is written with `save_pretrained`, with ``metrics.json`` and ``samples.png`` (input | edit |
target, with the instruction and strict score) beside it.

The model has no distilled guidance embedding (``guidance_embeds=False``; guidance_scale is ignored) and was trained
with 8 T5 tokens (``max_sequence_length=8``, in ``metrics.json["sampling"]``).

The shipped model stopped at step 2000, at 0.195 selection strict (the default `--target` 0.18-0.5): its selection
accuracy rose about 2.5 points per 250 steps, and a base inside the text-to-image default's 0.36-0.6 would have needed
well over 4000 steps on the shared core it was trained on (28 minutes of wall clock for 2000 steps).

Run (deterministic from ``--seed``; a killed run continues from its last checkpoint when started again with the same
arguments)::

    HF_HUB_OFFLINE=1 python scripts/train_edit_shapes.py --output data/weights/edit_shapes
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

from mmgrpo.data.shapes_edit import DIRECTIONS, KINDS, ShapesEdit
from mmgrpo.data.vlm_shapes import COLOURS, SHAPES
from mmgrpo.prompt_stream import items_to_batch
from mmgrpo.rewards.edit_fidelity import EditFidelityReward
from mmgrpo.state_io import save_state

import _shapes_common as common  # the scaffolding shared with the other shapes base-model scripts
from builders.flux import tiny_flux_pipeline

WORDS = ("make", "remove", "move", "the", *COLOURS, *SHAPES, *DIRECTIONS)
SIZE = 32


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_run_arguments(parser)
    parser.add_argument("--layers", type=int, default=1, help="double-stream blocks")
    parser.add_argument("--single-layers", type=int, default=2, help="single-stream blocks")
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--rope", type=int, nargs=3, default=[8, 12, 12], help="rotary dims per axis (sum: head dim)")
    parser.add_argument("--text-hidden", type=int, default=64)
    parser.add_argument("--vae-channels", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--text-length", type=int, default=8, help="CLIP and T5 tokens (max_sequence_length)")
    parser.add_argument("--freeze-text-encoders", action="store_true",
                        help="keep both text encoders at their random initialisation (in eval mode) and train the "
                             "transformer alone, as FLUX models are trained on frozen encoders")
    parser.add_argument("--context-loss", type=float, default=0.0,
                        help="weight of a second loss on the transformer's outputs at the input scene's tokens (which "
                             "the pipeline discards): the packed latent change target - input, so the clean input's "
                             "tokens must find what the instruction changes; 0: off")
    parser.add_argument("--n-train", type=int, default=4000, help="training edits (scenes of even indices)")
    parser.add_argument("--all-edits-per-scene", action="store_true",
                        help="train on every edit of each of the --n-train scenes (every kind, every shape named), "
                        "not one drawn edit per scene: the same scene under different instructions")
    parser.add_argument("--vae-steps", type=int, default=600)
    parser.add_argument("--vae-batch", type=int, default=32)
    parser.add_argument("--vae-lr", type=float, default=4e-3)
    common.add_flow_arguments(parser, steps=4000)
    parser.set_defaults(dropout=0.0, batch=32)  # no CFG for edits: every instruction is kept
    common.add_selection_arguments(parser, eval_start=1000, n_select=200, n_eval=600, target=[0.18, 0.5],
                                   checkpoint_every=250)
    return parser.parse_args(argv)


def build_pipeline(args):
    """A randomly initialised tiny `FluxKontextPipeline` (the components of the tiny FLUX builder)."""
    from diffusers import FluxKontextPipeline

    flux = tiny_flux_pipeline(
        num_layers=args.layers, num_single_layers=args.single_layers, attention_head_dim=sum(args.rope),
        num_attention_heads=args.heads, axes_dims_rope=tuple(args.rope), sample_size=SIZE,
        vae_channels=tuple(args.vae_channels), latent_channels=4, text_hidden_size=args.text_hidden,
        text_layers=2, text_max_length=args.text_length, guidance_embeds=False, vocab_words=WORDS, seed=args.seed,
    )
    return FluxKontextPipeline(**flux.components)


def pixels(images: list[torch.Tensor]) -> torch.Tensor:
    """uint8 `[3, H, W]` images -> `[B, 3, H, W]` in [-1, 1] (the VAE's range)."""
    return torch.stack(images).float() / 127.5 - 1.0


def train_vae(vae, items: list[dict], args, rng, log) -> None:
    """Trains `vae` as a (barely regularised) KL autoencoder on the items' input and target scenes."""
    vae.train()
    opt = torch.optim.AdamW(vae.parameters(), lr=args.vae_lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(args.seed)
    for step in range(args.vae_steps):
        picks = rng.integers(len(items), size=args.vae_batch)
        x = pixels([items[i]["metadata"][("source_image", "target_image")[j % 2]]
                    for j, i in enumerate(picks)])  # [B, 3, 32, 32]
        posterior = vae.encode(x).latent_dist
        recon = vae.decode(posterior.sample(gen)).sample  # [B, 3, 32, 32]
        loss = F.mse_loss(recon, x) + 0.5 * F.l1_loss(recon, x) + 1e-6 * posterior.kl().mean()
        for group in opt.param_groups:
            group["lr"] = args.vae_lr * min(1.0, (step + 1) / 50) * (0.1 if step > 0.8 * args.vae_steps else 1.0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 100 == 0 or step == args.vae_steps - 1:
            log(f"vae step {step} loss {loss.item():.4f}")
    vae.eval()


@torch.no_grad()
def encode_all(pipe, items: list[dict], key: str, batch: int = 256) -> torch.Tensor:
    """Unscaled VAE modes `[N, 4, 16, 16]` of the items' `key` images."""
    return torch.cat([pipe.vae.encode(pixels([it["metadata"][key] for it in items[i : i + batch]])).latent_dist.mode()
                      for i in range(0, len(items), batch)])


@torch.no_grad()
def reconstruction_accuracy(vae, items: list[dict], reward: EditFidelityReward) -> float:
    """Strict accuracy of VAE reconstructions of the targets (how much the VAE alone loses)."""
    recon = vae.decode(vae.encode(pixels([it["metadata"]["target_image"] for it in items])).latent_dist.mode()).sample
    return reward({"images": (recon / 2 + 0.5).clamp(0, 1)}, items_to_batch(items)).components["strict"].mean().item()


@torch.no_grad()
def evaluate(pipe, items: list[dict], reward: EditFidelityReward, seed: int, steps: int, length: int,
             batch_size: int = 100) -> tuple[dict, torch.Tensor]:
    """Edits each item's input with the stock pipeline and scores it.

    Returns:
        `tuple[dict, torch.Tensor]`: accuracies (``strict``, ``score``, ``strict_<kind>``) and images `[N, 3, H, W]`.
    """
    generator = torch.Generator().manual_seed(seed)
    pipe.set_progress_bar_config(disable=True)
    images = torch.cat([
        pipe(image=[it["images"][0] for it in items[i : i + batch_size]],
             prompt=[it["prompt"] for it in items[i : i + batch_size]], num_inference_steps=steps, height=SIZE,
             width=SIZE, max_area=SIZE * SIZE, output_type="pt", generator=generator, max_sequence_length=length,
             _auto_resize=False).images
        for i in range(0, len(items), batch_size)
    ])  # [N, 3, 32, 32] in [0, 1]
    result = reward({"images": images}, items_to_batch(items))
    strict = result.components["strict"]
    kinds = np.array([it["metadata"]["kind"] for it in items])
    metrics = {"strict": strict.mean().item(), "score": result.scores.mean().item()}
    for kind in KINDS:
        if (kinds == kind).any():
            metrics[f"strict_{kind}"] = strict[torch.from_numpy(kinds == kind)].mean().item()
    return metrics, images


def edit_flow_loss(pred: torch.Tensor, noise: torch.Tensor, x0: torch.Tensor, image: torch.Tensor,
                   context_weight: float = 0.0) -> torch.Tensor:
    """The base's training loss on the transformer's output `pred` `[B, 2L, C]` (the `L` noisy target tokens, then
    the `L` input-scene tokens): rectified flow on the target tokens (velocity ``noise - x0``), plus, with
    `context_weight` > 0, ``context_weight`` times the mean squared error of the outputs at the input's tokens
    (which `FluxKontextPipeline` discards) against the edit's change ``x0 - image`` there. `noise`, `x0` (packed
    target latents) and `image` (packed input latents): `[B, L, C]`."""
    length = x0.shape[1]
    loss = F.mse_loss(pred[:, :length], noise - x0)
    if context_weight:
        loss = loss + context_weight * F.mse_loss(pred[:, length:], x0 - image)
    return loss


def train_flow(pipe, items, select_items, reward, args, rng, log, checkpoint=None) -> tuple[dict, list[dict]]:
    """Trains both text encoders (with `--freeze-text-encoders`: neither) and the transformer with the rectified-flow
    loss on the train edits' targets, the input scene's tokens appended as `FluxKontextPipeline` does; the EMA weights
    are evaluated on `select_items` and training stops inside `args.target` (see
    [`_shapes_common.train_selected`], which also resumes from `checkpoint`).

    Returns:
        `tuple[dict, list[dict]]`: the chosen checkpoint and the evaluation history.
    """
    shift, scale = pipe.vae.config.shift_factor, pipe.vae.config.scaling_factor
    targets = (encode_all(pipe, items, "target_image") - shift) * scale  # [N, 4, 16, 16]
    sources = (encode_all(pipe, items, "source_image") - shift) * scale  # [N, 4, 16, 16]
    pack = lambda z: pipe._pack_latents(z, z.shape[0], z.shape[1], z.shape[2], z.shape[3])  # [B, 64, 16]
    side = SIZE // pipe.vae_scale_factor // 2
    ids = pipe._prepare_latent_image_ids(1, side, side, "cpu", torch.float32)  # [64, 3]
    image_ids = ids.clone()
    image_ids[:, 0] = 1  # the input image's tokens, as the pipeline marks them
    img_ids = torch.cat([ids, image_ids])  # [128, 3]
    trained = ("transformer",) if args.freeze_text_encoders else ("transformer", "text_encoder", "text_encoder_2")
    modules = {name: getattr(pipe, name) for name in trained}
    if args.freeze_text_encoders:
        for encoder in (pipe.text_encoder, pipe.text_encoder_2):
            encoder.eval()
            encoder.requires_grad_(False)
    gen = torch.Generator().manual_seed(args.seed + 1)
    # with every edit of each scene (recolours outnumber the rest about 3 to 1), each kind is drawn equally often
    share = None  # [N] each item's probability of being drawn, when not uniform
    if args.all_edits_per_scene:
        _, kind_index, counts = np.unique([item["metadata"]["kind"] for item in items], return_inverse=True,
                                          return_counts=True)
        share = 1.0 / counts[kind_index]
        share /= share.sum()

    def batch_loss() -> torch.Tensor:
        picks = rng.integers(len(items), size=args.batch) if share is None else rng.choice(len(items), args.batch,
                                                                                           p=share)
        x0, image = pack(targets[picks]), pack(sources[picks])  # [B, 64, 16] each
        prompts = [items[i]["prompt"] for i in picks]
        embeds, pooled, text_ids = pipe.encode_prompt(prompt=prompts, prompt_2=prompts, device="cpu",
                                                      max_sequence_length=args.text_length)
        s = torch.sigmoid(torch.randn(args.batch, generator=gen))  # [B] logit-normal noise level
        noise = torch.randn(x0.shape, generator=gen)  # [B, 64, 16]
        xs = (1 - s[:, None, None]) * x0 + s[:, None, None] * noise
        pred = pipe.transformer(hidden_states=torch.cat([xs, image], dim=1), timestep=s, guidance=None,
                                pooled_projections=pooled, encoder_hidden_states=embeds, txt_ids=text_ids,
                                img_ids=img_ids, return_dict=False)[0]  # [B, 128, 16]
        return edit_flow_loss(pred, noise, x0, image, args.context_loss)

    def select() -> dict:
        return evaluate(pipe, select_items, reward, args.seed + 7, args.eval_steps, args.text_length)[0]

    return common.train_selected(modules, batch_loss, select, args, rng, gen, log, checkpoint)


def save_grid(items: list[dict], images: torch.Tensor, scores: list[float], path: str, cols: int = 3) -> None:
    """Writes a PNG grid: input | edit | target at 3x for each item, its instruction and strict score below."""
    tile = SIZE * 3  # each picture at 3x
    cell_w, cell_h = 3 * tile + 16, tile + 30
    rows = (len(items) + cols - 1) // cols
    grid = Image.new("RGB", (cols * cell_w, rows * cell_h), (255, 255, 255))
    draw = ImageDraw.Draw(grid)
    font = ImageFont.load_default()
    for i, (item, image, score) in enumerate(zip(items, images, scores)):
        x, y = (i % cols) * cell_w, (i // cols) * cell_h
        edited = Image.fromarray((image.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8))
        target = Image.fromarray(item["metadata"]["target_image"].permute(1, 2, 0).numpy())
        for j, picture in enumerate((item["images"][0], edited, target)):
            grid.paste(picture.resize((tile, tile), Image.NEAREST), (x + 2 + j * (tile + 2), y + 2))
        text = "\n".join(textwrap.wrap(f"{item['prompt']}  strict={score:.0f}", 48))
        draw.multiline_text((x + 4, y + tile + 4), text, fill=(0, 0, 0), font=font)
    grid.save(path)


def training_edits(args) -> list[dict]:
    """The base's training edits: one drawn edit on each of `--n-train` training scenes (`ShapesEdit.train_items`),
    or with `--all-edits-per-scene` every edit those scenes allow (`ShapesEdit.train_scene_edits`)."""
    source = ShapesEdit(ShapesEdit.Config(seed=args.seed, n_train=args.n_train, n_eval=0, size=SIZE))
    return source.train_scene_edits() if args.all_edits_per_scene else source.train_items()


def main(argv=None) -> None:
    args = parse_args(argv)
    rng, log, start = common.start_run(args)
    items = training_edits(args)
    # selection and final items: held-out edits of other scenes than the RL config's evaluation (data.seed 0)
    select_items = ShapesEdit(ShapesEdit.Config(seed=args.seed + 2000, n_train=0, n_eval=args.n_select,
                                                size=SIZE)).eval_items()
    final_items = ShapesEdit(ShapesEdit.Config(seed=args.seed + 1000, n_train=0, n_eval=args.n_eval,
                                               size=SIZE)).eval_items()
    reward = EditFidelityReward()
    pipe = build_pipeline(args)
    sizes = common.parameter_counts(pipe, ("transformer", "text_encoder", "text_encoder_2", "vae"))
    log(f"parameters {sizes}")
    resume_path, state = common.open_resume(args.output)
    elapsed_before = state["seconds"] if state else 0.0

    # ---- (1) VAE
    if state is None:
        train_vae(pipe.vae, items, args, rng, log)
        latents = encode_all(pipe, items[:1024], "target_image")  # [n, 4, 16, 16]
        shift, scale = latents.mean().item(), 1.0 / latents.std().item()
        pipe.vae.register_to_config(shift_factor=shift, scaling_factor=scale)
        vae_accuracy = reconstruction_accuracy(pipe.vae, final_items, reward)
    else:
        pipe.vae.load_state_dict(state["vae"])
        shift, scale, vae_accuracy = state["shift"], state["scale"], state["vae_accuracy"]
        pipe.vae.register_to_config(shift_factor=shift, scaling_factor=scale)
    pipe.vae.eval()
    pipe.vae.requires_grad_(False)
    log(f"vae: shift_factor {shift:.4f} scaling_factor {scale:.4f}; strict accuracy of reconstructions "
        f"{vae_accuracy:.3f}")

    def save(flow_state: dict) -> None:
        flow_state.update(vae=pipe.vae.state_dict(), shift=shift, scale=scale, vae_accuracy=vae_accuracy,
                          seconds=elapsed_before + time.time() - start)
        save_state(flow_state, resume_path)  # atomic: a kill leaves the previous state whole

    # ---- (2) text encoders + transformer, rectified flow; keeps the selected EMA weights
    chosen, history = train_flow(pipe, items, select_items, reward, args, rng, log, (state, save))
    train_seconds = elapsed_before + time.time() - start

    # ---- (3) final held-out measurement, save
    pipe.save_pretrained(args.output)
    metrics, images = evaluate(pipe, final_items, reward, args.seed + 11, args.eval_steps, args.text_length)
    log(f"final held-out eval: {json.dumps({k: round(v, 3) for k, v in metrics.items()})}")
    strict = reward({"images": images}, items_to_batch(final_items)).components["strict"]
    show = list(range(min(len(final_items), 24)))
    save_grid([final_items[i] for i in show], images[show], strict[show].tolist(),
              os.path.join(args.output, "samples.png"))
    report = {
        "heldout": metrics,
        "heldout_n": len(final_items),
        "sampling": {"num_inference_steps": args.eval_steps, "height": SIZE, "width": SIZE,
                     "max_sequence_length": args.text_length, "_auto_resize": False},
        **common.run_record(args.output, chosen, history, vae_accuracy, train_seconds, sizes),
        "args": {k: v for k, v in vars(args).items() if k != "output"},
    }
    common.write_report(args.output, report, resume_path, log)


if __name__ == "__main__":
    main()
