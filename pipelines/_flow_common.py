"""Pieces shared by the flow-matching adapters (`sd3`, `flux`, `wan`...): the checks of their configs (and of the
image adapters' resolution against the 2x2 grouping of their latents), classifier-free
guidance, and one trained transformer (LoRA adapter or full fine-tuning, its reference, its checkpoints). The
pipeline wiring built on them is [`mmgrpo.pipelines._flow_policy`]; sampling, replay and likelihood follow the plan in
[`mmgrpo.samplers.flow_plan`].

Not a plugin: it defines no ``PLUGIN`` and its name starts with an underscore, so the registry skips it.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Callable

import torch

from mmgrpo.reference import ReferenceSwitch
from mmgrpo.hub import resolve_pretrained
from mmgrpo.model_limits import GUIDANCE_LIMIT, RESOLUTION_LIMIT, attention_width, check_lora, read_json
from mmgrpo.validation import check_fields, check_range

LORA_WEIGHTS = "pytorch_lora_weights.safetensors"


def check_flow_config(config, max_tokens: int) -> tuple[str, dict]:
    """The checks every flow adapter's `Config` shares (types from the annotations, step counts, text tokens up to
    `max_tokens`, guidance, LoRA options with the rank bounded by the transformer's attention width where its config
    is readable); resolves ``pretrained``. Returns ``(location, the transformer's config or {})`` for the adapter's
    own `__post_init__`, which adds its resolution and guidance rules."""
    check_fields(config)
    location = resolve_pretrained(config.pretrained, "pipeline.pretrained")  # kept as configured (runs record it)
    check_range("num_steps", config.num_steps, 1, 1000, fix="flow models are trained on 1000 noise levels")
    check_range("max_sequence_length", config.max_sequence_length, 1, max_tokens, fix="the text encoder's tokens")
    check_range("guidance_scale", config.guidance_scale, high=GUIDANCE_LIMIT, fix="real runs use 1 to ~20")
    transformer = read_json(location, "transformer/config.json") or read_json(location, "transformer_2/config.json")
    check_lora(config, attention_width(transformer))
    if config.lora_rank and not config.lora_targets:
        raise ValueError("lora_targets must name at least one module when lora_rank > 0 (0: full fine-tuning).")
    if config.eval_num_steps is not None:
        check_range("eval_num_steps", config.eval_num_steps, 1, 1000, fix="leave it out to use num_steps")
    return location, transformer


def check_resolution(config, grouping: str, fix: str) -> None:
    """The config check of the image adapters whose latents are grouped 2x2 into tokens (`grouping`: ``packing`` or
    ``patches``): ``resolution`` a positive multiple of 16 (8x VAE), at most ``RESOLUTION_LIMIT``; `fix` says up to
    what size the model is trained."""
    if config.resolution <= 0 or config.resolution % 16:
        raise ValueError(f"resolution must be a positive multiple of 16 (8x VAE, 2x2 {grouping}): {config.resolution}.")
    check_range("resolution", config.resolution, 16, RESOLUTION_LIMIT, fix=fix)


def check_packing(pipe, config, grouping: str) -> None:
    """The loaded pipeline's check of the same: ``pipeline.resolution`` a multiple of twice the VAE's downsampling
    (``pipe.vae_scale_factor``, read from the model), so the latents split into 2x2 groups (`grouping`)."""
    multiple = 2 * pipe.vae_scale_factor
    if config.resolution % multiple:
        raise ValueError(
            f"pipeline.resolution {config.resolution} is not a multiple of {multiple} (2x2 {grouping} of the "
            f"{pipe.vae_scale_factor}x-downsampled latents of {config.pretrained}); choose a multiple of {multiple}."
        )


def image_bytes(resolution: int) -> int:
    """Bytes of one decoded square image, float32 RGB of side `resolution` (the `Config.output_size` of the image
    adapters)."""
    return 3 * resolution**2 * 4


def decode_images(vae, latents: torch.Tensor) -> torch.Tensor:
    """Latents `[N, C, h, w]` -> images `[N, 3, H, W]` in [0, 1] through a diffusers `AutoencoderKL` (its scaling and
    shift factors undone, as the SD3 and FLUX pipelines do)."""
    z = latents.to(vae.dtype) / vae.config.scaling_factor + (vae.config.shift_factor or 0.0)
    images = vae.decode(z, return_dict=False)[0]
    return (images.float() / 2 + 0.5).clamp(0, 1)


def guided(v: torch.Tensor, scale: float) -> torch.Tensor:
    """Classifier-free guidance of velocities `[2n, ...]` (unconditional first, then conditional) -> `[n, ...]`:
    ``v_uncond + scale (v_text - v_uncond)``."""
    n = v.shape[0] // 2
    v_uncond, v_text = v[:n], v[n:]
    return v_uncond + scale * (v_text - v_uncond)


def _adapters_off(transformer: torch.nn.Module) -> Callable[[], contextlib.AbstractContextManager]:
    """A context factory that disables a diffusers model's adapters (it has no peft ``disable_adapter`` context)."""

    @contextlib.contextmanager
    def off():
        transformer.disable_adapters()
        try:
            yield
        finally:
            transformer.enable_adapters()

    return off


class TrainableTransformer:
    """The trained part of a diffusers pipeline: a peft LoRA adapter on its transformer, or the whole transformer
    with a frozen copy of its initial weights as the reference policy.

    Args:
        transformer (`torch.nn.Module`): the pipeline's (frozen, `eval()`) transformer; modified in place.
        lora_rank (`int`): LoRA rank; 0 trains the whole transformer.
        lora_alpha (`int`): LoRA scaling numerator.
        lora_targets (`list[str]`): module names (suffixes) that get LoRA.
        base_model (`str`, *optional*): the base model as configured, recorded in the LoRA's adapter metadata.

    Attributes:
        module (`torch.nn.Module`): the unwrapped transformer (checkpoints, adapters).
        forward (`torch.nn.Module`): what forwards run through: the module, its DDP/FSDP wrapper after
            [`~TrainableTransformer.prepare`], or the frozen copy inside [`~TrainableTransformer.reference`].
    """

    def __init__(self, transformer: torch.nn.Module, *, lora_rank: int, lora_alpha: int, lora_targets: list[str],
                 base_model: str | None = None):
        self.lora = lora_rank > 0
        if self.lora:
            from peft import LoraConfig

            transformer.add_adapter(
                LoraConfig(
                    r=lora_rank, lora_alpha=lora_alpha, init_lora_weights="gaussian", target_modules=lora_targets,
                )
            )
            transformer.peft_config["default"].base_model_name_or_path = base_model  # saved in the LoRA's metadata
            for param in transformer.parameters():
                if param.requires_grad:
                    param.data = param.data.float()  # trainable parameters are always float32
        else:
            transformer.float().requires_grad_(True)
        self.module = transformer
        self.switch = ReferenceSwitch(transformer, _adapters_off(transformer) if self.lora else None)

    @property
    def forward(self) -> torch.nn.Module:
        return self.switch.forward

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.module.parameters() if p.requires_grad]

    def prepare(self, accelerator) -> list[torch.nn.Module]:
        """Moves the frozen reference to the accelerator's device and wraps the trained module for distribution."""
        return self.switch.prepare(accelerator)

    def reference(self):
        """Forwards run through the reference: LoRA adapter disabled, or the frozen initial transformer."""
        return self.switch.reference()

    def save(self, path: str | Path, pipeline_cls: type, name: str = "transformer") -> None:
        """Writes a diffusers LoRA file with its adapter metadata (``pipeline_cls.load_lora_weights(path)`` reads it;
        for a pipeline class without a LoRA loader, the transformer's own adapter file, read by
        ``pipe.transformer.load_lora_adapter(path, prefix=None, use_safetensors=True)``) or, when fully fine-tuned, a
        ``transformer/`` folder that replaces the base pipeline's.

        A pipeline with a second trained transformer (Wan 2.2's ``transformer_2``) saves it with its component `name`:
        its LoRA file goes to ``path/<name>/``, its full weights to ``path/<name>/`` too."""
        path = Path(path)
        if self.lora and name != "transformer":
            path = path / name
        path.mkdir(parents=True, exist_ok=True)
        if self.lora:
            from diffusers.loaders.lora_base import LoraBaseMixin
            from peft.utils import get_peft_model_state_dict

            if not issubclass(pipeline_cls, LoraBaseMixin):  # no LoRA loader (HunyuanVideo 1.5): the model's own file
                self.module.save_lora_adapter(path, adapter_name="default", safe_serialization=True)
                return
            pipeline_cls.save_lora_weights(
                path,
                transformer_lora_layers=get_peft_model_state_dict(self.module),
                transformer_lora_adapter_metadata=self.module.peft_config["default"].to_dict(),
                safe_serialization=True,
            )
        else:
            self.module.save_pretrained(path / name)

    def load(self, path: str | Path, name: str = "transformer") -> None:
        """Loads weights written by [`~TrainableTransformer.save`] (with the same component `name`) into the trained
        module."""
        path = Path(path)
        if self.lora and name != "transformer":
            path = path / name
        if self.lora:
            from peft.utils import set_peft_model_state_dict
            from safetensors.torch import load_file

            if not (path / LORA_WEIGHTS).is_file():
                raise FileNotFoundError(
                    f"No LoRA file {path / LORA_WEIGHTS}: this policy trains a LoRA (lora_rank > 0); point at a folder "
                    f"written by its save_pretrained, or set lora_rank: 0 to load a full transformer/ folder."
                )
            state = {k.removeprefix("transformer."): v for k, v in load_file(path / LORA_WEIGHTS).items()}
            result = set_peft_model_state_dict(self.module, state)
            if getattr(result, "unexpected_keys", None):
                raise ValueError(
                    f"LoRA file {path / LORA_WEIGHTS} has keys this model lacks: {result.unexpected_keys[:3]}"
                )
        else:
            loaded = type(self.module).from_pretrained(path / name, use_safetensors=True)  # never a pickle
            self.module.load_state_dict(loaded.state_dict())
