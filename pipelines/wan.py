"""Wan 2.1 / 2.2 (video diffusion transformer, rectified flow) as a stochastic policy, with LoRA and optional CFG.

Wraps diffusers' `WanPipeline` components (`WanTransformer3DModel`, `AutoencoderKLWan`, `UMT5EncoderModel` and its
tokenizer, the scheduler's noise levels). RL sampling replaces the pipeline's multistep solver by the shared flow
steps of [`mmgrpo.samplers.flow_sde.flow_sde_step`] on the scheduler's sigma table (the adapter owns no sampling loop:
plans are run by `mmgrpo.samplers.flow_plan`, exactly as for `sd3` and `flux`); a step is the image step on latents
`[N, C, T, h, w]`, its log-density averaged over ``C, T, h, w``:

    mean = x (1 + std_t^2 dt / (2 sigma)) + v (1 + std_t^2 (1 - sigma) / (2 sigma)) dt,
    std_t = a sqrt(sigma / (1 - sigma)),  x' = mean + std_t sqrt(-dt) eps.

One timestep ``1000 sigma`` per sample, shared by every frame, or per token for Wan 2.2 TI2V (``expand_timesteps``);
Wan 2.2 A14B's two experts take the steps with ``sigma >= boundary_ratio`` (``transformer``) and below
(``transformer_2``), each with its own LoRA (or fully trained). Image-to-video conditions the first latent frame on an
image (``conditions["images"]`` of the prompt batch, see [`~mmgrpo.pipelines._wan_condition`]).

Wan: https://arxiv.org/abs/2503.20314 ; Flow-GRPO (video on Wan 2.1): https://arxiv.org/abs/2505.05470
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from mmgrpo.model_limits import GUIDANCE_LIMIT, SHIFT_LIMIT
from mmgrpo.pipelines._flow_common import check_flow_config, guided
from mmgrpo.pipelines import _flow_policy as flow_policy
from mmgrpo.pipelines._flow_policy import load_flow_pipeline
from mmgrpo.pipelines._wan_condition import encode_first_frames, final_latents, model_input
from mmgrpo.pipelines._wan_geometry import geometry_of, read_geometry
from mmgrpo.samplers.flow_plan import PLAN_FEATURES, SCORE_FIELDS
from mmgrpo.types import PromptBatch
from mmgrpo.validation import check_range

TEXT_TOKENS = 4096  # UMT5 has relative positions; Wan is trained with 512 tokens


@dataclass
class WanConfig:
    """Options of [`WanPolicy`]. Defaults follow Flow-GRPO's Wan 2.1 1.3B video setting where it sets one.

    Args:
        pretrained (`str`): a diffusers Wan folder or a hub id (e.g. ``Wan-AI/Wan2.1-T2V-1.3B-Diffusers``).
        height (`int`), width (`int`): frame size in pixels, multiples of the VAE's downsampling times the
            transformer's patch (16 for Wan 2.1, 32 for Wan 2.2 TI2V-5B).
        num_frames (`int`): frames per clip, ``1 mod t`` for the VAE's temporal compression `t` (4): 5, 9, ... 81.
        num_steps (`int`): denoising steps for training rollouts.
        eval_num_steps (`int`, *optional*): denoising steps for evaluation (default: `num_steps`).
        guidance_scale (`float`): classifier-free guidance; 1.0 turns CFG off (one forward per step).
        guidance_scale_2 (`float`, *optional*): the low-noise expert's guidance (Wan 2.2 A14B; default:
            `guidance_scale`).
        negative_prompt (`str`): the unconditional prompt used with CFG.
        max_sequence_length (`int`): UMT5 tokens (Wan: 512).
        flow_shift (`float`, *optional*): overrides the scheduler's sigma shift (Wan 2.1: 3.0 at 480p, 5.0 at 720p).
        lora_rank (`int`): LoRA rank on the transformer(s); 0 trains the whole transformer(s).
        lora_alpha (`int`): LoRA scaling numerator.
        lora_targets (`list[str]`): transformer module names (suffixes) that get LoRA; ``to_q`` ... match both the
            self- and the cross-attention of each block.
        weights_dtype (`str`): dtype of the frozen components (text encoder, VAE, and the base transformer under
            LoRA). Trainable parameters are always float32.
        gradient_checkpointing (`bool`): recompute each transformer block in the backward pass (same gradients,
            activations of one block at a time).
        offload (`bool`): keep the rollout's latents and text embeddings on the CPU between sampling and training;
            each replayed minibatch moves back to the device.
        decode_batch_size (`int`): clips per VAE decode call (the VAE's memory grows with it; one call per clip is the
            smallest).
        image_to_video (`bool`): condition the first frame on the prompt batch's ``conditions["images"]`` (one image
            per prompt); needs a Wan 2.2 TI2V model (``expand_timesteps``) or an I2V transformer without an image
            encoder (``in_channels = 2 z_dim + t``).
    """

    pretrained: str
    height: int = 240
    width: int = 416
    num_frames: int = 33
    num_steps: int = 10
    eval_num_steps: int | None = None
    guidance_scale: float = 4.5
    guidance_scale_2: float | None = None
    negative_prompt: str = ""
    max_sequence_length: int = 512
    flow_shift: float | None = None
    lora_rank: int = 64
    lora_alpha: int = 128
    lora_targets: list[str] = field(
        default_factory=lambda: ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"]
    )
    weights_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    gradient_checkpointing: bool = False
    offload: bool = False
    decode_batch_size: int = 4
    image_to_video: bool = False

    def __post_init__(self):
        location, _ = check_flow_config(self, max_tokens=TEXT_TOKENS)
        check_range("lora_rank", self.lora_rank, 0, fix="0 trains the whole transformer")
        check_range("guidance_scale", self.guidance_scale, 1, fix="1 disables CFG")
        check_range("decode_batch_size", self.decode_batch_size, 1, 1024, fix="1 decodes one clip at a time")
        if self.guidance_scale_2 is not None:
            check_range("guidance_scale_2", self.guidance_scale_2, 1, GUIDANCE_LIMIT,
                        fix="leave it out to use guidance_scale")
        if self.flow_shift is not None:
            check_range("flow_shift", self.flow_shift, 0, SHIFT_LIMIT, low_open=True,
                        fix="leave it out to use the scheduler's")
        geometry = read_geometry(location)
        geometry.check_size(self.num_frames, self.height, self.width)
        geometry.check_model(self, where="pipeline")

    def output_size(self) -> tuple[int, str]:
        """Bytes of one sample's decoded clip (float32 RGB), and the keys that set them: the memory check of
        [`~mmgrpo.preflight.preflight`] reads it."""
        keys = "pipeline.num_frames, pipeline.height or pipeline.width"
        return self.num_frames * 3 * self.height * self.width * 4, keys


class WanPolicy:
    """Wan sampler as a policy: `sample` draws SDE/ODE trajectories of video latents `[N, C, T, h, w]` (the trajectory
    keeps ``latents`` `[N, S + 1, C, T, h, w]` and the text embeddings once per prompt; on the CPU with ``offload``),
    `log_prob` replays their transitions, each through the expert of its noise level, `likelihood` scores the final
    latents; outputs ``videos`` `[N, F, 3, H, W]` in [0, 1]. Set-up, sampling, replay and checkpoints are shared
    with `sd3` and `flux` ([`mmgrpo.pipelines._flow_policy`], at the end of the class)."""

    Config = WanConfig
    modalities = frozenset({"video"})
    plan_families = ("flow",)  # it reads FlowPlan only
    plan_features = PLAN_FEATURES  # merged steps, branches, per-sample units, DPM solver, likelihood
    provides = SCORE_FIELDS  # scoring method -> the Score fields it fills
    capabilities = frozenset({"chunked_rollouts"})  # no teacher_rollout: mmgrpo sft does not fine-tune it
    input_names = ("prompt_index", "shared_prompt_embeds", "shared_negative_prompt_embeds", "condition")  # for replay

    def __init__(self, config: WanConfig):
        from diffusers import WanImageToVideoPipeline, WanPipeline

        self.config = config
        pipeline_cls = WanImageToVideoPipeline if config.image_to_video else WanPipeline
        self.flow = load_flow_pipeline(pipeline_cls, config, offload=config.offload)
        self.pipe = self.flow.pipe
        self.geometry = geometry_of(self.pipe)  # the loaded model's (a hub id's files are read only now)
        self.geometry.check_size(config.num_frames, config.height, config.width)
        self.geometry.check_model(config, where="pipeline")
        if config.flow_shift is not None:
            scheduler = self.pipe.scheduler
            key = "flow_shift" if "flow_shift" in scheduler.config else "shift"
            self.pipe.scheduler = type(scheduler).from_config(scheduler.config, **{key: config.flow_shift})
        self.experts = self.flow.experts  # one trained transformer per expert: [high-noise, low-noise (A14B)]
        self.transformer = self.experts[0].module  # the unwrapped (high-noise) transformer
        self.boundary = self.pipe.config.boundary_ratio if len(self.experts) > 1 else None
        self.device = torch.device("cpu")

    # ------------------------------------------------------------------------------------------------------ model
    def sigmas(self, num_steps: int) -> torch.Tensor:
        """The scheduler's sigmas for `num_steps` steps, `[num_steps + 1]`, ending at 0 (Wan ships UniPC with flow
        sigmas, ``s u / (1 + (s - 1) u)`` of ``u = linspace(1, 1/1000, S + 1)[:-1]``; a flow-matching Euler scheduler
        works too). UniPC lowers a first sigma of 1 by 1e-6 (its guard against ``log 0``); it is taken as 1 here, so
        that an SDE step there follows Flow-GRPO's rule at sigma = 1 instead of a noise scale
        ``sqrt(sigma / (1 - sigma))`` of 1000."""
        scheduler = self.pipe.scheduler
        scheduler.set_timesteps(num_steps, device="cpu")
        sigmas = scheduler.sigmas.float().clone()  # [S + 1]
        if 1 - 1e-4 < float(sigmas[0]) < 1:
            sigmas[0] = 1.0
        if len(sigmas) != num_steps + 1 or sigmas[-1] != 0:
            raise ValueError(
                f"the scheduler of {self.config.pretrained} gives {len(sigmas)} sigmas ending at {float(sigmas[-1])}; "
                f"flow sampling needs {num_steps + 1} ending at 0 (set final_sigmas_type='zero' in its config)."
            )
        return sigmas

    @property
    def do_cfg(self) -> bool:
        return self.config.guidance_scale > 1

    def expert_index(self, sigma) -> int:
        """Which expert takes noise level `sigma`: 0 (``transformer``) when there is one, or ``sigma >=
        boundary_ratio`` (the pipeline's ``t >= boundary_ratio * 1000``), else 1 (``transformer_2``)."""
        return 0 if self.boundary is None or float(sigma) >= self.boundary else 1

    @torch.no_grad()
    def _encode_text(self, texts: list[str]) -> torch.Tensor:
        """UMT5 states `[len(texts), L, D]`, zero past each prompt's tokens (as `WanPipeline.encode_prompt`)."""
        return self.pipe.encode_prompt(
            prompt=texts, do_classifier_free_guidance=False, max_sequence_length=self.config.max_sequence_length,
            device=self.device,
        )[0]

    @torch.no_grad()
    def encode(self, batch: PromptBatch) -> dict[str, torch.Tensor]:
        """Text embeddings computed once per distinct prompt (a group shares them): ``shared_prompt_embeds``
        `[U, L, D]`, ``prompt_index`` `[N]` into them, ``shared_negative_prompt_embeds`` `[1, L, D]` with CFG, and the
        first-frame ``condition`` of image-to-video."""
        position: dict[str, int] = {}
        index = torch.tensor([position.setdefault(p, len(position)) for p in batch.prompts], dtype=torch.long)
        out = {"prompt_index": index, "shared_prompt_embeds": self._encode_text(list(position))}
        if self.do_cfg:
            out["shared_negative_prompt_embeds"] = self._encode_text([self.config.negative_prompt])
        if self.config.image_to_video:
            out.update(encode_first_frames(self, batch))
        return out

    _inputs = encode  # the model inputs of a prompt batch, for the shared sampling

    def _pick(self, embeds: dict, rows: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """The per-sample inputs of samples `rows` (None: all): ``prompt_embeds`` `[r, L, D]`, maybe
        ``negative_prompt_embeds`` and ``condition``."""
        index = embeds["prompt_index"] if rows is None else embeds["prompt_index"][rows.cpu()]
        out = {"prompt_embeds": embeds["shared_prompt_embeds"][index.to(embeds["shared_prompt_embeds"].device)]}
        if "shared_negative_prompt_embeds" in embeds:
            out["negative_prompt_embeds"] = embeds["shared_negative_prompt_embeds"].expand(len(index), -1, -1)
        if "condition" in embeds:
            cond = embeds["condition"]
            out["condition"] = cond if rows is None else cond[rows.to(cond.device)]
        return {k: v.to(self.device) for k, v in out.items()}

    def _timestep(self, sigma, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """``1000 sigma`` per sample `[n]`, or per token `[n, T h w / (p_t p_h p_w)]` with ``expand_timesteps`` (0 on
        the tokens of a conditioning first frame, `mask` `[1 or n, 1, T, h, w]`)."""
        t = torch.as_tensor(sigma, dtype=torch.float32) * self.pipe.scheduler.config.num_train_timesteps
        t = t.to(self.device)
        if not self.geometry.expand_timesteps:
            return t.expand(x.shape[0])
        pt, ph, pw = self.geometry.patch
        if mask is None:
            mask = x.new_ones((1, 1, *x.shape[2:]), dtype=torch.float32)
        tokens = mask[:, 0, ::pt, ::ph, ::pw].flatten(1).float() * t  # [1 or n, L]
        return tokens.expand(x.shape[0], -1)

    def velocity(self, latents, sigma, embeds, guidance: bool = True) -> torch.Tensor:
        """Velocity `[n, C, T, h, w]` for latents `[n, C, T, h, w]` at noise level `sigma` from the expert of that
        level, guided (CFG) unless ``guidance=False`` (the conditional velocity, which the flow-matching likelihood
        scores)."""
        k = self.expert_index(sigma)
        expert = self.experts[k]
        cfg = self.do_cfg and guidance
        dtype = expert.module.dtype
        x, mask = model_input(self, latents.float(), embeds.get("condition"))  # [n, C', T, h, w], first-frame mask
        text = embeds["prompt_embeds"]  # [n, L, D]
        if cfg:
            x, text = torch.cat([x, x]), torch.cat([embeds["negative_prompt_embeds"], text])
        v = expert.forward(
            hidden_states=x.to(dtype), timestep=self._timestep(sigma, x, mask), encoder_hidden_states=text.to(dtype),
            return_dict=False,
        )[0].float()
        if cfg:
            second = k == 1 and self.config.guidance_scale_2 is not None
            v = guided(v, self.config.guidance_scale_2 if second else self.config.guidance_scale)
        if mask is not None:  # the conditioned frame is not generated: its velocity is no model output
            v = v * mask
        return v

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents `[N, C, T, h, w]` -> videos `[N, F, 3, H, W]` in [0, 1], `decode_batch_size` clips per VAE call."""
        vae = self.pipe.vae
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(self.device)
        std = torch.tensor(vae.config.latents_std).view(shape).to(self.device)
        videos = []
        for z in latents.split(self.config.decode_batch_size):
            z = z.to(self.device).float() * std + mean  # the pipeline's latents / (1 / std) + mean
            video = vae.decode(z.to(vae.dtype), return_dict=False)[0]  # [b, 3, F, H, W] in [-1, 1]
            videos.append((video.float() / 2 + 0.5).clamp(0, 1).transpose(1, 2).cpu())  # [b, F, 3, H, W]
        return torch.cat(videos)

    def _outputs(self, latents: torch.Tensor, embeds: dict) -> dict[str, torch.Tensor]:
        return {"videos": self.decode(final_latents(self, latents, embeds.get("condition")))}  # [N, F, 3, H, W]

    def _noise(self, count: int, generator: torch.Generator | None) -> torch.Tensor:
        """Initial latents `[count, z_dim, (F - 1) / t + 1, H / s, W / s]`, standard normal, drawn on the CPU."""
        shape = self.geometry.latent_shape(self.config.num_frames, self.config.height, self.config.width)
        return torch.randn((count, *shape), generator=generator).to(self.device)

    # ------------------------------------------------------------------------- shared with every flow adapter
    # the protocol's members that do not depend on the model: pipelines/_flow_policy.py (`FlowModel`: what they read)
    num_steps, eval_num_steps, trainable_parameters, trainable_modules, prepare, reference = flow_policy.SETUP
    sample, log_prob, likelihood = flow_policy.SAMPLING
    save_pretrained, load_trainable, export_pretrained = flow_policy.CHECKPOINTS


PLUGIN = WanPolicy
