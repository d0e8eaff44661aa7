"""What the VLM-judge rewards (`judge`, `judge_pairwise`) share: the server options ([`JudgeServer`], embedded in
both configs), the client that asks an OpenAI-compatible chat-completions API ([`JudgeClient`]: what vLLM and SGLang
serve) and the answer parsers. Not a plugin (no ``PLUGIN``).

The client never stalls a run: each request gets at most ``retries + 1`` attempts of at most `timeout` seconds each,
whole answer included (a server that trickles bytes is cut off), and an answer larger than `max_response_bytes` is a
failure; a request that still has no usable answer is reported as failed (its score is NaN) and the run goes on. At
most `max_concurrency` requests are in flight. Answers are cached by content: the key is the SHA-256 of the request's
JSON body (model, prompt text, images), so an identical request is asked once per `cache_size` most recent answers.

The API key is read from the environment variable `api_key_env` or the file `api_key_file`, never from the config
(configs are logged), and sent as ``Authorization: Bearer <key>``; redirects are refused so the key goes only to
`url`. Errors and logs never contain it.

Parsers read an answer in one pass (linear in its length, and the answer is at most `max_response_bytes`).
"""

from __future__ import annotations

import base64
import concurrent.futures
import hashlib
import io
import json
import logging
import math
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import urllib3
from PIL import Image

from mmgrpo.rewards._common import tag_spans
from mmgrpo.validation import ConfigError, check_fields, check_range, check_text

logger = logging.getLogger("mmgrpo.rewards.judge")
RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})  # answers worth another attempt


@dataclass
class JudgeServer:
    """The OpenAI-compatible chat-completions server of a VLM judge and how to ask it.

    Args:
        url (`str`, defaults to `"http://127.0.0.1:8000/v1"`): the API's base address (``vllm serve`` and SGLang serve
            ``http://HOST:PORT/v1``); requests go to ``<url>/chat/completions``.
        model (`str`, defaults to `"UnifiedReward"`): the served model name (``--served-model-name``).
        max_tokens (`int`, defaults to 512): longest answer asked for (a yes / no parser asks for 1 token).
        temperature (`float`, defaults to 0.0): sampling temperature of the judge (0: greedy, as the peers).
        timeout (`float`, defaults to 60.0): seconds one attempt may take, connection and whole answer included.
        retries (`int`, defaults to 2): further attempts after a refused, dropped or timed-out request or a 408, 429
            or 5xx answer; other answers are not retried.
        retry_wait (`float`, defaults to 1.0): seconds before the first retry, doubled for each next one.
        max_concurrency (`int`, defaults to 16): requests in flight at once.
        max_response_bytes (`int`, defaults to 1048576): an answer body larger than this fails (no retry).
        cache_size (`int`, defaults to 4096): answers kept in memory, keyed by the SHA-256 of the request (identical
            outputs and prompt: asked once); 0 disables the cache.
        api_key_env (`str`, *optional*): environment variable holding the API key (``vllm serve --api-key``); when
            named it must be set.
        api_key_file (`str`, *optional*): a file holding the API key instead (takes precedence).
    """

    url: str = "http://127.0.0.1:8000/v1"
    model: str = "UnifiedReward"
    max_tokens: int = 512
    temperature: float = 0.0
    timeout: float = 60.0
    retries: int = 2
    retry_wait: float = 1.0
    max_concurrency: int = 16
    max_response_bytes: int = 1 << 20
    cache_size: int = 4096
    api_key_env: str | None = None
    api_key_file: str | None = None

    def __post_init__(self):
        check_fields(self)
        if not self.url.startswith(("http://", "https://")) or "?" in self.url or "#" in self.url:
            raise ConfigError(f"url must be an http:// or https:// address without a query, e.g. "
                              f"http://127.0.0.1:8000/v1 (vllm serve), got {self.url!r}.")
        check_text("model", self.model)
        check_range("max_tokens", self.max_tokens, 1, 1 << 20, fix="the judge's longest answer in tokens")
        check_range("temperature", self.temperature, 0, 10, fix="0 is greedy")
        check_range("timeout", self.timeout, 0, 86400, low_open=True, fix="seconds per attempt")
        check_range("retries", self.retries, 0, 100, fix="0 tries once")
        check_range("retry_wait", self.retry_wait, 0, 3600, fix="seconds before the first retry")
        check_range("max_concurrency", self.max_concurrency, 1, 4096, fix="requests in flight at once")
        check_range("max_response_bytes", self.max_response_bytes, 1024, 1 << 30, fix="1048576 is 1 MiB")
        check_range("cache_size", self.cache_size, 0, 1 << 24, fix="0 disables the cache")
        if self.api_key_env is not None and (not self.api_key_env.strip() or "=" in self.api_key_env):
            raise ConfigError(f"api_key_env must name an environment variable, got {self.api_key_env!r}.")
        if self.api_key_file is not None and not os.path.isfile(self.api_key_file):
            raise ConfigError(f"api_key_file: no file at {self.api_key_file!r}; write the key there or use "
                              "api_key_env.")
        self.api_key()  # refuses a named but unset variable, an empty file

    def api_key(self) -> str | None:
        """The key from `api_key_file` or `api_key_env` (None when neither is named)."""
        if self.api_key_file is not None:
            with open(self.api_key_file, encoding="utf-8") as f:
                key = f.read().strip()
            where = f"api_key_file {self.api_key_file}"
        elif self.api_key_env is not None:
            key, where = os.environ.get(self.api_key_env, "").strip(), f"${self.api_key_env}"
        else:
            return None
        if not key or any(c.isspace() or not c.isprintable() for c in key):
            raise ConfigError(f"{where} must hold the API key (printable, no spaces); it is empty or malformed.")
        return key


# ------------------------------------------------------------------------------------------------- requests


def png_data_url(image: torch.Tensor) -> str:
    """An image `[3, H, W]` in [0, 1] as a ``data:image/png;base64,...`` URL (8-bit, lossless)."""
    pixels = (image.detach().float().nan_to_num(0.0).clamp(0, 1) * 255).round().to(torch.uint8).cpu()
    buffer = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(pixels.permute(1, 2, 0).numpy())).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def frame_indices(frames: int, wanted: int) -> list[int]:
    """`wanted` frame indices spread evenly over `frames` frames, first and last included (Pref-GRPO's
    ``np.linspace(0, F - 1, k)``, as integers)."""
    return np.linspace(0, frames - 1, min(wanted, frames)).astype(int).tolist()


def media_urls(value: torch.Tensor, num_frames: int) -> list[str]:
    """The PNG data URLs of one sample: an image `[3, H, W]` is one, a video `[F, 3, H, W]` `num_frames` frames."""
    if value.dim() == 3:
        return [png_data_url(value)]
    return [png_data_url(value[i]) for i in frame_indices(value.shape[0], num_frames)]


def chat_body(server: JudgeServer, text: str, urls: list[str], max_tokens: int | None = None,
              top_logprobs: int = 0) -> dict:
    """The chat-completions request: one user message holding the images, then the text (the peers' order)."""
    content = [{"type": "image_url", "image_url": {"url": url}} for url in urls] + [{"type": "text", "text": text}]
    body = {"model": server.model, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens or server.max_tokens, "temperature": server.temperature}
    if top_logprobs:
        body.update(logprobs=True, top_logprobs=top_logprobs)
    return body


# ------------------------------------------------------------------------------------------------- parsers


def answer_text(answer: dict) -> str | None:
    """The first choice's message text of a chat-completions answer, or None."""
    choices = answer.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return None
    message = choices[0].get("message")
    text = message.get("content") if isinstance(message, dict) else None
    return text if isinstance(text, str) else None


def parse_score(text: str, marker: str, low: float, high: float) -> float | None:
    """The number after the first `marker` in `text` (spaces skipped; digits with an optional decimal part), or None
    when there is none or it lies outside ``[low, high]``. One scan: linear in ``len(text)``."""
    start = text.find(marker)
    if start < 0:
        return None
    i, n = start + len(marker), len(text)
    while i < n and text[i] in " \t\r\n":
        i += 1
    j = i
    while j < n and j - i < 32 and text[j].isascii() and text[j].isdigit():
        j += 1
    if j == i:
        return None
    if j < n and text[j] == "." and j + 1 < n and text[j + 1].isascii() and text[j + 1].isdigit():
        j += 1
        while j < n and j - i < 32 and text[j].isascii() and text[j].isdigit():
            j += 1
    value = float(text[i:j])
    return value if low <= value <= high else None


def yes_probability(answer: dict, canonicalize: bool = False) -> float | None:
    """P(Yes) / (P(Yes) + P(No)) from the first answer token's ``top_logprobs`` (Flow-Factory's ``vllm_evaluate``):
    the tokens ``Yes`` and ``No`` exactly, or with `canonicalize` every token that reads yes / no once stripped and
    lower-cased. Without log-probs in the answer: 1.0 / 0.0 when the text starts with yes / no. None otherwise."""
    choice = (answer.get("choices") or [None])[0] if isinstance(answer.get("choices"), list) else None
    logprobs = choice.get("logprobs") if isinstance(choice, dict) else None
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    top = content[0].get("top_logprobs") if isinstance(content, list) and content and isinstance(content[0], dict) \
        else None
    if isinstance(top, list) and top:
        probs = {"yes": 0.0, "no": 0.0}
        for entry in top:
            token = entry.get("token") if isinstance(entry, dict) else None
            value = entry.get("logprob") if isinstance(entry, dict) else None
            if not isinstance(token, str) or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            key = token.strip().lower() if canonicalize else {"Yes": "yes", "No": "no"}.get(token)
            if key in probs and math.isfinite(value):
                probs[key] += math.exp(min(value, 0.0))
        total = probs["yes"] + probs["no"]
        return probs["yes"] / total if total > 0 else None
    text = answer_text(answer)
    words = text.strip().lower()[:8] if text is not None else ""
    return 1.0 if words.startswith("yes") else 0.0 if words.startswith("no") else None


def parse_preference(text: str, tag: str | None, first: str, second: str) -> float | None:
    """Pref-GRPO's reading of a pairwise answer: the first ``<tag>...</tag>`` block (the whole text when `tag` is
    None) -> 1.0 when it contains `first` (the first output wins), else 0.0 when it contains `second`, else 0.5 (a
    tie); None when the text has no such block (Pref-GRPO counts it as a tie too). Linear in ``len(text)``."""
    if tag is None:
        block = text
    else:
        span = next(tag_spans(text, f"<{tag}>", f"</{tag}>"), None)
        if span is None:
            return None
        block = text[span[0] : span[1]]
    return 1.0 if first in block else 0.0 if second in block else 0.5


# ------------------------------------------------------------------------------------------------- client


class JudgeClient:
    """Sends chat-completions requests concurrently, with bounded attempts, answer size and time, and a content cache.

    Args:
        server ([`JudgeServer`]): where and how to ask.
        parse (`Callable[[dict], float | None]`): reads a decoded answer into a value (None: unparsable); values are
            what the cache keeps.
        name (`str`): the reward's name, for the log.
    """

    def __init__(self, server: JudgeServer, parse: Callable[[dict], float | None], name: str):
        self.server, self.parse, self.name = server, parse, name
        self.endpoint = server.url.rstrip("/") + "/chat/completions"
        self.headers = {"Content-Type": "application/json"}
        key = server.api_key()
        if key is not None:
            self.headers["Authorization"] = f"Bearer {key}"
        self.pool = urllib3.PoolManager(num_pools=4, maxsize=server.max_concurrency, retries=False)
        self.cache: OrderedDict[str, float] = OrderedDict()
        self.lock = threading.Lock()

    def ask(self, bodies: list[dict]) -> tuple[list[float | None], list[str]]:
        """Asks every request of `bodies` (identical ones once). Returns per request its parsed value (None when it
        failed or was unparsable) and its status: ``"ok"``, ``"cached"``, ``"failed"`` or ``"unparsable"``."""
        raw = [json.dumps(body, sort_keys=True, separators=(",", ":")).encode() for body in bodies]
        keys = [hashlib.sha256(data).hexdigest() for data in raw]
        values: dict[str, float | None] = {}
        status: dict[str, str] = {}
        with self.lock:
            for key in keys:
                if key in self.cache:
                    self.cache.move_to_end(key)
                    values[key], status[key] = self.cache[key], "cached"
        todo = {key: data for key, data in zip(keys, raw) if key not in status}
        if todo:
            self._fetch(todo, values, status)
        return [values[k] for k in keys], [status[k] for k in keys]

    def _fetch(self, todo: dict[str, bytes], values: dict, status: dict) -> None:
        cfg = self.server
        attempts = cfg.retries + 1
        # each attempt ends within ~2 timeouts (a trickling answer is cut at the next read); a wait above that is a bug
        bound = attempts * 2 * cfg.timeout + cfg.retry_wait * (2 ** attempts) + 5.0
        errors = []
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=min(cfg.max_concurrency, len(todo)))
        try:
            futures = {pool.submit(self._post, data): key for key, data in todo.items()}
            done, _ = concurrent.futures.wait(futures, timeout=bound)
            for future, key in futures.items():
                answer, error = future.result() if future in done else (None, "no answer in time")
                value = None if answer is None else self.parse(answer)
                values[key] = value
                status[key] = "failed" if answer is None else "unparsable" if value is None else "ok"
                if answer is None:
                    errors.append(error)
                elif value is not None and cfg.cache_size:
                    with self.lock:
                        self.cache[key] = value
                        while len(self.cache) > cfg.cache_size:
                            self.cache.popitem(last=False)
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        if errors:
            logger.warning("%s: %d of %d judge requests to %s failed after %d attempt(s) each (scored NaN); last "
                           "error: %s", self.name, len(errors), len(todo), self.endpoint, attempts, errors[-1])

    def _post(self, data: bytes) -> tuple[dict | None, str]:
        """One request with bounded retries: ``(decoded answer, "")`` or ``(None, the last error)``."""
        cfg, error = self.server, ""
        for attempt in range(cfg.retries + 1):
            if attempt:
                time.sleep(cfg.retry_wait * 2 ** (attempt - 1))
            body, error, retry = self._attempt(data)
            if body is not None:
                try:
                    answer = json.loads(body)
                except (ValueError, UnicodeDecodeError):
                    return None, "the answer is not JSON"
                return (answer, "") if isinstance(answer, dict) else (None, "the answer is not a JSON object")
            if not retry:
                break
        return None, error

    def _attempt(self, data: bytes) -> tuple[bytes | None, str, bool]:
        """One attempt: ``(body, "", False)``, or ``(None, error, whether to retry)``."""
        cfg = self.server
        deadline = time.monotonic() + cfg.timeout
        try:
            response = self.pool.request("POST", self.endpoint, body=data, headers=self.headers, redirect=False,
                                         preload_content=False, timeout=urllib3.Timeout(connect=cfg.timeout,
                                                                                        read=cfg.timeout))
        except (urllib3.exceptions.HTTPError, OSError) as err:
            return None, type(err).__name__, True
        complete = False
        try:
            chunks, size = [], 0
            while True:
                chunk = response.read1(65536)
                if not chunk:
                    break
                size += len(chunk)
                if size > cfg.max_response_bytes:
                    return None, f"answer larger than max_response_bytes ({cfg.max_response_bytes})", False
                chunks.append(chunk)
                if time.monotonic() > deadline:
                    return None, f"answer not complete within timeout ({cfg.timeout} s)", True
            body, complete = b"".join(chunks), True
        except (urllib3.exceptions.HTTPError, OSError) as err:
            return None, f"{type(err).__name__} while reading the answer", True
        finally:
            if not complete:
                response.close()  # an answer cut short: its connection is not reused
            response.release_conn()
        if response.status != 200:
            detail = " ".join(body[:200].decode("utf-8", "replace").split())
            return None, f"HTTP {response.status}: {detail}", response.status in RETRY_STATUS
        return body, "", False
