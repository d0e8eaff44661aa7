"""Z-Image and Z-Image-Turbo (single-stream S3-DiT, rectified flow) as a stochastic policy, with LoRA and CFG.

Wraps diffusers' `ZImagePipeline` components (`ZImageTransformer2DModel`, `AutoencoderKL`, a Qwen3 text encoder,
`FlowMatchEulerDiscreteScheduler`). What is Z-Image's own, as the stock pipeline does it: prompts go through the
tokenizer's chat template and the second-to-last hidden states of the text encoder, one variable-length caption per
sample (kept padded, with its length, for replay); the transformer takes lists of latents `[C, 1, h, w]`, the
timestep ``1 - sigma`` and predicts minus the velocity; CFG is ``pos + s (pos - neg)`` with ``s > 0`` (0 turns it
off, as Z-Image-Turbo samples), optionally renormalised (``cfg_normalization``) and dropped late in sampling
(``cfg_truncation``). Noise levels are the stock ``linspace(1, 1/S, S)`` shifted by the scheduler (with the
image-size dependent ``mu`` where it shifts dynamically), so few-step schedules (Turbo's 8-9 steps) are the stock
ones. Sampling, replay and checkpoints are shared with `sd3` and `flux` ([`mmgrpo.pipelines._flow_policy`]).
Model: https://github.com/Tongyi-MAI/Z-Image ; paper: https://arxiv.org/abs/2511.22699
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from mmgrpo.pipelines._flow_common import (
    check_flow_config, check_packing, check_resolution, decode_images, image_bytes,
)
from mmgrpo.pipelines import _flow_policy as flow_policy
from mmgrpo.pipelines._flow_policy import load_flow_pipeline
from mmgrpo.samplers.flow_plan import PLAN_FEATURES, SCORE_FIELDS
from mmgrpo.validation import check_range


@dataclass
class ZImageConfig:
    """Options of [`ZImagePolicy`]; names and meanings are `ZImagePipeline.__call__`'s.

    Args:
        pretrained (`str`): a diffusers Z-Image folder or a hub id (``Tongyi-MAI/Z-Image-Turbo``, ``Tongyi-MAI/Z-Image``).
        resolution (`int`): image height and width in pixels; a multiple of twice the VAE's downsampling (16).
        num_steps (`int`): denoising steps for training rollouts.
        eval_num_steps (`int`, *optional*): denoising steps for evaluation (default: `num_steps`).
        guidance_scale (`float`): CFG ``pos + s (pos - neg)``; 0 turns it off (one forward per step, as
            Z-Image-Turbo is sampled).
        cfg_normalization (`float`): when > 0, a guided velocity's norm is capped at this multiple of the conditional
            one's (per sample); 0 turns it off.
        cfg_truncation (`float`): CFG is dropped at the steps whose ``1 - sigma`` exceeds it (1 keeps it everywhere).
        negative_prompt (`str`): the unconditional prompt used with CFG.
        max_sequence_length (`int`): text tokens (chat template included).
        lora_rank (`int`): LoRA rank on the transformer; 0 trains the whole transformer.
        lora_alpha (`int`): LoRA scaling numerator.
        lora_targets (`list[str]`): transformer module names (suffixes) that get LoRA.
        weights_dtype (`str`): dtype of the frozen components (text encoder, VAE, and the base transformer under
            LoRA). Trainable parameters are always float32.
        gradient_checkpointing (`bool`): recompute each transformer block in the backward pass.
    """

    pretrained: str
    resolution: int = 512
    num_steps: int = 8
    eval_num_steps: int | None = None
    guidance_scale: float = 5.0
    cfg_normalization: float = 0.0
    cfg_truncation: float = 1.0
    negative_prompt: str = ""
    max_sequence_length: int = 512
    lora_rank: int = 64
    lora_alpha: int = 128
    lora_targets: list[str] = field(
        default_factory=lambda: [
            "attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0",
            "feed_forward.w1", "feed_forward.w2", "feed_forward.w3",
        ]
    )
    weights_dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    gradient_checkpointing: bool = False

    def __post_init__(self):
        check_flow_config(self, max_tokens=1024)  # the transformer's caption positions (axes_lens[0] = 1024)
        check_resolution(self, "patches", fix="Z-Image is trained up to ~2048")
        check_range("guidance_scale", self.guidance_scale, 0.0, fix="0 turns CFG off (Z-Image-Turbo), the base uses ~4")
        check_range("cfg_normalization", self.cfg_normalization, 0.0, 100.0, fix="0 turns it off")
        check_range("cfg_truncation", self.cfg_truncation, 0.0, 1.0, fix="1 keeps CFG at every step")

    def output_size(self) -> tuple[int, str]:
        """Bytes of one sample's decoded image, and the key that sets them (for [`~mmgrpo.preflight.preflight`])."""
        return image_bytes(self.resolution), "pipeline.resolution"


def _captions(embeds: torch.Tensor, lengths: torch.Tensor, dtype: torch.dtype) -> list[torch.Tensor]:
    """Padded caption states `[n, L, D]` and their lengths `[n]` -> the list of `[L_i, D]` the transformer reads."""
    return [e[: int(k)].to(dtype) for e, k in zip(embeds, lengths)]


class ZImagePolicy:
    """Z-Image sampler as a policy: `sample` draws SDE/ODE trajectories of latents `[N, C, h, w]` (the trajectory keeps
    ``latents`` `[N, S + 1, C, h, w]` and the padded captions with their lengths), `log_prob` replays their transitions,
    `likelihood` scores the final latents; outputs ``images`` `[N, 3, H, W]` in [0, 1]. Set-up, sampling, replay and
    checkpoints are shared with `sd3` and `flux` ([`mmgrpo.pipelines._flow_policy`], at the end of the class)."""

    Config = ZImageConfig
    modalities = frozenset({"image"})
    plan_families = ("flow",)
    plan_features = PLAN_FEATURES
    provides = SCORE_FIELDS
    capabilities = frozenset()
    input_names = ("prompt_embeds", "prompt_lengths", "negative_prompt_embeds", "negative_prompt_lengths")

    def __init__(self, config: ZImageConfig):
        from diffusers import ZImagePipeline

        self.config = config
        self.flow = load_flow_pipeline(ZImagePipeline, config)
        self.pipe = self.flow.pipe
        check_packing(self.pipe, config, "patches")
        self.trainable = self.flow.experts[0]
        self.transformer = self.trainable.module
        self.device = torch.device("cpu")

    # ------------------------------------------------------------------------------------------------------ model
    def sigmas(self, num_steps: int) -> torch.Tensor:
        """The sigmas `[num_steps + 1]` (ending at 0) `ZImagePipeline` uses at this resolution: ``linspace(1, 1/S, S)``
        shifted by the scheduler, ``mu`` from the image's patch count where it shifts dynamically."""
        from diffusers.pipelines.z_image.pipeline_z_image import (
            calculate_shift, get_default_z_image_sigmas, retrieve_timesteps,
        )

        scheduler = self.pipe.scheduler
        side = self.config.resolution // self.pipe.vae_scale_factor // 2  # 2x2 patches per side
        mu = calculate_shift(
            side * side,
            scheduler.config.get("base_image_seq_len", 256),
            scheduler.config.get("max_image_seq_len", 4096),
            scheduler.config.get("base_shift", 0.5),
            scheduler.config.get("max_shift", 1.15),
        )
        retrieve_timesteps(scheduler, num_steps, "cpu", sigmas=get_default_z_image_sigmas(num_steps), mu=mu)
        return scheduler.sigmas.float().clone()  # [S + 1]

    @property
    def do_cfg(self) -> bool:
        return self.config.guidance_scale > 0

    @torch.no_grad()
    def _encode(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Caption states padded to `[n, L, D]` and their lengths `[n]` (the pipeline's ``encode_prompt``)."""
        states, _ = self.pipe.encode_prompt(
            prompt=list(prompts), device=self.device, do_classifier_free_guidance=False,
            max_sequence_length=self.config.max_sequence_length,
        )
        lengths = torch.tensor([s.shape[0] for s in states], device=self.device)
        return torch.nn.utils.rnn.pad_sequence(states, batch_first=True), lengths

    def encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Text embeddings, padded ``prompt_embeds`` `[N, L, D]` and ``prompt_lengths`` `[N]` (negatives with CFG)."""
        embeds, lengths = self._encode(prompts)
        out = {"prompt_embeds": embeds, "prompt_lengths": lengths}
        if self.do_cfg:
            negative, negative_lengths = self._encode([self.config.negative_prompt])
            n = len(prompts)
            out.update(negative_prompt_embeds=negative.expand(n, -1, -1), negative_prompt_lengths=negative_lengths.expand(n))
        return out

    def _guided_at(self, sigma: torch.Tensor) -> bool:
        """Whether CFG applies at noise level `sigma` (the pipeline's ``cfg_truncation`` on ``(1000 - t) / 1000``)."""
        t = sigma * self.pipe.scheduler.config.num_train_timesteps
        return bool(((1000 - t.float()) / 1000) <= self.config.cfg_truncation)

    def velocity(self, latents, sigma, embeds, guidance: bool = True) -> torch.Tensor:
        """Velocity `[n, C, h, w]` for latents `[n, C, h, w]` at noise level `sigma`: minus the transformer's output,
        guided (CFG) unless ``guidance=False`` (the conditional velocity, which the flow-matching likelihood scores)."""
        cfg = self.do_cfg and guidance and self._guided_at(sigma)
        dtype = self.pipe.transformer.dtype
        n = latents.shape[0]
        x = latents.to(dtype)  # [n, C, h, w]
        captions = _captions(embeds["prompt_embeds"], embeds["prompt_lengths"], dtype)
        if cfg:
            x = torch.cat([x, x])
            captions += _captions(embeds["negative_prompt_embeds"], embeds["negative_prompt_lengths"], dtype)
        t = sigma * self.pipe.scheduler.config.num_train_timesteps
        timestep = ((1000 - t) / 1000).to(self.device).expand(x.shape[0])
        out = self.trainable.forward(list(x.unsqueeze(2).unbind(0)), timestep, captions, return_dict=False)[0]
        out = torch.stack([o.float() for o in out]).squeeze(2)  # [n or 2n, C, h, w]
        if cfg:
            pos, neg = out[:n], out[n:]
            out = pos + self.config.guidance_scale * (pos - neg)
            if self.config.cfg_normalization > 0:  # cap each sample's guided norm at a multiple of the conditional one
                cap = pos.flatten(1).norm(dim=1) * self.config.cfg_normalization  # [n]
                norm = out.flatten(1).norm(dim=1)
                scale = torch.where(norm > cap, cap / norm, torch.ones_like(norm))
                out = out * scale.view(n, 1, 1, 1)
        return -out

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents `[N, C, h, w]` -> images `[N, 3, H, W]` in [0, 1]."""
        return decode_images(self.pipe.vae, latents)

    def _noise(self, count: int, generator: torch.Generator | None) -> torch.Tensor:
        """Initial latents `[count, C, h, w]`, standard normal, drawn as `ZImagePipeline` draws them."""
        size = self.config.resolution
        channels = self.pipe.transformer.config.in_channels
        return self.pipe.prepare_latents(count, channels, size, size, torch.float32, self.device, generator)

    # ------------------------------------------------------------------------- shared with every flow adapter
    num_steps, eval_num_steps, trainable_parameters, trainable_modules, prepare, reference = flow_policy.SETUP
    sample, log_prob, likelihood = flow_policy.SAMPLING
    save_pretrained, load_trainable, export_pretrained = flow_policy.CHECKPOINTS
    _inputs, _pick, _outputs = flow_policy.IMAGE_IO  # prompt embeddings in (a row per sample), images out


PLUGIN = ZImagePolicy
