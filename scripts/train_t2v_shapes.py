"""Trains the embedded tiny text-to-video model (Wan architecture) from scratch on the moving-shapes task.

Steps: (1) a tiny `AutoencoderKLWan` (spatial compression 4, temporal 2: a 5-frame 32 x 32 clip has latents ``[z, 3, 8,
8]``) starts as a frame-by-frame autoencoder (see `start_frame_by_frame`) and is trained on single rendered frames
(optionally then on whole clips, `--vae-steps`); its per-channel ``latents_mean`` / ``latents_std`` are set so latents
have zero mean and unit std. Kept frame by frame (the default), it encodes frames 0, 2 and 4 of a clip and decodes
frames 0, 2, 2, 4, 4: the motion is sampled every other frame; (2) a bank of rendered train clips is encoded once; (3)
the `UMT5EncoderModel` and the `WanTransformer3DModel` (patch ``(3, 1, 1)``: one token holds one latent pixel of all
three latent frames, a 4 x 4 pixel patch of the clip, 64 tokens per clip) are trained jointly with the rectified-flow
loss (``x_s = (1 - s) x_0 + s noise``, target ``noise - x_0``, `s` logit-normal) on latents drawn from that bank,
with 10% empty prompts; (4) from `--eval-start` on, the held-out strict accuracy of the EMA weights
(`mmgrpo.rewards.moving_shapes`, exact scene, sampling with `WanPipeline` itself: Euler, 10 steps, no guidance) is
measured every `--eval-every` steps, and training stops once it lies in `--target` (RL needs an imperfect start). The
result is written with `save_pretrained` (loadable by `WanPipeline.from_pretrained` and the `wan` policy), with
``metrics.json`` (accuracies overall and per prompt kind and motion, sampling settings, history) and ``samples.png``
(frame strips of held-out samples with their prompts and strict scores) beside it.

Recipe of the shipped model (the defaults): prompts of the ``single`` kind only, 4 latent channels, patch ``(3, 1, 1)``,
3 layers x 4 heads x 32, batch 64, lr 3e-3 cosine over 6000 steps, 2500 VAE steps (reconstructions: strict 1.0 on
100 held-out clips). The shipped weights took their VAE from an earlier run of these defaults with patch ``(3, 2, 2)``
(``--vae-from``; the VAE does not depend on the patch): the selection evaluations read 0.15-0.2 from step 1750 to
2750, 0.267 at 3000 and 0.333 at 3250, where the mean of the last two entered the target and training stopped; the EMA
weights of step 3250 score 0.267 held-out strict on 300 items (``metrics.json``), after 19 minutes of flow matching with
its evaluations on one thread of a 2-core machine shared with another job. What was measured on the way, held-out
strict on 120 items: with 16 latent channels, patch ``(1, 2, 2)``, 4 layers, batch 32, lr 2e-3 and both kinds, 0.003
after 3000 steps; with 4 channels, patch ``(1, 2, 2)``, single kind, batch 64, 0.0 at step 1500 and 0.025 at 1750 (each
of the three latent frames drew its own object: the first frame often in another colour or place, and little
motion); with patch ``(3, 2, 2)`` (the clip's frames in one token, a token covering 8 x 8 pixels), 0.033 at step 1500,
0.125 at 3250 and 0.2-0.22 from 4750 to 6000 (its squares had soft corners and almost never passed the shape check);
with patch ``(3, 1, 1)``, 0.15 at step 1750 and 0.333 at 3250 (0.32 s per step on one CPU thread).

Run from the repository root (deterministic from ``--seed``; a killed run continues from its last checkpoint when
started again with the same arguments)::

    HF_HUB_OFFLINE=1 python scripts/train_t2v_shapes.py --output data/weights/t2v_shapes

(the shipped weights were trained with ``--vae-from`` pointing at the earlier model's folder; ``--vae-from
data/weights/t2v_shapes`` reuses the same VAE weights and skips the 24-minute VAE stage).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tiny-model builders (tests/builders/)
sys.path.insert(0, str(Path(__file__).resolve().parent))  # _shapes_common, when imported from elsewhere

import numpy as np
import torch
import torch.nn.functional as F

from mmgrpo.data.moving_shapes import KINDS, MOTIONS, VOCABULARY, MovingShapesPrompts, prompt_from_metadata, render_clip
from mmgrpo.rewards.moving_shapes import MovingShapesReward
from mmgrpo.sample_writers import frame_strip
from mmgrpo.state_io import save_state
from mmgrpo.types import PromptBatch
from mmgrpo.visualize import save_image_grid

import _shapes_common as common  # the scaffolding shared with train_t2i_shapes.py
from _shapes_common import learning_rate  # the warm-up + cosine schedule (a module name tests can replace)
from builders._tokenizers import t5_tokenizer


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_run_arguments(parser)
    parser.add_argument("--num-frames", type=int, default=5)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--kinds", nargs="+", default=["single"], choices=list(KINDS),
                        help="prompt kinds trained and measured (the shipped model: single)")
    # model
    parser.add_argument("--patch-t", type=int, default=3, choices=[1, 3],
                        help="latent frames per patch: 3 (the whole clip in one token) or 1 (3x the tokens)")
    parser.add_argument("--patch-s", type=int, default=1, choices=[1, 2],
                        help="latent pixels per side of a transformer patch: 1 (a token covers 4 x 4 pixels, "
                             "64 tokens per clip) or 2 (8 x 8 pixels, 16 tokens)")
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--ffn", type=int, default=256)
    parser.add_argument("--text-hidden", type=int, default=64)
    parser.add_argument("--text-length", type=int, default=8, help="UMT5 tokens: the pipeline's max_sequence_length")
    parser.add_argument("--z-dim", type=int, default=4)
    parser.add_argument("--vae-dim", type=int, default=8, help="base channels of the VAE")
    parser.add_argument("--shift", type=float, default=1.0, help="`shift` of the saved Euler scheduler")
    # VAE stage
    parser.add_argument("--vae-from", default="",
                        help="a saved pipeline folder whose trained VAE (same --z-dim / --vae-dim) replaces the VAE "
                             "stage")
    parser.add_argument("--vae-image-steps", type=int, default=2500, help="VAE steps on single frames (cheap)")
    parser.add_argument("--vae-image-batch", type=int, default=32)
    parser.add_argument("--vae-steps", type=int, default=0,
                        help="VAE steps on whole clips after the frames (0: keep the frame-by-frame VAE)")
    parser.add_argument("--vae-batch", type=int, default=8)
    parser.add_argument("--vae-lr", type=float, default=3e-3)
    parser.add_argument("--vae-probe-every", type=int, default=0,
                        help="log the strict accuracy of 60 reconstructions every this many VAE steps (0: never)")
    parser.add_argument("--bank", type=int, default=2048, help="rendered train clips encoded once for stage 2")
    # flow-matching stage, selection / evaluation
    common.add_flow_arguments(parser, steps=6000)
    common.add_selection_arguments(parser, eval_start=1500, n_select=120, n_eval=300, target=[0.3, 0.5],
                                   checkpoint_every=100)
    return parser.parse_args(argv)


def build_pipeline(args):
    """A randomly initialised tiny `WanPipeline` (seeded by `args.seed`; the global RNG is left untouched)."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    tokenizer = t5_tokenizer(words=VOCABULARY, model_max_length=args.text_length)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(args.seed)
        text_encoder = UMT5EncoderModel(UMT5Config(
            vocab_size=len(tokenizer), d_model=args.text_hidden, d_kv=16, d_ff=2 * args.text_hidden, num_layers=2,
            num_heads=args.text_hidden // 16, relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1,
            decoder_start_token_id=0,
        ))
        vae = AutoencoderKLWan(  # one spatial halving, then one spatial + temporal halving
            base_dim=args.vae_dim, z_dim=args.z_dim, dim_mult=[1, 2, 2], num_res_blocks=1,
            temperal_downsample=[False, True], latents_mean=[0.0] * args.z_dim, latents_std=[1.0] * args.z_dim,
            scale_factor_temporal=2, scale_factor_spatial=4,
        )
        transformer = WanTransformer3DModel(
            patch_size=(args.patch_t, args.patch_s, args.patch_s), num_attention_heads=args.heads,
            attention_head_dim=args.head_dim, in_channels=args.z_dim, out_channels=args.z_dim,
            text_dim=args.text_hidden, freq_dim=256, ffn_dim=args.ffn, num_layers=args.layers, cross_attn_norm=True,
            qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
        )
    scheduler = FlowMatchEulerDiscreteScheduler(shift=args.shift)
    return WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=scheduler,
                       transformer=transformer)


def render_batch(metadata: list[dict], rng: np.random.Generator, args) -> torch.Tensor:
    """Renders correct clips for `metadata`: `[B, 3, F, H, W]` in [-1, 1] (the VAE's layout and range)."""
    clips = torch.stack([render_clip(m, rng, args.size, args.num_frames) for m in metadata])  # [B, F, 3, H, W]
    return clips.permute(0, 2, 1, 3, 4) * 2 - 1


def sample_metadata(pools: dict[str, list[dict]], n: int, rng: np.random.Generator) -> list[dict]:
    """`n` train prompts: a kind uniformly, then a prompt of that kind."""
    kinds = list(pools)
    return [pools[kinds[k]][rng.integers(len(pools[kinds[k]]))] for k in rng.integers(len(kinds), size=n)]


def decode_unclamped(vae, z: torch.Tensor) -> torch.Tensor:
    """`vae.decode` without its final clamp to [-1, 1] (`[B, z, T, h, w]` -> `[B, 3, F, H, W]`): the clamp has no
    gradient outside the range, and a decoder pushed there by an early step would never come back."""
    vae.clear_cache()
    x = vae.post_quant_conv(z)
    frames = [vae.decoder(x[:, :, i : i + 1], feat_cache=vae._feat_map, feat_idx=[0], first_chunk=i == 0)
              for i in range(x.shape[2])]  # the causal decoder, one latent frame at a time (as `vae.decode`)
    vae.clear_cache()
    return torch.cat(frames, dim=2)


@torch.no_grad()
def start_frame_by_frame(vae) -> None:
    """Makes the untrained VAE process a clip frame by frame, so that what the cheap single-frame stage learns holds
    for whole clips: the past-frame taps of its causal 3D convolutions are zeroed (every frame takes the first frame's
    path), the temporal down-sampling keeps the later frame of each pair and the temporal up-sampling repeats each
    latent frame (identity taps on the current frame). The clip stage then learns the motion in between; every tap
    stays trainable."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d

    for name, module in vae.named_modules():
        if not isinstance(module, WanCausalConv3d) or module.kernel_size[0] == 1:
            continue
        module.weight[:, :, :-1] = 0.0  # [out, in, k_t, k_h, k_w]: taps on frames t - k_t + 1 .. t - 1
        if "time_conv" in name:  # [c, c, 3, 1, 1] (down-sampling) or [2c, c, 3, 1, 1] (two output frames)
            module.weight.zero_()
            module.bias.zero_()
            out_channels, in_channels = module.weight.shape[:2]
            for o in range(out_channels):
                module.weight[o, o % in_channels, -1] = 1.0


def train_vae(vae, pools, args, rng, log, probe=None) -> None:
    """Trains `vae` as a plain autoencoder (decoding the posterior's mean: with the untrained log-variance, sampled
    latents are mostly noise and the decoder learns only the mean clip), first on single frames of rendered clips
    (a one-frame clip runs the causal VAE's first-frame path at a fifth of a clip's cost; on black-background shapes
    an autoencoder first sits at the all-black output for a few thousand samples), then on whole clips."""
    start_frame_by_frame(vae)
    vae.train()
    opt = torch.optim.AdamW(vae.parameters(), lr=args.vae_lr, weight_decay=0.0)
    total = args.vae_image_steps + args.vae_steps
    for step in range(total):
        single = step < args.vae_image_steps
        x = render_batch(sample_metadata(pools, args.vae_image_batch if single else args.vae_batch, rng), rng, args)
        if single:  # one random frame of each clip: [B, 3, 1, H, W]
            x = x[torch.arange(len(x)), :, torch.from_numpy(rng.integers(x.shape[2], size=len(x)))][:, :, None]
        recon = decode_unclamped(vae, vae.encode(x).latent_dist.mode())  # [B, 3, F, H, W]
        loss = F.mse_loss(recon, x) + 0.5 * F.l1_loss(recon, x)
        for group in opt.param_groups:
            decay = 0.1 if step >= 0.9 * total else 1.0  # the last tenth
            group["lr"] = args.vae_lr * min(1.0, (step + 1) / 20) * decay
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 25 == 0 or step == total - 1:
            log(f"vae step {step} ({'frames' if single else 'clips'}) loss {loss.item():.4f}")
        if probe is not None and args.vae_probe_every and (step + 1) % args.vae_probe_every == 0:
            vae.eval()
            log(f"vae step {step}: strict accuracy of reconstructions {probe():.3f}")
            vae.train()
    vae.eval()


@torch.no_grad()
def encode_bank(vae, pools, args, rng) -> dict:
    """Encodes `args.bank` rendered train clips once: the posterior's mean `[n, z, T, h, w]` (the latents the decoder
    was trained on) and the metadata; sets the VAE's per-channel ``latents_mean`` / ``latents_std`` from them."""
    metadata = sample_metadata(pools, args.bank, rng)
    mean = torch.cat([vae.encode(render_batch(metadata[i : i + 64], rng, args)).latent_dist.mode()
                      for i in range(0, len(metadata), 64)])  # [n, z, T, h, w]
    channel_mean = mean.mean(dim=(0, 2, 3, 4))  # [z]
    channel_std = mean.std(dim=(0, 2, 3, 4))  # [z]
    vae.register_to_config(latents_mean=channel_mean.tolist(), latents_std=channel_std.tolist())
    return {"mean": mean, "metadata": metadata}


def normalise(vae, latents: torch.Tensor) -> torch.Tensor:
    """Raw VAE latents `[B, z, T, h, w]` -> the transformer's (zero mean, unit std per channel), as `WanPipeline`."""
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    return (latents - mean) / std


@torch.no_grad()
def evaluate(pipe, items: list[dict], reward, seed: int, args, batch_size: int = 60):
    """Samples one clip per item with `WanPipeline` (Euler, no guidance) and scores it.

    Returns:
        `tuple[dict, torch.Tensor, torch.Tensor]`: accuracies (``strict``, ``partial``, ``strict_<kind>``,
        ``strict_<motion>``), videos `[N, F, 3, H, W]` in [0, 1] and the strict scores `[N]`.
    """
    generator = torch.Generator().manual_seed(seed)
    pipe.set_progress_bar_config(disable=True)
    videos = torch.cat([
        pipe(
            prompt=[it["prompt"] for it in items[i : i + batch_size]], num_frames=args.num_frames, height=args.size,
            width=args.size, num_inference_steps=args.eval_steps, guidance_scale=1.0, output_type="pt",
            generator=generator, max_sequence_length=args.text_length,
        ).frames
        for i in range(0, len(items), batch_size)
    ])  # [N, F, 3, H, W] in [0, 1]
    result = reward({"videos": videos}, PromptBatch([it["prompt"] for it in items], [it["metadata"] for it in items]))
    strict, partial = result.components["strict"], result.components["partial"]
    metrics = {"strict": strict.mean().item(), "partial": partial.mean().item()}
    for key, values in (("kind", KINDS), ("motion", tuple(MOTIONS))):
        labels = np.array([it["metadata"][key] for it in items])
        for value in values:
            if (labels == value).any():
                metrics[f"strict_{value}"] = strict[torch.from_numpy(labels == value)].mean().item()
    for name, values in result.components.items():
        if name.startswith("check_"):
            metrics[name] = float(values.nanmean())
    return metrics, videos, strict


def train_flow(pipe, bank, select_items, reward, args, rng, log, checkpoint=None) -> tuple[dict, list[dict]]:
    """Trains the text encoder and the transformer with the rectified-flow loss on latents from `bank`,
    `args.dropout` of the prompts empty; the EMA weights are evaluated on `select_items` and training stops inside
    `args.target` (see [`_shapes_common.train_selected`], which also resumes from `checkpoint`).

    Returns:
        `tuple[dict, list[dict]]`: the chosen checkpoint ``{"step", "strict", "state"}`` (already loaded into the
        pipeline) and the evaluation history.
    """
    modules = {"transformer": pipe.transformer, "text_encoder": pipe.text_encoder}
    gen = torch.Generator().manual_seed(args.seed + 1)
    prompts_of_bank = [prompt_from_metadata(m) for m in bank["metadata"]]

    def batch_loss() -> torch.Tensor:
        index = torch.from_numpy(rng.integers(len(prompts_of_bank), size=args.batch))  # [B]
        prompts = [("" if rng.random() < args.dropout else prompts_of_bank[i]) for i in index.tolist()]
        x0 = normalise(pipe.vae, bank["mean"][index])  # [B, z, T, h, w]
        embeds = pipe.encode_prompt(prompt=prompts, do_classifier_free_guidance=False,
                                    max_sequence_length=args.text_length)[0]  # [B, text_length, text_hidden]
        s = torch.sigmoid(torch.randn(args.batch, generator=gen))  # [B] logit-normal noise level
        noise = torch.randn(x0.shape, generator=gen)  # [B, z, T, h, w]
        xs = (1 - s.view(-1, 1, 1, 1, 1)) * x0 + s.view(-1, 1, 1, 1, 1) * noise
        pred = pipe.transformer(hidden_states=xs, timestep=s * 1000, encoder_hidden_states=embeds,
                                return_dict=False)[0]  # [B, z, T, h, w]
        return F.mse_loss(pred, noise - x0)

    def select() -> dict:
        return evaluate(pipe, select_items, reward, args.seed + 7, args)[0]

    return common.train_selected(modules, batch_loss, select, args, rng, gen, log, checkpoint, rate=learning_rate,
                          log_every=25)


@torch.no_grad()
def reconstruction_accuracy(vae, items: list[dict], reward, args) -> float:
    """Strict accuracy of VAE reconstructions of correct clips (how much the VAE alone loses)."""
    rng = np.random.default_rng(args.seed)
    x = render_batch([it["metadata"] for it in items], rng, args)  # [B, 3, F, H, W]
    recon = vae.decode(vae.encode(x).latent_dist.mode()).sample  # [B, 3, F, H, W]
    videos = (recon / 2 + 0.5).clamp(0, 1).permute(0, 2, 1, 3, 4)  # [B, F, 3, H, W]
    result = reward({"videos": videos}, PromptBatch([it["prompt"] for it in items], [it["metadata"] for it in items]))
    return result.components["strict"].mean().item()


def main(argv=None) -> None:
    args = parse_args(argv)
    rng, log, start = common.start_run(args)
    task = {"image_size": args.size, "num_frames": args.num_frames, "kinds": tuple(args.kinds)}
    source = MovingShapesPrompts(MovingShapesPrompts.Config(seed=args.seed, n_eval=args.n_select, **task))
    select_items = source.eval_items()
    final_items = MovingShapesPrompts(
        MovingShapesPrompts.Config(seed=args.seed + 1000, n_eval=args.n_eval, **task)).eval_items()
    reward = MovingShapesReward(MovingShapesReward.Config(score="strict", exact_scene=True))
    pipe = build_pipeline(args)
    sizes = common.parameter_counts(pipe, ("transformer", "text_encoder", "vae"))
    log(f"parameters {sizes}")
    resume_path, state = common.open_resume(args.output)
    elapsed_before = state["seconds"] if state else 0.0

    # ---- (1) VAE, (2) the latent bank
    if state is None:
        if args.vae_from:  # a VAE trained by an earlier run of this script
            from diffusers import AutoencoderKLWan

            pipe.vae.load_state_dict(AutoencoderKLWan.from_pretrained(args.vae_from, subfolder="vae").state_dict())
            pipe.vae.eval()
            log(f"vae: loaded from {args.vae_from}")
        else:
            train_vae(pipe.vae, source.train_pools, args, rng, log,
                      lambda: reconstruction_accuracy(pipe.vae, final_items[:60], reward, args))
        bank = encode_bank(pipe.vae, source.train_pools, args, rng)
        vae_accuracy = reconstruction_accuracy(pipe.vae, final_items[:100], reward, args)
        save_state({"vae": pipe.vae.state_dict(), "latents_mean": pipe.vae.config.latents_mean,
                    "latents_std": pipe.vae.config.latents_std, "bank": bank, "vae_accuracy": vae_accuracy,
                    "step": 0, "seconds": time.time() - start}, resume_path)
    else:
        pipe.vae.load_state_dict(state["vae"])
        pipe.vae.register_to_config(latents_mean=list(state["latents_mean"]), latents_std=list(state["latents_std"]))
        bank, vae_accuracy = state["bank"], state["vae_accuracy"]
        state = state if state["step"] > 0 else None
    pipe.vae.eval().requires_grad_(False)
    log(f"vae: strict accuracy of reconstructions {vae_accuracy:.3f}; bank of {len(bank['metadata'])} clips")

    def save(flow_state: dict) -> None:
        flow_state.update(vae=pipe.vae.state_dict(), latents_mean=pipe.vae.config.latents_mean,
                          latents_std=pipe.vae.config.latents_std, bank=bank, vae_accuracy=vae_accuracy,
                          seconds=elapsed_before + time.time() - start)
        save_state(flow_state, resume_path)  # atomic: a kill leaves the previous state whole

    # ---- (3) text encoder + transformer, rectified flow; keeps the selected EMA weights
    # the flow stage draws from its own seeds, so a run resumed after the VAE stage matches an uninterrupted one
    torch.manual_seed(args.seed + 2)
    flow_rng = np.random.default_rng(args.seed + 2)
    chosen, history = train_flow(pipe, bank, select_items, reward, args, flow_rng, log, (state, save))
    train_seconds = elapsed_before + time.time() - start

    # ---- (4) final held-out measurement, save
    pipe.save_pretrained(args.output)
    metrics, videos, strict = evaluate(pipe, final_items, reward, args.seed + 11, args)
    log(f"final held-out eval: {json.dumps({k: round(v, 3) for k, v in metrics.items()})}")
    show = list(range(min(len(final_items), 24)))
    save_image_grid([frame_strip(videos[i]) for i in show],
                    [f"{final_items[i]['prompt']} strict={strict[i]:.0f}" for i in show],
                    os.path.join(args.output, "samples.png"), columns=3)
    report = {
        "heldout": metrics,
        "heldout_n": len(final_items),
        "sampling": {"num_inference_steps": args.eval_steps, "guidance_scale": 1.0, "height": args.size,
                     "width": args.size, "num_frames": args.num_frames, "max_sequence_length": args.text_length,
                     "scheduler_shift": args.shift},
        **common.run_record(args.output, chosen, history, vae_accuracy, train_seconds, sizes),
        "args": {k: v for k, v in vars(args).items() if k != "output"},
    }
    common.write_report(args.output, report, resume_path, log)


if __name__ == "__main__":
    main()
