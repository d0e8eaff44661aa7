"""bench/option_ab.py: two trainers of one config, B with an option, alternate their steps; the paired ratios come from
the recorded times, and B differs from A by its option only (here one that keeps the numbers: the same rewards and,
to float32 rounding, the same gradient norms)."""

import json
import statistics
from pathlib import Path

import pytest

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny" / "vlm_count.yaml"


def test_paired_steps_of_a_config_with_and_without_an_option(load_bench, tmp_path):
    bench = load_bench("option_ab")
    common = ["train.prompts_per_step=2", "train.group_size=2", "train.minibatch_size=4", "train.updates_per_step=1",
              "pipeline.max_new_tokens=8", "data.n_eval=1"]
    bench.main([str(CONFIG), "--common", *common, "--b", "pipeline.share_prompt_forward=true", "--steps", "4",
                "--warmup", "1", "--output", str(tmp_path)])
    result = json.loads((tmp_path / "results.json").read_text())
    times = result["times"]
    assert len(times["A"]) == len(times["B"]) == len(times["pairs"]) == 4
    assert times["pairs"] == pytest.approx([a / b for a, b in zip(times["A"], times["B"])])
    assert result["ratio_median"] == pytest.approx(statistics.median(times["pairs"]))
    a, b = result["summary"]["A"], result["summary"]["B"]
    assert a["reward_mean"] == b["reward_mean"] and a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    table = (tmp_path / "table.md").read_text()
    assert "B adds pipeline.share_prompt_forward=true" in table and f"{result['ratio_median']:.3f}x" in table
    with pytest.raises(SystemExit):
        bench.main([str(CONFIG), "--b", "pipeline.share_prompt_forward=true", "--steps", "2"])
