"""`judge_pairwise` (Pref-GRPO's win rate) against the real loopback judge of tests/judge_server.py: hand-computed win
rates, position bias cancelled by judging both orders, the authors' one-order rule, the seeded pair cap, and
failures."""

import itertools
import json
import math

import pytest
import torch

from judge_server import judge_server, red_images  # noqa: F401
from mmgrpo.rewards.judge_pairwise import JudgePairwiseConfig, JudgePairwiseReward, sample_pairs, win_rates
from mmgrpo.types import PromptBatch
from mmgrpo.validation import ConfigError, build_dataclass

FAST = {"timeout": 2.0, "retries": 0, "retry_wait": 0.0, "template": "PAIR {prompt}"}


def _reward(server, **options):
    return JudgePairwiseReward(build_dataclass(JudgePairwiseConfig, {"url": server.url, **FAST, **options}, "reward"))


def _score(reward, shares, groups, prompts=None):
    groups = torch.tensor(groups)
    batch = PromptBatch(prompts or [f"prompt {int(g)}" for g in groups], group_ids=groups)
    first = reward({"images": red_images(shares)}, batch)
    return reward.group_stage(first, groups)


def test_win_rates_by_hand(judge_server):
    # group 0: redness 0.9 > 0.5 > 0.1; group 1: two equal images (the judge answers "tie"); group 2: one member
    result = _score(_reward(judge_server), [0.9, 0.5, 0.1, 0.2, 0.2, 0.7], [0, 0, 0, 1, 1, 2])
    # member 0 beats both (2 wins of 2 pairs, each judged twice: 4 / 4); member 1 wins 2 of 4; member 2 none;
    # the tie gives 1/2 each; alone: 1/2
    torch.testing.assert_close(result.scores, torch.tensor([1.0, 0.5, 0.0, 0.5, 0.5, 0.5]), rtol=0, atol=0)
    assert result.components["judge_calls"].tolist() == [6.0, 6.0, 6.0, 2.0, 2.0, 0.0]  # 2 * C(G, 2)
    assert judge_server.requests == 7  # the tie group's two orders are one identical request, asked once


def test_both_orders_cancel_a_position_bias(judge_server):
    judge_server.position_bias = True  # equal images: "Image 1 is better", whichever comes first
    both = _score(_reward(judge_server), [0.5] * 3, [0, 0, 0])
    torch.testing.assert_close(both.scores, torch.full((3,), 0.5), rtol=0, atol=0)
    one = _score(_reward(judge_server, orders="one"), [0.5] * 3, [0, 0, 0])
    torch.testing.assert_close(one.scores, torch.tensor([1.0, 0.5, 0.0]), rtol=0, atol=0)  # the bias shows


def _authors_win_rate(shares):
    """Pref-GRPO's ``_pairwise_win_rate`` over ``itertools.combinations``, with this judge's verdicts written out."""
    wins, counts = {}, {}
    for i, j in itertools.combinations(range(len(shares)), 2):
        counts[i], counts[j] = counts.get(i, 0) + 1, counts.get(j, 0) + 1
        if shares[i] > shares[j]:
            wins[i] = wins.get(i, 0) + 1
        elif shares[j] > shares[i]:
            wins[j] = wins.get(j, 0) + 1
        else:
            wins[i], wins[j] = wins.get(i, 0) + 0.5, wins.get(j, 0) + 0.5
    return [wins.get(i, 0) / counts[i] if counts.get(i) else 0.0 for i in range(len(shares))]


def test_one_order_is_the_authors_rule(judge_server):
    shares = [0.3, 0.8, 0.3, 0.0, 0.6]
    result = _score(_reward(judge_server, orders="one"), shares, [4] * 5)
    torch.testing.assert_close(result.scores, torch.tensor(_authors_win_rate(shares)), rtol=0, atol=1e-7)
    assert result.components["judge_calls"][0] == 10  # C(5, 2) comparisons
    assert judge_server.requests == 8  # members 0 and 2 are the same image: (0, 3) = (2, 3) and (0, 4) = (2, 4)


def test_the_pair_cap_is_seeded(judge_server):
    assert len(sample_pairs(6, 4, seed=1, group=3)) == 4 and sample_pairs(6, 4, 1, 3) == sample_pairs(6, 4, 1, 3)
    assert sample_pairs(6, 0, 1, 3) == list(itertools.combinations(range(6), 2))
    draws = {tuple(sample_pairs(6, 4, seed, 3)) for seed in range(8)}
    assert len(draws) > 1
    shares = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]
    first = _score(_reward(judge_server, max_pairs=4, seed=1), shares, [3] * 6)
    assert judge_server.requests == 8 and first.components["judge_calls"][0] == 8  # 4 pairs, both orders
    again = _score(_reward(judge_server, max_pairs=4, seed=1), shares, [3] * 6)  # a fresh cache: asked again
    assert judge_server.requests == 16
    torch.testing.assert_close(first.scores, again.scores, rtol=0, atol=0, equal_nan=True)
    pairs = sample_pairs(6, 4, 1, 3)
    expected = win_rates(6, [(a, b, float(shares[a] > shares[b])) for a, b in pairs], torch.ones(6, dtype=torch.bool))
    torch.testing.assert_close(first.scores, expected, rtol=0, atol=0, equal_nan=True)  # unjudged members: NaN


def test_failed_comparisons_are_left_out_and_unparsable_ones_tie(judge_server):
    shares = [0.9, 0.1, 0.9, 0.1]
    result = _score(_reward(judge_server), shares, [0, 0, 1, 1], prompts=["[drop]"] * 2 + ["[malformed]"] * 2)
    assert torch.isnan(result.scores[:2]).all()  # no judged comparison: NaN (the trainer counts it)
    torch.testing.assert_close(result.scores[2:], torch.tensor([0.5, 0.5]), rtol=0, atol=0)  # the authors' tie
    assert result.components["failed"].tolist() == [1.0, 1.0, 0.0, 0.0]
    assert result.components["unparsable"].tolist() == [0.0, 0.0, 1.0, 1.0]


def test_a_group_not_sampled_here_is_refused(judge_server):
    reward = _reward(judge_server)
    first = reward({"images": red_images([0.1, 0.2])}, PromptBatch(["a", "a"], group_ids=torch.tensor([0, 0])))
    with pytest.raises(ValueError, match="group_placement: contiguous"):
        reward.group_stage(first, torch.tensor([5, 5]))
    alone = reward.group_stage(first, torch.tensor([5, 6]))  # groups of one need no sample: 1/2, no request
    assert alone.scores.tolist() == [0.5, 0.5] and judge_server.requests == 0


@pytest.mark.parametrize("options, match", [
    ({"orders": "three"}, "orders"), ({"max_pairs": -1}, "max_pairs"), ({"first_better": "better"}, "contain"),
    ({"answer_tag": "<answer>"}, "answer_tag"), ({"modality": "text"}, "modality"),
])
def test_config_is_validated(options, match):
    with pytest.raises((ConfigError, ValueError), match=match):
        build_dataclass(JudgePairwiseConfig, options, "reward")


def test_win_rates_formula():
    judgements = [(0, 1, 1.0), (1, 0, 0.5), (0, 2, None), (2, 1, 0.0)]
    rates = win_rates(4, judgements, torch.tensor([True, True, True, False]))
    # 0: 1 + 0.5 of 2; 1: 0 + 0.5 + 1 of 3; 2: 0 of 1 (the failed one left out); 3: alone
    torch.testing.assert_close(rates, torch.tensor([0.75, 0.5, 0.0, 0.5]), rtol=0, atol=1e-7)
    assert math.isnan(win_rates(2, [(0, 1, None)], torch.ones(2, dtype=torch.bool))[0])


def test_trains_inside_composite_on_groups_judged_where_sampled(tmp_path, tiny_sd3_dir, judge_server):
    from mmgrpo import config as config_mod
    from mmgrpo.trainer import Trainer

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\na blue square\n")
    raw = {
        "output_dir": str(tmp_path / "run"), "seed": 3,
        "pipeline": {"name": "sd3", "pretrained": tiny_sd3_dir, "resolution": 32, "num_steps": 3,
                     "guidance_scale": 1.0, "lora_rank": 4, "max_sequence_length": 16},
        "algorithm": {"name": "flow_grpo", "clip_low": 0.2},
        "reward": {"name": "composite", "normalize": "group_normalize_then_sum", "rewards": {
            "judge_pairwise": {"weight": 0.4, "url": judge_server.url, "template": "PAIR {prompt}", "timeout": 5.0},
            "jpeg": {"weight": 0.6}}},
        "data": {"name": "prompt_file", "train_file": str(prompts), "eval_file": str(prompts)},
        "train": {"max_steps": 2, "prompts_per_step": 2, "group_size": 3, "minibatch_size": 6,
                  "learning_rate": 1e-3, "group_placement": "contiguous"},
        "eval": {"every": 0},
    }
    Trainer(config_mod.from_dict(raw)).train()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "reward/judge_pairwise" in r]
    assert len(steps) == 2
    for record in steps:
        assert record["reward/judge_pairwise/judge_calls"] == 6.0  # 2 * C(3, 2) per group
        assert record["reward/judge_pairwise"] == pytest.approx(0.5)  # win rates average 1/2 in every group
        assert record["reward/judge_pairwise/failed"] == 0.0
