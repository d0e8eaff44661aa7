"""Progress output: plain periodic lines when the output is not a terminal (no carriage-return updates in a log file),
a tqdm bar on a terminal; the total and the time left respect ``train.max_seconds``."""

import io

from mmgrpo.progress import StepProgress


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class Terminal(io.StringIO):
    def isatty(self):
        return True


def run(progress, clock, steps, seconds_per_step, start=0, start_seconds=0.0, stop_at=None):
    spent = start_seconds
    for step in range(start + 1, steps + 1):
        clock.now += seconds_per_step
        spent += seconds_per_step
        last = step == steps or step == stop_at
        progress.update(step, spent, {"reward": f"{step / 10:.4g}"}, last)
        if last:
            break
    progress.close()


def test_a_log_file_gets_plain_periodic_lines():
    log, clock = io.StringIO(), Clock()
    run(StepProgress(0, 100, 0.0, 0.0, "train", stream=log, every_seconds=30, clock=clock), clock, 100, 2.0)
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue()
    assert [int(line.split()[2].split("/")[0]) for line in lines] == [1, 16, 31, 46, 61, 76, 91, 100]  # 30 s apart
    assert lines[0] == "train: step 1/100 reward 0.1 (00:02 of training, about 03:18 of training left)"
    assert lines[-1] == "train: step 100/100 reward 10 (03:20 of training)"


def test_the_total_and_time_left_follow_max_seconds():
    log, clock = io.StringIO(), Clock()
    progress = StepProgress(0, 1000, 60.0, 0.0, "train", stream=log, every_seconds=0, clock=clock)
    assert progress.expected(4, 8.0) == (30, 52.0)  # 2 s per step: the budget's 60 s end the run at step 30
    run(progress, clock, 1000, 2.0, stop_at=30)
    lines = log.getvalue().splitlines()
    assert lines[0].startswith("train: step 1/30 ") and lines[0].endswith("about 00:58 of training left)")
    assert lines[-1].startswith("train: step 30/30 ")
    resumed = StepProgress(20, 1000, 60.0, 40.0, "train", stream=io.StringIO())
    assert resumed.expected(25, 50.0) == (30, 10.0)  # the resumed run's own steps set the pace
    assert StepProgress(0, 50, 0.0, 0.0, "t", stream=io.StringIO()).expected(5, 10.0) == (50, 90.0)


def test_a_terminal_gets_a_bar_with_the_budgets_total():
    screen, clock = Terminal(), Clock()
    progress = StepProgress(0, 1000, 60.0, 0.0, "train", stream=screen, clock=clock)
    run(progress, clock, 10, 2.0, stop_at=10)
    assert progress.bar.n == 10 and progress.bar.total == 10  # stopped at the last step
    shown = screen.getvalue()
    assert "\r" in shown and "train" in shown and "reward=1" in shown


def test_other_processes_show_nothing():
    log = io.StringIO()
    progress = StepProgress(0, 10, 0.0, 0.0, "train", enabled=False, stream=log)
    progress.update(1, 1.0, {"reward": "1"}, True)
    progress.close()
    assert log.getvalue() == ""


def test_library_bars_are_quiet_in_a_log_file():
    import diffusers.utils.logging
    import huggingface_hub.utils
    import transformers.utils.logging

    from mmgrpo.progress import quiet_library_bars

    assert not quiet_library_bars(Terminal())
    try:
        assert quiet_library_bars(io.StringIO())
        assert not diffusers.utils.logging.is_progress_bar_enabled()
        assert not transformers.utils.logging.is_progress_bar_enabled()
        assert huggingface_hub.utils.are_progress_bars_disabled()
    finally:
        diffusers.utils.logging.enable_progress_bar()
        transformers.utils.logging.enable_progress_bar()
        huggingface_hub.utils.enable_progress_bars()
