"""The per-prompt evaluation table: grouping, means that skip unscorable (NaN) items, worst prompt first; and the
headline metric per kind of item."""

import json
import math

import pytest
from hypothesis import given, settings, strategies as st

from mmgrpo.visualize import write_per_prompt_scores


def test_groups_by_prompt_sorts_worst_first_and_skips_nan(tmp_path):
    items = [("a red circle", 0.5, 1.0, 0), ("two blue squares", 0.2, 0.0, 1), ("a red circle", 1.0, 1.0, 2),
             ("two blue squares", 0.6, 1.0, 3), ("two blue squares", math.nan, math.nan, 4),
             ("no objects", math.nan, math.nan, 5)]
    path = tmp_path / "eval" / "step_00003.json"
    write_per_prompt_scores(items, path, "strict")
    rows = json.loads(path.read_text())
    assert [r["prompt"] for r in rows] == ["two blue squares", "a red circle", "no objects"]
    assert rows[0]["n"] == 3 and rows[0]["strict"] == pytest.approx(0.5) and rows[0]["reward"] == pytest.approx(0.4)
    assert rows[1] == {"prompt": "a red circle", "n": 2, "reward": 0.75, "strict": 1.0, "items": [0, 2],
                       "values": [1.0, 1.0]}
    assert rows[0]["items"] == [1, 3, 4]  # the held-out items behind each row, and each one's value
    assert rows[0]["values"] == [0.0, 1.0, None]  # an unscorable item: null, not NaN (which JSON has not)
    assert rows[2]["strict"] is None and rows[2]["reward"] is None  # nothing scorable: last, not a fake 0


def test_kind_metrics_average_the_headline_per_kind():
    from mmgrpo.evaluation import kind_metrics

    items = [{"prompt": "p", "metadata": {"kind": k}} for k in ("move", "recolor", "move", "remove", "move")]
    items += [{"prompt": "q"}, {"prompt": "r", "metadata": {"kind": 3}}]  # no kind, a kind that is not a name
    per_item = [("p", 0.0, v, i) for i, v in enumerate([1.0, 0.0, 0.0, 1.0, math.nan, 1.0, 1.0])]
    assert kind_metrics(per_item, items, "strict", "eval/") == {
        "eval/kind/move/strict": 0.5, "eval/kind/recolor/strict": 0.0, "eval/kind/remove/strict": 1.0}
    assert kind_metrics(per_item[:1] + per_item[2:3], items, "strict", "eval/ood/") == {}  # one kind: the headline
    many = [{"prompt": "p", "metadata": {"kind": f"k{i}"}} for i in range(17)]
    assert kind_metrics([("p", 0.0, 1.0, i) for i in range(17)], many, "score", "eval/") == {}  # past KIND_LIMIT


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["single", "counting", "two_objects"]),
                          st.one_of(st.floats(0, 1), st.just(math.nan))), min_size=1, max_size=40))
def test_kind_means_weighted_by_their_counts_give_the_overall_mean(rows):
    from mmgrpo.evaluation import kind_metrics

    items = [{"prompt": "p", "metadata": {"kind": kind}} for kind, _ in rows]
    out = kind_metrics([("p", 0.0, value, i) for i, (_, value) in enumerate(rows)], items, "strict", "eval/")
    finite = [(kind, value) for kind, value in rows if value == value]
    counts = {kind: sum(1 for k, _ in finite if k == kind) for kind, _ in finite}
    if len(counts) < 2:
        assert out == {}
        return
    assert set(out) == {f"eval/kind/{kind}/strict" for kind in counts}
    weighted = sum(counts[kind] * out[f"eval/kind/{kind}/strict"] for kind in counts) / len(finite)
    assert weighted == pytest.approx(sum(value for _, value in finite) / len(finite), abs=1e-9)


def test_zero_std_groups_counts_the_groups_whose_finite_rewards_are_equal():
    import torch

    from mmgrpo.evaluation import reward_metrics

    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, float("nan"), 0.0])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])  # group 3: one finite reward, so equal
    assert reward_metrics(scores[:6], groups[:6], {})["reward/zero_std_groups"] == pytest.approx(2 / 3)
    assert reward_metrics(scores, groups, {})["reward/zero_std_groups"] == pytest.approx(3 / 4)
