"""bench/soak.py's pure parts (no training runs): the growth fit and its verdict on synthetic samples, the step of a
metrics log with a torn last line, and the report written from recorded samples."""

import json
import os
import random

import pytest


@pytest.fixture(scope="module")
def soak(load_bench):
    return load_bench("soak")


def test_a_leak_of_known_slope_is_measured_and_flagged(soak):
    rng = random.Random(0)
    steps = list(range(301))
    rss = [800 + 0.05 * s + rng.gauss(0, 2.0) for s in steps]  # 5 MiB / 100 steps under 2 MiB of noise
    fit = soak.fit_growth(steps, rss, warmup=50, stop=300, block=25, floor=1.0)
    assert fit["blocks"] == 10 and fit["from_step"] == 50 and fit["to_step"] == 299
    assert fit["per_100_steps"] == pytest.approx(5.0, abs=3 * fit["se_per_100_steps"])
    assert 0 < fit["se_per_100_steps"] < 0.5 and fit["residual_std"] < 1.0  # a block median averages 25 steps
    assert fit["growth"] is True
    assert soak.verdict(fit, "MiB").startswith("grows 5.")


def test_flat_noisy_samples_are_no_growth(soak):
    rng = random.Random(1)
    steps = list(range(301))
    rss = [800 + 40 * (s < 50) + rng.gauss(0, 3.0) for s in steps]  # a warm-up bump, then flat noise
    fit = soak.fit_growth(steps, rss, warmup=50, stop=300, block=25, floor=0.0)
    assert abs(fit["per_100_steps"]) < 3 * fit["se_per_100_steps"]
    assert fit["growth"] is False and soak.verdict(fit, "MiB") == "no growth beyond noise"
    # the warm-up bump alone would read as a fall if it were fitted; a constant descriptor count is exactly flat
    assert soak.fit_growth(steps, rss, warmup=0, stop=300, block=25, floor=1.0)["per_100_steps"] < -5
    fds = soak.fit_growth(steps, [12.0] * 301, warmup=50, stop=300, block=25, floor=0.5)
    assert fds["per_100_steps"] == 0 and fds["se_per_100_steps"] == 0 and fds["growth"] is False


def test_a_bump_within_one_cycle_counts_once(soak):
    """Per-step values that sit 20 MiB high for 30 steps late in the run: fitted per step, the bump looks like
    growth many standard errors wide; through one median per 50-step cycle it is noise."""
    rng = random.Random(2)
    steps = list(range(601))
    rss = [900 + 20 * (430 <= s < 460) + rng.gauss(0, 2.0) for s in steps]
    fit = soak.fit_growth(steps, rss, warmup=100, stop=600, block=50, floor=0.0)
    assert fit["growth"] is False
    per_step = soak.fit_growth(steps, rss, warmup=100, stop=600, block=1, floor=0.0)
    assert per_step["growth"] is True  # what a per-step fit would have reported


def test_growth_below_the_floor_is_noise_and_one_descriptor_per_checkpoint_is_not(soak):
    steps = list(range(100, 301))
    tiny = soak.fit_growth(steps, [500 + 0.002 * s for s in steps], warmup=100, stop=300, block=50, floor=1.0)
    assert tiny["per_100_steps"] == pytest.approx(0.2) and tiny["growth"] is False  # 0.2 MiB / 100 steps
    leak = soak.fit_growth(steps, [20 + s // 50 for s in steps], warmup=100, stop=300, block=50, floor=0.5)
    assert leak["growth"] is True and leak["per_100_steps"] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="--warmup"):
        soak.fit_growth(steps, [1.0] * len(steps), warmup=250, stop=300, block=50, floor=1.0)


def test_read_step_skips_a_torn_last_line(soak, tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    assert soak.read_step(metrics) is None  # the run has not logged yet
    metrics.write_text('{"step": 0, "eval/score": 0.5}\n{"step": 1, "reward/mean": 0.4}\n{"step": 2, "rew')
    assert soak.read_step(metrics) == 1
    metrics.write_text(metrics.read_text() + 'ard/mean": 0.6}\n')
    assert soak.read_step(metrics) == 2
    metrics.write_text("".join(json.dumps({"step": s, "pad": "x" * 500}) + "\n" for s in range(400)) + '{"st')
    assert soak.read_step(metrics) == 399  # only the tail is read (the log grows every step)


def test_sample_process_reads_this_process(soak):
    sample = soak.sample_process(os.getpid())
    assert sample["rss_mib"] > 10 and sample["fds"] >= 3 and sample["threads"] >= 1
    assert soak.process_tree(os.getpid())[0] == os.getpid()


def test_summary_and_table_from_recorded_samples(soak, tmp_path):
    samples = [{"t": 0.0, "step": None, "rss_mib": 100.0, "fds": 5, "child_fds": 0, "threads": 3}]
    for step in range(0, 301):
        for repeat in range(2):
            samples.append({"t": step + repeat / 2, "step": step, "rss_mib": 500.0 + 0.1 * step + repeat,
                            "fds": 9 + 4 * (step == 300), "child_fds": 0, "threads": 4})
    run = {"config": "configs/tiny/mdlm_arith.yaml", "steps": 300, "wall_s": 210.0, "samples": samples}
    row = soak.summarize(run, warmup=100, block=50, rss_floor=1.0, fd_floor=0.5)
    rss, fd = row["rss"], row["fd"]
    # medians of steps 100-149 and 250-299 (the last step, 300, is the run closing); the maximum of every sample
    assert (rss["first_block"], rss["last_block"], rss["max"]) == (pytest.approx(512.95), pytest.approx(527.95), 531.0)
    assert rss["per_100_steps"] == pytest.approx(10.0) and rss["growth"] is True
    # the descriptors opened while the run closes (the last step) are not growth
    assert (fd["first_block"], fd["last_block"], fd["max"], fd["growth"]) == (9, 9, 13, False)
    table = soak.markdown_table([row])
    assert "| mdlm_arith | 300 | 210 | 513 / 528 | 531 | +10.00 +- 0.00 | 0.0 | 9 / 9, 13 | +0.00 +- 0.00 |" in table
    assert table.endswith("| grows 10.00 +- 0.00 MiB / 100 steps |")
    soak.plot([run], [row], tmp_path / "soak.png", warmup=100, block=50)
    assert (tmp_path / "soak.png").stat().st_size > 1000
