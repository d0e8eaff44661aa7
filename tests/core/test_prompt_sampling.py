"""The prompt stream: uniform epochs as before, and the cheap variant of variance-aware sampling, ``group_variance``
(draw probabilities and group variances against values worked out by hand, the uniform floor, reproducibility, and
exact resume from its state). MMR1's own sampler, ``vas``: `test_vas.py`."""

import pytest
import torch

from mmgrpo.prompt_stream import PromptStream, group_variances

ITEMS = [{"prompt": f"p{i}", "metadata": {"i": i}} for i in range(6)]


def indices(batch):
    return [m["i"] for m in batch.metadata]


def test_uniform_stream_is_one_seeded_shuffle_per_epoch():
    stream = PromptStream(ITEMS, seed=3)
    got = indices(stream.next_batch(4)) + indices(stream.next_batch(4)) + indices(stream.next_batch(4))
    epochs = [torch.randperm(6, generator=torch.Generator().manual_seed(3 * 1_000_003 + e)).tolist() for e in (0, 1)]
    assert got == (epochs[0] + epochs[1])[:12] and stream.position == 12
    assert not stream.adaptive and stream.state_dict() == {"position": 12}


def test_draw_probabilities_by_hand():
    stream = PromptStream(ITEMS[:4], seed=0, sampling="group_variance", mix=0.5)
    assert torch.allclose(stream.probabilities(), torch.full((4,), 0.25, dtype=torch.float64))  # nothing seen
    stream.scores = [0.25, 0.0, None, 0.09]  # the unseen item takes the largest v seen, 0.25: v sums to 0.59
    expected = [0.5 * v / 0.59 + 0.5 / 4 for v in (0.25, 0.0, 0.25, 0.09)]
    torch.testing.assert_close(stream.probabilities(), torch.tensor(expected, dtype=torch.float64))
    stream.scores = [0.0, 0.0, 0.0, 0.0]  # no variance anywhere: uniform
    torch.testing.assert_close(stream.probabilities(), torch.full((4,), 0.25, dtype=torch.float64))


def test_group_variances_and_observe():
    scores = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, float("nan"), 0.5, float("nan"), float("nan")])
    prompt = torch.tensor([0, 0, 0, 0, 1, 1, 1, 2, 3, 3])
    # prompt 0: p = 1/4 -> p (1 - p) = 0.1875; prompt 1: equal finite rewards -> 0; prompt 2: one reward -> 0; 3: none
    assert group_variances(scores, prompt, 4) == [pytest.approx(0.1875), 0.0, 0.0, None]
    stream = PromptStream(ITEMS, seed=1, sampling="group_variance")
    batch = indices(stream.next_batch(4))
    stream.scores[batch[3]] = 0.7  # seen before: a group without any finite reward keeps it
    stream.observe(scores, prompt)
    assert [stream.scores[i] for i in batch] == [pytest.approx(0.1875), 0.0, 0.0, 0.7]


def test_high_variance_prompts_are_favoured_over_a_uniform_floor():
    stream = PromptStream(ITEMS, seed=2, sampling="group_variance", mix=0.9)
    stream.scores = [0.25, 0.0, 0.0, 0.0, 0.0, 0.0]
    counts = torch.zeros(6)
    for _ in range(400):
        for i in indices(stream.next_batch(1)):
            counts[i] += 1
    q = stream.probabilities()  # 0.9 + 0.1 / 6 for item 0, 0.1 / 6 for the others
    assert q[0] == pytest.approx(0.9 + 0.1 / 6) and q[1] == pytest.approx(0.1 / 6)
    assert counts[0] > 300 and counts[1:].sum() > 0  # favoured, and the others are still drawn


def test_variance_stream_is_reproducible_and_resumes_exactly():
    def run(stream, steps, rewards):
        out = []
        for step in range(steps):
            batch = indices(stream.next_batch(3))
            out.append(batch)
            scores = torch.tensor([float((i + step + k) % rewards == 0) for i in batch for k in range(4)])
            stream.observe(scores, torch.arange(3).repeat_interleave(4))
        return out

    full = run(PromptStream(ITEMS, seed=5, sampling="group_variance"), 6, 3)
    assert full == run(PromptStream(ITEMS, seed=5, sampling="group_variance"), 6, 3)
    first = PromptStream(ITEMS, seed=5, sampling="group_variance")
    head = run(first, 3, 3)
    state = first.state_dict()
    assert state["position"] == 9 and len(state["variance_scores"]) == 6
    resumed = PromptStream(ITEMS, seed=5, sampling="group_variance")
    resumed.load_state_dict(state)
    # the resumed stream continues as the uninterrupted one (observations of steps 3.. use the same step numbers)
    tail = []
    for step in range(3, 6):
        batch = indices(resumed.next_batch(3))
        tail.append(batch)
        scores = torch.tensor([float((i + step + k) % 3 == 0) for i in batch for k in range(4)])
        resumed.observe(scores, torch.arange(3).repeat_interleave(4))
    assert head + tail == full
    assert all(len(set(b)) == 3 for b in full)  # no prompt twice in a batch
    with pytest.raises(ValueError, match="no group_variance state"):
        PromptStream(ITEMS, seed=5, sampling="group_variance").load_state_dict({"position": 3})
    with pytest.raises(ValueError, match=r"in \[0, 1\)"):
        PromptStream(ITEMS, seed=5, sampling="group_variance", mix=1.0)


def _run_config(tmp_path, tiny_mdlm_dir, max_steps):
    return {
        "output_dir": str(tmp_path / "out"), "seed": 4,
        "pipeline": {"name": "mdlm", "pretrained": tiny_mdlm_dir, "gen_length": 4, "steps_per_block": 4,
                     "lora_rank": 0},
        "algorithm": {"name": "grpo", "kl_beta": 0.0},
        "reward": {"name": "accuracy", "mode": "numeric", "fuzzy_width": 1000.0},
        "data": {"name": "arith", "digits": 2, "n_train": 12, "n_eval": 4},
        "train": {"max_steps": max_steps, "prompts_per_step": 3, "group_size": 4, "minibatch_size": 12,
                  "learning_rate": 1e-2, "prompt_sampling": "group_variance", "prompt_sampling_mix": 0.8},
        "eval": {"every": 0},
        "checkpoint": {"every": 2, "keep_last": 3},
    }


def test_trainer_feeds_group_variances_back_and_resumes_the_stream(tmp_path, tiny_mdlm_dir):
    """The trainer hands each step's gathered rewards to the stream (each drawn prompt's ``v`` is its group's
    variance), and 2 steps + a resumed 2 give the same prompts, scores and weights as 4 in one go."""
    from mmgrpo import config as config_mod
    from mmgrpo.trainer import Trainer

    full = Trainer(config_mod.from_dict(_run_config(tmp_path / "a", tiny_mdlm_dir, 4)))
    full.train()
    seen = [v for v in full.stream.scores if v is not None]
    assert 3 <= len(seen) <= 12 and full.stream.position == 12
    raw = _run_config(tmp_path / "b", tiny_mdlm_dir, 2)
    Trainer(config_mod.from_dict(raw)).train()
    raw["train"]["max_steps"] = 4
    raw["checkpoint"]["resume_from"] = "latest"
    resumed = Trainer(config_mod.from_dict(raw))
    assert resumed.stream.position == 6 and any(v is not None for v in resumed.stream.scores)
    resumed.train()
    assert resumed.stream.scores == full.stream.scores and resumed.stream.last == full.stream.last
    for a, b in zip(full.policy.trainable_parameters(), resumed.policy.trainable_parameters()):
        assert torch.equal(a, b)
