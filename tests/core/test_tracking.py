"""Trackers through accelerate's tracking API (TensorBoard here; the others are the same calls): metrics per step, the
config as hyper-parameters, evaluation samples as images, no step twice after a resume, and clear errors for an
unknown or missing tracker before any model loads."""

from pathlib import Path

import pytest
import yaml

from mmgrpo import config as config_mod
from mmgrpo.sample_writers import SampleWriter
from mmgrpo.tracker_samples import log_tracker_samples
from mmgrpo.tracking import TrackingConfig, hyperparameters
from mmgrpo.types import PromptBatch
from mmgrpo.trainer import Trainer
from mmgrpo.validation import ConfigError

from builders._runs import dgpo_config


def _events(folder: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(folder), size_guidance={"images": 0, "scalars": 0, "tensors": 0})
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


def _tensorboard_accelerator(folder: Path):
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    accelerator = Accelerator(log_with="tensorboard", project_config=ProjectConfiguration(
        project_dir=str(folder), logging_dir=str(folder / "tensorboard")))
    accelerator.init_trackers("samples")
    return accelerator


def test_tensorboard_gets_completions_as_a_text_table_and_clips_as_videos(tmp_path):
    import io

    import torch
    from PIL import Image

    text = SampleWriter("text", limit=2)
    text.add({"texts": ["<answer>3</answer>", "a | b\nsecond line"]}, PromptBatch(["how many?", "say a | b"]))
    video = SampleWriter("video", limit=2)
    frames = torch.linspace(0, 1, 5)[:, None, None, None].expand(5, 3, 20, 28)  # [F, 3, H, W] a fade to white
    video.add({"videos": torch.stack([frames, 1 - frames])}, PromptBatch(["fade in", "fade out"]))
    accelerator = _tensorboard_accelerator(tmp_path)
    paths = text.write(tmp_path / "samples", 4, [1.0, 0.25]) + video.write(tmp_path / "samples", 4, [0.5, 0.0])
    for tracker in accelerator.trackers:
        log_tracker_samples(tracker, paths, 4)
        tracker.finish()
    events = _events(tmp_path / "tensorboard" / "samples")
    (table,) = events.Tensors("samples/table/text_summary")
    assert table.step == 4
    assert table.tensor_proto.string_val[0].decode().splitlines() == [
        "| prompt | completion | reward |", "|---|---|---|", "| how many? | <answer>3</answer> | 1.000 |",
        "| say a \\| b | a \\| b<br>second line | 0.250 |"]
    for name, first in (("samples/video.sample_00", 0), ("samples/video.sample_01", 255)):
        (clip,) = events.Images(name)
        assert clip.step == 4 and clip.encoded_image_string.startswith(b"GIF89a")
        with Image.open(io.BytesIO(clip.encoded_image_string)) as gif:
            assert gif.n_frames == 5 and gif.size == (28, 20)
            assert abs(int(gif.convert("L").getpixel((14, 10))) - first) < 16  # the clip's first frame
    assert [e.step for e in events.Images("samples/video")] == [4]  # the frame strips, as before
