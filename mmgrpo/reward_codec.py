"""The reward server's wire protocol, shared by the server (`mmgrpo.reward_server`) and its client (the `remote`
reward): the JSON payload codec and the shared-secret token.

Values are JSON, with three tagged forms: a tensor ``{"__tensor__": {"dtype", "shape", "data"}}`` (raw little-endian
bytes, base64: exact; booleans, integers, floats and complex numbers only), images ``{"__png__": {"shape", "frames"}}``
(a float tensor `[..., 3, H, W]` in [0, 1] as 8-bit PNGs, base64: ~10x smaller, quantised to 1/255) and a PIL image
``{"__pil__": base64 PNG}``. A few bytes of PNG can claim a gigapixel image, so sizes are read before decoding: one
PNG may hold at most `MAX_PNG_PIXELS` pixels, and [`decode_request`] refuses a request whose images and tensors would
decode to more than the server's limit ([`decoded_pixels`], raising [`DecodedSizeError`]) before decoding any of them.

The token is read from an environment variable (`TOKEN_ENV` by default) or a file, never from a command line or a
config (configs are logged); it must be at least `MIN_TOKEN_LENGTH` printable ASCII characters without spaces, and is
sent as ``Authorization: Bearer <token>``.
"""

from __future__ import annotations

import base64
import io
import ipaddress
import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from .types import PromptBatch, RewardResult

PNG_KEYS = ("images", "videos")  # output keys sent as PNG when the client asks for it
MAX_PNG_PIXELS = 1 << 26  # 8192 x 8192 per frame
TOKEN_ENV = "MMGRPO_REWARD_TOKEN"
MIN_TOKEN_LENGTH = 16
TOKEN_HINT = (
    f'e.g. `export {TOKEN_ENV}=$(python -c "import secrets; print(secrets.token_urlsafe(32))")` on the server and '
    f"every training node, or write it to a file readable only by you and pass --token-file PATH (server) / "
    f"reward.token_file (client)"
)


# ------------------------------------------------------------------------------------------------------- payload codec


class DecodedSizeError(ValueError):
    """A request whose images and tensors would decode to more pixels than the server accepts (answered 413).

    Args:
        pixels (`int`): what the request would decode to ([`decoded_pixels`]).
        limit (`int`): the server's limit.
    """

    def __init__(self, pixels: int, limit: int):
        super().__init__(f"the request's images and tensors decode to {pixels / 1e6:.1f} million pixels")
        self.pixels, self.limit = pixels, limit


def _png_frames(tensor: torch.Tensor) -> dict:
    pixels = (tensor.detach().float().nan_to_num(0.0).clamp(0, 1) * 255).round().to(torch.uint8).cpu()
    flat = pixels.reshape(-1, *pixels.shape[-3:]).permute(0, 2, 3, 1).numpy()  # [M, H, W, 3]
    encoded = []
    for frame in flat:
        buffer = io.BytesIO()
        Image.fromarray(np.ascontiguousarray(frame)).save(buffer, format="PNG")
        encoded.append(base64.b64encode(buffer.getvalue()).decode("ascii"))
    return {"__png__": {"shape": list(tensor.shape), "frames": encoded}}


def _png_header(data: str) -> Image.Image:
    """A PNG from base64, opened lazily: PIL reads its header (size, mode) and decodes nothing yet."""
    if not isinstance(data, str):
        raise ValueError(f"a PNG frame must be a base64 string, got {type(data).__name__}")
    return Image.open(io.BytesIO(base64.b64decode(data, validate=True)), formats=["PNG"])


def _open_png(data: str) -> Image.Image:
    """A PNG from base64, refused before decoding when it is not a PNG or claims more than `MAX_PNG_PIXELS`."""
    image = _png_header(data)
    if image.width * image.height > MAX_PNG_PIXELS:
        raise ValueError(f"a PNG of {image.width}x{image.height} exceeds the limit of {MAX_PNG_PIXELS} pixels")
    return image


def decoded_pixels(value: Any) -> int:
    """How many pixels a JSON payload (the output of [`encode`]) decodes to, from PNG headers and tensor shapes only:
    each PNG frame or PIL image counts width x height, a raw tensor a third of its elements rounded up (three values
    make an RGB pixel, so a batch counts alike in either encoding). Raises `ValueError` on a malformed shape."""
    if isinstance(value, list):
        return sum(decoded_pixels(v) for v in value)
    if not isinstance(value, dict):
        return 0
    if "__tensor__" in value:
        shape = value["__tensor__"]["shape"]
        if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
            raise ValueError(f"tensor shape must be a list of sizes >= 0, got {shape!r}")
        return -(-math.prod(shape) // 3)
    if "__png__" in value:
        frames = value["__png__"]["frames"]
        if not isinstance(frames, list):
            raise ValueError("__png__ frames must be a list of base64 PNGs")
        return sum(math.prod(_png_header(frame).size) for frame in frames)
    if "__pil__" in value:
        return math.prod(_png_header(value["__pil__"]).size)
    return sum(decoded_pixels(v) for v in value.values())


def encode(value: Any, png_keys: tuple[str, ...] = (), key: str | None = None) -> Any:
    """A JSON-ready form of `value` (tensors, arrays, PIL images, nested lists and dicts); tensors under a key in
    `png_keys` with shape `[..., 3, H, W]` become PNGs."""
    if isinstance(value, np.ndarray):
        value = torch.from_numpy(value)
    if isinstance(value, torch.Tensor):
        if key in png_keys and value.dim() >= 3 and value.shape[-3] == 3 and value.is_floating_point():
            return _png_frames(value)
        value = value.detach().cpu()
        array = (value.float() if value.dtype == torch.bfloat16 else value).contiguous().numpy()
        data = base64.b64encode(array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()).decode("ascii")
        return {"__tensor__": {"dtype": str(array.dtype), "shape": list(array.shape), "data": data}}
    if isinstance(value, Image.Image):
        buffer = io.BytesIO()
        value.save(buffer, format="PNG")
        return {"__pil__": base64.b64encode(buffer.getvalue()).decode("ascii")}
    if isinstance(value, dict):
        return {str(k): encode(v, png_keys, str(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [encode(v, png_keys, key) for v in value]
    if isinstance(value, (np.integer, np.floating, np.bool_)):
        return value.item()
    return value


def _decode_tensor(spec: dict) -> torch.Tensor:
    dtype = np.dtype(spec["dtype"])
    if dtype.kind not in "biufc":
        raise ValueError(f"tensor dtype {spec['dtype']!r} is not a number type")
    array = np.frombuffer(base64.b64decode(spec["data"], validate=True), dtype=dtype.newbyteorder("<"))
    return torch.from_numpy(array.astype(dtype).reshape(spec["shape"]))


def _decode_png(spec: dict) -> torch.Tensor:
    """Frames of one size decoded one at a time into a float tensor, reshaped to the sent shape `[..., 3, H, W]`."""
    frames = spec["frames"]
    if not isinstance(frames, list) or not frames:
        raise ValueError("__png__ frames must be a non-empty list of base64 PNGs")
    width, height = _open_png(frames[0]).size  # checked against MAX_PNG_PIXELS before anything is allocated
    stacked = torch.empty(len(frames), 3, height, width)  # [M, 3, H, W]
    for index, frame in enumerate(frames):
        pixels = np.asarray(_open_png(frame).convert("RGB"))  # [H, W, 3] uint8
        if pixels.shape[:2] != (height, width):
            raise ValueError(f"PNG frames differ in size: {pixels.shape[1]}x{pixels.shape[0]} after {width}x{height}")
        stacked[index].numpy()[:] = pixels.transpose(2, 0, 1)  # [3, H, W], uint8 to float in place
    return stacked.div_(255).reshape(spec["shape"])


def decode(value: Any) -> Any:
    """Inverse of [`encode`]: tensors come back as CPU tensors, PNG images as float tensors in [0, 1]."""
    if isinstance(value, dict):
        if "__tensor__" in value:
            return _decode_tensor(value["__tensor__"])
        if "__png__" in value:
            return _decode_png(value["__png__"])
        if "__pil__" in value:
            return _open_png(value["__pil__"]).copy()
        return {k: decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode(v) for v in value]
    return value


def encode_request(outputs: dict[str, Any], batch: PromptBatch, png: bool) -> bytes:
    """The ``/score`` request body for `outputs` and `batch`."""
    payload = {
        "outputs": encode(outputs, PNG_KEYS if png else ()),
        "batch": {
            "prompts": list(batch.prompts),
            "metadata": encode(batch.metadata),
            "group_ids": None if batch.group_ids is None else batch.group_ids.tolist(),
            "member_ids": None if batch.member_ids is None else batch.member_ids.tolist(),
            "conditions": encode(batch.conditions),
        },
    }
    return json.dumps(payload).encode("utf-8")


def decode_request(body: bytes, max_pixels: int | None = None) -> tuple[dict[str, Any], PromptBatch]:
    """Inverse of [`encode_request`]; raises `ValueError`, `KeyError` or `TypeError` on a malformed body, and
    [`DecodedSizeError`] before decoding anything when its images and tensors would decode to more than `max_pixels`
    pixels ([`decoded_pixels`]; `None`: no limit but `MAX_PNG_PIXELS` per PNG)."""
    payload = json.loads(body.decode("utf-8"))
    if not isinstance(payload, dict) or not isinstance(payload.get("batch"), dict) or "outputs" not in payload:
        raise ValueError('expected a JSON object {"outputs": ..., "batch": {"prompts": [...], ...}}')
    if max_pixels is not None:
        pixels = decoded_pixels(payload)
        if pixels > max_pixels:
            raise DecodedSizeError(pixels, max_pixels)
    raw = payload["batch"]
    batch = PromptBatch(
        prompts=list(raw["prompts"]),
        metadata=decode(raw.get("metadata") or []),
        group_ids=None if raw.get("group_ids") is None else torch.tensor(raw["group_ids"], dtype=torch.long),
        conditions=decode(raw.get("conditions") or {}),
        member_ids=None if raw.get("member_ids") is None else torch.tensor(raw["member_ids"], dtype=torch.long),
    )
    return decode(payload["outputs"]), batch


def _floats(values: torch.Tensor) -> list[float | None]:
    return [None if not math.isfinite(v) else v for v in values.detach().float().cpu().tolist()]


def encode_result(result: RewardResult) -> bytes:
    payload = {"scores": _floats(result.scores), "components": {k: _floats(v) for k, v in result.components.items()}}
    return json.dumps(payload).encode("utf-8")


def decode_result(body: bytes) -> RewardResult:
    payload = json.loads(body.decode("utf-8"))

    def tensor(values: list) -> torch.Tensor:
        return torch.tensor([float("nan") if v is None else v for v in values], dtype=torch.float32)

    return RewardResult(
        scores=tensor(payload["scores"]), components={k: tensor(v) for k, v in payload["components"].items()}
    )


# ------------------------------------------------------------------------------------------------------- token


def check_token(token: str, source: str) -> str:
    """Returns `token` if it is usable as a shared secret; raises `ValueError` naming `source` otherwise."""
    if len(token) < MIN_TOKEN_LENGTH or not token.isascii() or not token.isprintable() or " " in token:
        raise ValueError(
            f"the reward token from {source} must be at least {MIN_TOKEN_LENGTH} printable ASCII characters without "
            f"spaces (got {len(token)} characters); generate one, {TOKEN_HINT}."
        )
    return token


def read_token(token_file: str | Path | None = None, token_env: str | None = TOKEN_ENV) -> str | None:
    """The shared secret of the reward server: the contents of `token_file` (surrounding whitespace removed) if given,
    else the environment variable `token_env` if set and not empty, else `None` (no token)."""
    if token_file is not None:
        path = Path(token_file)
        if not path.is_file():
            raise ValueError(f"token file {path} does not exist; {TOKEN_HINT}.")
        return check_token(path.read_text(encoding="utf-8").strip(), f"file {path}")
    value = os.environ.get(token_env, "").strip() if token_env else ""
    return check_token(value, f"${token_env}") if value else None


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address, IPv6 possibly in brackets) only reaches this machine: ``localhost``,
    127.0.0.0/8 or ::1. An empty host or ``0.0.0.0`` means every interface, hence not loopback."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # another host name: it may resolve to anything
        return False
