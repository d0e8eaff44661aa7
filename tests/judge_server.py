"""A tiny VLM judge served over real HTTP on loopback, for the `judge` and `judge_pairwise` tests: an
OpenAI-compatible ``POST /v1/chat/completions`` that decodes the request's PNG data URLs and answers by a rule.

The rule: an image's redness is the share of its pixels with red > 0.5 and green, blue < 0.5.

- a request asking for log-probs (``logprobs: true``) gets one token with ``top_logprobs`` Yes / No of
  probabilities p / 1 - p, p = redness clamped to [0.01, 0.99];
- a request whose text holds ``PAIR`` compares the first half of its images with the second half by mean redness:
  ``<answer>Image 1 is better</answer>``, ``Image 2 is better``, or, when equal, ``Image 1 is better`` if the server's
  `position_bias` is set (a judge that prefers the first position) and ``<answer>tie</answer>`` otherwise;
- any other request gets ``Final Score: x`` with x = 1 + 4 * redness (two decimals).

Faults, chosen by a marker in the request's text: ``[malformed]`` (an answer without a score), ``[drop]`` (the
connection closed with no answer), ``[stall]`` (no answer until the server stops), ``[huge]`` (a 2 MiB answer),
``[error500]`` (HTTP 500), ``[error400]`` (HTTP 400), ``[flaky]`` (HTTP 503 to the first attempt of each request,
then the answer), ``[notjson]`` (a body that is not JSON), ``[trickle]`` (the answer one byte at a time, slowly).
Every request is counted (`requests`), with its Authorization header (`authorizations`).
"""

from __future__ import annotations

import base64
import io
import json
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from PIL import Image


def redness(url: str) -> float:
    """The share of red pixels of a ``data:image/png;base64,...`` image."""
    pixels = np.asarray(Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB")) / 255.0
    red = (pixels[..., 0] > 0.5) & (pixels[..., 1] < 0.5) & (pixels[..., 2] < 0.5)
    return float(red.mean())


class TinyJudge:
    """The server (see the module docstring); `url` is its ``.../v1`` base address."""

    def __init__(self):
        self.requests = 0
        self.authorizations: list[str | None] = []
        self.position_bias = False
        self.release = threading.Event()  # ends every stalled answer
        self.seen: set[str] = set()  # bodies of [flaky] requests already refused once
        self.lock = threading.Lock()
        judge = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with judge.lock:
                    judge.requests += 1
                    judge.authorizations.append(self.headers.get("Authorization"))
                judge.answer(self, body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)

    def start(self) -> "TinyJudge":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()

    def answer(self, handler: BaseHTTPRequestHandler, body: bytes) -> None:
        request = json.loads(body)
        content = request["messages"][0]["content"]
        text = next(part["text"] for part in content if part["type"] == "text")
        urls = [part["image_url"]["url"] for part in content if part["type"] == "image_url"]
        if "[drop]" in text:
            handler.close_connection = True
            handler.connection.shutdown(2)
            return
        if "[stall]" in text:
            self.release.wait(30)
        if "[error500]" in text or "[error400]" in text:
            return self.send(handler, 500 if "[error500]" in text else 400, b'{"error": "injected"}')
        if "[flaky]" in text:
            with self.lock:
                first = body not in self.seen
                self.seen.add(body)
            if first:
                return self.send(handler, 503, b'{"error": "busy"}')
        if "[notjson]" in text:
            return self.send(handler, 200, b"<html>not json</html>")
        if "[huge]" in text:
            return self.send(handler, 200, json.dumps(_chat("x" * (2 << 20))).encode())
        if "[malformed]" in text:
            return self.send(handler, 200, json.dumps(_chat("I cannot judge this image.")).encode())
        scores = [redness(url) for url in urls]
        if request.get("logprobs"):
            p = min(max(scores[0] if scores else 0.5, 0.01), 0.99)
            reply = _chat("Yes" if p >= 0.5 else "No")
            reply["choices"][0]["logprobs"] = {"content": [{"token": reply["choices"][0]["message"]["content"],
                                                            "top_logprobs": [{"token": "Yes", "logprob": math.log(p)},
                                                                             {"token": "No", "logprob": math.log(1 - p)}]}]}
        elif "PAIR" in text:
            half = len(scores) // 2
            first, second = np.mean(scores[:half]), np.mean(scores[half:])
            verdict = "Image 1 is better" if first > second or (first == second and self.position_bias) else \
                "Image 2 is better" if second > first else "tie"
            reply = _chat(f"<think>red {first:.3f} vs {second:.3f}</think><answer>{verdict}</answer>")
        else:
            reply = _chat(f"The image is fine. Final Score: {1 + 4 * (scores[0] if scores else 0):.2f}")
        data = json.dumps(reply).encode()
        if "[trickle]" in text:
            return self.trickle(handler, data)
        self.send(handler, 200, data)

    @staticmethod
    def send(handler: BaseHTTPRequestHandler, status: int, data: bytes) -> None:
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)

    def trickle(self, handler: BaseHTTPRequestHandler, data: bytes) -> None:
        handler.send_response(200)
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        for byte in data:
            if self.release.wait(0.05):
                return
            try:
                handler.wfile.write(bytes([byte]))
                handler.wfile.flush()
            except OSError:
                return


def _chat(text: str) -> dict:
    return {"id": "t", "object": "chat.completion", "model": "tiny",
            "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text}}]}


@pytest.fixture
def judge_server():
    """A [`TinyJudge`] on a free loopback port, in background threads."""
    server = TinyJudge().start()
    yield server
    server.stop()


def red_images(shares: list[float], size: int = 10):
    """Images `[n, 3, size, size]` in [0, 1] whose redness is each share (rounded to whole rows), the rest blue."""
    import torch

    images = torch.zeros(len(shares), 3, size, size)
    images[:, 2] = 1.0
    for i, share in enumerate(shares):
        rows = round(share * size)
        images[i, 0, :rows], images[i, 2, :rows] = 1.0, 0.0
    return images
