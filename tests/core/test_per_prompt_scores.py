"""The per-prompt evaluation table: grouping, means that skip unscorable (NaN) items, worst prompt first."""

import json
import math

import pytest

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
    assert rows[1] == {"prompt": "a red circle", "n": 2, "reward": 0.75, "strict": 1.0, "items": [0, 2]}
    assert rows[0]["items"] == [1, 3, 4]  # the held-out items behind each row
    assert rows[2]["strict"] is None and rows[2]["reward"] is None  # nothing scorable: last, not a fake 0
