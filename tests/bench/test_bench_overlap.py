"""bench/overlap.py on the smallest case: three trainers (one chunk, chunks scored after each other, chunks scored
while the next samples) take turns on the tiny text-to-image config and the table reports each one's step time."""

import json


def test_the_three_modes_train_and_are_tabled(load_bench, tmp_path):
    bench = load_bench("overlap")
    measured = bench.main(["--output", str(tmp_path), "--chunks", "2", "--prompts", "2", "--group", "2", "--num-steps", "5",
                        "--call-s", "0", "--rounds", "2", "--steps", "1"])
    times, exposed = measured["step_s"], measured["reward_exposed_s"]
    assert list(times) == list(exposed) == ["1 chunk", "2 chunks, synchronous", "2 chunks, overlapped"]
    assert all(len(values) == 1 and values[0] > 0 for values in times.values())  # round 0 is not counted
    assert all(len(values) == 1 and 0 <= values[0] < times[label][0] for label, values in exposed.items())
    table = (tmp_path / "table.md").read_text()
    assert table.count("\n") == 5 and "| 2 chunks, synchronous | 2 | 0.00 | " in table and "| 1.00x | " in table
    assert json.loads((tmp_path / "results.json").read_text())["settings"]["chunks"] == 2
