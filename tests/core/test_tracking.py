"""Trackers through accelerate's tracking API (TensorBoard here; the others are the same calls): metrics per step, the
config as hyper-parameters, evaluation samples as images, no step twice after a resume, and clear errors for an
unknown or missing tracker before any model loads."""

from pathlib import Path

import pytest
import yaml

from mmgrpo import config as config_mod
from mmgrpo.tracking import TrackingConfig, hyperparameters
from mmgrpo.trainer import Trainer
from mmgrpo.validation import ConfigError

from builders._runs import dgpo_config


def _events(folder: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(folder), size_guidance={"images": 0, "scalars": 0})
    accumulator.Reload()
    return accumulator


def _run(tmp_path, tiny_sd3_dir, steps, **changes):
    raw = dgpo_config(tmp_path, tiny_sd3_dir, steps)
    raw["eval"] = {"every": 2, "num_prompts": 2, "grid_size": 2, "metric": "jpeg_kb"}
    raw.update(changes)
    return raw


def test_tensorboard_gets_metrics_hyperparameters_and_sample_images(tmp_path, tiny_sd3_dir):
    raw = _run(tmp_path, tiny_sd3_dir, 2)
    Trainer(config_mod.from_dict(raw)).train()
    board = Path(raw["output_dir"]) / "tensorboard" / "mmgrpo"
    events = _events(board)
    assert [e.step for e in events.Scalars("reward/mean")] == [1, 2]
    assert [e.step for e in events.Scalars("eval/jpeg_kb")] == [0, 2]
    assert [e.step for e in events.Images("samples/grid")] == [0, 2]  # the image grid of each evaluation
    # the config as hyper-parameters (accelerate's TensorBoard tracker also writes them to an hparams.yml)
    (hparams,) = board.rglob("hparams.yml")
    logged = yaml.safe_load(hparams.read_text())
    flat = hyperparameters(config_mod.from_dict(raw))
    assert logged == flat
    assert flat["algorithm/name"] == "dgpo" and flat["train/group_size"] == 2 and flat["tracking/project"] == "mmgrpo"


def test_no_step_shows_twice_after_a_resume(tmp_path, tiny_sd3_dir):
    raw = _run(tmp_path, tiny_sd3_dir, 4)  # checkpoints at steps 2 and 4: the run is "stopped" after step 4
    Trainer(config_mod.from_dict(raw)).train()
    raw["checkpoint"]["resume_from"] = str(Path(raw["output_dir"]) / "checkpoints" / "step_0000002")
    Trainer(config_mod.from_dict(raw)).train()  # steps 3 and 4 again
    events = _events(Path(raw["output_dir"]) / "tensorboard" / "mmgrpo")
    assert [e.step for e in events.Scalars("reward/mean")] == [1, 2, 3, 4]


def test_no_tracker_writes_metrics_jsonl_only(tmp_path, tiny_sd3_dir):
    raw = _run(tmp_path, tiny_sd3_dir, 1, tracking={"log_with": []})
    Trainer(config_mod.from_dict(raw)).train()
    assert (Path(raw["output_dir"]) / "metrics.jsonl").is_file()
    assert not (Path(raw["output_dir"]) / "tensorboard").exists()


def test_unknown_or_missing_trackers_are_config_errors():
    with pytest.raises(ConfigError, match="unknown tracker 'tensorbord'"):
        TrackingConfig(log_with=["tensorbord"])
    pytest.importorskip("tensorboard")
    try:
        import comet_ml  # noqa: F401
        pytest.skip("comet_ml is installed here")
    except ImportError:
        pass
    with pytest.raises(ConfigError, match="comet_ml is not installed: pip install comet_ml"):
        TrackingConfig(log_with=["tensorboard", "comet_ml"])
