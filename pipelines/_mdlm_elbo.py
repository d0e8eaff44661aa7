"""GDPO's likelihood of a masked-diffusion completion: its sequence ELBO by semi-deterministic Monte Carlo (SDMC).

Paper: Rojas et al., *Improving Reasoning for Diffusion Language Models via Group Diffusion Policy Optimization*,
https://arxiv.org/abs/2510.08554. For a completion `y` of a prompt `q`, the masked-diffusion ELBO is

    ELBO(y | q) = int_0^1 E_{y_t ~ q_t(. | y)} [ (1 / t) sum_i 1[y_t^i = M] log pi(y^i | y_t, q) ] dt  <=  log pi(y | q)

where `y_t` masks each token of `y` with probability `t`. Double Monte Carlo (random `t`, random mask) is noisy, and
most of its variance comes from `t`; SDMC integrates `t` with a fixed Gauss-Legendre rule on (0, 1) (nodes `t_n`,
weights `w_n` summing to 1; ``pipeline.elbo_points`` of them) and keeps Monte Carlo only for the masks
(``pipeline.elbo_masks`` draws per node):

    ELBO ~= sum_n w_n (1 / K) sum_k c_nk sum_{i masked by draw (n, k)} log pi(y^i | y^(n, k), q)

Two conventions (``MaskedPlan.elbo_convention``, set by the algorithm: GDPO's ``elbo_convention``):

- ``"to_first_eos"`` (default): the scored tokens of a completion are those up to and including its first EOS (the
  completion mask d1 scores); the tokens after it stay as sampled in the input. Masking (``pipeline.elbo_masking``):
  ``"count"`` masks exactly ``k_n = clamp(floor(t_n * L_y + 1/2), 1, L_y)`` of the `L_y` scored tokens, chosen
  uniformly, with ``c_nk = L_y / k_n``: the unbiased weight of a fixed-size mask (LLaDA's likelihood estimator), which
  is ``1 / t_n`` whenever ``t_n * L_y`` is whole and removes the spread of a binomial count; ``"bernoulli"`` masks
  each scored token with probability `t_n`, ``c_nk = 1 / t_n`` (the formula's inner expectation as written).
- ``"full_width"``: GDPO's released code (``NumericalIntegrationEstimator`` of github.com/KevinRojas1499/GDPO): every
  one of the `W` completion positions is scored, the EOS tokens that fill the canvas after the answer included.
  ``"count"`` masks exactly ``k_n = floor(t_n * W)`` positions chosen uniformly among all `W` (0 when ``t_n W < 1``:
  the node then adds nothing), with ``c_nk = 1 / t_n``; ``"bernoulli"`` masks each of the `W` positions with
  probability `t_n`, ``c_nk = 1 / t_n``. The authors' recipe is ``elbo_masks: 1`` (one mask per node) with
  ``elbo_points`` 2 (their config's default) or 3 (their released scripts). Two things are not theirs: the masks are
  the same for the policy, the sampling policy and the reference (their code draws the old ELBO's masks in a call of
  its own; the co-authors' NeMo-RL port shares them), and a left-padded prompt's padding is masked out of attention
  (their code passes no attention mask).

The prompt is never masked. The masks are drawn from the plan's seed at sampling, where the sampling policy's ELBO is
recorded ("old" value), so every later score of the rollout (policy, reference) uses the same masks and the ratio
measures the policy change, not mask noise. Each likelihood draw (a train unit) is one full SDMC estimate with its own
masks; it costs ``elbo_points * elbo_masks`` forwards.
"""

from __future__ import annotations

import numpy as np
import torch

from mmgrpo.samplers.masked_diffusion import token_log_probs
from mmgrpo.types import Rollout, Score
from mmgrpo.plans import MaskedPlan
from mmgrpo.validation import check_range


def quadrature(points: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gauss-Legendre nodes `t_n` `[points]` in (0, 1) and weights `w_n` `[points]` (summing to 1), float64."""
    nodes, weights = np.polynomial.legendre.leggauss(points)  # on [-1, 1], weights summing to 2
    return torch.from_numpy((nodes + 1) / 2), torch.from_numpy(weights / 2)


def check_options(config) -> None:
    """Validates the ELBO keys of an `MDLMConfig`."""
    check_range("elbo_points", config.elbo_points, 1, 16, fix="2 or 3 Gauss-Legendre nodes are usual")
    check_range("elbo_masks", config.elbo_masks, 1, 64, fix="1 mask per node is usual")
    if config.elbo_masking not in ("count", "bernoulli"):
        raise ValueError(f"elbo_masking must be 'count' or 'bernoulli', got {config.elbo_masking!r}.")


def draw_masks(scored: torch.Tensor, draws: int, points: int, masks: int, masking: str,
               generator: torch.Generator, convention: str = "to_first_eos") -> tuple[torch.Tensor, torch.Tensor]:
    """The masks and weights of `draws` SDMC estimates.

    Args:
        scored (`torch.BoolTensor` of shape `[N, L]`): the tokens each completion's ELBO scores (at least one per row;
            every position with ``"full_width"``).
        draws (`int`): independent estimates (likelihood draws); points, masks: nodes and masks per node.
        masking (`str`): ``"count"`` or ``"bernoulli"`` (see the module docstring).
        generator (`torch.Generator`): CPU generator the masks are drawn from.
        convention (`str`): ``"to_first_eos"`` or ``"full_width"``: how ``"count"`` sizes and weights a mask.

    Returns:
        ``(masked, weights)``: `masked` `[N, draws, M, L]` (bool, ``M = points * masks``, node-major) and `weights`
        `[N, draws, M]` (float32), ``w_n * c_nk / masks``: the estimate of draw `j` is
        ``sum_m weights[:, j, m] * sum_i masked[:, j, m, i] * log pi(y^i | masked input m)``.
    """
    n, length = scored.shape
    times, node_weights = quadrature(points)  # [P], [P] float64
    times, node_weights = times.repeat_interleave(masks), node_weights.repeat_interleave(masks)  # [M]
    noise = torch.rand((n, draws, times.numel(), length), generator=generator, dtype=torch.float64)  # [N, D, M, L]
    live = scored[:, None, None, :]  # [N, 1, 1, L]
    if masking == "bernoulli":
        masked = live & (noise < times[None, None, :, None])
        weights = (node_weights / times / masks).expand(n, draws, -1)  # [N, D, M]
        return masked, weights.float().contiguous()
    count = scored.sum(-1).double()[:, None]  # [N, 1]
    if convention == "full_width":  # the authors' int(t W) positions, weighted 1 / t
        k = torch.floor(times[None, :] * count)  # [N, M], may be 0
        weights = (node_weights / times / masks)[None, None, :].expand(n, draws, -1)  # [N, D, M]
    else:
        k = torch.floor(times[None, :] * count + 0.5).clamp(min=1.0)  # [N, M]
        k = torch.minimum(k, count)
        weights = (node_weights[None, :] * count / k / masks)[:, None, :].expand(-1, draws, -1)  # [N, D, M]
    ranks = noise.masked_fill(~live, float("inf")).argsort(-1).argsort(-1)  # [N, D, M, L]: scored ones first
    masked = live & (ranks < k[:, None, :, None])
    return masked, weights.float().contiguous()


def token_terms(policy, prompt_ids, prompt_attention, completion, masked, weights, temperature: float) -> torch.Tensor:
    """Each scored token's share of one SDMC estimate, `[n, L]` (summing to the ELBO), with gradients: one forward
    per mask `m` of `masked` `[n, M, L]` with `weights` `[n, M]` (see [`draw_masks`])."""
    terms = torch.zeros(completion.shape, device=policy.device)  # [n, L]
    for m in range(masked.shape[1]):
        hidden = masked[:, m].to(policy.device)  # [n, L]
        noisy = torch.where(hidden, torch.full_like(completion, policy.mask_id), completion)  # [n, L]
        logits = policy._completion_logits(prompt_ids, prompt_attention, noisy)  # [n, L, V]
        log_probs = token_log_probs(logits, completion, temperature)  # [n, L]
        terms = terms + weights[:, m, None].to(policy.device) * log_probs * hidden
    return terms


def record(policy, trajectory: dict, plan: MaskedPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """Draws the masks of the plan's likelihood draws from ``plan.seed`` and records the sampling policy's ELBO.

    Returns:
        ``(old, mask)``, both `[N, S]`: column `j` of `old` is draw `j`'s ELBO where `j` is a trained draw (0 else).
    """
    c = policy.config
    completion = trajectory["completion"]  # [N, L]
    if plan.elbo_convention == "full_width":
        scored = torch.ones_like(completion, dtype=torch.bool)  # [N, L]: every position
    else:
        scored = policy.completion_mask(completion)  # [N, L]: up to and including the first EOS
    n, steps = completion.shape[0], plan.num_steps
    generator = torch.Generator().manual_seed(plan.seed)
    masked, weights = draw_masks(scored, steps, c.elbo_points, c.elbo_masks, c.elbo_masking, generator,
                                 plan.elbo_convention)
    trajectory.update(elbo_masked=masked, elbo_weights=weights, elbo_scored=scored)  # [N, S, M, L], [N, S, M], [N, L]
    old_terms = torch.zeros(n, steps, completion.shape[1])  # [N, S, L]
    prompt_ids, attention = trajectory["prompt_ids"].to(policy.device), trajectory["prompt_attention"].to(policy.device)
    temperature = float(trajectory["shared_temperatures"][0])
    for j in plan.trained_steps:
        old_terms[:, j] = token_terms(policy, prompt_ids, attention, completion.to(policy.device), masked[:, j],
                                      weights[:, j], temperature).cpu()
    trajectory["elbo_token_terms"] = old_terms
    mask = torch.zeros(n, steps, dtype=torch.bool)
    mask[:, plan.trained_steps] = True
    return old_terms.sum(-1), mask


def score(policy, rollout: Rollout, steps: list[int]) -> Score:
    """The ELBO of the likelihood draws `steps` under the policy's current forward (masks recorded at sampling).

    Returns:
        [`Score`] with `log_prob` `[n, k]` (the ELBO of each draw), `token_log_prob` `[n, k, L]` (each scored token's
        share of it), `token_mask` `[n, k, L]` (the scored tokens), `old_token_log_prob` `[n, k, L]` (the shares
        recorded at sampling) and `mask` `[n, k]`.
    """
    t = rollout.trajectory
    prompt_ids, attention = t["prompt_ids"].to(policy.device), t["prompt_attention"].to(policy.device)
    completion = t["completion"].to(policy.device)
    temperature = float(t["shared_temperatures"][0])
    terms = torch.stack([token_terms(policy, prompt_ids, attention, completion, t["elbo_masked"][:, j],
                                     t["elbo_weights"][:, j], temperature) for j in steps], 1)  # [n, k, L]
    scored = t["elbo_scored"].to(policy.device)[:, None].expand_as(terms)  # [n, k, L]
    return policy._pack(terms, scored, t["elbo_token_terms"], rollout, steps)
