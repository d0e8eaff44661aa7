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

import contextlib
from dataclasses import dataclass, field
from typing import Literal

import torch

from mmgrpo.hub import DTYPES, load_diffusers_pipeline
from mmgrpo.model_limits import GUIDANCE_LIMIT, SHIFT_LIMIT
from mmgrpo.pipelines._flow_common import TrainableTransformer, check_flow_config
from mmgrpo.pipelines._wan_condition import encode_first_frames, final_latents, model_input
from mmgrpo.pipelines._wan_geometry import geometry_of, read_geometry
from mmgrpo.samplers.flow_plan import PLAN_FEATURES, SCORE_FIELDS, plan_likelihood, replay_plan, run_plan
from mmgrpo.types import PromptBatch, Rollout, Score
from mmgrpo.plans import FlowPlan
from mmgrpo.validation import check_range

EXPERTS = ("transformer", "transformer_2")
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
    """Wan sampler as a policy: `sample` draws SDE/ODE trajectories of video latents, `log_prob` replays them."""

    Config = WanConfig
    modalities = frozenset({"video"})
    plan_families = ("flow",)  # it reads FlowPlan only
    plan_features = PLAN_FEATURES  # merged steps, branches, per-sample units, DPM solver, likelihood
    provides = SCORE_FIELDS  # scoring method -> the Score fields it fills
    capabilities = frozenset()  # no optional members (no teacher_rollout: mmgrpo sft does not fine-tune it)

    def __init__(self, config: WanConfig):
        from diffusers import WanImageToVideoPipeline, WanPipeline

        self.config = config
        self.pipeline_cls = WanImageToVideoPipeline if config.image_to_video else WanPipeline
        self.pipe = load_diffusers_pipeline(self.pipeline_cls, config.pretrained, dtype=DTYPES[config.weights_dtype])
        self.pipe.set_progress_bar_config(disable=True)
        self.geometry = geometry_of(self.pipe)  # the loaded model's (a hub id's files are read only now)
        self.geometry.check_size(config.num_frames, config.height, config.width)
        self.geometry.check_model(config, where="pipeline")
        if config.flow_shift is not None:
            scheduler = self.pipe.scheduler
            key = "flow_shift" if "flow_shift" in scheduler.config else "shift"
            self.pipe.scheduler = type(scheduler).from_config(scheduler.config, **{key: config.flow_shift})
        for name in ("text_encoder", "vae", "image_encoder", *EXPERTS):
            module = getattr(self.pipe, name, None)
            if module is not None:
                module.requires_grad_(False).eval()
        self.experts = []  # one trained transformer per expert: [high-noise, low-noise (Wan 2.2 A14B)]
        for name in EXPERTS:
            module = getattr(self.pipe, name, None)
            if module is None:
                continue
            if config.gradient_checkpointing:
                module.enable_gradient_checkpointing()
            self.experts.append(TrainableTransformer(
                module, lora_rank=config.lora_rank, lora_alpha=config.lora_alpha, lora_targets=config.lora_targets,
                base_model=config.pretrained,
            ))
        self.transformer = self.experts[0].module  # the unwrapped (high-noise) transformer
        self.boundary = self.pipe.config.boundary_ratio if len(self.experts) > 1 else None
        self.device = torch.device("cpu")

    # ----------------------------------------------------------------------------------------------------- set-up
    def trainable_parameters(self):
        return [p for expert in self.experts for p in expert.parameters()]

    def trainable_modules(self) -> dict[str, torch.nn.Module]:
        return {name: expert.module for name, expert in zip(EXPERTS, self.experts)}

    @property
    def num_steps(self) -> int:
        return self.config.num_steps

    @property
    def eval_num_steps(self) -> int:
        return self.config.eval_num_steps or self.config.num_steps

    def prepare(self, accelerator) -> list[torch.nn.Module]:
        """Moves every component to the accelerator's device and wraps the trainable module(s) for distribution."""
        self.device = accelerator.device
        self.pipe.to(self.device)
        return [wrapped for expert in self.experts for wrapped in expert.prepare(accelerator)]

    @contextlib.contextmanager
    def reference(self):
        """The reference policy: LoRA adapters disabled, or the frozen initial transformer(s) when fully fine-tuned."""
        with contextlib.ExitStack() as stack:
            for expert in self.experts:
                stack.enter_context(expert.reference())
            yield

    # --------------------------------------------------------------------------------------------------- sampling
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
        n = latents.shape[0]
        x, mask = model_input(self, latents.float(), embeds.get("condition"))  # [n, C', T, h, w], first-frame mask
        text = embeds["prompt_embeds"]  # [n, L, D]
        if cfg:
            x, text = torch.cat([x, x]), torch.cat([embeds["negative_prompt_embeds"], text])
        v = expert.forward(
            hidden_states=x.to(dtype), timestep=self._timestep(sigma, x, mask), encoder_hidden_states=text.to(dtype),
            return_dict=False,
        )[0].float()
        if cfg:
            scale = self.config.guidance_scale
            if k == 1 and self.config.guidance_scale_2 is not None:
                scale = self.config.guidance_scale_2
            v_uncond, v_text = v[:n], v[n:]
            v = v_uncond + scale * (v_text - v_uncond)
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

    def _model(self, embeds: dict[str, torch.Tensor], guidance: bool = True):
        """``velocity(latents [r, ...], sigma, rows)`` over the samples `rows` (None: all) of `embeds`."""

        def velocity(x, sigma, rows=None):
            return self.velocity(x, sigma, self._pick(embeds, rows), guidance=guidance)

        return velocity

    def _noise(self, count: int, generator: torch.Generator | None) -> torch.Tensor:
        """Initial latents `[count, z_dim, (F - 1) / t + 1, H / s, W / s]`, standard normal, drawn on the CPU."""
        shape = self.geometry.latent_shape(self.config.num_frames, self.config.height, self.config.width)
        return torch.randn((count, *shape), generator=generator).to(self.device)

    def _embeds(self, trajectory: dict) -> dict[str, torch.Tensor]:
        names = ("prompt_index", "shared_prompt_embeds", "shared_negative_prompt_embeds", "condition")
        return {k: trajectory[k] for k in names if k in trajectory}

    @torch.no_grad()
    def sample(self, batch: PromptBatch, plan: FlowPlan, *, generator: torch.Generator | None = None) -> Rollout:
        """Samples one video per prompt following `plan` (SDE on `plan.sde_steps`, ODE elsewhere; merged steps,
        branches from a shared anchor, the DPM solver: see `mmgrpo.samplers.flow_plan`).

        The trajectory keeps every latent (`latents` `[N, S + 1, C, T, h, w]`), the text embeddings (once per prompt)
        and the noise level of each step, so `log_prob` can re-score exactly the transitions taken; with ``offload``
        its tensors are kept on the CPU.
        """
        n = len(batch)
        embeds = self.encode(batch)
        group_ids = batch.group_ids if batch.group_ids is not None else torch.arange(n)
        trajectory, log_probs, mask, group_ids = run_plan(
            self._model(embeds), self._noise, self.sigmas(plan.num_steps), plan, group_ids, batch.member_ids, generator
        )
        videos = self.decode(final_latents(self, trajectory["latents"][:, -1], embeds.get("condition")))
        trajectory = {**trajectory, **embeds}
        if self.config.offload:
            trajectory = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in trajectory.items()}
        return Rollout(
            group_ids=group_ids,
            outputs={"videos": videos},  # [N, F, 3, H, W] in [0, 1]
            old_log_probs=log_probs,  # [N, S]
            mask=mask,
            trajectory=trajectory,  # latents [N, S + 1, C, T, h, w], embeddings, shared_* step parameters
        )

    def log_prob(self, rollout: Rollout, steps: list[int]) -> Score:
        """Replays transitions `steps` under the current parameters (with gradients), for the samples that train
        them (`rollout.mask`).

        Returns:
            [`Score`] with `log_prob` `[n, k]`, `mean` `[n, k, C, T, h, w]`, ``std`` `[n, k, 1, 1, 1, 1]` and ``mask``
            `[n, k]` (which entries are replayed transitions).
        """
        model = self._model(self._embeds(rollout.trajectory))
        return replay_plan(model, rollout.trajectory, rollout.group_ids, rollout.mask, steps, self.device)

    def likelihood(self, rollout: Rollout, steps: list[int]) -> Score:
        """Minus the flow-matching loss of the final latents at noise levels ``sigmas[j]``, `j` in `steps`, with noise
        shared within a group; the conditional velocity (no CFG), with gradients.

        Returns:
            [`Score`] with `log_prob` `[n, k]`, `velocity` `[n, k, C, T, h, w]` and ``group_ids`` `[n]`.
        """
        model = self._model(self._embeds(rollout.trajectory), guidance=False)
        return plan_likelihood(model, self._noise, rollout.trajectory, rollout.group_ids, steps, self.device)

    # ------------------------------------------------------------------------------------------------ checkpoints
    def save_pretrained(self, path: str) -> None:
        """Writes the trainable weights: a diffusers LoRA file (``pipe.load_lora_weights(path)`` reads it; the second
        expert's in ``transformer_2/``, read with ``load_into_transformer_2=True``) or, when fully fine-tuned,
        ``transformer/`` (and ``transformer_2/``) folders that replace the base pipeline's."""
        for name, expert in zip(EXPERTS, self.experts):
            expert.save(path, self.pipeline_cls, name=name)

    def load_trainable(self, path: str) -> None:
        """Loads weights written by [`~WanPolicy.save_pretrained`] into this policy."""
        for name, expert in zip(EXPERTS, self.experts):
            expert.load(path, name=name)

    def export_pretrained(self, path: str, merge_lora: bool = False) -> None:
        """Writes the whole diffusers pipeline with the trained weights (LoRA fused into each expert, or in
        ``lora/``), loadable with the pipeline class's ``from_pretrained`` (see [`mmgrpo.export.export_diffusers`])."""
        from mmgrpo.export import export_diffusers

        export_diffusers(self, self.pipeline_cls, self.config.pretrained, path, merge_lora, self.config.lora_rank > 0)


PLUGIN = WanPolicy
