"""Experiment trackers through accelerate's tracking API: TensorBoard by default; Weights & Biases, MLflow, trackio,
Comet, Aim, ClearML, DVCLive or SwanLab when installed (none is needed to train). The config is logged as
hyper-parameters, metrics at every logged step, and evaluation samples as each tracker shows them
([`mmgrpo.tracker_samples`]: images, completion tables, videos, MLflow artifacts). ``metrics.jsonl`` is written
whatever the trackers ([`mmgrpo.metrics_log.MetricsLog`]); the trackers get its finite numbers under names every one
of them accepts ([`mmgrpo.tracker_names`]: ``eval/accuracy/malformed`` is logged as ``eval/accuracy.malformed``, since
MLflow cannot keep a metric that is also the folder of another).

TensorBoard's events go to ``<output_dir>/tensorboard/<project>``; after a resume, events an interrupted run wrote past
the checkpoint are hidden (TensorBoard's ``purge_step``), so no step shows twice.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from .tracker_names import tracker_metrics
from .validation import ConfigError, check_fields, check_text

# tracker name -> the package it needs (the name accelerate's `log_with` takes)
TRACKERS = {
    "tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow", "trackio": "trackio",
    "comet_ml": "comet_ml", "aim": "aim", "clearml": "clearml", "dvclive": "dvclive", "swanlab": "swanlab",
}


@dataclass
class TrackingConfig:
    """Where metrics and samples go besides ``metrics.jsonl``.

    Args:
        log_with (`list[str]`): trackers, by accelerate's names: ``tensorboard`` (the default), ``wandb``, ``mlflow``,
            ``trackio``, ``comet_ml``, ``aim``, ``clearml``, ``dvclive``, ``swanlab``; each needs its package installed
            (checked before any model loads). An empty list writes ``metrics.jsonl`` only.
        project (`str`): the project (experiment) the trackers file the run under.
        run_name (`str`, *optional*): the run's name in trackers that name runs (default: the output folder's name).
        entity (`str`, *optional*): the team or user the run is filed under: W&B's ``entity``, Comet's ``workspace``
            (default: the tracker's own, e.g. your W&B default entity).
        tags (`list[str]`): tags of the run: W&B's ``tags``, MLflow tags (each set to ``"true"``).
        log_samples (`bool`): log each evaluation's sample pictures (image grids, frame strips, overlays) as images,
            and its text table where the tracker has tables.
    """

    log_with: list[str] = field(default_factory=lambda: ["tensorboard"])
    project: str = "mmgrpo"
    run_name: str | None = None
    entity: str | None = None
    tags: list[str] = field(default_factory=list)
    log_samples: bool = True

    def __post_init__(self):
        check_fields(self)
        check_text("tracking.project", self.project)
        check_text("tracking.run_name", self.run_name)
        check_text("tracking.entity", self.entity)
        for tag in self.tags:
            check_text("tracking.tags", tag)
        for name in self.log_with:
            if name not in TRACKERS:
                raise ConfigError(f"tracking.log_with: unknown tracker {name!r}; choose from {sorted(TRACKERS)}.")
            if importlib.util.find_spec(TRACKERS[name]) is None:
                raise ConfigError(f"tracking.log_with: {name} is not installed: pip install {TRACKERS[name]} (or "
                                  f"remove it from tracking.log_with).")


def hyperparameters(config) -> dict:
    """The experiment config flattened to ``section/key`` -> a number, string or bool (lists and None as text), the
    form every tracker's hyper-parameter table takes."""
    flat = {}

    def walk(prefix: str, value) -> None:
        if dataclasses.is_dataclass(value):
            value = dataclasses.asdict(value)
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}/{key}" if prefix else str(key), item)
        elif isinstance(value, (bool, int, float, str)):
            flat[prefix] = value
        else:
            flat[prefix] = str(value)

    walk("", config.to_dict())
    return flat


class Trackers:
    """The run's trackers (on the main process; accelerate logs nothing elsewhere).

    A resumed run continues the trackers' runs of the checkpoint it resumes ([`init_options`]): the run's ids are kept
    in every checkpoint's ``trainer_state.json`` (``tracker_runs``, see [`state`]).

    Args:
        accelerator: the run's `Accelerator`, built with ``log_with`` (see [`accelerator_options`]).
        config: the [`ExperimentConfig`].
        resumed_step (`int`): the checkpoint's step when resuming (0 otherwise).
        resumed_from (`Path`, *optional*): the checkpoint resumed, whose ``tracker_runs`` are continued.
    """

    def __init__(self, accelerator, config, resumed_step: int = 0, resumed_from: Path | None = None):
        self.accelerator = accelerator
        self.settings = config.tracking
        self.enabled = bool(self.settings.log_with)
        self.runs = resumed_runs(resumed_from) or {"id": uuid.uuid4().hex}
        if not self.enabled:
            return
        run_name = self.settings.run_name or Path(config.output_dir).name
        init_kwargs = init_options(self.settings, run_name, self.runs, resumed_step)
        accelerator.init_trackers(self.settings.project, config=hyperparameters(config), init_kwargs=init_kwargs)
        if "mlflow" in self.settings.log_with:  # MLflow chooses its run ids: read it back to continue the run
            self.runs["mlflow"] = accelerator.get_tracker("mlflow", unwrap=True).info.run_id

    def state(self) -> dict:
        """What a checkpoint keeps so that a resumed run continues these trackers' runs: ``{"tracker_runs": {"id":
        our run id, "mlflow": MLflow's run id (when logging to MLflow)}}``."""
        return {"tracker_runs": dict(self.runs)}

    def log(self, step: int, metrics: dict) -> None:
        """Scalars of one step: finite numbers only, under names every tracker accepts (see
        [`mmgrpo.tracker_names`])."""
        if self.enabled:
            self.accelerator.log(tracker_metrics(metrics), step=step)

    def log_samples(self, paths: list[Path], step: int) -> None:
        """An evaluation's sample files, to each tracker as it shows them ([`mmgrpo.tracker_samples`]): pictures as
        images, completions as tables (TensorBoard: markdown text), clips as videos (TensorBoard) and every file as an
        artifact (MLflow)."""
        if not (self.enabled and self.settings.log_samples and self.accelerator.is_main_process):
            return
        from .tracker_samples import log_tracker_samples

        for tracker in self.accelerator.trackers:
            log_tracker_samples(tracker, paths, step)

    def close(self) -> None:
        """Finishes each tracker (not ``accelerator.end_training``, which would also end the process group that an
        evaluation after training still uses)."""
        if self.enabled:
            for tracker in self.accelerator.trackers:
                tracker.finish()


def resumed_runs(checkpoint_dir: Path | None) -> dict | None:
    """The ``tracker_runs`` a checkpoint recorded (None: no checkpoint, or one written before they were kept)."""
    if checkpoint_dir is None:
        return None
    from .checkpoint import read_metadata

    runs = (read_metadata(checkpoint_dir) or {}).get("tracker_runs")
    return dict(runs) if isinstance(runs, dict) and isinstance(runs.get("id"), str) else None


def init_options(settings: TrackingConfig, run_name: str, runs: dict, resumed_step: int = 0) -> dict:
    """Each tracker's ``init_kwargs``: the run's name, entity and tags (`settings`), and the ids that make a resumed
    run continue its trackers' runs instead of starting new ones (`runs`: see [`Trackers.state`]): W&B's ``id`` with
    ``resume="allow"``, MLflow's ``run_id``, Comet's ``experiment_key``, trackio's run name with ``resume="allow"``;
    TensorBoard's ``purge_step`` hides what an interrupted run wrote after the checkpoint. Aim, ClearML, DVCLive and
    SwanLab start a new run on resume."""
    entity, tags = settings.entity, list(settings.tags)
    options = {
        "wandb": {"name": run_name, "id": runs["id"], "resume": "allow",
                  **({"entity": entity} if entity else {}), **({"tags": tags} if tags else {})},
        "mlflow": {"run_name": run_name, **({"run_id": runs["mlflow"]} if runs.get("mlflow") else {}),
                   **({"tags": {tag: "true" for tag in tags}} if tags else {})},
        "comet_ml": {"experiment_key": runs["id"], **({"workspace": entity} if entity else {})},
        "trackio": {"name": run_name, "resume": "allow"},
        "swanlab": {"experiment_name": run_name},
    }
    if resumed_step:
        options["tensorboard"] = {"purge_step": resumed_step + 1}
    return options


def accelerator_options(config, output_dir: Path) -> dict:
    """The `Accelerator` arguments that route its trackers: ``log_with`` and the logging folder."""
    if not config.tracking.log_with:
        return {}
    from accelerate.utils import ProjectConfiguration

    return {"log_with": list(config.tracking.log_with),
            "project_config": ProjectConfiguration(project_dir=str(output_dir), logging_dir=str(output_dir / "tensorboard"))}
