"""The reward server and the `remote` client: same scores as in-process, clear errors when the server is down, hangs or
fails; the payload codec; ``mmgrpo serve-reward`` and ``mmgrpo list``."""

import math
import os
import socket
import subprocess
import sys
import time

import pytest
import torch

from mmgrpo import cli, registry
from mmgrpo.reward_server import RewardServer, decode, encode, load_reward
from mmgrpo.rewards.accuracy import AccuracyReward
from mmgrpo.rewards.jpeg import JpegReward
from mmgrpo.rewards.remote import RemoteReward, RemoteRewardError
from mmgrpo.types import PromptBatch
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


def test_stopped_server_gives_a_clear_error_within_the_timeout():
    server = RewardServer(JpegReward(), "jpeg").start()
    url = server.url
    server.stop()
    reward = remote(url, timeout=2.0, retries=2, retry_wait=0.05)
    started = time.monotonic()
    with pytest.raises(RemoteRewardError, match=r"no answer from .* after 3 attempt\(s\).*serve-reward"):
        reward({"images": torch.rand(1, 3, 8, 8)}, PromptBatch(["a"]))
    assert time.monotonic() - started < 2.0  # refused at once, three times


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
    name, reward = load_reward(experiment, ["reward.mode=incompressibility"])
    assert name == "jpeg" and reward.config.quality == 50 and reward.config.mode == "incompressibility"
    alone = tmp_path / "reward.yaml"
    alone.write_text("name: box_iou\ncoords: norm1000\n")
    assert load_reward(alone)[1].config.coords == "norm1000"


def test_serve_reward_command(tmp_path):
    config = tmp_path / "reward.yaml"
    config.write_text("name: jpeg\n")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "mmgrpo.cli", "serve-reward", str(config), "--port", "0", "quality=80"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    try:
        line = process.stdout.readline()
        assert "serving reward 'jpeg' on http://127.0.0.1:" in line, process.stderr.read()
        url = line.split(" on ")[1].split()[0]
        images = torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))
        expected = JpegReward(JpegReward.Config(quality=80))({"images": images}, PromptBatch(["a", "b"]))
        result = remote(url, encoding="float32")({"images": images}, PromptBatch(["a", "b"]))
        torch.testing.assert_close(result.scores, expected.scores, rtol=0, atol=0)
    finally:
        process.terminate()
        process.wait(timeout=10)


def test_list_shows_every_reward_on_one_line(capsys):
    assert cli.main(["list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for name in registry.available("reward"):
        matching = [line for line in lines if line.split() and line.split()[0] == name]
        assert len(matching) == 1 and len(matching[0].split()) > 1, name
    expected = {"accuracy", "aesthetic", "box_iou", "clip_score", "composite", "format", "jpeg", "mask_iou", "pickscore",
                "remote"}
    assert expected <= set(registry.available("reward"))
