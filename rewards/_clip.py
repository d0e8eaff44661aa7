"""open_clip loading and CLIP image preprocessing shared by `clip_score`, `aesthetic` and `pickscore` (not a plugin)."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from mmgrpo.rewards._common import BATCH_LIMIT, resolve_device
from mmgrpo.validation import check_range, check_text


def looks_like_file(value: str | None) -> bool:
    """Whether a ``pretrained`` value names a local file rather than an open_clip tag such as ``"openai"``."""
    return bool(value) and (os.sep in value or "/" in value or value.endswith((".bin", ".pt", ".pth", ".safetensors")))


def check_source(reward: str, model_name: str, pretrained: str | None) -> None:
    """Config-time checks of a CLIP source, with errors that say which file is needed and which key to set."""
    if model_name.startswith("local-dir:"):
        folder = os.path.expanduser(model_name[len("local-dir:"):])
        if not os.path.isfile(os.path.join(folder, "open_clip_config.json")):
            raise ValueError(
                f"{reward}.model_name={model_name!r}: the folder needs open_clip_config.json (with 'model_cfg') and "
                f"the weights (open_clip_model.safetensors or open_clip_pytorch_model.bin); point {reward}.model_name "
                f"at 'local-dir:<folder holding them>'."
            )
    elif looks_like_file(pretrained) and not os.path.isfile(os.path.expanduser(pretrained)):
        raise ValueError(
            f"{reward}.pretrained={pretrained!r}: no such file. It must be an open_clip checkpoint of "
            f"{model_name} (e.g. open_clip_pytorch_model.bin downloaded from the model's hub page); set "
            f"{reward}.pretrained to its path, or to an open_clip tag such as 'openai' when the hub is reachable."
        )


def check_options(reward: str, config) -> None:
    """Config-time checks shared by the open_clip rewards, on `config`'s ``model_name``, ``pretrained``,
    ``batch_size`` and ``device``: names not blank, at least one image per forward, the source as [`check_source`]."""
    check_text(f"{reward}.model_name", config.model_name)
    check_text(f"{reward}.device", config.device)
    check_range(f"{reward}.batch_size", config.batch_size, 1, BATCH_LIMIT, fix="images per CLIP forward")
    check_source(reward, config.model_name, config.pretrained)


def load_open_clip(reward: str, model_name: str, pretrained: str | None, device: str):
    """Builds an open_clip model (eval mode, on `device`) and its tokenizer.

    Args:
        reward (`str`): the reward's name, for errors.
        model_name (`str`): a built-in open_clip name (``"ViT-L-14"``), ``"local-dir:<folder>"`` or ``"hf-hub:org/repo"``.
        pretrained (`str`, *optional*): an open_clip tag (``"openai"``) or a local checkpoint file; None builds
            random weights (tests only).
        device (`str`): ``"auto"`` (CUDA when available), ``"cpu"``, ``"cuda"``, ``"cuda:1"``...

    Returns:
        `tuple`: ``(model, tokenizer)``.
    """
    import open_clip

    device = resolve_device(device)
    pretrained = os.path.expanduser(pretrained) if looks_like_file(pretrained) else pretrained
    try:
        model = open_clip.create_model(model_name, pretrained=pretrained, device=device)
    except Exception as err:  # open_clip raises RuntimeError / OSError for missing weights and offline hubs
        raise RuntimeError(
            f"{reward}: could not load the CLIP weights model_name={model_name!r}, pretrained={pretrained!r} "
            f"({err}). Without network access, download the checkpoint (open_clip_pytorch_model.bin of {model_name}) "
            f"and set {reward}.pretrained=<path of that file>, or set {reward}.model_name='local-dir:<folder>' with "
            f"open_clip_config.json and the weights in it."
        ) from err
    return model.eval().requires_grad_(False), open_clip.get_tokenizer(model_name)


def resize_crop_normalize(images: torch.Tensor, size, mean, std, device) -> torch.Tensor:
    """CLIP's eval transform on tensors: resize the shorter side (bicubic, antialiased), centre-crop, normalise.

    Args:
        images (`torch.FloatTensor` of shape `[M, 3, H, W]`): values in [0, 1].
        size (`int` or `tuple[int, int]`): output side, or (height, width).
        mean, std (`Sequence[float]`): per-channel normalisation.
        device: where the result goes.

    Returns:
        `torch.FloatTensor` of shape `[M, 3, S_h, S_w]` on `device`.
    """
    out_h, out_w = (size, size) if isinstance(size, int) else tuple(size)
    images = images.to(device).clamp(0, 1)  # [M, 3, H, W]
    h, w = images.shape[-2:]
    scale = max(out_h / h, out_w / w)
    new_h, new_w = max(out_h, round(h * scale)), max(out_w, round(w * scale))
    if (new_h, new_w) != (h, w):
        images = F.interpolate(images, size=(new_h, new_w), mode="bicubic", align_corners=False, antialias=True)
    top, left = (new_h - out_h) // 2, (new_w - out_w) // 2
    images = images[..., top : top + out_h, left : left + out_w].clamp(0, 1)  # [M, 3, S_h, S_w]
    mean = torch.tensor(mean, device=device, dtype=images.dtype).view(1, 3, 1, 1)
    std = torch.tensor(std, device=device, dtype=images.dtype).view(1, 3, 1, 1)
    return (images - mean) / std


def preprocess(images: torch.Tensor, model) -> torch.Tensor:
    """open_clip's eval transform of `images` `[M, 3, H, W]` in [0, 1] for `model` (its ``visual.preprocess_cfg``)."""
    cfg = model.visual.preprocess_cfg
    return resize_crop_normalize(images, cfg["size"], cfg["mean"], cfg["std"], next(model.parameters()).device)


@torch.no_grad()
def image_embeddings(images: torch.Tensor, model, batch_size: int) -> torch.Tensor:
    """L2-normalised CLIP image embeddings `[M, D]` (float32, CPU) of `images` `[M, 3, H, W]` in [0, 1]."""
    chunks = [
        F.normalize(model.encode_image(preprocess(images[i : i + batch_size], model)).float(), dim=-1).cpu()
        for i in range(0, images.shape[0], batch_size)
    ]
    return torch.cat(chunks) if chunks else torch.zeros(0, model.visual.output_dim)


@torch.no_grad()
def text_embeddings(prompts: list[str], model, tokenizer, batch_size: int) -> torch.Tensor:
    """L2-normalised CLIP text embeddings `[M, D]` (float32, CPU) of `prompts` (truncated to the context length)."""
    device = next(model.parameters()).device
    chunks = [
        F.normalize(model.encode_text(tokenizer(prompts[i : i + batch_size]).to(device)).float(), dim=-1).cpu()
        for i in range(0, len(prompts), batch_size)
    ]
    return torch.cat(chunks) if chunks else torch.zeros(0, 0)
