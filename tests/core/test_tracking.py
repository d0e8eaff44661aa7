"""Trackers through accelerate's tracking API (TensorBoard here; the others are the same calls): metrics per step, the
config as hyper-parameters, evaluation samples (images; on TensorBoard also completion tables and videos; on MLflow
every file as an artifact), no step twice after a resume, and clear errors for an unknown or missing tracker before
any model loads."""

import shutil
from pathlib import Path

import pytest
import yaml

from accelerate.tracking import GeneralTracker

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


def _sample_files(folder: Path) -> list[Path]:
    """The files the text and video writers write for step 4: two completions, two clips of 5 frames."""
    import torch

    text = SampleWriter("text", limit=2)
    text.add({"texts": ["<answer>3</answer>", "a | b\nsecond line"]}, PromptBatch(["how many?", "say a | b"]))
    video = SampleWriter("video", limit=2)
    frames = torch.linspace(0, 1, 5)[:, None, None, None].expand(5, 3, 20, 28)  # [F, 3, H, W] a fade to white
    video.add({"videos": torch.stack([frames, 1 - frames])}, PromptBatch(["fade in", "fade out"]))
    return text.write(folder / "samples", 4, [1.0, 0.25]) + video.write(folder / "samples", 4, [0.5, 0.0])


def test_tensorboard_gets_completions_as_a_text_table_and_clips_as_videos(tmp_path):
    import io

    from PIL import Image

    accelerator = _tensorboard_accelerator(tmp_path)
    paths = _sample_files(tmp_path)
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


class ArtifactStore(GeneralTracker):
    """An accelerate tracker named ``mlflow`` whose ``log_artifact`` does what accelerate's MLflowTracker's does with a
    local store (``mlflow.log_artifact``: the file copied into ``<artifact root>/<artifact_path>/``), for where mlflow
    is not installed."""

    name, requires_logging_directory = "mlflow", False

    def __init__(self, root: Path):
        super().__init__()
        self.root = root

    @property
    def tracker(self):
        return self.root

    def log_artifact(self, local_path: str, artifact_path: str | None = None):
        folder = self.root / (artifact_path or "")
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copy(local_path, folder)


def _artifacts(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


MLFLOW_FILES = [f"samples/step_00004/{name}" for name in (
    "step_00004.html", "step_00004.jsonl", "step_00004_video.html", "step_00004_video.png",
    "step_00004_video/sample_00.mp4", "step_00004_video/sample_01.mp4")]


def test_mlflow_gets_every_sample_file_as_an_artifact_through_accelerates_tracker(tmp_path):
    from accelerate import Accelerator

    accelerator = Accelerator(log_with=[ArtifactStore(tmp_path / "artifacts")])
    accelerator.init_trackers("samples")
    paths = _sample_files(tmp_path)
    for tracker in accelerator.trackers:
        log_tracker_samples(tracker, paths, 4)
    assert _artifacts(tmp_path / "artifacts") == MLFLOW_FILES
    for path in paths:  # each file as written
        copy = tmp_path / "artifacts" / next(name for name in MLFLOW_FILES if name.endswith(f"/{path.name}"))
        assert copy.read_bytes() == path.read_bytes()


def test_mlflow_keeps_the_sample_files_of_a_real_run(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    from accelerate import Accelerator

    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # a local store without a database (MLflow 3)
    accelerator = Accelerator(log_with="mlflow")
    accelerator.init_trackers("samples")
    tracker = accelerator.get_tracker("mlflow")
    log_tracker_samples(tracker, _sample_files(tmp_path), 4)
    run_id = tracker.tracker.info.run_id
    tracker.finish()
    local = mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path="samples", dst_path=str(tmp_path / "got"))
    assert _artifacts(Path(local).parent) == MLFLOW_FILES
