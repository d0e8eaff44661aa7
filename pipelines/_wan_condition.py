"""First-frame conditioning of the `wan` adapter (image-to-video), in the two layouts of diffusers'
`WanImageToVideoPipeline`:

- Wan 2.2 TI2V (``expand_timesteps``): the image's latent `[n, C, 1, h, w]` replaces the first latent frame of the
  transformer's input, whose tokens get timestep 0; the first frame is not generated, so its velocity is set to 0
  (its transitions are the same for every parameter value and cancel in every likelihood ratio), and it is replaced by
  the image's latent before decoding.
- I2V without an image encoder (``in_channels = 2 z_dim + t``): the transformer's input is the latents concatenated
  with a first-frame mask `[n, t, T, h, w]` and the latents of the image followed by black frames `[n, C, T, h, w]`.

Not a plugin: its name starts with an underscore, so the registry skips it.
"""

from __future__ import annotations

import torch


def first_frame_mask(latents: torch.Tensor) -> torch.Tensor:
    """`[1, 1, T, h, w]`: 0 on the first latent frame, 1 elsewhere (diffusers' ``first_frame_mask``)."""
    mask = latents.new_ones((1, 1, *latents.shape[2:]), dtype=torch.float32)
    mask[:, :, 0] = 0
    return mask


def model_input(policy, latents: torch.Tensor, condition: torch.Tensor | None):
    """The transformer's input `[n, C', T, h, w]` for latents `[n, C, T, h, w]` and the mask of generated entries
    (`[1, 1, T, h, w]` for TI2V, else `None`)."""
    if condition is None:
        return latents, None
    condition = condition.to(latents.device, latents.dtype)
    if policy.geometry.expand_timesteps:
        mask = first_frame_mask(latents)
        return (1 - mask) * condition + mask * latents, mask
    return torch.cat([latents, condition], dim=1), None


def final_latents(policy, latents: torch.Tensor, condition: torch.Tensor | None) -> torch.Tensor:
    """The latents to decode: TI2V puts the image's latent in the first frame, as the pipeline does."""
    if condition is None or not policy.geometry.expand_timesteps:
        return latents
    mask = first_frame_mask(latents)
    return (1 - mask) * condition.to(latents.device, latents.dtype) + mask * latents


def _first_images(batch) -> list:
    images = batch.conditions.get("images")
    if images is None or len(images) != len(batch):
        raise ValueError(
            "pipeline.image_to_video: each prompt needs its first frame in the prompt batch's conditions['images'] "
            "(a PIL image or a [3, H, W] tensor in [0, 1]); this batch has none. Use a data source that provides "
            "images, or set image_to_video: false."
        )
    return [image[0] if isinstance(image, (list, tuple)) else image for image in images]


@torch.no_grad()
def encode_first_frames(policy, batch) -> dict[str, torch.Tensor]:
    """``condition`` for every sample of `batch`: TI2V `[N, C, 1, h, w]`, I2V `[N, t + C, T, h, w]`; each distinct image
    object (a group shares one) is encoded once, with the VAE's mode, normalised like the pipeline's latents."""
    cfg, pipe, geometry = policy.config, policy.pipe, policy.geometry
    vae = pipe.vae
    shape = (1, vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean).view(shape).to(policy.device)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(policy.device)
    images, cache = _first_images(batch), {}
    for image in images:
        if id(image) in cache:
            continue
        pixels = image[None] if isinstance(image, torch.Tensor) and image.dim() == 3 else image  # tensors in [0, 1]
        pixels = pipe.video_processor.preprocess(pixels, height=cfg.height, width=cfg.width)  # [1, 3, H, W], [-1, 1]
        video = pixels.to(policy.device, torch.float32).unsqueeze(2)  # [1, 3, 1, H, W]
        if not geometry.expand_timesteps:  # the image, then black frames
            video = torch.cat([video, video.new_zeros((1, 3, cfg.num_frames - 1, cfg.height, cfg.width))], dim=2)
        latent = vae.encode(video.to(vae.dtype)).latent_dist.mode().float()  # [1, C, T or 1, h, w]
        cache[id(image)] = (latent - mean) * inv_std
    rows = [cache[id(image)] for image in images]
    latents = torch.cat(rows)  # [N, C, T or 1, h, w]
    if geometry.expand_timesteps:
        return {"condition": latents}
    n, _, frames, h, w = latents.shape
    t = geometry.temporal
    mask = torch.zeros(n, 1, cfg.num_frames, h, w, device=latents.device)  # 1 on the given (first) pixel frame
    mask[:, :, 0] = 1
    mask = torch.cat([mask[:, :, :1].repeat_interleave(t, dim=2), mask[:, :, 1:]], dim=2)  # [N, 1, t T, h, w]
    mask = mask.view(n, frames, t, h, w).transpose(1, 2)  # [N, t, T, h, w]
    return {"condition": torch.cat([mask, latents], dim=1)}
