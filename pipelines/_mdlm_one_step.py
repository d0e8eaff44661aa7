"""d1's one-step likelihood of a masked-diffusion completion, the `mdlm` pipeline's ``likelihood`` for plans with
``likelihood="one_step"`` (diffu-GRPO): the completion fully masked, each prompt token masked with probability
``pipeline.prompt_mask_prob``, one forward; every completion token up to and including the first EOS is scored.

Paper: Zhao et al., *d1: Scaling Reasoning in Diffusion Large Language Models via Reinforcement Learning*,
https://arxiv.org/abs/2504.12216. The prompt masks of every likelihood draw are drawn from the plan's seed at
sampling, where the sampling policy's log-probs are recorded under them ("old" values, as d1 computes them at rollout
time), so later scores of the rollout (policy, reference) use the same masks.

Not a plugin: the name starts with an underscore and it defines no ``PLUGIN``.
"""

from __future__ import annotations

import torch

from mmgrpo.plans import MaskedPlan
from mmgrpo.samplers.masked_diffusion import token_log_probs
from mmgrpo.types import Rollout, Score


def token_terms(policy, prompt_ids, prompt_attention, completion, prompt_masked) -> torch.Tensor:
    """d1's one-step token log-probs `[n, L]`: the prompt `[n, P]` with `prompt_masked` `[n, P]` tokens masked, the
    completion `[n, L]` fully masked, one forward."""
    prompt = torch.where(prompt_masked, torch.full_like(prompt_ids, policy.mask_id), prompt_ids)
    logits = policy._completion_logits(prompt, prompt_attention, torch.full_like(completion, policy.mask_id))
    return token_log_probs(logits, completion)  # [n, L]


def record(policy, trajectory: dict, plan: MaskedPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """Draws the prompt masks of the plan's likelihood draws (from ``plan.seed``) and records the sampling policy's
    one-step log-probs under them.

    Returns:
        ``(old, mask)``, both `[N, S]`: column `j` of `old` is draw `j`'s log-likelihood of the scored tokens where
        `j` is a trained draw (0 else).
    """
    generator = torch.Generator().manual_seed(plan.seed)
    prompt_ids, attention = trajectory["prompt_ids"], trajectory["prompt_attention"]
    n, steps = prompt_ids.shape[0], plan.num_steps
    draws = torch.rand((n, steps, prompt_ids.shape[1]), generator=generator) < policy.config.prompt_mask_prob
    trajectory["prompt_masked"] = draws & attention[:, None]  # [N, S, P]
    old_tokens = torch.zeros(n, steps, policy.config.gen_length)  # [N, S, L]
    completion = trajectory["completion"].to(policy.device)
    keep = policy.completion_mask(trajectory["completion"])  # [N, L]
    for j in plan.trained_steps:
        masked = trajectory["prompt_masked"][:, j].to(policy.device)
        old_tokens[:, j] = token_terms(policy, prompt_ids.to(policy.device), attention.to(policy.device), completion,
                                       masked).cpu()
    trajectory["likelihood_token_log_probs"] = old_tokens
    mask = torch.zeros(n, steps, dtype=torch.bool)
    mask[:, plan.trained_steps] = True
    return (old_tokens * keep[:, None]).sum(-1), mask  # [N, S], [N, S]


def score(policy, rollout: Rollout, steps: list[int]) -> Score:
    """d1's one-step estimate for the draws `steps` (prompt masks recorded at sampling), with gradients.

    Returns:
        The [`Score`] of the policy's ``log_prob``, with `token_mask` `[n, k, L]` the completion mask and
        `old_token_log_prob` `[n, k, L]` the sampling policy's one-step log-probs under the same masks.
    """
    t = rollout.trajectory
    if "prompt_masked" not in t:
        raise ValueError("This rollout was not sampled with a likelihood plan: no prompt masks were drawn.")
    prompt_ids, attention = t["prompt_ids"].to(policy.device), t["prompt_attention"].to(policy.device)
    completion = t["completion"].to(policy.device)
    token_lp = torch.stack(
        [token_terms(policy, prompt_ids, attention, completion, t["prompt_masked"][:, j].to(policy.device))
         for j in steps], 1
    )  # [n, k, L]
    keep = policy.completion_mask(completion)[:, None].expand_as(token_lp)  # [n, k, L]
    return policy._pack(token_lp, keep, t["likelihood_token_log_probs"], rollout, steps)
