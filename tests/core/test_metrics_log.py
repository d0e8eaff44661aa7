"""metrics.jsonl survives a torn last write: one reader skips a torn last line (and only the last), used on resume,
by the reward curve and by the bench scripts."""

import json
import math

import pytest

from mmgrpo.metrics_log import MetricsLog, read_records
from mmgrpo.visualize import plot_reward_curve

TORN = '{"step": 4, "reward/mean": 0.5, "eval/jp'  # a record cut by a crash mid-write (no newline)


def write_log(path, steps, tail=""):
    lines = [json.dumps({"step": s, "reward/mean": 0.1 * s, "eval/jpeg_kb": 1.0 + s, "time/step_s": 1.0})
             for s in steps]
    path.write_text("".join(line + "\n" for line in lines) + tail, encoding="utf-8")
    return path


def test_torn_last_line_is_skipped(tmp_path):
    path = write_log(tmp_path / "metrics.jsonl", [1, 2, 3], tail=TORN)
    assert [r["step"] for r in read_records(path)] == [1, 2, 3]
    path.write_bytes(path.read_bytes()[:-3] + "é".encode()[:1])  # cut inside a multi-byte character
    assert [r["step"] for r in read_records(path)] == [1, 2, 3]
    write_log(path, [1, 2], tail="\n\n")  # blank lines are no records
    assert [r["step"] for r in read_records(path)] == [1, 2]


def test_a_torn_line_before_the_last_is_an_error_with_its_line_number(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n' + TORN + '\n{"step": 5}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"metrics.jsonl, line 2: not a JSON record"):
        read_records(path)
    path.write_text('{"step": 1}\n[1, 2]\n{"step": 5}\n', encoding="utf-8")  # JSON, but not a record
    with pytest.raises(ValueError, match="line 2"):
        read_records(path)


def test_resume_truncation_drops_later_steps_and_a_torn_line(tmp_path):
    write_log(tmp_path / "metrics.jsonl", [1, 2, 3], tail=TORN)
    log = MetricsLog(tmp_path)
    log.truncate_after(2)
    log.write(3, {"reward/mean": 0.7})
    log.close()
    assert [r["step"] for r in read_records(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    assert (tmp_path / "metrics.jsonl").read_text().endswith('"reward/mean": 0.7}\n')
    assert not list(tmp_path.glob("*.tmp"))


def test_reward_curve_plots_a_log_with_a_torn_last_line(tmp_path):
    path = write_log(tmp_path / "metrics.jsonl", [1, 2, 3], tail=TORN)
    plot_reward_curve(path, tmp_path / "curve.png", "jpeg_kb")
    assert (tmp_path / "curve.png").stat().st_size > 1000


def test_bench_reads_a_run_with_a_torn_last_line(tmp_path, load_bench):
    run = tmp_path / "run"
    run.mkdir()
    config = {"seed": 0, "train": {"max_seconds": 30.0}, "pipeline": {"pretrained": "mmgrpo:t2i_shapes"},
              "eval": {"metric": "jpeg_kb", "num_prompts": 4, "every_seconds": 10.0}}
    (run / "config.json").write_text(json.dumps(config))
    write_log(run / "metrics.jsonl", [1, 2], tail=TORN)
    result = load_bench("flow_algorithms").read_run(run)
    assert result["steps"] == 2 and [p["value"] for p in result["curve"]] == [2.0, 3.0]


def test_non_finite_values_are_written_as_json_null(tmp_path):
    log = MetricsLog(tmp_path)
    log.write(1, {"reward/mean": float("nan"), "loss": float("inf"), "grad_norm": float("-inf"), "lr": 1e-3})
    log.close()
    line = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" not in line and "Infinity" not in line
    assert json.loads(line) == {"step": 1, "reward/mean": None, "loss": None, "grad_norm": None, "lr": 1e-3}
    plot_reward_curve(tmp_path / "metrics.jsonl", tmp_path / "curve.png", "jpeg_kb")  # a null is a gap, not an error
    assert (tmp_path / "curve.png").is_file()


def test_reward_curves_add_one_curve_per_kind_of_held_out_item(tmp_path):
    from mmgrpo.visualize import reward_curves

    records = [{"step": 0, "eval/strict": 0.2, "eval/kind/move/strict": 0.3, "eval/kind/remove/strict": 0.1,
                "eval/kind/move/edit_change": 0.9},
               {"step": 1, "reward/mean": 0.25},
               {"step": 2, "reward/mean": None, "eval/strict": 0.4, "eval/kind/move/strict": 0.7,
                "eval/kind/remove/strict": None}]
    curves = reward_curves(records, "strict")
    assert list(curves) == ["train reward (mean)", "held-out strict", "held-out strict, move",
                            "held-out strict, remove"]
    assert curves["held-out strict, move"] == [(0, 0.3), (2, 0.7)]
    assert curves["held-out strict, remove"][0] == (0, 0.1) and math.isnan(curves["held-out strict, remove"][1][1])
    assert curves["train reward (mean)"][0] == (1, 0.25) and math.isnan(curves["train reward (mean)"][1][1])
    assert list(reward_curves(records[1:2], "strict")) == ["train reward (mean)"]  # no evaluation yet
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    plot_reward_curve(path, tmp_path / "curve.png", "strict")
    assert (tmp_path / "curve.png").stat().st_size > 1000
