"""The reward server merges concurrent requests: fewer reward calls than requests (counted by the server's ``/info``
stats and by the reward itself), each client getting exactly the scores of its request scored alone; requests that
cannot merge (other shapes, over ``max_batch``) are scored alone; groups, prompts and metadata stay per request; a full
queue answers 503; a failing merged call fails only the faulty request. Real servers on loopback, clients in threads;
the first request holds the reward (a gate) until the others wait in the queue, so the batches are deterministic."""

import json
import threading
import time
import urllib.request

import pytest
import torch

from mmgrpo.reward_server import RewardServer, ServerLimits
from mmgrpo.rewards.jpeg import JpegReward
from mmgrpo.rewards.remote import RemoteReward, RemoteRewardError
from mmgrpo.types import PromptBatch, RewardResult
from mmgrpo.validation import ConfigError


class GroupSizeReward:
    """Scores each sample with the size of its group in the batch it is called on (so a batch whose groups joined
    across requests would score differently); component ``echo``: 1 where the text equals its prompt. Raises on a
    sample whose metadata says ``fail``."""

    modalities = frozenset({"text"})
    group_stage = None
    artifacts = frozenset()

    def __call__(self, outputs, batch):
        if any(m.get("fail") for m in batch.metadata):
            raise ValueError("asked to fail")
        ids = batch.group_ids if batch.group_ids is not None else torch.zeros(len(batch), dtype=torch.long)
        sizes = (ids[:, None] == ids[None, :]).sum(1).float()  # [N]
        echo = torch.tensor([float(t == p) for t, p in zip(outputs["texts"], batch.prompts)])  # [N]
        return RewardResult(scores=sizes, components={"echo": echo})


class Gated:
    """Wraps a reward: counts its calls and the batch sizes, and holds the first call until `release` is set."""

    group_stage = None
    artifacts = frozenset()

    def __init__(self, inner):
        self.inner, self.modalities, self.sizes = inner, inner.modalities, []
        self.entered, self.release = threading.Event(), threading.Event()

    def __call__(self, outputs, batch):
        self.sizes.append(len(batch))
        if len(self.sizes) == 1:
            self.entered.set()
            assert self.release.wait(20.0)
        return self.inner(outputs, batch)


def stats(url):
    with urllib.request.urlopen(f"{url}/info", timeout=5) as response:
        return json.loads(response.read())["stats"]


def wait_until(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def images(n, size=16, seed=0):
    return torch.rand(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


def in_threads(calls):
    """Runs each `(reward, outputs, batch)` in its own thread; returns a function that joins them and gives the
    results (or exceptions) in order."""
    results = [None] * len(calls)

    def run(i, reward, outputs, batch):
        try:
            results[i] = reward(outputs, batch)
        except Exception as err:  # noqa: BLE001 (reported to the test)
            results[i] = err

    threads = [threading.Thread(target=run, args=(i, *call)) for i, call in enumerate(calls)]
    for thread in threads:
        thread.start()

    def join():
        for thread in threads:
            thread.join(timeout=30)
        assert not any(thread.is_alive() for thread in threads)
        return results

    return join


def held_server(inner, **limits):
    """A server for `Gated(inner)` whose first request is being scored, held, when it returns."""
    reward = Gated(inner)
    server = RewardServer(reward, "gated", limits=ServerLimits(batch_wait=0.0, threads=8, **limits)).start()
    client = RemoteReward(RemoteReward.Config(url=server.url, encoding="float32", modalities=sorted(reward.modalities)))
    first = in_threads([(client, *first_request(inner))])
    assert reward.entered.wait(10.0)
    return reward, server, client, first


def first_request(inner):
    if isinstance(inner, JpegReward):
        return {"images": images(1, seed=99)}, PromptBatch(["first"])
    return {"texts": ["x"]}, PromptBatch(["x"])


def queue(server, client, requests):
    """Sends `requests` from threads once the first is held, each once the previous one waits in the queue (so their
    order is known); returns the function joining them."""
    joins = []
    for i, (outputs, batch) in enumerate(requests):
        joins.append(in_threads([(client, outputs, batch)]))
        wait_until(lambda: stats(server.url)["waiting"] == i + 1)  # noqa: B023 (called at once)
    return lambda: [join()[0] for join in joins]


def test_concurrent_requests_merge_into_fewer_calls_with_the_same_scores():
    inner = JpegReward()
    reward, server, client, first = held_server(inner)
    try:
        requests = [({"images": images(n, seed=n)}, PromptBatch([f"p{n}"] * n)) for n in (1, 3, 2, 4, 1)]
        join = queue(server, client, requests)
        reward.release.set()
        results, first_result = join(), first()[0]
        assert reward.sizes == [1, 11]  # the held request, then the five waiting ones in one call
        assert stats(server.url) | {"waiting": 0} == {"requests": 6, "reward_calls": 2, "samples": 12,
                                                      "largest_batch": 11, "refused_busy": 0, "waiting": 0}
        for (outputs, batch), result in zip(requests, results):
            alone = inner(outputs, batch)
            torch.testing.assert_close(result.scores, alone.scores, rtol=0, atol=0)
            torch.testing.assert_close(result.components["jpeg_kb"], alone.components["jpeg_kb"], rtol=0, atol=0)
        torch.testing.assert_close(first_result.scores, inner(*first_request(inner)).scores, rtol=0, atol=0)
    finally:
        reward.release.set()
        server.stop()


def test_requests_that_cannot_merge_or_exceed_max_batch_are_scored_alone():
    inner = JpegReward()
    reward, server, client, first = held_server(inner, max_batch=4)
    try:
        shapes = [(2, 16), (2, 32), (2, 16), (6, 16), (1, 16)]  # (samples, image size)
        requests = [({"images": images(n, size, seed=i)}, PromptBatch(["p"] * n)) for i, (n, size) in enumerate(shapes)]
        join = queue(server, client, requests)
        reward.release.set()
        results = join()
        first()
        # 16 px: 2 + 2 merge (4 = max_batch, so the 1 waits); 32 px alone; 6 > max_batch alone; then the 1
        assert reward.sizes == [1, 4, 2, 6, 1]
        assert stats(server.url)["reward_calls"] == 5 and stats(server.url)["requests"] == 6
        for (outputs, batch), result in zip(requests, results):
            torch.testing.assert_close(result.scores, inner(outputs, batch).scores, rtol=0, atol=0)
    finally:
        reward.release.set()
        server.stop()


def test_groups_prompts_and_metadata_stay_per_request():
    inner = GroupSizeReward()
    reward, server, client, first = held_server(inner)
    try:
        # two processes send parts of the same global groups 7 and 8: merged, each still sees only its own
        requests = [({"texts": ["a", "b", "zz"]}, PromptBatch(["a", "q", "zz"], group_ids=torch.tensor([7, 7, 8]),
                                                              member_ids=torch.tensor([0, 1, 0]))),
                    ({"texts": ["c", "d", "e"]}, PromptBatch(["c", "d", "x"], group_ids=torch.tensor([7, 8, 8]),
                                                             member_ids=torch.tensor([2, 1, 2])))]
        join = queue(server, client, requests)
        reward.release.set()
        results = join()
        first()
        assert reward.sizes == [1, 6]
        assert results[0].scores.tolist() == [2, 2, 1] and results[1].scores.tolist() == [1, 2, 2]
        assert results[0].components["echo"].tolist() == [1, 0, 1]
        assert results[1].components["echo"].tolist() == [1, 1, 0]
        for (outputs, batch), result in zip(requests, results):
            torch.testing.assert_close(result.scores, inner(outputs, batch).scores, rtol=0, atol=0)
    finally:
        reward.release.set()
        server.stop()


def test_a_failing_merged_call_fails_only_the_faulty_request():
    inner = GroupSizeReward()
    reward, server, client, first = held_server(inner)
    try:
        requests = [({"texts": ["a"]}, PromptBatch(["a"])), ({"texts": ["b"]}, PromptBatch(["b"], [{"fail": True}]))]
        join = queue(server, client, requests)
        reward.release.set()
        good, bad = join()
        first()
        assert good.scores.tolist() == [1.0] and good.components["echo"].tolist() == [1.0]
        assert isinstance(bad, RemoteRewardError) and "answered 500" in str(bad) and "asked to fail" in str(bad)
        assert reward.sizes == [1, 2, 1, 1]  # the merged call raised: each request scored again alone
    finally:
        reward.release.set()
        server.stop()


def test_a_full_queue_answers_503_and_the_client_says_so():
    inner = JpegReward()
    reward, server, client, first = held_server(inner, max_queue=1)
    try:
        join = queue(server, client, [({"images": images(1)}, PromptBatch(["a"]))])
        data = json.dumps({"outputs": {"images": [[0.0]]}, "batch": {"prompts": ["b"]}}).encode()
        request = urllib.request.Request(f"{server.url}/score", data=data, method="POST")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=5)
        answer = json.loads(refused.value.read())
        assert refused.value.code == 503 and answer["limit"] == "max_queue" and "--max-queue 1" in answer["error"]
        busy = RemoteReward(RemoteReward.Config(url=server.url, retries=1, retry_wait=0.01))
        with pytest.raises(RemoteRewardError, match=r"answered 503: the reward server is busy.*after 2 attempt"):
            busy({"images": images(1)}, PromptBatch(["c"]))
        assert stats(server.url)["refused_busy"] == 3
        reward.release.set()
        assert isinstance(join()[0], RewardResult) and isinstance(first()[0], RewardResult)
    finally:
        reward.release.set()
        server.stop()


def test_a_request_at_an_idle_reward_waits_at_most_batch_wait_for_others():
    inner = JpegReward()
    server = RewardServer(inner, "jpeg", limits=ServerLimits(batch_wait=0.5, max_batch=2)).start()
    try:
        client = RemoteReward(RemoteReward.Config(url=server.url, encoding="float32"))
        started = time.monotonic()
        client({"images": images(1)}, PromptBatch(["a"]))  # alone: a partial batch runs after batch_wait
        assert 0.5 <= time.monotonic() - started < 5.0
        requests = [({"images": images(1, seed=i)}, PromptBatch(["a"])) for i in range(2)]
        results = in_threads([(client, *request) for request in requests])()  # together: max_batch reached, no wait
        assert stats(server.url)["reward_calls"] == 2 and stats(server.url)["largest_batch"] == 2
        for (outputs, batch), result in zip(requests, results):
            torch.testing.assert_close(result.scores, inner(outputs, batch).scores, rtol=0, atol=0)
    finally:
        server.stop()


@pytest.mark.parametrize("options, flag", [
    ({"max_batch": 0}, "--max-batch"), ({"max_batch": 70000}, "--max-batch"), ({"batch_wait": -0.1}, "--batch-wait"),
    ({"batch_wait": 11.0}, "--batch-wait"), ({"max_queue": 0}, "--max-queue"), ({"max_queue": 2000}, "--max-queue"),
])
def test_batching_limits_are_validated(options, flag):
    with pytest.raises(ConfigError, match=flag):
        ServerLimits(**options)


def test_serve_reward_refuses_an_out_of_range_batching_flag(tmp_path, capsys):
    from mmgrpo import cli

    (tmp_path / "reward.yaml").write_text("name: jpeg\n")
    assert cli.main(["serve-reward", str(tmp_path / "reward.yaml"), "--port", "0", "--max-batch", "0"]) == 2
    assert "max_batch must be >= 1" in capsys.readouterr().err
