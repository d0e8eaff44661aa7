"""bench/vlm_vs_trl.py without running a model: the step clock, the report it writes from measurements (table,
ratios, errors, figure; `bench/_vlm_report.py`) and its message when TRL is not installed."""

import importlib.metadata
import json

import pytest


@pytest.fixture(scope="module")
def bench(load_bench):
    return load_bench("vlm_vs_trl")


def test_step_stats_take_the_median_after_the_warmup(bench):
    stats = bench.step_stats([3.0, 4.0, 6.0, 7.0], start=0.0, warmup=1)  # steps of 3, 1, 2, 1 s
    assert stats["step_times_s"] == [3.0, 1.0, 2.0, 1.0] and stats["step_s"] == 1.0


def test_report_ratios_errors_and_files(bench, tmp_path):
    args = bench.argparse.Namespace(model="mmgrpo:vlm_shapes", config="configs/tiny/vlm_count.yaml", prompts=16,
                                    max_new_tokens=20, steps=4, warmup=1, learning_rate=2e-4, group_sizes=[2, 8],
                                    main_g=8, image_size=56, rounds=1, device="cpu")
    results = {
        "mmgrpo": {"2": {"step_s": 0.5, "peak_rss_mib": 700.0, "rss_before_steps_mib": 600.0},
                   "8": {"step_s": 1.0, "peak_rss_mib": 800.0, "rss_before_steps_mib": 600.0}},
        "trl": {"2": {"error": "RuntimeError: boom"},
                "8": {"step_s": 4.0, "peak_rss_mib": 1000.0, "rss_before_steps_mib": 600.0}},
    }
    bench.write_outputs(args, results, tmp_path)
    rows = {r["G"]: r for r in json.loads((tmp_path / "results.json").read_text())["rows"]}
    assert rows[8]["speedup"] == 4.0 and rows[8]["time_ratio"] == 0.25
    assert rows[8]["peak_rss_ratio"] == 0.8 and rows[8]["increment_ratio"] == 0.5
    assert rows[2]["speedup"] is None
    table = (tmp_path / "table.md").read_text()
    assert "| **8** | 1.000 | 4.000 | 0.25 | 4.0x | 800 | 1000 | 0.8 | 200 | 400 | 0.5 |" in table
    assert "| 2 | 0.500 | error |" in table and "- trl G=2: `RuntimeError: boom`" in table
    assert (tmp_path / "step_time_vs_g.png").stat().st_size > 1000
    assert "Peak GPU memory" not in table and "torch threads, CPU." in table

    args.device = "cuda"  # on a GPU the table also gives each side's peak GPU memory
    results["mmgrpo"]["8"]["peak_gpu_mib"], results["trl"]["8"]["peak_gpu_mib"] = 300.0, 900.0
    bench.write_outputs(args, results, tmp_path)
    table = (tmp_path / "table.md").read_text()
    assert "one GPU (float32)" in table and "G=2: - / -, G=8: 300 / 900" in table


def test_interleaved_rounds_report_the_median_run_and_the_median_per_round_ratio(bench, load_bench):
    ours = [{"step_s": 1.0}, {"step_s": 3.0}, {"step_s": 2.0}]  # round 2 was slow for both frameworks
    trl = [{"step_s": 4.0}, {"step_s": 6.0}, {"error": "boom"}]
    merged = bench.median_round(ours)
    assert merged["step_s"] == 2.0 and merged["round_step_s"] == [1.0, 3.0, 2.0]
    # per-round ratios 4.0 and 2.0 (the round without a TRL time is left out): their median
    assert load_bench("_vlm_report").round_speedup(merged, bench.median_round(trl)) == 3.0
    assert bench.median_round([{"error": "a"}, {"error": "b"}]) == {"error": "a"}


def test_missing_trl_names_the_pip_command(bench, monkeypatch, tmp_path):
    real = importlib.metadata.version

    def version(name):
        if name == "trl":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--output", str(tmp_path)])
    assert "pip install --no-deps trl==1.16.0" in str(exit_info.value.code)
