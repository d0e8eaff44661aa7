"""The `judge` reward against a real HTTP judge on loopback (tests/judge_server.py): scores by the judge's rule,
yes / no probabilities from log-probs, the cache, the API key, and every fault ending as a counted NaN in bounded
time; the parsers on adversarial answers."""

import math
import time

import pytest
import torch
from hypothesis import given, settings, strategies as st

from judge_server import judge_server, red_images  # noqa: F401
from mmgrpo.rewards._judge import parse_preference, parse_score, yes_probability
from mmgrpo.rewards.judge import JudgeConfig, JudgeReward
from mmgrpo.types import PromptBatch
from mmgrpo.validation import ConfigError, build_dataclass

FAST = {"timeout": 2.0, "retries": 0, "retry_wait": 0.0}


def _config(**options) -> JudgeConfig:
    """The config of a YAML ``reward:`` mapping (the server's options flat beside the judge's)."""
    return build_dataclass(JudgeConfig, options, "reward")


def _reward(server, **options):
    return JudgeReward(_config(url=server.url, **{**FAST, **options}))


def test_scores_follow_the_judges_rule(judge_server):
    shares = [0.0, 0.3, 0.5, 1.0]
    result = _reward(judge_server)({"images": red_images(shares)}, PromptBatch(["a red square"] * 4))
    expected = torch.tensor([(1 + 4 * s) / 5 for s in shares])  # Final Score: 1 + 4 * redness, divided by 5
    torch.testing.assert_close(result.scores, expected, rtol=0, atol=1e-6)
    assert result.components["failed"].sum() == 0 and result.components["unparsable"].sum() == 0


def test_yes_no_probability_from_logprobs(judge_server):
    shares = [0.2, 0.7]
    reward = _reward(judge_server, parser="yes_no", template="Is it red? {prompt}")
    result = reward({"images": red_images(shares)}, PromptBatch(["x", "y"]))
    torch.testing.assert_close(result.scores, torch.tensor(shares), rtol=0, atol=1e-6)  # p / (p + 1 - p)


def test_video_frames_and_text_outputs(judge_server):
    video = torch.stack([red_images([0.5, 0.5, 0.5]), red_images([0.0, 0.0, 0.0])])  # [2, 3 frames, 3, H, W]
    result = _reward(judge_server, modality="video", num_frames=2)({"videos": video}, PromptBatch(["a", "b"]))
    torch.testing.assert_close(result.scores, torch.tensor([3 / 5, 1 / 5]), rtol=0, atol=1e-6)  # the first frame's
    text = _reward(judge_server, modality="text", template="{prompt} -> {output}")
    out = text({"texts": ["an answer", None]}, PromptBatch(["q", "q"]))
    assert out.scores[0] == pytest.approx(1 / 5) and math.isnan(out.scores[1])  # no image: redness 0
    assert out.components["unparsable"].tolist() == [0.0, 1.0]  # a malformed completion is not sent


def test_identical_requests_are_asked_once_and_cached(judge_server):
    reward = _reward(judge_server)
    images = red_images([0.4, 0.4, 0.9])
    first = reward({"images": images}, PromptBatch(["p"] * 3))
    assert judge_server.requests == 2  # two distinct requests
    second = reward({"images": images}, PromptBatch(["p"] * 3))
    assert judge_server.requests == 2 and torch.equal(first.scores, second.scores)
    reward({"images": images}, PromptBatch(["another prompt"] * 3))
    assert judge_server.requests == 4  # the prompt is part of the key
    uncached = _reward(judge_server, cache_size=0)
    uncached({"images": images}, PromptBatch(["p"] * 3))
    uncached({"images": images}, PromptBatch(["p"] * 3))
    assert judge_server.requests == 8


@pytest.mark.parametrize("fault", ["[malformed]", "[drop]", "[huge]", "[error500]", "[error400]", "[notjson]"])
def test_a_fault_is_a_counted_nan_and_spares_the_others(judge_server, fault):
    reward = _reward(judge_server)
    result = reward({"images": red_images([1.0, 1.0])}, PromptBatch([f"bad {fault}", "good"]))
    assert math.isnan(result.scores[0]) and result.scores[1] == pytest.approx(1.0)
    kind = "unparsable" if fault == "[malformed]" else "failed"
    assert result.components[kind].tolist() == [1.0, 0.0]


def test_stalls_and_trickles_end_within_the_timeout(judge_server):
    reward = _reward(judge_server, timeout=0.3, retries=1)
    start = time.monotonic()
    result = reward({"images": red_images([1.0, 1.0, 1.0])}, PromptBatch(["[stall]", "[trickle]", "fine"]))
    assert time.monotonic() - start < 6.0  # 2 attempts of 0.3 s each (+ a trickle's last read); a stall is 30 s
    assert torch.isnan(result.scores[:2]).all() and result.scores[2] == pytest.approx(1.0)
    assert result.components["failed"].tolist() == [1.0, 1.0, 0.0]


def test_busy_answers_are_retried(judge_server):
    result = _reward(judge_server, retries=1)({"images": red_images([1.0])}, PromptBatch(["[flaky]"]))
    assert result.scores[0] == pytest.approx(1.0) and judge_server.requests == 2
    once = _reward(judge_server, retries=0)({"images": red_images([0.0])}, PromptBatch(["[flaky]"]))
    assert math.isnan(once.scores[0]) and judge_server.requests == 3


def test_no_server_is_a_nan_not_an_error():
    reward = JudgeReward(_config(url="http://127.0.0.1:9/v1", **FAST))
    result = reward({"images": red_images([1.0])}, PromptBatch(["p"]))
    assert math.isnan(result.scores[0]) and result.components["failed"][0] == 1


def test_api_key_from_env_or_file_is_sent_never_stored(judge_server, monkeypatch, tmp_path):
    monkeypatch.setenv("JUDGE_TEST_KEY", "sekrit-env-key")
    config = _config(url=judge_server.url, api_key_env="JUDGE_TEST_KEY", **FAST)
    assert "sekrit" not in repr(config)
    JudgeReward(config)({"images": red_images([1.0])}, PromptBatch(["p"]))
    key_file = tmp_path / "key"
    key_file.write_text("file-key-123\n")
    JudgeReward(_config(url=judge_server.url, api_key_file=str(key_file), **FAST))(
        {"images": red_images([0.0])}, PromptBatch(["p"]))
    assert judge_server.authorizations == ["Bearer sekrit-env-key", "Bearer file-key-123"]
    monkeypatch.delenv("JUDGE_TEST_KEY")
    with pytest.raises(ConfigError, match=r"\$JUDGE_TEST_KEY"):
        _config(api_key_env="JUDGE_TEST_KEY")


@pytest.mark.parametrize("options, match", [
    ({"url": "ftp://x"}, "url"), ({"timeout": 0}, "timeout"), ({"retries": 1000}, "retries"),
    ({"max_concurrency": 0}, "max_concurrency"), ({"template": "{nope}"}, "template"),
    ({"modality": "text", "template": "{prompt}"}, "output"), ({"top_logprobs": 50}, "top_logprobs"),
    ({"score_min": 9}, "score_min"), ({"num_frames": 0}, "num_frames"), ({"max_response_bytes": 10}, "max_response"),
])
def test_config_is_validated(options, match):
    with pytest.raises(ConfigError, match=match):
        _config(**options)


def test_parsers_on_hand_written_answers():
    assert parse_score("... Final Score: 4.5 end", "Final Score:", 1, 5) == 4.5
    assert parse_score("Final Score:3\nFinal Score: 5", "Final Score:", 1, 5) == 3  # the first, as Flow-GRPO
    assert parse_score("Final Score: 10", "Final Score:", 1, 5) is None  # out of range, not "1"
    assert parse_score("Final Score: .5", "Final Score:", 0, 5) is None
    assert parse_score("Final Score: 2.", "Final Score:", 1, 5) == 2
    assert parse_preference("<think>Image 2 is better?</think><answer>Image 1 is better</answer>", "answer",
                            "Image 1 is better", "Image 2 is better") == 1.0
    assert parse_preference("<answer>both fine</answer>", "answer", "Image 1", "Image 2") == 0.5
    assert parse_preference("Image 1 is better", "answer", "Image 1", "Image 2") is None
    logprobs = {"choices": [{"logprobs": {"content": [{"top_logprobs": [
        {"token": "Yes", "logprob": math.log(0.6)}, {"token": "No", "logprob": math.log(0.2)},
        {"token": " yes", "logprob": math.log(0.2)}]}]}}]}
    assert yes_probability(logprobs) == pytest.approx(0.75)  # sigmoid(log 0.6 - log 0.2), Flow-Factory's
    assert yes_probability(logprobs, canonicalize=True) == pytest.approx(0.8)
    assert yes_probability({"choices": [{"message": {"content": "No."}}]}) == 0.0


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet="Final Score:0123456789. <>/answerImage12", max_size=400), st.integers(1, 2000))
def test_parsers_take_linear_time_on_adversarial_answers(fragment, repeats):
    text = fragment * (200_000 // max(len(fragment), 1) + 1)  # ~200 K characters of repeated near-matches
    start = time.perf_counter()
    parse_score(text, "Final Score:", 1, 5)
    parse_preference(text, "answer", "Image 1 is better", "Image 2 is better")
    assert time.perf_counter() - start < 1.0


@pytest.mark.parametrize("unit", ["Final Score:", "Final Score: x", "<answer>", "<answer>Image 1</answr>", "9" * 40])
def test_one_megabyte_answers_parse_in_linear_time(unit):
    text = unit * (2**20 // len(unit))
    start = time.perf_counter()
    assert parse_score(text, "Final Score:", 1, 5) is None
    parse_preference(text, "answer", "Image 1 is better", "Image 2 is better")
    yes_probability({"choices": [{"message": {"content": text}}]})
    assert time.perf_counter() - start < 1.0
