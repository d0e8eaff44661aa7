"""The plugins of a run and what the trainer asks of them per unit: [`build_components`] instantiates the pipeline,
algorithm, reward and prompt source of a config (with the checks that need a built policy), [`score_unit`] gives
``algorithm.loss`` its inputs for one trained unit (the new score, the old log-probs, the reference's score)."""

from __future__ import annotations

import torch

from . import registry
from .config import ExperimentConfig
from .preflight import SCORERS, check_modalities, require_plan
from .reference import reference_needed
from .types import Score


def build_components(config: ExperimentConfig):
    """Instantiates the plugins named by `config`; checks, before the pipeline loads, that the reward can score the
    pipeline's outputs. Any layout of groups over processes works: a reward that scores a sample against its group
    does so in its group stage, on the gathered batch ([`~mmgrpo.trainer.Trainer.gather_rewards`])."""
    policy_cls = registry.get("pipeline", config.pipeline.name)
    reward = registry.get("reward", config.reward.name)(config.reward.options)
    check_modalities(config)
    data = registry.get("data", config.data.name)(config.data.options)
    algorithm = registry.get("algorithm", config.algorithm.name)(config.algorithm.options)
    with reference_needed(algorithm.traits.needs_reference):  # no frozen copy of the weights for nothing
        policy = policy_cls(config.pipeline.options)
    check_plan(policy, algorithm, config)
    return policy, algorithm, reward, data


def check_plan(policy, algorithm, config: ExperimentConfig) -> None:
    """[`mmgrpo.preflight.require_plan`] on a built policy (its own number of steps)."""
    require_plan(policy, algorithm, policy.num_steps, config)


def score_unit(policy, algorithm, sub, unit: list[int], device) -> tuple[Score, torch.Tensor | Score, Score | None]:
    """The inputs of `algorithm.loss` for one unit of a minibatch: ``(new, old_log_prob, ref)``.

    `new` is the policy's score of `sub` at `unit`, with gradients: ``policy.log_prob`` or ``policy.likelihood`` as
    `algorithm.scoring` says. `old_log_prob` `[n, k]` is what ``algorithm.traits.old_source`` declares (see
    [`~mmgrpo.types.AlgorithmTraits`]): the log-probs the rollout recorded (``"rollout"``), the `log_prob` of the score
    under the algorithm's own old model (``"old_model"``: inside its ``old_policy(policy)`` context, e.g. DGPO's fast
    EMA) or that of `new`, detached (``"current"``: no old model is read, no extra forward). With
    ``algorithm.traits.old_score`` it is that old [`Score`] whole instead (DiffusionNFT reads its ``velocity``).
    `ref` is the reference policy's score when ``algorithm.traits.needs_reference``.
    """
    score = SCORERS[algorithm.scoring](policy)  # the method the policy declares in `provides`
    traits = algorithm.traits
    source = traits.old_source
    if source == "old_model":
        with torch.no_grad(), algorithm.old_policy(policy):  # before `new`: a weight swap must not touch a live graph
            old_score = score(sub, unit)
        old = old_score if traits.old_score else old_score.log_prob
    new = score(sub, unit)
    if sub.is_weights is not None:  # the rollout correction's importance weights (see mmgrpo.rollout_correction)
        new.is_weight = sub.is_weights[:, unit].to(device)
    if source == "rollout":
        old = sub.old_log_probs[:, unit].to(device)
    elif source == "current":  # the algorithm reads no old model: it is the current one, no extra forward
        old = detached(new) if traits.old_score else new.log_prob.detach()
    ref = None
    if algorithm.traits.needs_reference:
        with torch.no_grad(), policy.reference():
            ref = score(sub, unit)
    return new, old, ref


def detached(score: Score) -> Score:
    """`score` with every tensor detached (the current score standing for the old one, ``old_source="current"``)."""
    values = vars(score)
    return Score(**{k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in values.items()})
