"""Every metric a shipped config logs reaches every supported tracker under a name that tracker accepts, and values
that are not finite are not sent.

The metric names are the trainer's own, plus the reward components of each shipped config, found by scoring sample
outputs of its pipeline's modalities on items of its own prompt source (a config whose reward needs weights that are
not here, or that asks a server, is left out, and the test says how many were covered). Each tracker's naming rules
are written out from its code: MLflow's ``_validate_metric_name`` (allowed characters, no ``..`` part, not an
absolute path) and its file store (a metric is a file under its name, so no name may be the folder of another); W&B's
reserved ``_`` prefix; DVCLive's file per metric (MLflow's folder rule). TensorBoard runs for real."""

import math
import re
from pathlib import Path

import pytest
import torch
from hypothesis import given, strategies as st

from mmgrpo import registry
from mmgrpo.config import load
from mmgrpo.prompt_stream import items_to_batch
from mmgrpo.tracker_names import tracker_metrics, tracker_name

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml")) + sorted((ROOT / "configs" / "tiny").glob("*.yaml"))
TRAINER_NAMES = ["reward/mean", "reward/std", "reward/invalid", "reward/zero_std_groups", "reward/sampled_mean", "lr",
                 "samples_seen", "time/step_s", "time/train_s", "time/reward_wait_s", "train/skipped_updates",
                 "train/unscored_share", "train/loss", "train/ratio_mean", "eval/score"]
SERVED = {"judge", "judge_pairwise", "remote"}  # rewards that ask a server: none runs here
TEXTS = ["<think>a</think><answer>3</answer>", "<answer>[1, 2, 10, 12]</answer>", "junk", ""]
OUTPUTS = {  # modality -> sample outputs of n samples
    "image": lambda n: {"images": torch.rand(n, 3, 32, 32, generator=torch.Generator().manual_seed(0))},
    "video": lambda n: {"videos": torch.rand(n, 2, 3, 32, 32, generator=torch.Generator().manual_seed(0))},
    "text": lambda n: {"texts": [TEXTS[i % len(TEXTS)] for i in range(n)]},
}


def _mlflow(names: list[str]) -> list[str]:
    errors = [n for n in names if not re.fullmatch(r"[/\w.\- :]*", n) or n.startswith("/") or ".." in n.split("/")]
    folders = {"/".join(n.split("/")[:i]) for n in names for i in range(1, n.count("/") + 1)}
    return errors + [f"{n} is also a folder" for n in names if n in folders]


RULES = {
    "mlflow": _mlflow,
    "dvclive": lambda names: _mlflow(names),
    "wandb": lambda names: [n for n in names if n.startswith("_")],
    "generic": lambda names: [n for n in names if not n or n != n.strip()],  # trackio, comet_ml, aim, clearml, swanlab
}


def config_metric_names(path: Path) -> list[str] | None:
    """The metric names of config `path`: the trainer's and its reward's components (at training and evaluation);
    None when its reward cannot be built here (weights that are not shipped)."""
    unused = f"output_dir={ROOT / 'outputs' / 'unused'}"
    try:  # four training items are scored: a synthetic source need not render thousands
        config = load(path, [unused, "data.n_train=4"])
    except ValueError:  # a source without `n_train` (a file), or a base model that is not shipped (yet)
        try:
            config = load(path, [unused])
        except ValueError:
            return None
    if config.reward.name in SERVED:
        return None
    reward_cls = registry.get("reward", config.reward.name)
    modalities = registry.get("pipeline", config.pipeline.name).modalities
    outputs = {k: v for modality in modalities if modality in OUTPUTS for k, v in OUTPUTS[modality](4).items()}
    try:  # weights that are not shipped; metadata that only the pipeline adds while sampling (a resized frame)
        reward = reward_cls(config.reward.options)
        items = registry.get("data", config.data.name)(config.data.options).train_items()[:4]
        result = reward(outputs, items_to_batch(items))
    except (OSError, ValueError, RuntimeError):
        return None
    if reward.group_stage is not None:
        result = reward.group_stage(result, torch.arange(len(items)) // 2)
    components = list(result.components)
    return TRAINER_NAMES + [f"{stage}/{name}" for name in components for stage in ("reward", "eval")]


def test_every_shipped_configs_metric_names_suit_every_tracker():
    covered, problems = 0, {}
    for path in CONFIGS:
        names = config_metric_names(path)
        if names is None:
            continue
        covered += 1
        logged = list(tracker_metrics({name: 1.0 for name in names}))
        assert len(logged) == len(set(names)), f"{path.name}: two metrics share a tracker name"
        for tracker, rule in RULES.items():
            if rule(logged):
                problems[f"{path.name} / {tracker}"] = rule(logged)
    assert not problems, problems
    print(f"{covered} of {len(CONFIGS)} configs scored")
    assert covered >= 25, f"only {covered} of {len(CONFIGS)} configs could be scored here"


def test_the_vlm_default_logged_a_name_that_is_also_a_folder_before():
    names = config_metric_names(ROOT / "configs" / "tiny" / "vlm_count.yaml")
    assert {"eval/accuracy", "eval/accuracy/malformed"} <= set(names)
    assert _mlflow(names)  # our names, as metrics.jsonl keeps them, would fail MLflow's file store
    assert not _mlflow(list(tracker_metrics({name: 0.0 for name in names})))
    assert tracker_name("eval/accuracy/malformed") == "eval/accuracy.malformed"


@given(st.lists(st.text(alphabet="ab/_.-: é", min_size=1, max_size=12), max_size=12))
def test_any_names_become_names_every_tracker_accepts(names):
    logged = [tracker_name(name) for name in names]
    groups = {name.split("/")[0] for name in logged if "/" in name}
    logged = [name for name in logged if "/" in name or name not in groups]  # our metrics have no group as a name
    for tracker, rule in RULES.items():
        assert not rule(sorted(set(logged))), (tracker, logged)


def test_values_that_are_not_finite_are_not_sent():
    sent = tracker_metrics({"reward/mean": 0.5, "reward/accuracy": math.nan, "train/loss": math.inf, "flag": True,
                            "text": "x", "samples_seen": 4})
    assert sent == {"reward/mean": 0.5, "samples_seen": 4}


def test_tensorboard_logs_the_tracker_names(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    names = config_metric_names(ROOT / "configs" / "tiny" / "vlm_count.yaml")
    with SummaryWriter(str(tmp_path)) as writer:
        for name, value in tracker_metrics({name: 1.0 for name in names}).items():
            writer.add_scalar(name, value, 1)
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == sorted(tracker_name(name) for name in set(names))
