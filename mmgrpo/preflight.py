"""What can be checked of a validated experiment without loading any weights: the output folder, the reward's
modalities against the pipeline's, the algorithm's sampling plan against the pipeline's features, branch sub-groups,
and the prompt source's items. `mmgrpo check`, `train` and `eval` run [`preflight`] before any model loads.

The field checks (types, ranges, local paths, registry names, the resume checkpoint) run earlier, when the config is
built ([`mmgrpo.config.from_dict`]).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from . import registry
from .async_rollouts import check_schedule
from .config import PLUGIN_KINDS, ExperimentConfig
from .engine_builders import check_engine
from .eval_rewards import check_eval_rewards
from .held_out_splits import DEFAULT_SPLIT, chosen_splits
from .memory_check import check_memory
from .overlapped_scoring import check_pipeline as check_chunked_sampling
from .plans import FEATURE_SCORE_FIELDS, FlowPlan, SamplingPlan
from .validation import ConfigError
from .weight_ema import refuse_averaged_checkpoint


@contextlib.contextmanager
def _named(section: str, context: str = ""):
    """Turns a plugin's `ValueError` into a one-line [`ConfigError`] that starts with `section` and ends with
    `context`."""
    try:
        yield
    except ConfigError:
        raise
    except ValueError as err:
        message = " ".join(str(err).split()).rstrip(".")
        head = message if message.startswith(f"{section}.") else f"{section}: {message}"
        raise ConfigError(f"{head}{context}.") from None


REMOTE_CODE_KEY = "trust_remote_code"  # the option, in any plugin's config, that lets a model's own code run


def remote_code_keys(config: ExperimentConfig) -> list[str]:
    """The keys of `config` that ask to run a model's own code (``trust_remote_code: true`` in a plugin's options)."""
    found = []

    def walk(node, prefix: str) -> None:
        for key, value in node.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            elif key == REMOTE_CODE_KEY and value is True:
                found.append(f"{prefix}{key}")

    whole = config.to_dict()
    walk({kind: whole[kind] for kind in PLUGIN_KINDS}, "")
    return found


def check_remote_code(config: ExperimentConfig, allowed: bool) -> None:
    """Refuses a config that asks to run a model's own code (see [`remote_code_keys`]) unless the user allowed it on
    the command line (`allowed`: ``--trust-remote-code``): a config may come from a run folder someone else wrote, so
    a file alone never lets code run."""
    keys = remote_code_keys(config)
    if keys and not allowed:
        raise ConfigError(
            f"{keys[0]} is true: loading would run the model's own Python code (from its folder or the hub). If you "
            "trust that code, pass --trust-remote-code on the command line; a config file alone cannot allow it."
        )


def reward_modalities(name: str, options) -> frozenset[str]:
    """The modalities reward `name` scores with `options`, as its class declares them (``modalities_for``; see
    [`mmgrpo.protocols.RewardFn`])."""
    with _named("reward"):
        return frozenset(registry.get("reward", name).modalities_for(options))


def reward_artifacts(name: str, options) -> frozenset[str]:
    """The artifact kinds reward `name`'s results carry with `options` for the sample writers, as its class declares
    them (``artifacts_for``)."""
    with _named("reward"):
        return frozenset(registry.get("reward", name).artifacts_for(options))


def check_modalities(config: ExperimentConfig) -> None:
    """The pipeline declares output modalities that have a sample writer ([`mmgrpo.sample_writers.WRITERS`]), the
    reward scores only what the pipeline produces, and the writers of those modalities draw every artifact the reward
    declares ([`mmgrpo.sample_writers.ARTIFACT_WRITERS`])."""
    from .sample_writers import ARTIFACT_WRITERS, WRITERS  # matplotlib: loaded only when checking

    produced = frozenset(registry.get("pipeline", config.pipeline.name).modalities)
    unknown = sorted(produced - WRITERS.keys())
    if unknown or not produced:
        raise ConfigError(
            f"pipeline.name: pipeline {config.pipeline.name!r} declares output modalities {sorted(produced)}, "
            f"{'which has none' if not produced else f'and {unknown} has no sample writer'}: declare its `modalities` "
            f"among {sorted(WRITERS)} (or add a writer to mmgrpo.sample_writers.WRITERS)."
        )
    scored = reward_modalities(config.reward.name, config.reward.options)
    if scored - produced:
        raise ConfigError(
            f"reward.name: reward {config.reward.name!r} scores {sorted(scored)} but pipeline "
            f"{config.pipeline.name!r} produces {sorted(produced)}: choose a matching reward (or its modality option)."
        )
    added = reward_artifacts(config.reward.name, config.reward.options)
    drawn = frozenset().union(*(ARTIFACT_WRITERS.get(modality, frozenset()) for modality in produced))
    if added - drawn:
        raise ConfigError(
            f"reward.name: reward {config.reward.name!r} adds the artifacts {sorted(added - drawn)} for the sample "
            f"writers, which no writer of pipeline {config.pipeline.name!r}'s modalities {sorted(produced)} draws: turn "
            "them off in the reward's options (sam_mask: attach_masks: false) or add a writer to "
            "mmgrpo.sample_writers.ARTIFACT_WRITERS."
        )


def check_reward_advantages(config: ExperimentConfig) -> None:
    """A reward whose scores are the whole batch's advantages (``composite`` with TRL's ``normalize_then_sum``,
    declared by its config's ``scores_are_advantages``) runs its group stage on the whole batch: refuses
    ``train.group_placement: contiguous``, where each process would z-score its own share."""
    from .rewards.composite import CompositeConfig  # the one reward that declares it

    options = config.reward.options
    if isinstance(options, CompositeConfig) and options.scores_are_advantages and \
            config.train.group_placement == "contiguous":
        raise ConfigError("train.group_placement: contiguous runs the reward's group stage on each process's groups, "
                          "but composite normalize_then_sum z-scores the whole batch (its scores are the advantages): "
                          "use spread, or normalize: group_normalize_then_sum.")


SCORING_METHODS = {"trajectory": "log_prob", "likelihood": "likelihood"}  # Algorithm.scoring -> `provides` key
SCORERS = {  # Algorithm.scoring -> the policy method of that `provides` key (a policy declares the ones it has)
    "trajectory": lambda policy: policy.log_prob,
    "likelihood": lambda policy: policy.likelihood,
}


def require_plan(pipeline, algorithm, num_steps: int, names) -> SamplingPlan:
    """The algorithm's plan over `num_steps` steps, after checking that `pipeline` (a class or an instance) implements
    every feature it asks for (branches, merged steps, a solver...) and the algorithm's scoring method, instead of
    letting them be silently ignored. `names` carries ``algorithm.name`` and ``pipeline.name`` for the message."""
    require_family(pipeline, algorithm, names)
    plan = algorithm.schedule(num_steps, torch.Generator().manual_seed(0))
    missing = plan.features() - pipeline.plan_features
    if missing or SCORING_METHODS[algorithm.scoring] not in pipeline.provides:
        needs = sorted(missing) or [algorithm.scoring + " scoring"]
        raise ConfigError(
            f"algorithm.name: algorithm {names.algorithm.name!r} needs {needs}, "
            f"which pipeline {names.pipeline.name!r} does not implement: choose another pipeline or algorithm."
        )
    require_scores(pipeline, algorithm, names)
    unrecorded = sorted(algorithm.traits.reads & {f for feature, fs in FEATURE_SCORE_FIELDS.items()
                                                  if feature not in plan.features() for f in fs})
    if unrecorded:
        raise ConfigError(f"algorithm.name: algorithm {names.algorithm.name!r} reads the score field(s) {unrecorded}, "
                          f"which a pipeline fills only for plans asking for them (FEATURE_SCORE_FIELDS), but its plan "
                          f"does not: make its schedule set the feature from the same option as its traits.reads.")
    if ("ground_truth_member" in plan.features()) != algorithm.traits.ground_truth_member:
        raise ConfigError(
            f"algorithm.name: algorithm {names.algorithm.name!r} declares traits.ground_truth_member="
            f"{algorithm.traits.ground_truth_member} but its plan says otherwise: declare the trait from the same "
            "option as the plan's ground_truth_member."
        )
    return plan


def require_family(pipeline, algorithm, names) -> None:
    """The algorithm emits plans of a family the pipeline speaks (``algorithm.plan_family`` among
    ``pipeline.plan_families``), so no pipeline is handed another family's plan. `names` as in [`require_plan`]."""
    if algorithm.plan_family not in pipeline.plan_families:
        raise ConfigError(
            f"algorithm.name: algorithm {names.algorithm.name!r} emits {algorithm.plan_family!r} plans, but pipeline "
            f"{names.pipeline.name!r} reads only {list(pipeline.plan_families)} plans (plan family mismatch): choose an "
            f"algorithm of the {pipeline.plan_families[0]!r} family, or a pipeline that speaks "
            f"{algorithm.plan_family!r} plans."
        )


def require_scores(pipeline, algorithm, names) -> None:
    """The pipeline's scoring method (a class or an instance's ``provides``) fills every [`~mmgrpo.types.Score`] field
    the algorithm's loss reads (``algorithm.traits.reads``), so an incompatible pair fails here, naming the field,
    not in the middle of a step. `names` carries ``algorithm.name`` and ``pipeline.name`` for the message."""
    method = SCORING_METHODS[algorithm.scoring]
    provided = pipeline.provides[method]
    missing = sorted(algorithm.traits.reads - provided)
    if missing:
        raise ConfigError(
            f"algorithm.name: algorithm {names.algorithm.name!r} (with these options) reads the score field(s) "
            f"{missing}, which pipeline {names.pipeline.name!r}'s {method} does not provide (it gives "
            f"{sorted(provided)}): choose another pipeline, or algorithm options that do not read them (e.g. "
            "kl_beta=0 when a KL term reads them)."
        )


def check_plan(config: ExperimentConfig) -> None:
    """The algorithm's plan fits the pipeline's steps and asks only for features and a scoring method the pipeline
    implements; a branching plan splits each group into sub-groups of at least two samples; a tree plan's group is
    its leaves."""
    policy_cls = registry.get("pipeline", config.pipeline.name)
    num_steps = config.pipeline.options.num_steps
    with _named("algorithm", f" (pipeline.num_steps is {num_steps})"):
        algorithm = registry.get("algorithm", config.algorithm.name)(config.algorithm.options)
        plan = require_plan(policy_cls, algorithm, num_steps, config)
    if isinstance(plan, FlowPlan) and plan.tree_split_points and config.train.group_size != plan.tree_leaves:
        raise ConfigError(
            f"train.group_size {config.train.group_size} must equal the tree's leaves, branch_factor ** "
            f"len(tree_split_points) = {plan.branch_factor}^{len(plan.tree_split_points)} = {plan.tree_leaves}: set "
            f"train.group_size: {plan.tree_leaves}, or change algorithm.tree_split_points / branch_factor."
        )
    if not isinstance(plan, FlowPlan) or not plan.branch:  # only a flow plan branches
        return
    branches, group = len(plan.sde_steps), config.train.group_size
    if group % branches or group // branches < 2:
        raise ConfigError(
            f"train.group_size {group} does not split into {branches} branch sub-groups (one per "
            f"algorithm.sde_steps entry) of at least 2 samples: make it a multiple of {branches}, >= {2 * branches}."
        )


def check_items(config: ExperimentConfig, split: str = "eval") -> None:
    """The prompt source has training items (the trainer draws from them even to evaluate), and held-out items when
    the run evaluates them."""
    with _named("data"):
        data = registry.get("data", config.data.name)(config.data.options)
    train_items = data.train_items()  # built once: a synthetic source renders every item
    if not train_items:
        raise ConfigError(f"data: prompt source {config.data.name!r} has no training items: give it some (e.g. "
                          "data.n_train, data.train_file).")
    evaluating = bool(config.eval.every or config.eval.every_seconds)
    check_input_images(config, train_items, "training")
    if split != "eval":
        return
    splits = chosen_splits(data.eval_splits(), config.eval.splits, config.data.name)  # eval.splits names declared ones
    named = sorted(set(splits) & set(config.eval.rewards))
    if named:
        raise ConfigError(f"eval.rewards.{named[0]}: an eval.rewards entry named after a held-out split would log the "
                          f"same metrics (eval/{named[0]}/score): rename the entry.")
    for name, items in splits.items() if evaluating else ():
        if not items:
            where = "" if name == DEFAULT_SPLIT else f" in split {name!r}"
            raise ConfigError(
                f"eval.every: prompt source {config.data.name!r} has no held-out items to evaluate{where}: give it some "
                f"({held_out_options(config.data.options)}) or set eval.every=0 and eval.every_seconds=0."
            )
        check_input_images(config, items, "held-out" if name == DEFAULT_SPLIT else f"held-out ({name})")


INPUT_IMAGES = "input_images"  # the capability of a pipeline whose `sample` reads conditions["images"] (editing)
EDIT_SOURCE = "source_image"  # the metadata key of an edit item: the input image it changes (edit_jsonl, shapes_edit)


def check_input_images(config: ExperimentConfig, items: list[dict], which: str) -> None:
    """A pipeline that edits images (it declares the ``input_images`` capability) gets at least one input image with
    every prompt item (the item's ``images`` condition, see [`mmgrpo.protocols.PromptSource`]), so a text-only prompt
    source fails here in one line rather than at the first rollout; and edit items (their metadata names the
    ``source_image`` they change) go to an editing pipeline, not to one that would ignore their input images."""
    edits = INPUT_IMAGES in registry.get("pipeline", config.pipeline.name).capabilities
    for index, item in enumerate(items):
        if not edits:
            if (item.get("metadata") or {}).get(EDIT_SOURCE) is not None:
                raise ConfigError(
                    f"pipeline.name: prompt source {config.data.name!r} gives edits (an instruction and the input image "
                    f"it changes, {which} item {index}), but pipeline {config.pipeline.name!r} reads no input image and "
                    "would draw from the instruction alone: use an editing pipeline (flux_kontext or "
                    "qwen_image_edit)."
                )
            continue
        images = item.get("images")  # an item's conditions are its keys beside "prompt" and "metadata"
        if images is None or (isinstance(images, (list, tuple)) and not images):
            raise ConfigError(
                f"data.name: pipeline {config.pipeline.name!r} edits input images, but {which} item {index} "
                f"({item['prompt']!r}) of prompt source {config.data.name!r} has none (its 'images' condition): use "
                "a prompt source whose items carry input images (data: edit_jsonl or shapes_edit), or a "
                "text-to-image pipeline."
            )


def held_out_options(options) -> str:
    """The options of a prompt source (`options`, its Config instance) that give it held-out items
    (``data.eval_split``...), for an error."""
    import dataclasses

    names = [f.name for f in dataclasses.fields(options)] if dataclasses.is_dataclass(options) else []
    names = [n for n in names if n.startswith(("eval_", "n_eval")) and not n.startswith("eval_seed")]
    return ", ".join(f"data.{n}" for n in names) or "see `mmgrpo show NAME --kind data`"


def check_output_dir(config: ExperimentConfig) -> None:
    """The output folder is a folder (or does not exist yet)."""
    path = Path(config.output_dir).expanduser()
    if path.exists() and not path.is_dir():
        raise ConfigError(f"output_dir: {config.output_dir!r} is a file, not a folder; choose another output_dir.")


def check_checkpoint(config: ExperimentConfig, resuming: bool) -> None:
    """The checkpoint ``checkpoint.resume_from`` names holds readable weights and, when `resuming` training, training
    state that this version reads (an older one, with pickled state, is refused with the conversion command), whose
    files are all present and readable, and which holds the trained weights unless the run sets ``train.ema``; checked
    before any model loads. An evaluation reads only the weights."""
    from . import checkpoint

    root, resume_from = Path(config.output_dir) / "checkpoints", config.checkpoint.resume_from
    if not resume_from or resume_from == "auto" and not checkpoint.complete_checkpoints(root):  # auto: fresh start
        return
    path = checkpoint.resolve(resume_from, root)
    if resuming and config.train.ema is None:  # weights/ holding an average would become the trained weights
        refuse_averaged_checkpoint(path)
    try:
        if resuming:
            checkpoint.check_format(path)
        checkpoint.verify(path, state=resuming)
    except (checkpoint.LegacyCheckpointError, checkpoint.CheckpointError) as err:
        raise ConfigError(f"checkpoint.resume_from: {err}") from None


def preflight(config: ExperimentConfig, split: str | None = None) -> None:
    """Every check of this module; raises [`ConfigError`] naming the key. `split` is the evaluated split of
    ``mmgrpo eval`` (``"train"`` needs no held-out items); evaluations do not check that a resumed checkpoint's
    training state is readable, training (`split` None) does; training also checks that one step's outputs fit in
    this machine's memory ([`~mmgrpo.memory_check.check_memory`])."""
    check_output_dir(config)
    check_modalities(config)
    check_eval_rewards(config)
    check_reward_advantages(config)
    check_plan(config)
    check_schedule(config)  # train.async: no step planned ahead from the steps before it
    check_engine(config)
    check_chunked_sampling(config)  # train.sample_chunks: a pipeline whose rollouts join
    if split is None:
        check_memory(config)
    check_items(config, split or "eval")
    check_checkpoint(config, resuming=split is None)
