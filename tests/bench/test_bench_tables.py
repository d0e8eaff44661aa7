"""bench/flow_algorithms.py's report on synthetic runs (no model runs): time to reach Flow-GRPO's final reward, the
speed-ups, the verdict on DGPO's claim, and the files it writes."""

import json
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def bench(load_bench):
    return load_bench("flow_algorithms")


def write_run(folder: Path, evals: dict[int, float], step_s: float, with_train_s: bool = True) -> Path:
    """A run folder as the trainer leaves it: `evals` maps step -> held-out strict; 128 images and `step_s` s a step."""
    folder.mkdir(parents=True)
    config = {"seed": 0, "train": {"max_seconds": 30.0}, "pipeline": {"pretrained": "mmgrpo:t2i_shapes"},
              "eval": {"metric": "strict", "num_prompts": 16, "every_seconds": 10.0}}
    (folder / "config.json").write_text(json.dumps(config))
    lines = [{"step": 0, "eval/strict": evals[0]}]
    for step in range(1, max(evals) + 1):
        line = {"step": step, "reward/mean": 0.5, "samples_seen": 128 * step, "time/step_s": step_s}
        if with_train_s:
            line["time/train_s"] = step_s * step
        if step in evals:
            line["eval/strict"] = evals[step]
        lines.append(line)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return folder


def test_report_times_every_run_to_flow_grpo_final_reward(bench, tmp_path):
    write_run(tmp_path / "flow_grpo_s0", {0: 0.5, 1: 0.6, 2: 0.7, 3: 0.8}, step_s=10.0)
    write_run(tmp_path / "dgpo_s0", {0: 0.5, 1: 0.85, 6: 0.9}, step_s=5.0, with_train_s=False)  # reaches 0.8 at 5 s
    write_run(tmp_path / "e_grpo_s0", {0: 0.5, 3: 0.79}, step_s=10.0)  # never reaches it
    bench.main(["--report-only", "--output", str(tmp_path), "--algorithms", "flow_grpo", "dgpo", "e_grpo", "--seeds", "0"])

    results = json.loads((tmp_path / "results.json").read_text())
    rows = results["per_seed"]["0"]["rows"]
    assert results["per_seed"]["0"]["target"] == 0.8
    assert rows["flow_grpo"]["reached"] == {"step": 3, "train_s": 30.0, "samples_seen": 384, "speedup_s": 1.0,
                                            "speedup_images": 1.0}
    assert rows["dgpo"]["reached"]["train_s"] == 5.0 and rows["dgpo"]["reached"]["speedup_s"] == 6.0
    assert rows["dgpo"]["reached"]["speedup_images"] == 3.0 and rows["dgpo"]["train_s"] == 30.0  # summed time/step_s
    assert rows["e_grpo"]["reached"] is None and rows["e_grpo"]["best"] == 0.79
    assert results["per_seed"]["0"]["claim"]["held"] is True
    assert [p["train_s"] for p in results["runs"]["dgpo_s0"]["curve"]] == [0.0, 5.0, 30.0]

    table = (tmp_path / "table.md").read_text()
    assert "| DGPO | 1 | 0.500 | 0.900 | +0.400 | 0.900 | 6 | 768 | 1/1 | 6.00x | 3.00x |" in table
    assert "| E-GRPO | 1 | 0.500 | 0.790 | +0.290 | 0.790 | 3 | 384 | 0/1 | n/a | n/a |" in table
    assert "- seed 0: Yes:" in table
    assert (tmp_path / "curves.png").stat().st_size > 1000


def test_seeds_are_compared_to_their_own_reference_and_averaged(bench, tmp_path):
    # seed 0: Flow-GRPO ends at 0.8 after 30 s; seed 1: at 0.7 after 20 s (it first reaches 0.7 at 20 s)
    write_run(tmp_path / "flow_grpo_s0", {0: 0.5, 1: 0.6, 2: 0.7, 3: 0.8}, step_s=10.0)
    write_run(tmp_path / "flow_grpo_s1", {0: 0.5, 1: 0.6, 2: 0.7, 3: 0.7}, step_s=10.0)
    write_run(tmp_path / "e_grpo_s0", {0: 0.5, 1: 0.8, 3: 0.9}, step_s=10.0)  # 0.8 at 10 s: 3x sooner
    write_run(tmp_path / "e_grpo_s1", {0: 0.5, 2: 0.65, 3: 0.6}, step_s=10.0)  # never reaches 0.7
    bench.main(["--report-only", "--output", str(tmp_path), "--algorithms", "flow_grpo", "e_grpo", "--seeds", "0", "1"])

    results = json.loads((tmp_path / "results.json").read_text())
    assert [results["per_seed"][s]["target"] for s in ("0", "1")] == [0.8, 0.7]
    row = bench.aggregate({int(k): v for k, v in results["per_seed"].items()})["e_grpo"]
    assert row["seeds"] == 2 and row["reached"] == 1
    assert row["final"] == {"mean": 0.75, "min": 0.6, "max": 0.9, "n": 2}
    assert row["speedup_s"] == {"mean": 3.0, "min": 3.0, "max": 3.0, "n": 1}  # over the seed that reached it
    assert abs(row["gain"]["mean"] - 0.25) < 1e-12
    table = (tmp_path / "table.md").read_text()
    assert "| E-GRPO | 2 | 0.500 | 0.750 (0.600-0.900) | +0.250 (+0.100-+0.400) | 0.775 (0.650-0.900) |" in table
    assert "| 1/2 | 3.00x | 3.00x |" in table
    assert "- seed 1: Not measured: DGPO was not run" in table


def test_claim_verdict_says_no_and_cannot_judge(bench, tmp_path):
    flow = bench.read_run(write_run(tmp_path / "f", {0: 0.5, 1: 0.6, 2: 0.7}, step_s=10.0))
    slow = bench.read_run(write_run(tmp_path / "d", {0: 0.5, 1: 0.7}, step_s=10.0))  # reaches it 2x sooner
    never = bench.read_run(write_run(tmp_path / "n", {0: 0.5, 2: 0.6}, step_s=10.0))
    flat = bench.read_run(write_run(tmp_path / "z", {0: 0.5, 2: 0.5}, step_s=10.0))

    assert bench.compare({"flow_grpo": flow, "dgpo": slow})["claim"]["held"] is False
    verdict = bench.compare({"flow_grpo": flow, "dgpo": never})["claim"]
    assert verdict["held"] is False and verdict["text"].startswith("No: DGPO never reached")
    verdict = bench.compare({"flow_grpo": flat, "dgpo": slow})["claim"]  # Flow-GRPO did not improve: nothing to reach
    assert verdict["held"] is None and verdict["text"].startswith("Cannot be judged")
    assert bench.compare({"flow_grpo": flow})["claim"]["held"] is None


def test_commands_share_budget_and_evaluation_and_run_every_seed(bench):
    args = bench.parse_args(["--budget-s", "90", "--eval-prompts", "16", "--seeds", "3", "4"])
    commands = [bench.train_command(name, seed, args) for seed in args.seeds for name in args.algorithms]
    assert [c[4] for c in commands] == list(bench.CONFIGS.values()) * 2
    assert all((bench.ROOT / path).is_file() for path in bench.CONFIGS.values())
    for command in commands:
        assert {"train.max_seconds=90.0", "eval.every=0", "eval.every_seconds=10.0", "eval.num_prompts=16"} <= set(command)
    assert [c.count("seed=3") for c in commands] == [1] * len(args.algorithms) + [0] * len(args.algorithms)
    assert any(arg.endswith("flow_grpo_s3") for arg in commands[0])
    with pytest.raises(SystemExit):
        bench.parse_args(["--algorithms", "dgpo"])  # nothing to time it against
