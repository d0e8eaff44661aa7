"""The reward server and the `remote` client: same scores as in-process, clear errors when the server is down, hangs or
fails; the payload codec; ``mmgrpo serve-reward`` and ``mmgrpo list``. The HTTP layer is probed with raw sockets on
loopback (bad lengths, bodies over the limit, a stalled client, tokens), every loop bounded in count and time."""

import base64
import json
import math
import os
import select
import socket
import struct
import subprocess
import sys
import time
import zlib

import pytest
import torch

from mmgrpo import cli, registry
from mmgrpo.reward_codec import decode, encode, is_loopback
from mmgrpo.reward_server import RewardServer, ServerLimits, load_reward, require_token_off_loopback
from mmgrpo.rewards.accuracy import AccuracyReward
from mmgrpo.rewards.jpeg import JpegReward
from mmgrpo.rewards.remote import RemoteReward, RemoteRewardError
from mmgrpo.types import PromptBatch
from mmgrpo.validation import ConfigError
from reward_fixtures import jpeg_server  # noqa: F401 (fixture)


def remote(url, **options):
    return RemoteReward(RemoteReward.Config(url=url, **options))


def test_round_trip_gives_the_in_process_scores(jpeg_server):
    images = torch.rand(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    batch = PromptBatch(["a", "b"], metadata=[{"mask": torch.ones(2, 2, dtype=torch.bool)}, {}]).repeat(2)
    local = JpegReward()({"images": images}, batch)
    exact = remote(jpeg_server.url, encoding="float32")({"images": images}, batch)
    torch.testing.assert_close(exact.scores, local.scores, rtol=0, atol=0)
    torch.testing.assert_close(exact.components["jpeg_kb"], local.components["jpeg_kb"], rtol=0, atol=0)
    # PNG is 8-bit: the same scores as in-process on the quantised images
    quantised = JpegReward()({"images": (images * 255).round() / 255}, batch)
    torch.testing.assert_close(remote(jpeg_server.url)({"images": images}, batch).scores, quantised.scores, rtol=0, atol=0)


def test_round_trip_keeps_nan_and_metadata():
    server = RewardServer(AccuracyReward(), "accuracy").start()
    try:
        texts = ["<answer>3</answer>", "<answer>4</answer>", "<answer>x</answer>"]
        batch = PromptBatch(["p"] * 3, metadata=[{"answer": "3"}, {}, {"answer": 4.0, "extra": torch.arange(3)}])
        local = AccuracyReward()({"texts": texts}, batch)
        result = remote(server.url, modalities=["text"])({"texts": texts}, batch)
        torch.testing.assert_close(result.scores, local.scores, rtol=0, atol=0, equal_nan=True)
        assert math.isnan(result.scores[1]) and result.components["malformed"][2] == 1.0
    finally:
        server.stop()


def test_codec_is_exact_for_tensors():
    value = {"f": torch.randn(2, 3), "b": torch.tensor([True, False]), "i": torch.arange(4).view(2, 2), "s": "x",
             "n": [1, 2.5, None], "h": torch.ones(2, dtype=torch.bfloat16)}
    back = decode(encode(value))
    for key in ("f", "b", "i"):
        assert back[key].dtype == value[key].dtype and torch.equal(back[key], value[key])
    assert back["s"] == "x" and back["n"] == [1, 2.5, None] and torch.equal(back["h"], torch.ones(2))


def test_codec_refuses_a_png_claiming_a_huge_image_before_decoding_it():
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", 9000, 9000, 8, 2, 0, 0, 0)  # 9000 x 9000 RGB: 243 MB once decoded
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")
    frame = base64.b64encode(png).decode()
    with pytest.raises(ValueError, match="9000x9000 exceeds the limit"):
        decode({"__png__": {"shape": [1, 3, 9000, 9000], "frames": [frame]}})
    with pytest.raises(ValueError, match="not a number type"):
        decode({"__tensor__": {"dtype": "object", "shape": [1], "data": ""}})


def test_stopped_server_gives_a_clear_error_within_the_timeout():
    server = RewardServer(JpegReward(), "jpeg").start()
    url = server.url
    server.stop()
    reward = remote(url, timeout=2.0, retries=2, retry_wait=0.05)
    started = time.monotonic()
    with pytest.raises(RemoteRewardError, match=r"no answer from .* after 3 attempt\(s\).*serve-reward"):
        reward({"images": torch.rand(1, 3, 8, 8)}, PromptBatch(["a"]))
    assert time.monotonic() - started < 2.0  # refused at once, three times


def test_a_server_whose_wake_up_pipe_was_closed_under_it_still_stops():
    """Another library closing a descriptor twice can close the number waitress's wake-up pipe reuses: `stop` then
    closes the sockets itself, the serving thread ends and the port is free."""
    server = RewardServer(JpegReward(), "jpeg").start()
    host, port = server.server.effective_host, server.server.effective_port
    os.close(server.server.trigger.trigger)  # the pipe's write end, as a foreign double close would
    server.stop()
    assert not server.thread.is_alive()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((host, port), timeout=2).close()


def test_hanging_server_times_out_after_bounded_retries():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)  # accepts connections in the kernel, never answers
    try:
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        reward = remote(url, timeout=0.3, retries=1, retry_wait=0.05)
        started = time.monotonic()
        with pytest.raises(RemoteRewardError, match="after 2 attempt"):
            reward({"images": torch.rand(1, 3, 8, 8)}, PromptBatch(["a"]))
        assert time.monotonic() - started < 0.3 * 2 + 0.05 + 1.0
    finally:
        listener.close()


def test_server_side_errors_are_reported_without_retrying(jpeg_server):
    reward = remote(jpeg_server.url, retries=3, retry_wait=5.0)
    started = time.monotonic()
    with pytest.raises(RemoteRewardError, match=r"answered 500: reward 'jpeg' raised .*images"):
        reward({"texts": ["not an image"]}, PromptBatch(["a"]))
    assert time.monotonic() - started < 2.0


def test_load_reward_reads_an_experiment_config_or_a_reward_file(tmp_path):
    experiment = tmp_path / "experiment.yaml"
    experiment.write_text("output_dir: out\nreward:\n  name: jpeg\n  quality: 50\n")
    name, reward, options = load_reward(experiment, ["reward.mode=incompressibility"])
    assert options == reward.config  # what /info reports
    assert name == "jpeg" and reward.config.quality == 50 and reward.config.mode == "incompressibility"
    alone = tmp_path / "reward.yaml"
    alone.write_text("name: box_iou\ncoords: norm1000\n")
    assert load_reward(alone)[1].config.coords == "norm1000"


def test_a_reward_with_a_group_stage_is_not_served(tmp_path):
    grouped = tmp_path / "grouped.yaml"
    grouped.write_text("name: composite\nnormalize: normalize_then_sum\nrewards:\n  jpeg: {weight: 1.0}\n")
    with pytest.raises(ConfigError, match="normalize: none"):
        load_reward(grouped)
    plain = tmp_path / "plain.yaml"
    plain.write_text("name: composite\nnormalize: none\nrewards:\n  jpeg: {weight: 1.0}\n")
    assert load_reward(plain)[1].group_stage is None


def test_serve_reward_command(tmp_path):
    config, token_file = tmp_path / "reward.yaml", tmp_path / "token"
    config.write_text("name: jpeg\n")
    token_file.write_text(TOKEN + "\n")
    env = {k: v for k, v in os.environ.items() if k != "MMGRPO_REWARD_TOKEN"} | {"PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "mmgrpo.cli", "serve-reward", str(config), "--port", "0", "quality=80",
         "--token-file", str(token_file), "--max-body-mb", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    try:
        line = process.stdout.readline()
        assert "serving reward 'jpeg' on http://127.0.0.1:" in line and "token required" in line, process.stderr.read()
        url = line.split(" on ")[1].split()[0]
        status, body = exchange(int(url.rsplit(":", 1)[1]), request("GET", "/info", token=TOKEN))
        assert status == 200 and json.loads(body)["max_body_bytes"] == 2 * 2**20
        assert json.loads(body)["config"]["quality"] == 80  # the options it was started with
        images = torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))
        expected = JpegReward(JpegReward.Config(quality=80))({"images": images}, PromptBatch(["a", "b"]))
        reward = remote(url, encoding="float32", token_file=str(token_file))
        result = reward({"images": images}, PromptBatch(["a", "b"]))
        torch.testing.assert_close(result.scores, expected.scores, rtol=0, atol=0)
    finally:
        process.terminate()
        process.wait(timeout=10)


def test_list_shows_every_reward_on_one_line(capsys):
    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    lines = out[out.index("rewards:"):].split("\n\n")[0].splitlines()  # the rewards section (a name may be a source too)
    lines = lines[: next((i for i, line in enumerate(lines[1:], 1) if not line.startswith(" ")), len(lines))]
    for name in registry.available("reward"):
        matching = [line for line in lines if line.split() and line.split()[0] == name]
        assert len(matching) == 1 and len(matching[0].split()) > 1, name
    expected = {"accuracy", "aesthetic", "box_iou", "clip_score", "composite", "format", "jpeg", "mask_iou", "pickscore",
                "remote", "temporal_consistency", "temporal_flicker", "dpp_diversity"}
    assert expected <= set(registry.available("reward"))


# ------------------------------------------------------------------------------------------------------- HTTP layer

TOKEN = "test-token-0123456789abcdef"
LIMIT = 2**20  # the guarded server's body limit (1 MiB)


def request(method, path, body=b"", token=None, headers=()):
    """Raw HTTP/1.1 request bytes (``Connection: close``: the server closes once it has answered)."""
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", "Connection: close", *headers]
    lines += [f"Authorization: Bearer {token}"] * (token is not None) + [f"Content-Length: {len(body)}"] * bool(body)
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def exchange(port, data, timeout=5.0):
    """Sends `data` on a fresh loopback connection and reads until the server closes it (at most `timeout` s and 200
    reads). Returns the status (`None`: no response at all) and the body."""
    received, deadline = b"", time.monotonic() + timeout
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as conn:
        conn.sendall(data)
        for _ in range(200):
            conn.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                chunk = conn.recv(65536)
            except (TimeoutError, ConnectionResetError):
                break
            if not chunk:
                break
            received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    return (int(head.split()[1]) if head.startswith(b"HTTP/1.") else None), body


def score_body(outputs, prompts=("a",)):
    return json.dumps({"outputs": encode(outputs), "batch": {"prompts": list(prompts)}}).encode()


@pytest.fixture(scope="module")
def guarded():
    """A `jpeg` server with a token, a 1 MiB body limit and a 1 s channel timeout."""
    server = RewardServer(JpegReward(), "jpeg", token=TOKEN, limits=ServerLimits(max_body_mb=1, channel_timeout=1))
    server.start()
    yield server
    server.stop()


def port_of(server):
    return int(server.url.rsplit(":", 1)[1])


@pytest.mark.parametrize("length, status", [("abc", 400), ("-5", 400), ("12x", 400), (str(LIMIT + 1), 413),
                                            ("99999999999999999999", 413)])
def test_bad_or_huge_content_length_gets_a_4xx_answer(guarded, length, status):
    data = request("POST", "/score", token=TOKEN, headers=[f"Content-Length: {length}"]) + b'{"outputs"'
    assert exchange(port_of(guarded), data)[0] == status  # the old http.server closed without answering, or hung


def test_a_body_over_the_limit_gets_413(guarded):
    # chunked, so no Content-Length announces the size: the server counts the bytes; the body is exactly the limit
    # (framing included), so the server has read everything when it answers
    size = LIMIT - len(b"00000000\r\n")
    data = request("POST", "/score", token=TOKEN, headers=["Transfer-Encoding: chunked"])
    status, body = exchange(port_of(guarded), data + f"{size:08x}\r\n".encode() + b"x" * size)
    assert status == 413, body


@pytest.mark.parametrize("n", [24, 240])  # 1.5 MiB: the 413 reaches the client; 15 MiB: the upload is cut short
def test_the_client_says_a_batch_is_too_large(guarded, monkeypatch, n):
    monkeypatch.setenv("MMGRPO_REWARD_TOKEN", TOKEN)
    reward = remote(guarded.url, encoding="float32", retries=3, retry_wait=5.0)
    started = time.monotonic()
    with pytest.raises(RemoteRewardError, match=r"batch \(\d+\.\d MiB\) is too large .* --max-body-mb"):
        reward({"images": torch.rand(n, 3, 64, 64)}, PromptBatch(["a"] * n))  # base64 float32
    assert time.monotonic() - started < 4.0  # not retried


def test_a_stalled_client_is_cut_off_while_others_are_served(guarded):
    with socket.create_connection(("127.0.0.1", port_of(guarded)), timeout=8.0) as stalled:
        stalled.sendall(request("POST", "/score", token=TOKEN, headers=["Content-Length: 100"]) + b'{"outputs":')
        started = time.monotonic()
        status, body = exchange(port_of(guarded), request("GET", "/info", token=TOKEN))
        assert status == 200 and json.loads(body)["reward"] == "jpeg" and time.monotonic() - started < 2.0
        assert select.select([stalled], [], [], 8.0)[0], "the stalled connection was never closed"
        assert stalled.recv(1024) == b"" and time.monotonic() - started < 8.0  # closed after the 1 s timeout


@pytest.mark.parametrize("method, path, body, status, message", [
    ("POST", "/score", b"{not json", 400, "undecodable request"),
    ("POST", "/score", b'{"batch": 3}', 400, "expected a JSON object"),
    ("POST", "/score", b'{"outputs": {"images": {"__tensor__": {"dtype": "object", "shape": [1], "data": ""}}}, '
                       b'"batch": {"prompts": ["a"]}}', 400, "not a number type"),
    ("POST", "/score", score_body({"texts": ["not an image"]}), 500, "reward 'jpeg' raised"),
    ("GET", "/nowhere", b"", 404, "GET /info or POST /score"),
    ("GET", "/score", b"", 405, "/score takes POST"),
    ("POST", "/info", b"{}", 405, "/info takes GET"),
])
def test_bad_requests_get_a_json_error(guarded, method, path, body, status, message):
    got, answer = exchange(port_of(guarded), request(method, path, body, token=TOKEN))
    assert got == status and message in json.loads(answer)["error"]


@pytest.mark.parametrize("token, status", [(None, 401), ("wrong-token-0123456789", 401), (TOKEN[:-1], 401),
                                           ("", 401), (TOKEN, 200)])
def test_every_request_needs_the_token(guarded, token, status):
    valid = score_body({"images": torch.rand(1, 3, 8, 8)})
    for data in (request("GET", "/info", token=token), request("POST", "/score", valid, token=token)):
        got, body = exchange(port_of(guarded), data)
        assert got == status and (status == 200 or "token" in json.loads(body)["error"])


def test_the_client_sends_its_token_and_explains_a_refusal(guarded, monkeypatch, tmp_path):
    images, batch = torch.rand(2, 3, 8, 8), PromptBatch(["a", "b"])
    for env, match in ((None, "requires a token and none was sent"), ("wrong-token-0123456789", "is not the server's")):
        if env is None:
            monkeypatch.delenv("MMGRPO_REWARD_TOKEN", raising=False)
        else:
            monkeypatch.setenv("MMGRPO_REWARD_TOKEN", env)
        started = time.monotonic()
        with pytest.raises(RemoteRewardError, match=f"answered 401 .*{match}"):
            remote(guarded.url, retries=3, retry_wait=5.0)({"images": images}, batch)
        assert time.monotonic() - started < 4.0  # not retried
    (tmp_path / "token").write_text(TOKEN)
    result = remote(guarded.url, token_file=str(tmp_path / "token"))({"images": images}, batch)
    assert result.scores.shape == (2,) and torch.isfinite(result.scores).all()


def test_off_loopback_the_server_refuses_to_start_without_a_token(tmp_path, monkeypatch, capsys):
    assert all(map(is_loopback, ["127.0.0.1", "127.3.2.1", "::1", "[::1]", "localhost"]))
    assert not any(map(is_loopback, ["0.0.0.0", "", "::", "10.0.0.1", "192.168.1.2", "reward-node"]))
    with pytest.raises(ValueError, match="refusing to serve on '0.0.0.0'.*MMGRPO_REWARD_TOKEN.*--token-file"):
        require_token_off_loopback("0.0.0.0", None)
    require_token_off_loopback("0.0.0.0", TOKEN)
    with pytest.raises(ValueError, match="refusing"):  # raised before any socket is bound
        RewardServer(JpegReward(), "jpeg", host="0.0.0.0")
    monkeypatch.delenv("MMGRPO_REWARD_TOKEN", raising=False)
    (tmp_path / "reward.yaml").write_text("name: jpeg\n")
    assert cli.main(["serve-reward", str(tmp_path / "reward.yaml"), "--host", "0.0.0.0"]) == 2
    assert "refusing to serve" in capsys.readouterr().err
    monkeypatch.setenv("MMGRPO_REWARD_TOKEN", "short")  # a token too short to be a secret is refused too
    assert cli.main(["serve-reward", str(tmp_path / "reward.yaml"), "--host", "0.0.0.0"]) == 2
    assert "at least 16" in capsys.readouterr().err


@pytest.mark.parametrize("options, message", [
    ({"url": "http://10.1.2.3:8000"}, "not on loopback.*MMGRPO_REWARD_TOKEN"),
    ({"url": "ftp://127.0.0.1"}, "reward.url must be http"),
    ({"url": "http://127.0.0.1:99999"}, "reward.url .* not a valid address"),
    ({"url": "http://"}, "reward.url must be http"),
    ({"timeout": float("nan")}, "reward.timeout"), ({"timeout": 0}, "reward.timeout"),
    ({"retries": -1}, "reward.retries"), ({"retries": True}, "reward.retries"),
    ({"retry_wait": float("inf")}, "reward.retry_wait"), ({"encoding": "jpeg"}, "reward.encoding"),
    ({"modalities": []}, "reward.modalities"), ({"token_env": ""}, "reward.token_env"),
    ({"token_file": "no/such/file"}, "reward.token_file"),
])
def test_remote_config_names_the_bad_key(options, message, monkeypatch):
    monkeypatch.delenv("MMGRPO_REWARD_TOKEN", raising=False)
    with pytest.raises(ValueError, match=message):
        RemoteReward.Config(**options)


def test_a_valid_request_still_succeeds_after_the_abuse(guarded):
    # runs after the tests above in file order; the server's thread is alive and it still scores
    images = torch.rand(3, 3, 16, 16, generator=torch.Generator().manual_seed(2))
    status, body = exchange(port_of(guarded), request("POST", "/score", score_body({"images": images}, "abc"), TOKEN))
    expected = JpegReward()({"images": images}, PromptBatch(list("abc")))
    assert status == 200 and guarded.thread.is_alive()
    torch.testing.assert_close(torch.tensor(json.loads(body)["scores"]), expected.scores, rtol=0, atol=0)
