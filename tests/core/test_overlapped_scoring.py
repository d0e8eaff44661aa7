"""Rewards scored while the next chunk of a step samples (`mmgrpo.overlapped_scoring`): the chunks' rollouts join into
one that replays exactly, a step's statistics are the same bit for bit with and without overlap, and the reward of
chunk 0 runs while chunk 1 samples (shown by the order of events, not by timing)."""

import dataclasses
import json
import threading
import time

import pytest
import torch

from algorithm_options import algo_config
from builders._runs import dgpo_config
from builders.sd3 import build_policy as build_sd3
from builders.wan import tiny_policy as wan_policy
from mmgrpo import config as config_mod
from mmgrpo.algorithms.flow_grpo import FlowGRPO, FlowGRPOConfig
from mmgrpo.engines import LocalEngine
from mmgrpo.function_reward import FunctionRewardConfig, function_reward
from mmgrpo.overlapped_scoring import ChunkedScoring, cat_results, cat_rollouts, check_chunks
from mmgrpo.sections import TrainConfig
from mmgrpo.trainer import Trainer
from mmgrpo.types import PromptBatch, RewardResult
from mmgrpo.validation import ConfigError

PROMPTS = ["a red circle", "a blue square"]


def brightness(outputs, batch):
    """Mean brightness of each image."""
    return outputs["images"].mean(dim=(1, 2, 3))


def image_reward(fn):
    reward_cls = function_reward(fn)
    return reward_cls(FunctionRewardConfig(modalities=["image"]))


def flow_plan(num_steps=3, seed=0):
    return FlowGRPO(algo_config(FlowGRPOConfig)).schedule(num_steps, torch.Generator().manual_seed(seed))


def assert_same(a, b, path="rollout"):
    """Rollouts, reward results or their entries equal bit for bit."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for key in a:
            assert_same(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    elif dataclasses.is_dataclass(a):
        assert_same(vars(a), vars(b), path)
    else:
        assert a == b, path


def test_sample_chunks_are_validated():
    with pytest.raises(ConfigError, match="train.sample_chunks"):
        TrainConfig(sample_chunks=0)
    with pytest.raises(ConfigError, match="train.sample_chunks"):
        TrainConfig(prompts_per_step=2, group_size=2, sample_chunks=5)
    with pytest.raises(ConfigError, match="sample_chunks: 3 does not divide the 4 samples"):
        check_chunks(3, 4)
    check_chunks(2, 4)


def test_a_chunk_count_that_does_not_split_a_process_share_is_refused(tmp_path, tiny_sd3_dir):
    raw = dgpo_config(tmp_path, tiny_sd3_dir, 1)
    raw["train"]["sample_chunks"] = 3  # 4 samples per step
    with pytest.raises(ConfigError, match="train.sample_chunks: 3 does not divide the 4 samples"):
        Trainer(config_mod.from_dict(raw))


def test_joined_chunks_replay_their_recorded_log_probs(request):
    """SD3 (per-sample text embeddings) sampled in two chunks: the joined rollout is the chunks' in batch order and
    replays to the log-probs each chunk recorded."""
    policy = build_sd3(request)
    plan, batch = flow_plan(), PromptBatch(PROMPTS).repeat(2)
    parts = [policy.sample(batch.select(rows), plan, generator=torch.Generator().manual_seed(seed))
             for rows, seed in (([0, 1], 1), ([2, 3], 2))]
    joined = cat_rollouts(parts)
    assert_same(joined.select(torch.tensor([2, 3])).outputs, parts[1].outputs)
    assert torch.equal(joined.group_ids, batch.group_ids)
    steps = [i for i in range(3) if joined.mask[:, i].any()]
    with torch.no_grad():
        replay = policy.log_prob(joined, steps).log_prob  # [4, k]
    torch.testing.assert_close(replay, joined.old_log_probs[:, steps], rtol=0, atol=1e-5)


def test_prompts_encoded_once_are_joined_with_shifted_indices(tiny_wan_dir):
    """Wan keeps each distinct prompt's embeddings once (``shared_prompt_embeds`` and ``prompt_index``) and the negative
    prompt's once: the join stacks the chunks' prompts, shifts the indices and keeps one negative; it replays."""
    policy = wan_policy(tiny_wan_dir, guidance_scale=3.0)
    plan, batch = flow_plan(), PromptBatch(PROMPTS).repeat(2)
    parts = [policy.sample(batch.select(rows), plan, generator=torch.Generator().manual_seed(seed))
             for rows, seed in (([0, 1], 1), ([2, 3], 2))]
    joined = cat_rollouts(parts)
    trajectory = joined.trajectory
    assert trajectory["prompt_index"].tolist() == [0, 0, 1, 1]
    assert trajectory["shared_prompt_embeds"].shape[0] == 2
    assert torch.equal(trajectory["shared_negative_prompt_embeds"], parts[0].trajectory["shared_negative_prompt_embeds"])
    steps = [i for i in range(3) if joined.mask[:, i].any()]
    with torch.no_grad():
        replay = policy.log_prob(joined, steps).log_prob
    torch.testing.assert_close(replay, joined.old_log_probs[:, steps], rtol=0, atol=1e-5)


def test_entries_that_cannot_be_joined_are_refused_by_name(request):
    policy = build_sd3(request)
    plan, batch = flow_plan(), PromptBatch(PROMPTS).repeat(2)
    parts = [policy.sample(batch.select(rows), plan, generator=torch.Generator().manual_seed(1))
             for rows in ([0, 1], [2, 3])]
    parts[1].trajectory["prompt_embeds"] = parts[1].trajectory["prompt_embeds"][:, :-1]  # a batch padded shorter
    with pytest.raises(ValueError, match="'prompt_embeds' has per-sample shapes .* train.sample_chunks: 1"):
        cat_rollouts(parts)
    parts[1].trajectory["prompt_embeds"] = parts[0].trajectory["prompt_embeds"]
    parts[1].trajectory["shared_sigmas"] = parts[1].trajectory["shared_sigmas"] + 1
    with pytest.raises(ValueError, match="'shared_sigmas' is shared .* differs between chunks"):
        cat_rollouts(parts)


def test_reward_results_join_in_batch_order():
    a = RewardResult(scores=torch.tensor([1.0, 2.0]), components={"c": torch.tensor([3.0, 4.0])},
                     features=torch.ones(2, 3), artifacts={"mask": [None, "x"]})
    b = RewardResult(scores=torch.tensor([5.0, float("nan")]), components={"c": torch.tensor([6.0, 7.0])},
                     features=torch.zeros(2, 3), artifacts={"mask": ["y", None]})
    joined = cat_results([a, b])
    assert joined.scores[:3].tolist() == [1.0, 2.0, 5.0] and joined.scores[3].isnan()
    assert joined.components["c"].tolist() == [3.0, 4.0, 6.0, 7.0]
    assert joined.features.sum().item() == 6.0 and joined.artifacts["mask"] == [None, "x", "y", None]
    with pytest.raises(ValueError, match="different components"):
        cat_results([a, RewardResult(scores=torch.zeros(2))])


class RecordingEngine:
    """The policy's own sampling (a [`LocalEngine`]) with the start and end of each call recorded; before sampling
    chunk `wait_chunk` it waits (at most 60 s) for `before` to be set."""

    name = "recording"

    def __init__(self, policy, before: threading.Event | None = None, wait_chunk: int = 1):
        self.inner, self.before, self.wait_chunk = LocalEngine(policy), before, wait_chunk
        self.calls, self.started = [], threading.Event()

    def sample(self, batch, plan, *, generator=None):
        start = time.perf_counter()
        if len(self.calls) == self.wait_chunk and self.before is not None:
            self.started.set()
            assert self.before.wait(60), "the reward of the previous chunk never started"
        rollout = self.inner.sample(batch, plan, generator=generator)
        self.calls.append((start, time.perf_counter()))
        return rollout

    def sync_weights(self, policy):
        pass


def test_chunk_zero_is_scored_while_chunk_one_samples(request):
    """Chunk 1 samples only once the reward of chunk 0 has started, and that reward ends only once chunk 1 has
    started: both can only happen when they overlap (scored in order in the caller's thread, it would wait out the
    60 s and fail). The values are the same as synchronous scoring's."""
    policy = build_sd3(request)
    plan, batch = flow_plan(), PromptBatch(PROMPTS).repeat(2)
    reward_started, reward_calls = threading.Event(), []
    engine = RecordingEngine(policy, before=reward_started)

    def gated(outputs, prompts):
        start = time.perf_counter()
        if not reward_calls:
            reward_started.set()
            assert engine.started.wait(60), "chunk 1 never started sampling while chunk 0 was scored"
        reward_calls.append((start, time.perf_counter()))
        return brightness(outputs, prompts)

    rollout, pending = ChunkedScoring(2, True, 4).sample(engine, image_reward(gated), batch, plan,
                                                        torch.Generator().manual_seed(7))
    result = pending.result()
    (score_start, score_end), (sample_start, sample_end) = reward_calls[0], engine.calls[1]
    assert score_start < sample_end and sample_start < score_end  # the two intervals intersect
    sync_rollout, sync_pending = ChunkedScoring(2, False, 4).sample(LocalEngine(policy), image_reward(brightness),
                                                                    batch, plan, torch.Generator().manual_seed(7))
    assert_same(rollout, sync_rollout)
    assert_same(result, sync_pending.result())


def test_one_chunk_is_the_single_call(request):
    """``sample_chunks: 1`` samples with the step's generator itself (the same rollout as the policy's own call) and
    scores only when the result is asked for, in the caller's thread."""
    policy = build_sd3(request)
    plan, batch = flow_plan(), PromptBatch(PROMPTS).repeat(2)
    threads = []

    def recorded(outputs, prompts):
        threads.append(threading.current_thread())
        return brightness(outputs, prompts)

    rollout, pending = ChunkedScoring(1, True, 4).sample(LocalEngine(policy), image_reward(recorded), batch, plan,
                                                         torch.Generator().manual_seed(7))
    assert_same(rollout, policy.sample(batch, plan, generator=torch.Generator().manual_seed(7)))
    assert not threads
    assert torch.equal(pending.result().scores, brightness(rollout.outputs, batch))
    assert threads == [threading.current_thread()]


def test_a_step_is_the_same_bit_for_bit_with_and_without_overlap(tmp_path, tiny_sd3_dir):
    """Two training steps in two chunks, scored by the JPEG reward while sampling or after each chunk: the same
    metrics (every statistic but the timings) and the same weights."""
    runs = {}
    for overlap in (True, False):
        raw = dgpo_config(tmp_path / str(overlap), tiny_sd3_dir, 2)
        raw["train"].update(sample_chunks=2, overlap_scoring=overlap)
        trainer = Trainer(config_mod.from_dict(raw))
        trainer.train()
        # the scoring worker is stopped when training ends
        assert not [t for t in threading.enumerate() if t.name.startswith("mmgrpo-chunk-scoring")]
        records = [json.loads(line) for line in trainer.log.path.read_text().splitlines()]
        runs[overlap] = ([{k: v for k, v in r.items() if not k.startswith("time/")} for r in records],
                         [p.detach().clone() for p in trainer.policy.trainable_parameters()])
    assert len(runs[True][0]) == 2 and "reward/mean" in runs[True][0][0]
    assert all(0 <= r["time/reward_wait_s"] < r["time/step_s"] for r in records)  # the last run's (synchronous)
    assert runs[True][0] == runs[False][0]
    for a, b in zip(runs[True][1], runs[False][1]):
        assert torch.equal(a, b)
