"""The video geometry of a Wan model folder, read from its config files without loading weights, and the checks a
`wan` config must pass before any model loads.

Not a plugin: its name starts with an underscore, so the registry skips it.

Wan's VAE compresses time by ``t`` and space by ``s`` (Wan 2.1: ``t = 4``, ``s = 8``; Wan 2.2 TI2V-5B: ``s = 16``) and
its transformer cuts latents into patches ``(p_t, p_h, p_w)`` (``(1, 2, 2)``), so a clip of ``F`` frames of ``H x W``
pixels needs ``(F - 1) % t == 0``, ``H % (s * p_h) == 0`` and ``W % (s * p_w) == 0``, and has latents
``[z_dim, (F - 1) / t + 1, H / s, W / s]``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class WanGeometry:
    """What a Wan folder's configs say about its latents (Wan 2.1 defaults for a hub id, whose files are not read).

    Args:
        temporal (`int`): the VAE's temporal compression ``t``.
        spatial (`int`): the VAE's spatial compression ``s``.
        patch (`tuple[int, int, int]`): the transformer's patch ``(p_t, p_h, p_w)``.
        z_dim (`int`): latent channels.
        in_channels (`int`): the transformer's input channels (``z_dim`` for text-to-video; more for models that
            concatenate an image condition).
        image_dim (`int` or `None`): the width of CLIP image features the transformer takes (Wan 2.1 I2V), or `None`.
        expand_timesteps (`bool`): per-token timesteps (Wan 2.2 TI2V).
        boundary_ratio (`float` or `None`): the two-expert switch (Wan 2.2 A14B), or `None` for one transformer.
        has_transformer_2 (`bool`): whether the folder has a second expert.
        rope_positions (`int`): the rotary positions the transformer has along each axis (``rope_max_seq_len``): a
            clip has at most this many patches in time, height and width.
        local (`bool`): whether these values were read from files (`False`: defaults for a hub id).
    """

    temporal: int = 4
    spatial: int = 8
    patch: tuple[int, int, int] = (1, 2, 2)
    z_dim: int = 16
    in_channels: int = 16
    image_dim: int | None = None
    expand_timesteps: bool = False
    boundary_ratio: float | None = None
    has_transformer_2: bool = False
    rope_positions: int = 1024
    local: bool = False

    def latent_shape(self, num_frames: int, height: int, width: int) -> tuple[int, int, int, int]:
        """``(z_dim, (F - 1) / t + 1, H / s, W / s)``."""
        return (self.z_dim, (num_frames - 1) // self.temporal + 1, height // self.spatial, width // self.spatial)

    def check_size(self, num_frames: int, height: int, width: int, where: str = "pipeline") -> None:
        """Raises a `ValueError` stating the rule when `num_frames`, `height` or `width` do not fit this model (their
        multiples, and at most ``rope_positions`` patches along each axis)."""
        t, s, (pt, ph, pw) = self.temporal, self.spatial, self.patch
        source = "read from the model folder's vae/ and transformer/ configs" if self.local else "Wan 2.1 defaults"
        if num_frames < 1 or (num_frames - 1) % t:
            low = (max(num_frames - 1, 0) // t) * t + 1
            raise ValueError(
                f"{where}.num_frames must be 1 mod {t} (the VAE compresses time by {t}: F = {t} k + 1; {source}), got "
                f"{num_frames}; use {low} or {low + t}."
            )
        most = (self.rope_positions * pt - 1) * t + 1  # frames whose latents fill rope_positions temporal patches
        if num_frames > most:
            raise ValueError(f"{where}.num_frames must be <= {most} (the transformer's {self.rope_positions} rotary "
                             f"positions x temporal patch {pt} x the VAE's compression {t}; {source}), got "
                             f"{num_frames}.")
        for key, value, p in (("height", height, ph), ("width", width, pw)):
            multiple = s * p
            if value <= 0 or value % multiple:
                low = max(value // multiple, 1) * multiple
                raise ValueError(
                    f"{where}.{key} must be a positive multiple of {multiple} (VAE downsampling {s} x transformer "
                    f"patch {p}; {source}), got {value}; use {low} or {low + multiple}."
                )
            if value > self.rope_positions * multiple:
                raise ValueError(
                    f"{where}.{key} must be <= {self.rope_positions * multiple} (the transformer's "
                    f"{self.rope_positions} rotary positions x {multiple} pixels per patch; {source}), got {value}."
                )

    def check_model(self, config, where: str = "pipeline") -> None:
        """Raises a `ValueError` when `config` (a `WanConfig`) asks this model for what it cannot do: image-to-video on
        a text-to-video transformer or the reverse, a CLIP image encoder (Wan 2.1 I2V), ``guidance_scale_2`` without
        a second expert. Nothing is checked for a hub id before loading (its configs are not read); the policy checks
        again with the loaded model's configs."""
        if not self.local:
            return
        concat = 2 * self.z_dim + self.temporal  # I2V transformers take [latents, first-frame mask, image latents]
        if self.image_dim is not None and config.image_to_video:
            raise ValueError(
                f"{where}.image_to_video: this transformer takes CLIP image features (image_dim={self.image_dim}, Wan "
                "2.1 I2V), which this adapter does not compute; use a Wan 2.2 TI2V model (expand_timesteps) or an I2V "
                "model without an image encoder (Wan 2.2 I2V), or a text-to-video model with image_to_video: false."
            )
        if not config.image_to_video and self.in_channels != self.z_dim:
            raise ValueError(
                f"{where}.image_to_video: the transformer takes {self.in_channels} input channels, not the VAE's "
                f"z_dim {self.z_dim}: it is an image-to-video model; set image_to_video: true and give each prompt "
                "an image in conditions['images'], or use a text-to-video model."
            )
        if config.image_to_video and not self.expand_timesteps and self.in_channels != concat:
            raise ValueError(
                f"{where}.image_to_video: this model has no image input (transformer in_channels {self.in_channels}, "
                f"z_dim {self.z_dim}, no expand_timesteps); image-to-video needs a Wan 2.2 TI2V model "
                f"(expand_timesteps: true) or an I2V transformer with in_channels = 2 z_dim + {self.temporal} = "
                f"{concat}; "
                "set image_to_video: false for text-to-video."
            )
        if self.has_transformer_2 and self.boundary_ratio is None:
            raise ValueError(
                f"{where}.pretrained: the model has a transformer_2 but no boundary_ratio in model_index.json, so the "
                "second expert would never run; set the model's boundary_ratio (Wan 2.2 A14B: 0.875 for T2V, 0.9 for "
                "I2V) or remove transformer_2."
            )
        if config.guidance_scale_2 is not None and not self.has_transformer_2:
            raise ValueError(
                f"{where}.guidance_scale_2 is the low-noise expert's guidance, but this model has one transformer "
                "(no transformer_2 / boundary_ratio); leave it out."
            )



def _read(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def read_geometry(location: str) -> WanGeometry:
    """The [`WanGeometry`] of a local Wan folder (``model_index.json``, ``vae/config.json``,
    ``transformer/config.json``), or Wan 2.1's defaults when `location` is not a local folder (a hub id)."""
    root = Path(location)
    if not root.is_dir():
        return WanGeometry()
    index, vae, transformer = _read(root / "model_index.json"), _read(root / "vae" / "config.json"), {}
    for name in ("transformer", "transformer_2"):  # the high-noise expert may be absent (low-noise only)
        transformer = transformer or _read(root / name / "config.json")
    default = WanGeometry()
    second = index.get("transformer_2")
    return WanGeometry(
        temporal=int(vae.get("scale_factor_temporal") or default.temporal),
        spatial=int(vae.get("scale_factor_spatial") or default.spatial),
        patch=tuple(transformer.get("patch_size", default.patch)),
        z_dim=int(vae.get("z_dim", default.z_dim)),
        in_channels=int(transformer.get("in_channels", default.in_channels)),
        image_dim=transformer.get("image_dim"),
        expand_timesteps=bool(index.get("expand_timesteps", False)),
        boundary_ratio=index.get("boundary_ratio"),
        has_transformer_2=isinstance(second, list) and second[0] is not None,
        rope_positions=int(transformer.get("rope_max_seq_len") or default.rope_positions),
        local=True,
    )


def geometry_of(pipe) -> WanGeometry:
    """The [`WanGeometry`] of a loaded Wan pipeline (its modules' configs)."""
    transformer = pipe.transformer
    if transformer is None:
        raise ValueError("this Wan pipeline has no `transformer` (high-noise expert); the adapter needs one.")
    vae = pipe.vae.config
    return WanGeometry(
        temporal=int(vae.get("scale_factor_temporal") or 4),
        spatial=int(vae.get("scale_factor_spatial") or 8),
        patch=tuple(transformer.config.patch_size),
        z_dim=int(vae.z_dim),
        in_channels=int(transformer.config.in_channels),
        image_dim=transformer.config.get("image_dim"),
        expand_timesteps=bool(pipe.config.get("expand_timesteps", False)),
        boundary_ratio=pipe.config.get("boundary_ratio"),
        has_transformer_2=getattr(pipe, "transformer_2", None) is not None,
        rope_positions=int(transformer.config.get("rope_max_seq_len") or 1024),
        local=True,
    )
