"""Tracker init options as config keys (project, entity, run name, tags), and a resumed run continuing the trackers'
runs of its checkpoint (their ids are kept in ``trainer_state.json``) instead of starting new ones."""

import inspect
import json
from pathlib import Path

from accelerate.tracking import MLflowTracker, SwanLabTracker, TensorBoardTracker

from mmgrpo import config as config_mod
from mmgrpo.tracking import TrackingConfig, init_options
from mmgrpo.trainer import Trainer

from builders._runs import dgpo_config


def test_entity_tags_and_run_ids_reach_each_trackers_init():
    settings = TrackingConfig(log_with=[], project="p", entity="team", tags=["a", "b"])
    options = init_options(settings, "run-1", {"id": "0123abcd" * 4, "mlflow": "f00d"}, resumed_step=4)
    assert options["wandb"] == {"name": "run-1", "id": "0123abcd" * 4, "resume": "allow", "entity": "team",
                                "tags": ["a", "b"]}
    assert options["mlflow"] == {"run_name": "run-1", "run_id": "f00d", "tags": {"a": "true", "b": "true"}}
    assert options["comet_ml"] == {"experiment_key": "0123abcd" * 4, "workspace": "team"}
    assert options["tensorboard"] == {"purge_step": 5}
    # accelerate passes these to the tracker classes it ships (MLflow's, SwanLab's, TensorBoard's name their
    # arguments; W&B's, Comet's and trackio's take **kwargs for wandb.init, comet_ml.start and trackio.init)
    for tracker, cls in (("mlflow", MLflowTracker), ("swanlab", SwanLabTracker), ("tensorboard", TensorBoardTracker)):
        parameters = inspect.signature(cls.__init__).parameters
        named = set(parameters) if not any(p.kind is p.VAR_KEYWORD for p in parameters.values()) else None
        assert named is None or set(options[tracker]) <= named, (tracker, options[tracker])
    fresh = init_options(TrackingConfig(log_with=[]), "run-1", {"id": "x" * 32})
    assert "run_id" not in fresh["mlflow"] and "tags" not in fresh["wandb"] and "tensorboard" not in fresh


def test_a_resumed_run_continues_the_trackers_runs_of_its_checkpoint(tmp_path, tiny_sd3_dir):
    raw = dgpo_config(tmp_path, tiny_sd3_dir, 2)
    raw["tracking"] = {"log_with": ["tensorboard"], "project": "proj", "tags": ["t"]}
    first = Trainer(config_mod.from_dict(raw))
    first.train()
    checkpoint = Path(raw["output_dir"]) / "checkpoints" / "step_0000002"
    kept = json.loads((checkpoint / "trainer_state.json").read_text())["tracker_runs"]
    assert kept == {"id": first.log.trackers.runs["id"]} and len(kept["id"]) == 32
    raw["train"]["max_steps"] = 3
    raw["checkpoint"]["resume_from"] = "latest"
    resumed = Trainer(config_mod.from_dict(raw))
    assert resumed.log.trackers.runs == kept
    resumed.train()
    later = json.loads((Path(raw["output_dir"]) / "checkpoints" / "step_0000003" / "trainer_state.json").read_text())
    assert later["tracker_runs"] == kept
    other = Trainer(config_mod.from_dict({**raw, "output_dir": str(tmp_path / "other"),
                                          "checkpoint": {"every": 2}}))
    assert other.log.trackers.runs["id"] != kept["id"]  # a new run gets a new id
