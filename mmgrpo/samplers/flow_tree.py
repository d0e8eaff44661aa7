"""BranchGRPO's tree rollout (feature ``"tree"`` of a [`~mmgrpo.plans.FlowPlan`]), stateless: each group is a tree.

Paper: https://arxiv.org/abs/2509.06040 (code: Fredreic1849/BranchGRPO, ``fastvideo/train_branchgrpo_flux.py``).

A group of ``G = B ** K`` samples (``B`` = ``plan.branch_factor``, ``K`` = ``len(plan.tree_split_points)``) starts from
one root noise. Every step is a flow step (SDE on ``plan.sde_steps``); at a split point each node takes ``B``
independent SDE draws, its children, and elsewhere one. The leaves are the group's members: member `m` (its
``PromptBatch.member_ids``) follows the path whose choices, read most significant first, are the base-``B`` digits of
`m`. After step `i` a node is the block of ``w_i = G / B ** k_i`` consecutive members, ``k_i`` the split points
``<= i`` (its *level*); it is node ``m // w_i`` of its tree. The model is forwarded once per node and step (the
shared prefixes once, not once per leaf).

Random draws are keyed by the node, not by the process: the root noise by ``(plan.seed, group)``, the noise of the
transition into a node by ``(plan.seed, group, step, node)``, so any subset of a group's members, on any process,
samples exactly the same shared prefixes (a group may span processes).

Split noise: at a split step the standard normal draw is multiplied by ``plan.tree_split_noise_scale`` while the
recorded log-probability is the density of the transition with its unscaled std, as the authors' code does; a replay
re-scores the stored latents with the same density, so on-policy ratios are exactly 1.

The rollout keeps one path per leaf (``latents`` `[N, S + 1, ...]`, shared prefixes repeated exactly) and the trained
mask trains each node's incoming transition once: at step `i` only the first leaf of each node (``m % w_i == 0``)
trains it ([`tree_mask`]); [`~mmgrpo.samplers.flow_plan.replay_plan`] replays those rows only.
"""

from __future__ import annotations

import torch

from mmgrpo.plans import FlowPlan
from mmgrpo.samplers.flow_sde import flow_sde_step
from mmgrpo.seeding import mix_seed

NOISE_OFFSET = 11  # the node-keyed draws' stream (other flow samplers mix with 7)


def tree_levels(plan: FlowPlan) -> list[int]:
    """The level of the node each step `i` lands on: the number of split points ``<= i``, length `S`."""
    return [sum(p <= i for p in plan.tree_split_points) for i in range(plan.num_steps)]


def tree_widths(plan: FlowPlan) -> list[int]:
    """Leaves under the node each step `i` lands on, ``G / B ** level_i``, length `S`."""
    return [plan.branch_factor ** (len(plan.tree_split_points) - k) for k in tree_levels(plan)]


def tree_mask(plan: FlowPlan, member_ids: torch.Tensor) -> torch.Tensor:
    """The trained mask `[N, S]` of a tree rollout: step `i` of member `m` is trained iff `i` is a trained step of the
    plan and `m` is its node's first leaf (``m % w_i == 0``), so each node transition is trained exactly once."""
    widths = torch.tensor(tree_widths(plan))  # [S]
    first = member_ids.long()[:, None] % widths[None, :] == 0  # [N, S]
    trained = torch.zeros(plan.num_steps, dtype=torch.bool)
    trained[plan.trained_steps] = True
    return first & trained[None, :]


def check_members(plan: FlowPlan, member_ids: torch.Tensor | None) -> torch.Tensor:
    """`member_ids` as a long tensor, refused when absent or outside ``0 .. G - 1`` of the tree's `G` leaves."""
    if member_ids is None:
        raise ValueError("A tree plan needs PromptBatch.member_ids (set by PromptBatch.repeat).")
    member_ids = member_ids.long()
    if member_ids.numel() and (member_ids.min() < 0 or member_ids.max() >= plan.tree_leaves):
        raise ValueError(f"A tree plan of {plan.tree_leaves} leaves got member ids outside 0..{plan.tree_leaves - 1}: "
                         f"set train.group_size to {plan.tree_leaves}.")
    return member_ids


def _node_noise(noise, plan: FlowPlan, keys: list[tuple[int, int]], step: int) -> torch.Tensor:
    """Standard normal draws `[M, ...]`, one per ``(group, node)`` key, seeded by the plan seed, group, step and node."""
    return torch.cat([noise(1, torch.Generator().manual_seed(mix_seed(plan.seed, g, step, node, offset=NOISE_OFFSET)))
                      for g, node in keys])


@torch.no_grad()
def sample_tree(velocity, noise, sigmas: torch.Tensor, plan: FlowPlan, group_ids: torch.Tensor,
                member_ids: torch.Tensor | None) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """Samples the leaves `group_ids`, `member_ids` of their groups' trees (see the module docstring).

    Args:
        velocity (`Callable`): ``velocity(latents [r, ...], sigma, rows [r])``, the model at one noise level, `rows`
            picking each latent's conditioning among the `N` samples.
        noise (`Callable`): ``noise(count, generator)``, standard normal latents `[count, ...]`.
        sigmas (`torch.FloatTensor` of shape `[S + 1]`): the noise levels, ending at 0.
        plan ([`FlowPlan`]): a tree plan (``tree_split_points`` set).
        group_ids (`torch.LongTensor` of shape `[N]`), member_ids (`torch.LongTensor` of shape `[N]`): each leaf's tree
            and its index in it.

    Returns:
        `tuple`: the replay state (``latents`` `[N, S + 1, ...]` per leaf path, ``shared_sigmas``,
        ``shared_noise_levels``, ``shared_sde_type``, ``shared_tree_forwards``: the model forwards taken), the
        log-probabilities `[N, S]` (CPU) and the trained mask `[N, S]` ([`tree_mask`]).
    """
    member_ids = check_members(plan, member_ids)
    group_ids = group_ids.long()
    n, num, widths = len(group_ids), plan.num_steps, tree_widths(plan)
    sde = set(plan.sde_steps)
    # the current nodes: their keys (group, node index), a leaf row for their conditioning and their latents
    keys, first_row = _nodes(group_ids, member_ids, plan.tree_leaves)
    x = torch.cat([noise(1, torch.Generator().manual_seed(mix_seed(plan.seed, g, -1, offset=NOISE_OFFSET)))
                   for g, _ in keys])  # [M, ...] one root noise per tree
    latents = x.new_zeros((n, num + 1, *x.shape[1:]))  # [N, S + 1, ...]
    latents[:, 0] = x[_index(keys, group_ids, member_ids // plan.tree_leaves)]
    log_probs = torch.zeros(n, num)  # [N, S]
    forwards = 0
    for i in range(num):
        v = velocity(x, sigmas[i], first_row)  # [M, ...] one forward per node
        forwards += len(keys)
        child_keys, child_row = _nodes(group_ids, member_ids, widths[i])
        parent = _index(keys, torch.tensor([g for g, _ in child_keys]),
                        torch.tensor([c for _, c in child_keys]) * widths[i] // (widths[i - 1] if i else plan.tree_leaves))
        level = plan.noise_level if i in sde else 0.0
        draws = None
        if level > 0:
            scale = plan.tree_split_noise_scale if i in plan.tree_split_points else 1.0
            draws = _node_noise(noise, plan, child_keys, i).to(x.device) * scale  # [M', ...]
        step = flow_sde_step(v[parent], x[parent], sigmas[i], sigmas[i + 1], noise_level=level,
                             sde_type=plan.sde_type, sigma_at_one=sigmas[1], noise=draws)
        x, keys, first_row = step.prev_sample, child_keys, child_row
        leaf_node = _index(keys, group_ids, member_ids // widths[i])  # [N]
        latents[:, i + 1] = x[leaf_node].to(latents.dtype)
        log_probs[:, i] = step.log_prob.cpu()[leaf_node.cpu()]
    trajectory = {
        "latents": latents,  # [N, S + 1, ...]
        "shared_sigmas": sigmas,  # [S + 1]
        "shared_noise_levels": torch.tensor([plan.noise_level if i in sde else 0.0 for i in range(num)]),  # [S]
        "shared_sde_type": plan.sde_type,
        "shared_tree_forwards": forwards,
    }
    return trajectory, log_probs, tree_mask(plan, member_ids)


def _nodes(group_ids: torch.Tensor, member_ids: torch.Tensor, width: int) -> tuple[list[tuple[int, int]], torch.Tensor]:
    """The distinct nodes ``(group, member // width)`` of the leaves, sorted, and the first leaf row of each `[M]`."""
    pairs = torch.stack([group_ids, member_ids // width], dim=1)  # [N, 2]
    unique, inverse = torch.unique(pairs, dim=0, return_inverse=True)
    rows = torch.stack([torch.nonzero(inverse == u)[0, 0] for u in range(len(unique))])  # [M]
    return [tuple(p) for p in unique.tolist()], rows


def _index(keys: list[tuple[int, int]], groups: torch.Tensor, nodes: torch.Tensor) -> torch.Tensor:
    """The position in `keys` of each ``(groups[j], nodes[j])``, `[len(groups)]`."""
    where = {key: j for j, key in enumerate(keys)}
    return torch.tensor([where[(int(g), int(c))] for g, c in zip(groups.tolist(), nodes.tolist())], dtype=torch.long)
