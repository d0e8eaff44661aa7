"""Held-out evaluation on rewards of its own (``eval.rewards``): besides the trained reward, each named reward scores
the same held-out samples, and its means are logged under its own name, so a run shows when the trained reward rises
while another measure of the same goal falls (reward hacking).

``eval.rewards`` maps a name to ``{name: <registered reward, defaults to the name>, **that reward's options}``::

    eval:
      rewards:
        pickscore: {device: cuda}
        aesthetic_judge: {name: judge, parser: yes_no, template: "Is this image beautiful? {prompt}"}

Evaluation then logs, beside ``eval/score`` and ``eval/<component>`` of the trained reward, ``eval/<name>/score``
(that reward's mean after its group stage) and ``eval/<name>/<component>``; ``eval.metric`` and
``checkpoint.keep_best`` may name them (``pickscore/score``, ``eval/pickscore/score``). Each reward is built once per
run, its options checked when the config is read and its modalities against the pipeline's before any model loads.
Held-out prompts are groups of one, as for the trained reward.
"""

from __future__ import annotations

from typing import Any

import torch

from . import registry
from .types import PromptBatch, RewardResult
from .validation import ConfigError, build_dataclass


def eval_reward_specs(rewards: Any) -> dict[str, tuple[str, Any]]:
    """The registered reward and checked options of every ``eval.rewards`` entry: ``{key: (name, Config)}``.

    Raises:
        [`ConfigError`]: naming ``eval.rewards.<key>`` and what to change.
    """
    if not isinstance(rewards, dict):
        raise ConfigError(f"eval.rewards must map a name to a reward's options (e.g. {{pickscore: {{}}}}), got "
                          f"{rewards!r}.")
    specs = {}
    for key, raw in rewards.items():
        where = f"eval.rewards.{key}"
        if not isinstance(key, str) or not key or "/" in key or key in ("score", "loss", "tokens"):
            raise ConfigError(f"eval.rewards: {key!r} cannot name a reward's metrics (eval/<name>/score): use a "
                              "non-empty name without '/' other than score, loss or tokens.")
        raw = {} if raw is None else raw
        if not isinstance(raw, dict):
            raise ConfigError(f"{where} must be a mapping of the reward's options, got {raw!r}.")
        options = dict(raw)
        name = options.pop("name", key)
        if not isinstance(name, str) or name not in registry.available("reward"):
            choices = ", ".join(sorted(registry.available("reward")))
            raise ConfigError(f"{where}.name: {name!r} is not a registered reward (one of: {choices}); give the "
                              "reward's name under name: when the entry's own name is not one.")
        specs[key] = (name, build_dataclass(registry.get("reward", name).Config, options, where))
    return specs


def check_eval_rewards(config) -> None:
    """Before any model loads: every ``eval.rewards`` entry scores only what the pipeline produces, and
    ``checkpoint.keep_best`` is set only where the run evaluates (``eval.every`` or ``eval.every_seconds``)."""
    produced = frozenset(registry.get("pipeline", config.pipeline.name).modalities)
    for key, (name, options) in eval_reward_specs(config.eval.rewards).items():
        scored = frozenset(registry.get("reward", name).modalities_for(options))
        if scored - produced:
            raise ConfigError(f"eval.rewards.{key}: reward {name!r} scores {sorted(scored)} but pipeline "
                              f"{config.pipeline.name!r} produces {sorted(produced)}: choose a matching reward (or its "
                              "modality option).")
    if config.checkpoint.keep_best and not (config.eval.every or config.eval.every_seconds):
        raise ConfigError(f"checkpoint.keep_best: {config.checkpoint.keep_best} is read from evaluations, but the run "
                          "does not evaluate: set eval.every (or eval.every_seconds) above 0.")


def held_out_scorer(reward, eval_config):
    """The reward an evaluation scores with: `reward` itself without ``eval.rewards``, else a [`HeldOutScorer`]
    of `reward` and each entry's reward (built here: models load now)."""
    specs = eval_reward_specs(eval_config.rewards)
    if not specs:
        return reward
    return HeldOutScorer(reward, {key: registry.get("reward", name)(options) for key, (name, options) in specs.items()})


class HeldOutScorer:
    """The trained reward plus the ``eval.rewards`` rewards, as one reward (see `mmgrpo.protocols.RewardFn`): its
    scores and artifacts are the trained reward's, and each other reward adds its score and components as the
    components ``<key>/score`` and ``<key>/<component>``. The group stage runs each reward's own stage on its part of
    the gathered batch.

    Args:
        reward: the trained reward.
        extras (`dict[str, RewardFn]`): the evaluation's other rewards by name.
    """

    def __init__(self, reward, extras: dict[str, Any]):
        self.reward, self.extras = reward, extras
        self.modalities = frozenset(reward.modalities).union(*(extra.modalities for extra in extras.values()))
        self.artifacts = reward.artifacts  # the sample writers draw the trained reward's artifacts
        self.staged = [key for key, extra in extras.items() if extra.group_stage is not None]
        self.widths: dict[str | None, int] | None = None  # features' width of each staged reward (None: the trained)
        self.group_stage = self.stage_groups if reward.group_stage is not None or self.staged else None

    def __call__(self, outputs: dict[str, Any], batch: PromptBatch) -> RewardResult:
        """The trained reward's result `[N]`, with each other reward's score and components added as components; the
        features side by side when another reward has a group stage."""
        result = self.reward(outputs, batch)
        prefixes = tuple(f"{key}/" for key in self.extras)
        clash = next((name for name in result.components if name.startswith(prefixes)), None)
        if clash is not None:
            raise ValueError(f"eval.rewards: the trained reward's component {clash!r} would be overwritten by an "
                             "eval.rewards entry of the same name: rename the entry.")
        components, features = dict(result.components), []
        self.widths = {None: 0 if result.features is None else result.features[0].numel()}
        if self.staged and result.features is not None:
            features.append(result.features.detach().float().cpu().flatten(1))  # [N, D_0]
        for key, extra in self.extras.items():
            own = extra(outputs, batch)
            components[f"{key}/score"] = own.scores.detach().float().cpu()  # [N]
            components.update({f"{key}/{name}": value.detach().float().cpu() for name, value in own.components.items()})
            if key in self.staged:
                self.widths[key] = 0 if own.features is None else own.features[0].numel()
                if own.features is not None:
                    features.append(own.features.detach().float().cpu().flatten(1))  # [N, D_key]
        if not self.staged:
            return RewardResult(scores=result.scores, components=components, features=result.features,
                                artifacts=result.artifacts)
        return RewardResult(scores=result.scores, components=components,
                            features=torch.cat(features, dim=1) if features else None, artifacts=result.artifacts)

    def stage_groups(self, result: RewardResult, group_ids: torch.Tensor | None) -> RewardResult:
        """Each reward's group stage on its part of the gathered `result` (``scores`` `[N]`, ``components``,
        ``features``); returns the trained reward's final scores with every reward's components."""
        if self.widths is None:
            raise ValueError("eval.rewards: the group stage runs on the gathered results of this scorer's __call__; "
                             "call it on the samples first.")
        prefixes = tuple(f"{key}/" for key in self.extras)
        mine = {name: value for name, value in result.components.items() if not name.startswith(prefixes)}
        offset = self.widths[None] if self.staged else 0
        trained = RewardResult(scores=result.scores, components=mine,
                               features=result.features[:, :offset] if self.staged and offset else
                               None if self.staged else result.features)
        if self.reward.group_stage is not None:
            trained = self.reward.group_stage(trained, group_ids)
        components = {**trained.components, **{k: v for k, v in result.components.items() if k.startswith(prefixes)}}
        for key in self.staged:
            width, prefix = self.widths[key], f"{key}/"
            own = RewardResult(scores=components[f"{key}/score"],
                               components={k[len(prefix):]: v for k, v in components.items()
                                           if k.startswith(prefix) and k != f"{key}/score"},
                               features=None if width == 0 else result.features[:, offset : offset + width])
            offset += width
            staged = self.extras[key].group_stage(own, group_ids)
            components[f"{key}/score"] = staged.scores.detach().float().cpu()
            components.update({prefix + k: v.detach().float().cpu() for k, v in staged.components.items()})
        return RewardResult(scores=trained.scores, components=components, features=result.features,
                            scores_are_advantages=trained.scores_are_advantages)
