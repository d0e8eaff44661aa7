"""HunyuanVideo 1.5 text-to-video (rectified flow) as a stochastic policy, with LoRA and CFG.

Wraps diffusers' `HunyuanVideo15Pipeline` components (`HunyuanVideo15Transformer3DModel`,
`AutoencoderKLHunyuanVideo15`, the Qwen2.5-VL text model and the ByT5 glyph encoder with their tokenizers,
`FlowMatchEulerDiscreteScheduler`). What is HunyuanVideo 1.5's own, as the stock pipeline does it: two text streams
(Qwen2.5-VL's third-to-last hidden states of the chat-templated prompt with the template's 108 tokens cropped, and
ByT5 states of the quoted text of the prompt, zero when it quotes none), each padded with its mask; the transformer
takes the latents `[N, C, T, h, w]` concatenated with zero first-frame latents and a zero mask (text-to-video),
all-zero image embeddings (which it masks out: one position here, 729 in the stock pipeline, with the same outputs),
the timestep ``1000 sigma``, and predicts the velocity; CFG is the
guider's ``uncond + s (cond - uncond)`` against the negative prompt (the stock default: the empty prompt). Noise
levels are the stock ``linspace(1, 0, S + 1)[:-1]`` shifted by the scheduler (``flow_shift`` overrides its shift).
Sampling, replay and checkpoints are the shared flow steps ([`mmgrpo.pipelines._flow_policy`], as `wan`).

The guider's own scale in the model folder is not read: ``guidance_scale`` sets CFG here (an exported pipeline keeps
the base folder's guider). Model: https://github.com/Tencent-Hunyuan/HunyuanVideo-1.5 ;
report: https://arxiv.org/abs/2511.18870
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from mmgrpo.model_limits import SHIFT_LIMIT
from mmgrpo.pipelines._flow_common import check_flow_config, guided
from mmgrpo.pipelines import _flow_policy as flow_policy
from mmgrpo.pipelines._flow_policy import load_flow_pipeline
from mmgrpo.samplers.flow_plan import PLAN_FEATURES, SCORE_FIELDS
from mmgrpo.validation import check_range

TEXT_KEYS = ("embeds", "mask", "embeds_2", "mask_2")  # the two text streams and their masks, as encode_prompt


@dataclass
class HunyuanVideo15Config:
    """Options of [`HunyuanVideo15Policy`]; names and meanings are `HunyuanVideo15Pipeline.__call__`'s where it has
    them. Defaults follow UniRL's HunyuanVideo 1.5 480p recipe where it sets one.

    Args:
        pretrained (`str`): a diffusers HunyuanVideo 1.5 folder or a hub id (e.g.
            ``hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v``).
        height (`int`), width (`int`): frame size in pixels, multiples of the VAE's spatial compression (16) times
            the transformer's patch (1).
        num_frames (`int`): frames per clip, ``1 mod t`` for the VAE's temporal compression `t` (4): 5, 9, ... 121.
        num_steps (`int`): denoising steps for training rollouts.
        eval_num_steps (`int`, *optional*): denoising steps for evaluation (default: `num_steps`).
        guidance_scale (`float`): classifier-free guidance ``uncond + s (cond - uncond)``; 1 turns it off.
        negative_prompt (`str`): the unconditional prompt used with CFG (the stock default is the empty prompt).
        max_sequence_length (`int`): Qwen2.5-VL tokens after the template (the pipeline's ``tokenizer_max_length``,
            1000); the transformer masks the padding.
        glyph_max_length (`int`): ByT5 tokens of the quoted text (the pipeline's ``tokenizer_2_max_length``, 256).
        flow_shift (`float`, *optional*): overrides the scheduler's sigma shift (HunyuanVideo 1.5: 5 at 480p, 7 at 720p
            in the released schedulers).
        lora_rank (`int`): LoRA rank on the transformer; 0 trains the whole transformer.
        lora_alpha (`int`): LoRA scaling numerator.
        lora_targets (`list[str]`): transformer module names (suffixes) that get LoRA.
        weights_dtype (`str`): dtype of the frozen components (text encoders, VAE, and the base transformer under
            LoRA). Trainable parameters are always float32.
        gradient_checkpointing (`bool`): recompute each transformer block in the backward pass.
        offload (`bool`): keep the rollout's latents and text embeddings on the CPU between sampling and training.
    """

    pretrained: str
    height: int = 480
    width: int = 848
    num_frames: int = 33
    num_steps: int = 16
    eval_num_steps: int | None = None
    guidance_scale: float = 6.0
    negative_prompt: str = ""
    max_sequence_length: int = 1000
    glyph_max_length: int = 256
    flow_shift: float | None = None
    lora_rank: int = 64
    lora_alpha: int = 128
    lora_targets: list[str] = field(
        default_factory=lambda: [
            "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
            "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
        ]
    )
    weights_dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    gradient_checkpointing: bool = False
    offload: bool = False

    def __post_init__(self):
        check_flow_config(self, max_tokens=1000)
        check_range("guidance_scale", self.guidance_scale, 1, fix="1 disables CFG")
        check_range("glyph_max_length", self.glyph_max_length, 1, 1024, fix="the pipeline uses 256 ByT5 tokens")
        check_range("height", self.height, 1, 4096, fix="a multiple of 16")
        check_range("width", self.width, 1, 4096, fix="a multiple of 16")
        check_range("num_frames", self.num_frames, 1, 1024, fix="1 mod 4, e.g. 33 or 121")
        if self.flow_shift is not None:
            check_range("flow_shift", self.flow_shift, 0, SHIFT_LIMIT, low_open=True,
                        fix="leave it out to use the scheduler's")

    def output_size(self) -> tuple[int, str]:
        """Bytes of one sample's decoded clip (float32 RGB), and the keys that set them (for the preflight)."""
        keys = "pipeline.num_frames, pipeline.height or pipeline.width"
        return self.num_frames * 3 * self.height * self.width * 4, keys


class HunyuanVideo15Policy:
    """HunyuanVideo 1.5 sampler as a policy: `sample` draws SDE/ODE trajectories of video latents `[N, C, T, h, w]`
    (the trajectory keeps ``latents`` `[N, S + 1, C, T, h, w]` and both text streams once per prompt), `log_prob`
    replays their transitions, `likelihood` scores the final latents; outputs ``videos`` `[N, F, 3, H, W]` in [0, 1].
    Set-up, sampling, replay and checkpoints are shared with the other flow adapters (at the end of the class)."""

    Config = HunyuanVideo15Config
    modalities = frozenset({"video"})
    plan_families = ("flow",)
    plan_features = PLAN_FEATURES
    provides = SCORE_FIELDS
    capabilities = frozenset({"chunked_rollouts"})
    input_names = ("prompt_index", *(f"shared_{k}" for k in TEXT_KEYS), *(f"shared_negative_{k}" for k in TEXT_KEYS))

    def __init__(self, config: HunyuanVideo15Config):
        from diffusers import HunyuanVideo15Pipeline

        self.config = config
        self.flow = load_flow_pipeline(HunyuanVideo15Pipeline, config, offload=config.offload)
        self.pipe = self.flow.pipe
        self.pipe.tokenizer_max_length = config.max_sequence_length
        self.pipe.tokenizer_2_max_length = config.glyph_max_length
        if config.flow_shift is not None:
            scheduler = self.pipe.scheduler
            self.pipe.scheduler = type(scheduler).from_config(scheduler.config, shift=config.flow_shift)
        self._check_size()
        self.trainable = self.flow.experts[0]
        self.transformer = self.trainable.module
        self.device = torch.device("cpu")

    def _check_size(self) -> None:
        """Frames ``1 mod t`` and sides multiples of ``s p`` for the loaded VAE's compressions and the patch."""
        c, t = self.config, self.pipe.vae_scale_factor_temporal
        side = self.pipe.vae_scale_factor_spatial * self.pipe.transformer.config.patch_size
        if (c.num_frames - 1) % t:
            raise ValueError(f"pipeline.num_frames must be 1 mod {t} (the VAE's temporal compression); got "
                             f"{c.num_frames}: use {c.num_frames - (c.num_frames - 1) % t} or "
                             f"{c.num_frames - (c.num_frames - 1) % t + t}.")
        for name, size in (("height", c.height), ("width", c.width)):
            if size % side:
                raise ValueError(f"pipeline.{name} must be a multiple of {side} (VAE spatial compression x patch) "
                                 f"for {c.pretrained}; got {size}.")

    # ------------------------------------------------------------------------------------------------------ model
    def sigmas(self, num_steps: int) -> torch.Tensor:
        """The stock sigmas `[num_steps + 1]`: ``linspace(1, 0, S + 1)[:-1]`` shifted by the scheduler, then 0."""
        import numpy as np

        scheduler = self.pipe.scheduler
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 0.0, num_steps + 1)[:-1], device="cpu")
        return scheduler.sigmas.float().clone()  # [S + 1]

    @property
    def do_cfg(self) -> bool:
        return self.config.guidance_scale > 1

    @torch.no_grad()
    def _encode_text(self, texts: list[str]) -> dict[str, torch.Tensor]:
        """Both text streams of `texts` and their masks (``embeds`` `[n, L, D]`, ``mask`` `[n, L]`, ``embeds_2``
        `[n, L2, D2]`, ``mask_2`` `[n, L2]`), as `HunyuanVideo15Pipeline.encode_prompt` gives them."""
        out = self.pipe.encode_prompt(prompt=list(texts), device=self.device, dtype=self.transformer.dtype,
                                      batch_size=len(texts))
        return dict(zip(TEXT_KEYS, out))

    # text inputs computed once per distinct prompt (`_encode_text`), picked per sample
    encode, _pick = flow_policy.DISTINCT_PROMPTS
    _inputs = encode  # the model inputs of a prompt batch, for the shared sampling

    def velocity(self, latents: torch.Tensor, sigma, picked: dict, guidance: bool = True) -> torch.Tensor:
        """Velocity `[n, C, T, h, w]` in float32 for latents `[n, C, T, h, w]` at noise level `sigma`; CFG unless
        ``guidance=False`` (the conditional velocity)."""
        cfg = self.do_cfg and guidance
        dtype = self.transformer.dtype
        n = latents.shape[0]
        text = [picked[k] for k in TEXT_KEYS]
        if cfg:  # unconditional first, as `guided` reads them
            text = [torch.cat([picked[f"negative_{k}"], t]) for k, t in zip(TEXT_KEYS, text)]
        x = latents.to(dtype)
        x = torch.cat([x, x]) if cfg else x  # [b, C, T, h, w]
        b, _, frames, h, w = x.shape
        # text-to-video: zero first-frame latents and mask; all-zero image embeddings, which the transformer masks out
        # of its attention (one position instead of the stock 729: the same outputs, ~700 fewer tokens per forward)
        model_input = torch.cat([x, x.new_zeros(b, x.shape[1] + 1, frames, h, w)], dim=1)  # [b, 2C + 1, T, h, w]
        image_embeds = x.new_zeros(b, 1, self.pipe.vision_states_dim)
        t = torch.as_tensor(sigma, dtype=torch.float32) * self.pipe.scheduler.config.num_train_timesteps
        v = self.trainable.forward(
            hidden_states=model_input, image_embeds=image_embeds, timestep=t.to(self.device, dtype).expand(b),
            encoder_hidden_states=text[0], encoder_attention_mask=text[1], encoder_hidden_states_2=text[2],
            encoder_attention_mask_2=text[3], return_dict=False,
        )[0].float()  # [b, C, T, h, w]
        return guided(v, self.config.guidance_scale) if cfg else v

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents `[N, C, T, h, w]` -> videos `[N, F, 3, H, W]` in [0, 1], one clip per VAE call (the VAE's
        attention in diffusers 0.42 takes one clip at a time)."""
        vae = self.pipe.vae
        videos = []
        for z in latents.split(1):
            z = z.to(self.device, vae.dtype) / vae.config.scaling_factor
            video = vae.decode(z, return_dict=False)[0]  # [1, 3, F, H, W] in [-1, 1]
            videos.append((video.float() / 2 + 0.5).clamp(0, 1).transpose(1, 2).cpu())  # [1, F, 3, H, W]
        return torch.cat(videos)

    def _outputs(self, latents: torch.Tensor, inputs: dict) -> dict[str, torch.Tensor]:
        return {"videos": self.decode(latents)}  # [N, F, 3, H, W]

    def _noise(self, count: int, generator: torch.Generator | None) -> torch.Tensor:
        """Initial latents `[count, C, (F - 1) / t + 1, H / s, W / s]`, standard normal, drawn on the CPU (as the
        pipeline's ``prepare_latents`` draws them there)."""
        c, pipe = self.config, self.pipe
        shape = (count, pipe.num_channels_latents, (c.num_frames - 1) // pipe.vae_scale_factor_temporal + 1,
                 c.height // pipe.vae_scale_factor_spatial, c.width // pipe.vae_scale_factor_spatial)
        return torch.randn(shape, generator=generator).to(self.device)

    # ------------------------------------------------------------------------- shared with every flow adapter
    num_steps, eval_num_steps, trainable_parameters, trainable_modules, prepare, reference = flow_policy.SETUP
    sample, log_prob, likelihood = flow_policy.SAMPLING
    save_pretrained, load_trainable, export_pretrained = flow_policy.CHECKPOINTS


PLUGIN = HunyuanVideo15Policy
