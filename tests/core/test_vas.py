"""``train.prompt_sampling: vas``, MMR1's Variance-Aware Sampling: the weights against MMR1's worked example
(learnability p (1 - p), min-max with 1e-8, momentum), the batch split (``int(B * mix)`` weighted draws with
replacement, the rest in order from one shuffled pool that starts again when too few are left) and its interleaving,
the draw statistics, the refresh cadence, exact resume from the JSON state, the old value ``variance`` refused, and
real runs on the shipped VLM config: refreshes at the cadence from extra rollouts, and 2 + 2 resumed steps equal to 4."""

import json
import math
from pathlib import Path

import pytest
import torch

from mmgrpo import config as config_mod
from mmgrpo.config import ConfigError, build_dataclass
from mmgrpo.sections import TrainConfig
from mmgrpo.prompt_stream import PromptStream
from mmgrpo.vas import VASConfig

ITEMS = [{"prompt": f"p{i}", "metadata": {"i": i}} for i in range(5)]
COUNTS = [0, 2, 4, 6, 8]  # correct answers of 8 rollouts per prompt (the worked example)
ROOT = Path(__file__).resolve().parents[2]


def stream(mix=0.5, seed=0, **options) -> PromptStream:
    return PromptStream(ITEMS, seed=seed, sampling="vas", mix=mix, vas=VASConfig(**options))


def accuracies(counts=COUNTS, n=8) -> dict[int, torch.Tensor]:
    return {i: torch.tensor([1.0] * c + [0.0] * (n - c)) for i, c in enumerate(counts)}


def indices(batch) -> list[int]:
    return [m["i"] for m in batch.metadata]


def test_weights_of_the_worked_example():
    s = stream()
    assert s.refresh_due(0) and s.draw_probabilities().tolist() == [0.2] * 5  # no weights yet: uniform
    metrics = s.refresh(accuracies(), 0)
    # p = [0, .25, .5, .75, 1] -> p (1 - p) = [0, .1875, .25, .1875, 0] -> min-max: [0, .75, 1, .75, 0] (+1e-8)
    assert s.scores == pytest.approx([0.0, 0.1875, 0.25, 0.1875, 0.0])
    assert s.weights == pytest.approx([0.0, 0.75, 1.0, 0.75, 0.0], abs=1e-7)
    assert s.weights[2] == 0.25 / (0.25 + 1e-8)
    assert s.draw_probabilities().tolist() == pytest.approx([0.0, 0.3, 0.4, 0.3, 0.0])
    assert metrics["vas/mean_accuracy"] == pytest.approx(0.5) and metrics["vas/scored_prompts"] == 5
    # momentum 0.5 from weights 0.2 everywhere: [.1, .475, .6, .475, .1]
    m = stream(momentum=0.5)
    m.load_state_dict({"position": 0, "vas": {"weights": [0.2] * 5, "scores": [None] * 5, "pool_position": 0,
                                              "refreshed_at": 0, "score_cursor": 0}})
    m.refresh(accuracies(), 4)
    assert m.weights == pytest.approx([0.1, 0.475, 0.6, 0.475, 0.1], abs=1e-7)
    # a prompt without any finite accuracy scores learnability 0; equal scores everywhere: weights 0, uniform draws
    nan = stream()
    nan.refresh({0: torch.tensor([math.nan] * 8), 1: torch.tensor([1.0, 0.0]), 2: torch.tensor([1.0, 1.0])}, 0)
    assert nan.scores[:3] == [0.0, 0.25, 0.0] and nan.weights[1] == pytest.approx(1.0)
    assert nan.scores[3:] == [None, None] and nan.weights[3:] == nan.weights[1:2] * 2  # never scored: the largest
    flat = stream()
    flat.refresh(accuracies([8] * 5), 0)
    assert flat.weights == [0.0] * 5 and flat.draw_probabilities().tolist() == [0.2] * 5


def test_batches_interleave_weighted_draws_and_the_sequential_pool():
    s = stream(mix=0.5)
    s.refresh(accuracies(), 0)
    pool = s._permutation(1)
    batches = [indices(s.next_batch(4)) for _ in range(6)]
    # pooled items at odd positions: pool[0:2], pool[2:4], then too few left (1 of 5): from the start again
    assert [b[1::2] for b in batches] == [pool[0:2], pool[2:4]] * 3
    assert all(i in (1, 2, 3) for b in batches for i in b[0::2])  # weighted draws: never a zero-weight prompt
    odd = stream(mix=0.6)  # int(5 * 0.6) = 3 weighted, 2 pooled: w r w r w
    odd.refresh(accuracies(), 0)
    batch = indices(odd.next_batch(5))
    assert batch[1::2] == odd._permutation(1)[0:2] and all(i in (1, 2, 3) for i in batch[0::2])
    half = stream(mix=0.5)  # int(5 * 0.5) = 2 weighted, 3 pooled: w r w r r
    half.refresh(accuracies(), 0)
    batch = indices(half.next_batch(5))
    assert [batch[1], batch[3], batch[4]] == half._permutation(1)[0:3]
    assert len(stream(mix=1.0).next_batch(3)) == 3  # all weighted (uniform before a refresh)
    pooled = stream(mix=0.0)  # all pooled, more than the pool holds: it cycles
    assert indices(pooled.next_batch(7)) == (pooled._permutation(1) * 2)[:7]


def test_weighted_draw_statistics():
    s = stream(mix=0.5, seed=7)
    s.refresh(accuracies(), 0)
    counts = torch.zeros(5)
    for _ in range(2000):
        for i in indices(s.next_batch(4))[0::2]:
            counts[i] += 1
    share = counts / counts.sum()  # 4000 draws from [0, .3, .4, .3, 0]
    assert share[0] == share[4] == 0
    torch.testing.assert_close(share, torch.tensor([0.0, 0.3, 0.4, 0.3, 0.0]), rtol=0, atol=0.03)


def test_refresh_cadence_and_subsets():
    s = stream(update_every=4)
    assert s.refresh_due(0) and not PromptStream(ITEMS, seed=0).refresh_due(0)
    s.refresh(accuracies(), 0)
    assert [s.refresh_due(k) for k in range(9)] == [False, False, False, False, True, False, False, False, True]
    s.refresh(accuracies(), 4)
    assert not s.refresh_due(4) and s.refresh_due(8)
    sub = stream(score_prompts=2)
    order = sub._permutation(2)
    assert sub.items_to_score() == order[0:2]
    sub.refresh({i: accuracies()[i] for i in order[0:2]}, 0)
    assert sub.items_to_score() == order[2:4]
    sub.refresh({i: accuracies()[i] for i in order[2:4]}, 4)
    assert sub.items_to_score() == [order[4], order[0]]
    assert stream(score_prompts=9).items_to_score() == [0, 1, 2, 3, 4]


def test_state_round_trips_through_json_and_resumes_exactly():
    def run(s, steps, start=0):
        out = []
        for step in range(start, steps):
            if s.refresh_due(step):
                s.refresh(accuracies([(c + 2 * step) % 9 for c in COUNTS]), step)
            out.append(indices(s.next_batch(3)))
        return out

    full = run(stream(mix=0.5, seed=3, update_every=2, momentum=0.3), 7)
    first = stream(mix=0.5, seed=3, update_every=2, momentum=0.3)
    head = run(first, 3)
    state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint holds
    resumed = stream(mix=0.5, seed=3, update_every=2, momentum=0.3)
    resumed.load_state_dict(state)
    assert head + run(resumed, 7, start=3) == full
    assert resumed.weights == run_weights(7)
    with pytest.raises(ValueError, match="no vas state"):
        stream().load_state_dict({"position": 3})


def run_weights(steps):
    s = stream(mix=0.5, seed=3, update_every=2, momentum=0.3)
    for step in range(steps):
        if s.refresh_due(step):
            s.refresh(accuracies([(c + 2 * step) % 9 for c in COUNTS]), step)
        s.next_batch(3)
    return s.weights


def test_config_names_and_bounds():
    with pytest.raises(ConfigError, match=r"train.prompt_sampling: 'variance' was renamed: use 'group_variance' .* "
                                          r"or 'vas'"):
        build_dataclass(TrainConfig, {"prompt_sampling": "variance"}, "train")
    assert build_dataclass(TrainConfig, {"prompt_sampling": "vas", "prompt_sampling_mix": 1.0}, "train").vas == VASConfig()
    with pytest.raises(ConfigError, match=r"prompt_sampling_mix must be < 1"):
        build_dataclass(TrainConfig, {"prompt_sampling": "group_variance", "prompt_sampling_mix": 1.0}, "train")
    for key, value in [("update_every", 0), ("rollouts", 1), ("momentum", 1.0), ("batch_prompts", 0)]:
        with pytest.raises(ConfigError, match=f"train.vas.{key}"):
            build_dataclass(TrainConfig, {"vas": {key: value}}, "train")
    with pytest.raises(ConfigError, match="Unknown config key train.vas.bogus"):
        build_dataclass(TrainConfig, {"vas": {"bogus": 1}}, "train")


def vlm_config(tmp_path, max_steps, resume=False):
    """The shipped VLM default at small sizes, VAS on its accuracy component."""
    overrides = [f"output_dir={tmp_path}", f"train.max_steps={max_steps}", "train.max_seconds=0", "eval.every=0",
                 "data.n_train=12", "data.n_eval=4", "train.prompts_per_step=4", "train.group_size=2",
                 "train.minibatch_size=8", "train.updates_per_step=1", "train.prompt_sampling=vas",
                 "train.vas.update_every=2", "train.vas.rollouts=2", "train.vas.batch_prompts=8",
                 "train.vas.accuracy=accuracy", "checkpoint.every=2", "checkpoint.keep_last=3",
                 "train.lr_schedule=constant"]  # the same learning rates whatever max_steps
    overrides += ["checkpoint.resume_from=latest"] if resume else []
    return config_mod.load(ROOT / "configs" / "tiny" / "vlm_count.yaml", overrides)


def test_real_run_refreshes_at_the_cadence_and_resumes_exactly(tmp_path):
    from mmgrpo.metrics_log import read_records
    from mmgrpo.trainer import Trainer

    full = Trainer(vlm_config(tmp_path / "a", 5))
    full.train()
    records = read_records(tmp_path / "a" / "metrics.jsonl")
    refreshed = [r["step"] for r in records if "vas/mean_weight" in r]
    assert refreshed == [1, 3, 5]  # before the first step, then after every 2
    assert all(r["vas/scored_prompts"] == 12 for r in records if "vas/mean_weight" in r)
    assert full.stream.refreshed_at == 4 and all(0 <= w <= 1 for w in full.stream.weights)
    assert full.stream.pool_position > 0 and full.stream.position == 20
    Trainer(vlm_config(tmp_path / "b", 3)).train()  # saves at steps 2 and 3
    resumed = Trainer(vlm_config(tmp_path / "b", 5, resume=True))
    assert resumed.step == 3 and resumed.stream.refreshed_at == 2
    resumed.train()  # step 4, then the refresh after 4 steps and step 5
    assert resumed.stream.state_dict() == full.stream.state_dict()
    for a, b in zip(full.policy.trainable_parameters(), resumed.policy.trainable_parameters()):
        assert torch.equal(a, b)


def test_two_processes_share_the_refresh(tmp_path):
    """12 prompts over 2 processes in calls of 4 (16 slots, 4 padded): every prompt scored once, the same weights on
    both processes, so both draw the same batches."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, ACCELERATE_USE_CPU="true", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(Path(__file__).with_name("vas_worker.py")), str(tmp_path)],
                          capture_output=True, text=True, timeout=600, env=env)
    first = proc.stderr.find("Traceback")
    assert proc.returncode == 0, proc.stderr[first : first + 4000] if first >= 0 else proc.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["world"] == 2 and ranks[0]["metrics"]["vas/scored_prompts"] == 12
    assert ranks[0]["weights"] == ranks[1]["weights"] and ranks[0]["state"] == ranks[1]["state"]
    assert all(s is not None for s in ranks[0]["scores"]) and max(ranks[0]["weights"]) in (0.0, pytest.approx(1.0))
    assert ranks[0]["last"] == ranks[1]["last"]
