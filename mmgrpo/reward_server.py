"""Serving a registered reward over HTTP, for ``mmgrpo serve-reward CONFIG`` and the `remote` reward (the client).

A reward model with heavy or conflicting dependencies (GenEval's detector, an OCR stack, a large VLM judge) runs in its
own process, as the diffusion-RL peers serve GenEval and OCR; training talks to it through `mmgrpo.rewards.remote`.
Standard library only (``http.server``, ``json``): JSON over HTTP, with no authentication, so it listens on loopback.

Protocol:

- ``GET /info`` -> ``{"reward": name, "modalities": [...], "config": {...}}``.
- ``POST /score`` with ``{"outputs": ..., "batch": {"prompts", "metadata", "group_ids", "member_ids", "conditions"}}``
  -> ``{"scores": [...], "components": {name: [...]}}`` (NaN written as null), or ``{"error": message}`` with status 400
  (undecodable request) or 500 (the reward raised). One batch per request; requests are scored one at a time.

Values are JSON, with three tagged forms: a tensor ``{"__tensor__": {"dtype", "shape", "data"}}`` (raw little-endian
bytes, base64: exact), images ``{"__png__": {"shape", "frames"}}`` (a float tensor `[..., 3, H, W]` in [0, 1] as 8-bit
PNGs, base64: ~10x smaller, quantised to 1/255) and a PIL image ``{"__pil__": base64 PNG}``.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import math
import sys
import threading
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from PIL import Image

from . import registry
from .config import ConfigError, apply_overrides, build_dataclass
from .types import PromptBatch, RewardResult

PNG_KEYS = ("images", "videos")  # output keys sent as PNG when the client asks for it


# ------------------------------------------------------------------------------------------------------- payload codec


def _png_frames(tensor: torch.Tensor) -> dict:
    pixels = (tensor.detach().float().nan_to_num(0.0).clamp(0, 1) * 255).round().to(torch.uint8).cpu()
    flat = pixels.reshape(-1, *pixels.shape[-3:]).permute(0, 2, 3, 1).numpy()  # [M, H, W, 3]
    encoded = []
    for frame in flat:
        buffer = io.BytesIO()
        Image.fromarray(np.ascontiguousarray(frame)).save(buffer, format="PNG")
        encoded.append(base64.b64encode(buffer.getvalue()).decode("ascii"))
    return {"__png__": {"shape": list(tensor.shape), "frames": encoded}}


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


def decode(value: Any) -> Any:
    """Inverse of [`encode`]: tensors come back as CPU tensors, PNG images as float tensors in [0, 1]."""
    if isinstance(value, dict):
        if "__tensor__" in value:
            spec = value["__tensor__"]
            array = np.frombuffer(base64.b64decode(spec["data"]), dtype=np.dtype(spec["dtype"]).newbyteorder("<"))
            return torch.from_numpy(array.astype(np.dtype(spec["dtype"])).reshape(spec["shape"]))
        if "__png__" in value:
            spec = value["__png__"]
            frames = [np.asarray(Image.open(io.BytesIO(base64.b64decode(f))).convert("RGB")) for f in spec["frames"]]
            stacked = torch.from_numpy(np.stack(frames)).permute(0, 3, 1, 2).float() / 255  # [M, 3, H, W]
            return stacked.reshape(spec["shape"])
        if "__pil__" in value:
            return Image.open(io.BytesIO(base64.b64decode(value["__pil__"]))).copy()
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


def decode_request(body: bytes) -> tuple[dict[str, Any], PromptBatch]:
    payload = json.loads(body.decode("utf-8"))
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


# ------------------------------------------------------------------------------------------------------- server


def load_reward(path: str | Path, overrides: list[str] = ()) -> tuple[str, Any]:
    """Reads a reward from YAML: an experiment config (its ``reward:`` section is used) or a mapping with ``name`` and
    the reward's options. ``key=value`` overrides apply to that file (``reward.x=...`` in an experiment config).

    Returns:
        `tuple`: the reward's registry name and an instance.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"Reward config file {path} does not exist.")
    raw = apply_overrides(yaml.safe_load(path.read_text(encoding="utf-8")) or {}, list(overrides))
    spec = raw.get("reward", raw) if isinstance(raw, dict) else raw
    if not isinstance(spec, dict) or "name" not in spec:
        choices = ", ".join(sorted(registry.available("reward")))
        raise ConfigError(f"{path}: expected a 'reward:' section or a mapping with 'name' (one of: {choices}).")
    options = {k: v for k, v in spec.items() if k != "name"}
    try:
        cls = registry.get("reward", spec["name"])
    except ValueError as err:
        raise ConfigError(f"reward.name: {err}") from err
    return spec["name"], cls(build_dataclass(cls.Config, options, "reward"))


class RewardServer:
    """An HTTP server scoring batches with one reward instance (see the module docstring for the protocol).

    Args:
        reward: any `RewardFn`.
        name (`str`): its registry name, reported by ``/info``.
        host (`str`, defaults to `"127.0.0.1"`), port (`int`, defaults to 0: a free port).
    """

    def __init__(self, reward, name: str, host: str = "127.0.0.1", port: int = 0):
        self.reward, self.name = reward, name
        self.lock = threading.Lock()
        self.httpd = ThreadingHTTPServer((host, port), self._handler())
        self.httpd.daemon_threads = True
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def info(self) -> dict:
        config = getattr(self.reward, "config", None)
        options = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else {}
        return {"reward": self.name, "modalities": sorted(self.reward.modalities), "config": options}

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def _send(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path.rstrip("/") != "/info":
                    return self._send(404, json.dumps({"error": "GET /info or POST /score"}).encode())
                self._send(200, json.dumps(server.info(), default=str).encode())

            def do_POST(self):
                if self.path.rstrip("/") != "/score":
                    return self._send(404, json.dumps({"error": "POST /score"}).encode())
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                try:
                    outputs, batch = decode_request(body)
                except Exception as err:  # a malformed request: the client's fault
                    return self._send(400, json.dumps({"error": f"undecodable request: {err!r}"}).encode())
                try:
                    with server.lock:  # one batch at a time: reward models are rarely thread-safe
                        result = server.reward(outputs, batch)
                    self._send(200, encode_result(result))
                except Exception as err:
                    traceback.print_exc()
                    self._send(500, json.dumps({"error": f"reward {server.name!r} raised {err!r}"}).encode())

            def log_message(self, format, *args):  # quiet: one line per request is noise in training logs
                pass

        return Handler

    def start(self) -> "RewardServer":
        """Serves in a background thread (for tests and notebooks); returns self."""
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        """Stops serving and closes the socket."""
        self.httpd.shutdown()
        self.httpd.server_close()
        if self.thread is not None:
            self.thread.join(timeout=5)


def serve(config: str, overrides: list[str], host: str, port: int) -> int:
    """``mmgrpo serve-reward``: loads the reward, prints its address and serves until interrupted."""
    try:
        name, reward = load_reward(config, overrides)
    except (ConfigError, ValueError, RuntimeError) as err:  # RuntimeError: weights that cannot be loaded
        print(f"mmgrpo: config error: {err}", file=sys.stderr)
        return 2
    if host not in ("127.0.0.1", "localhost"):
        print(f"mmgrpo: warning: serving on {host}, not loopback; the server has no authentication.", file=sys.stderr)
    server = RewardServer(reward, name, host, port)
    print(f"serving reward {name!r} on {server.url} (POST /score, GET /info); Ctrl-C stops", flush=True)
    try:
        server.httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.httpd.server_close()
    return 0
