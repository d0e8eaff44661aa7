"""bench/vlm_phases.py: the phase clock attributes nested calls to the outer phase and puts every function back; on a
short run of the shipped VLM the phases and "other" add up to the step, the decode parts lie within the decode loop,
and nothing stays wrapped afterwards."""

import json
import time

import pytest
import torch


@pytest.fixture(scope="module")
def bench(load_bench):
    return load_bench("vlm_phases")


class Work:
    def outer(self):
        time.sleep(0.02)
        return self.inner() + 1

    def inner(self):
        time.sleep(0.01)
        return 1


def test_a_phase_inside_another_counts_for_the_outer_one_and_restore_unwraps(bench):
    clock = bench.PhaseClock()
    outer, inner = Work.outer, Work.inner
    clock.wrap(Work, "outer", "outer")
    clock.wrap(Work, "inner", "inner")
    clock.wrap(Work, "inner", "inner part", top=False)
    work = Work()
    assert work.outer() == 2 and not clock.seconds  # off: nothing counted
    clock.on = True
    assert work.outer() == 2 and work.inner() == 1
    assert clock.calls == {"outer": 1, "inner": 1, "inner part": 2}  # the nested inner: only its part
    assert clock.seconds["outer"] >= 0.03 and 0.01 <= clock.seconds["inner"] < clock.seconds["outer"]
    clock.restore()
    assert Work.outer is outer and Work.inner is inner and not clock.wrapped


def test_phases_add_up_to_the_step_on_the_shipped_vlm(bench, tmp_path):
    backward = torch.Tensor.backward
    bench.main(["--prompts", "4", "--group-sizes", "4", "--max-new-tokens", "24", "--steps", "2", "--warmup", "1",
                "--output", str(tmp_path)])
    assert torch.Tensor.backward is backward  # every wrapper removed
    row = json.loads((tmp_path / "results.json").read_text())["rows"]["4"]
    phases = row["ms_per_step"]
    assert sum(phases[p] for p in (*bench.PHASES, "other")) == pytest.approx(row["step_ms"])
    assert row["updates_per_step"] == 1  # the timed steps took their update (groups with unequal rewards)
    assert all(phases[p] > 0 for p in bench.PHASES) and phases["other"] > 0
    assert sum(phases[p] for p in bench.DECODE_PARTS) < phases["decode loop"]
    assert 1 <= row["decode_steps_per_step"] <= 23  # at most 24 tokens: at most 23 steps after the prompt's
    table = (tmp_path / "table.md").read_text()
    assert "| - of which decode steps |" in table and f"**{row['step_ms']:.1f}**" in table
