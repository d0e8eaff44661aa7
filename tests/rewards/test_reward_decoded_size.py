"""The reward server's bound on decoded size: a request whose images and tensors would decode to more pixels than
``--max-decoded-mpixels`` is refused with 413 from the PNG headers and tensor shapes, before anything is decoded, and
the `remote` client explains it apart from a body over ``--max-body-mb``; the count over random batches."""

import base64
import io
import json
import math
import socket
import struct
import time
import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from mmgrpo import reward_codec
from mmgrpo.reward_codec import DecodedSizeError, decode_request, decoded_pixels, encode, encode_request
from mmgrpo.reward_server import RewardServer, ServerLimits
from mmgrpo.rewards.jpeg import JpegReward
from mmgrpo.rewards.remote import RemoteReward, RemoteRewardError
from mmgrpo.types import PromptBatch

TOKEN = "test-token-0123456789abcdef"


def post(port, body, timeout=20.0):
    """POST /score with the token on a fresh connection; the status and the JSON answer."""
    head = (f"POST /score HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nAuthorization: Bearer {TOKEN}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    received = b""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as conn:
        conn.sendall(head + body)
        for _ in range(1000):
            chunk = conn.recv(65536)
            if not chunk:
                break
            received += chunk
    status, _, answer = received.partition(b"\r\n\r\n")
    return int(status.split()[1]), json.loads(answer)


def bomb(side: int) -> str:
    """A one-colour `side` x `side` PNG in base64 (an 8192 x 8192 one is a few hundred KiB)."""
    buffer = io.BytesIO()
    Image.new("L", (side, side)).save(buffer, format="PNG", optimize=True)
    return base64.b64encode(buffer.getvalue()).decode()


@pytest.fixture(scope="module")
def small_server():
    """A `jpeg` server accepting 0.01 million pixels (a hundred 10 x 10 images) per request."""
    server = RewardServer(JpegReward(), "jpeg", token=TOKEN, limits=ServerLimits(max_decoded_mpixels=0.01)).start()
    yield server
    server.stop()


def port_of(server):
    return int(server.url.rsplit(":", 1)[1])


@pytest.mark.parametrize("outputs", [
    {"images": {"__png__": {"shape": [1, 3, 2048, 2048], "frames": [bomb(2048)]}}},  # 4.2 megapixels in ~5 KiB
    {"images": [{"__pil__": bomb(200)}]},
    {"images": {"__tensor__": {"dtype": "float32", "shape": [100000, 100000], "data": ""}}},  # a shape that lies
])
def test_a_request_decoding_past_the_limit_gets_413_before_decoding(small_server, monkeypatch, outputs):
    decoded = []
    monkeypatch.setattr(reward_codec, "_decode_png", lambda spec: decoded.append(spec))
    monkeypatch.setattr(reward_codec, "_decode_tensor", lambda spec: decoded.append(spec))
    body = json.dumps({"outputs": outputs, "batch": {"prompts": ["a"]}}).encode()
    started = time.monotonic()
    status, answer = post(port_of(small_server), body)
    assert status == 413 and answer["limit"] == "max_decoded_mpixels" and decoded == []
    assert "--max-decoded-mpixels" in answer["error"] and "limit of 0.01 million" in answer["error"]
    assert time.monotonic() - started < 5.0


def test_the_default_limit_refuses_an_8192_square_png(monkeypatch):
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", 8192, 8192, 8, 0, 0, 0, 0)  # 67 megapixels: 805 MB as floats
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")
    frames = [base64.b64encode(png).decode()]
    body = json.dumps({"outputs": {"images": {"__png__": {"shape": [1, 3, 8192, 8192], "frames": frames}}},
                       "batch": {"prompts": ["a"]}}).encode()
    server = RewardServer(JpegReward(), "jpeg", token=TOKEN).start()
    try:
        status, answer = post(port_of(server), body)
        assert status == 413 and "67.1 million pixels" in answer["error"] and "limit of 64 million" in answer["error"]
    finally:
        server.stop()


def test_a_request_within_the_limit_is_scored(small_server):
    images = torch.rand(4, 3, 16, 16, generator=torch.Generator().manual_seed(0))  # 1024 pixels
    body = encode_request({"images": images}, PromptBatch(list("abcd")), png=True)
    status, answer = post(port_of(small_server), body)
    assert status == 200 and len(answer["scores"]) == 4


def test_the_client_explains_a_decoded_size_refusal(small_server, monkeypatch):
    monkeypatch.setenv("MMGRPO_REWARD_TOKEN", TOKEN)
    reward = RemoteReward(RemoteReward.Config(url=small_server.url, retries=3, retry_wait=5.0))
    started = time.monotonic()
    with pytest.raises(RemoteRewardError, match=r"answered 413: the batch's images decode to more pixels .*"
                                                r"0\.1 million pixels.*larger --max-decoded-mpixels") as caught:
        reward({"images": torch.rand(25, 3, 64, 64)}, PromptBatch(["a"] * 25))  # 0.1 megapixels, 1 MiB of PNG
    assert "--max-body-mb" not in str(caught.value) and time.monotonic() - started < 4.0  # not retried


@settings(max_examples=25, deadline=None)
@given(images=st.lists(st.tuples(st.integers(1, 3), st.integers(1, 9), st.integers(1, 9)), max_size=3),
       tensor=st.lists(st.integers(0, 7), max_size=3), pil=st.none() | st.tuples(st.integers(1, 9), st.integers(1, 9)))
def test_decoded_size_counts_every_frame_and_a_third_of_every_tensor(images, tensor, pil):
    outputs = {"images": [torch.rand(m, 3, h, w) for m, h, w in images], "scalars": torch.zeros(tensor)}
    metadata = [{"image": Image.new("RGB", pil)}] if pil else [{}]
    body = encode_request(outputs, PromptBatch(["a"], metadata=metadata), png=True)
    expected = sum(m * h * w for m, h, w in images) + -(-math.prod(tensor) // 3) + (math.prod(pil) if pil else 0)
    assert decoded_pixels(json.loads(body)) == expected
    decoded, batch = decode_request(body, max_pixels=expected)  # at the limit: decoded as sent
    assert [tuple(t.shape) for t in decoded["images"]] == [(m, 3, h, w) for m, h, w in images]
    if expected:
        with pytest.raises(DecodedSizeError, match="decode to"):
            decode_request(body, max_pixels=expected - 1)


def test_png_tensors_decode_frame_by_frame_to_the_sent_shape():
    video = torch.rand(2, 3, 3, 5, 4, generator=torch.Generator().manual_seed(1))  # [B, T, 3, H, W]
    back = reward_codec.decode(encode({"videos": video}, ("videos",)))["videos"]
    assert back.shape == video.shape and back.dtype == torch.float32
    torch.testing.assert_close(back, (video * 255).round() / 255, rtol=0, atol=1e-6)
    frames = [bomb(4), bomb(5)]
    with pytest.raises(ValueError, match="differ in size"):
        reward_codec.decode({"__png__": {"shape": [2, 3, 4, 4], "frames": frames}})
