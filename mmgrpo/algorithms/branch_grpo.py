"""BranchGRPO: tree-structured rollouts with depth-wise advantages on every node transition.

Paper: https://arxiv.org/abs/2509.06040 (code: Fredreic1849/BranchGRPO, ``fastvideo/train_branchgrpo_flux.py``).

Rollout ([`mmgrpo.samplers.flow_tree`]): each prompt's group of ``G = B ** K`` samples is a tree from one root noise;
every step is an SDE step, and at each of the `K` ``tree_split_points`` every node splits into ``B`` children
(``branch_factor``), their noise multiplied by ``tree_split_noise_scale`` while the recorded log-probability keeps the
unscaled std (as the authors' code). Shared prefixes are computed once per node; the leaves are the samples.

Rewards fused up the tree: a leaf's reward is the reward of its sample, an internal node's the mean of its leaf
descendants' (NaN leaves left out), or, with ``tree_prob_weighted`` (the authors' ``--tree_prob_weighted``), the
children's rewards weighted by the softmax of the log-probabilities of the split transitions into them,

    R(node) = sum_b softmax_b(log p(x_child_b | x_node)) R(child_b)

applied level by level from the leaves up (a node with one child passes its reward on; ``log p`` is the recorded
per-element mean Gaussian log-density of the split step, temperature 1 as in their code). Depth-wise advantages: the
nodes at the same depth of one tree are normalised together,

    A(node) = (R(node) - mean_depth R) / (std_depth R + adv_eps),    0 where std_depth R < 1e-6,

clamped to ``[-adv_clip_max, adv_clip_max]`` (the authors: unbiased std, eps 1e-8, clamp 5). The node a step lands on
gives that step its advantage, so the advantage is per step: ``step_advantages`` returns `[N, S]` (declared by
``traits.step_advantages``). Each node transition ``parent -> child`` is trained once, with the child's advantage,
through PPO's clipped ratio of Flow-GRPO ([`~mmgrpo.losses.clipped_surrogate`], the authors' clip 1e-3):

    loss = mean over trained transitions t of max(-A_t r_t, -A_t clip(r_t, 1 - clip_low, 1 + clip_high))

Every transition weighs the same over an optimizer update (``update_mean: entries``). Depth pruning
(``depth_pruning``): the transitions into the listed depths (depth ``d`` = after step ``d - 1``) are sampled and
rewarded but not trained. Width pruning (``width_pruning_mode``, the authors' rule, applied after depth pruning to the
trained transitions after the last split point, which each leaf takes alone; each has the advantage of the node it
lands on, so all of one leaf's are equal):

- mode 1: of each leaf's such transitions, keep the ``max(1, int(n * width_pruning_ratio))`` with the highest
  advantage, ties in step order (the authors' stable sort); as they are all equal, this keeps each leaf's earliest
  ones whatever its reward, exactly as their code does (their "best per branch" groups by the node the last split
  creates, which is one leaf);
- mode 2: of all such transitions of the tree, in the authors' depth-first order (leaf by leaf, step by step), sorted
  by advantage (stable), keep ``k = max(2, int(n * width_pruning_ratio))``: the ``k // 2`` highest and the
  ``k - k // 2`` lowest.

The others are not trained: ``step_advantages`` gives them NaN and ``loss`` leaves them out of the objective and of
its ``entries``.

Differences from the authors' code:

- The SDE step is the authors' by default (DanceGRPO's, ``sde_type: dance``, ``noise_level`` 0.3); any of mmgrpo's
  ``sde_type`` may be chosen (``"sde"``: Flow-GRPO's).
- Optimizer updates follow the trainer (``minibatch_size``, ``updates_per_step``), the gradient averaged over all the
  update's transitions; the authors step every ``gradient_accumulation_steps`` transitions of a shuffled list, each
  loss divided by the average transitions per tree.
- Noise is drawn per node from the plan's seed, so a group split over processes samples identical prefixes.
- Width pruning acts per tree (theirs: on all the trees of a process's batch at once, mode 2 ranking them together),
  so a group's advantages stay its own (``group_local_advantages``); pruned transitions are still replayed (the
  pruning saves no compute here); with fewer than ``k`` transitions mode 2 keeps them all (theirs would repeat one).
- ``tree_prob_weighted`` with NaN rewards: children without a reward are left out of the softmax.
- Not implemented: sliding depth pruning, ``mix_ode_sde_tree`` and ``pruning_step_ratio`` (pruning on the first
  steps of a run only).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..advantages import group_normalize, tempsamp_soft
from ..losses import clipped_surrogate, gaussian_mean_kl
from ..plans import FlowPlan
from ..samplers.flow_tree import tree_levels
from ..types import AlgorithmTraits, LossOutput, Score
from ..validation import ConfigError, check_fields, check_range, embedded
from ._limits import SCALE_LIMIT, STEP_LIMIT
from ._options import AdvantageOptions, ClipOptions, KLOptions, KLWeight, SDEOptions

MIN_STD = 1e-6  # the authors: a depth whose node rewards' std is below it gets advantage 0
LEAVES_LIMIT = 4096  # samples per group (the authors: 16)


@dataclass
class BranchGRPOConfig:
    """Options of [`BranchGRPO`]: its own and the shared clip, KL, advantage and SDE options (written flat, see
    ``mmgrpo show branch_grpo``) with the authors' defaults.

    Args:
        tree_split_points (`list[int]`): the steps at which every node splits (the authors' 0, 3, 6, 9 of 20 steps);
            increasing, below the pipeline's ``num_steps``. ``train.group_size`` must be
            ``branch_factor ** len(tree_split_points)``.
        branch_factor (`int`): children per split (the authors: 2).
        tree_split_noise_scale (`float`): the split steps' standard normal noise is multiplied by it; the recorded
            log-probability keeps the transition's unscaled std (the authors' script: 4.0).
        depth_pruning (`list[int]`): depths whose incoming transitions are not trained (depth ``d``: the nodes after
            step ``d - 1``, 1 .. num_steps), as the authors' ``depth_pruning``; sampling and rewards are unchanged.
        width_pruning_mode (`int`): the authors' width pruning of the trained transitions after the last split point
            (``n`` of them per leaf or per tree): 0 off (their default); 1, each leaf keeps its ``max(1, int(n *
            ratio))`` with the highest advantage (ties: the earliest steps); 2, the tree keeps the ``k // 2`` highest
            and ``k - k // 2`` lowest of ``k = max(2, int(n * ratio))``. The others are not trained.
        width_pruning_ratio (`float`): the share of those transitions kept (their default 0.5).
        tree_prob_weighted (`bool`): fuse rewards up the tree with the softmax of the split transitions' log-probs
            (the authors' ``--tree_prob_weighted``; off in their script) instead of the mean of the leaves.
        clip_low (`float`): the per-transition ratio is clipped to ``[1 - clip_low, 1 + clip_high]`` (1e-3).
        scale_rewards (`str`): ``"group"``: the nodes of one tree at one depth are normalised together (the
            authors'); ``"batch"``: the std is that of the nodes of every tree at that depth (the mean stays the
            tree's); ``"none"``: centring only.
        adv_std (`str`): the depth normalisation's std estimator (``"unbiased"``, PyTorch's ``std``: the authors').
        adv_eps (`float`): added to the depth's std (the authors: 1e-8).
        adv_clip_max (`float`, *optional*): the advantages are clamped to ``[-adv_clip_max, adv_clip_max]`` (5).
        kl_beta (`float`): weight of the exact KL of the Gaussian transitions to the reference (0: off, the authors').
        noise_level (`float`): the SDE's eta (the authors: 0.3 with DanceGRPO's step).
        sde_type (`str`): the SDE step (the authors': ``"dance"``, DanceGRPO's).
    """

    tree_split_points: list[int] = field(default_factory=lambda: [0, 3, 6, 9])
    branch_factor: int = 2
    tree_split_noise_scale: float = 4.0
    depth_pruning: list[int] = field(default_factory=list)
    width_pruning_mode: int = 0
    width_pruning_ratio: float = 0.5
    tree_prob_weighted: bool = False
    clip: ClipOptions = embedded(ClipOptions, clip_low=1e-3)
    advantage: AdvantageOptions = embedded(AdvantageOptions, scale_rewards="group", adv_std="unbiased", adv_eps=1e-8,
                                           adv_clip_max=5.0)
    kl: KLOptions = embedded(KLOptions, kl_beta=0.0)
    sde: SDEOptions = embedded(SDEOptions, noise_level=0.3, sde_type="dance")

    def __post_init__(self):
        check_fields(self)
        points = self.tree_split_points
        if not points or points != sorted(set(points)):
            raise ConfigError(f"tree_split_points must be a non-empty increasing list of distinct steps, got {points}.")
        for p in points:
            check_range("tree_split_points", p, 0, STEP_LIMIT - 1, fix="a split step index, below num_steps")
        check_range("branch_factor", self.branch_factor, 2, 64, fix="the authors split in 2")
        check_range("tree_split_noise_scale", self.tree_split_noise_scale, 0, SCALE_LIMIT, low_open=True,
                    fix="the authors use 4.0 (1.0: the plain SDE noise)")
        if self.branch_factor ** len(points) > LEAVES_LIMIT:
            raise ConfigError(f"branch_factor ** len(tree_split_points) = {self.branch_factor}^{len(points)} leaves "
                              f"per group is above {LEAVES_LIMIT}: use fewer split points.")
        for d in self.depth_pruning:
            check_range("depth_pruning", d, 1, STEP_LIMIT, fix="a depth d is the node after step d - 1")
        check_range("width_pruning_mode", self.width_pruning_mode, 0, 2,
                    fix="0 off, 1 the best transitions of each leaf, 2 the best and worst of the tree")
        check_range("width_pruning_ratio", self.width_pruning_ratio, 0, 1, low_open=True,
                    fix="the share of the last layer's transitions kept; the authors use 0.5")

    @property
    def leaves(self) -> int:
        """Samples per group, ``branch_factor ** len(tree_split_points)``."""
        return self.branch_factor ** len(self.tree_split_points)


class BranchGRPO:
    """BranchGRPO: tree rollouts, rewards fused up the tree, depth-wise advantages, clipped per-transition ratio."""

    Config = BranchGRPOConfig
    scoring = "trajectory"
    plan_family = "flow"  # the plan type `schedule` returns

    def __init__(self, config: BranchGRPOConfig):
        self.config = config
        self.kl = KLWeight(config.kl)  # the KL weight, moving under a schedule
        kl_reads = {"mean", "std"} if self.kl.ever_positive else set()
        self.traits = AlgorithmTraits(
            reads=frozenset({"log_prob", "mask"} | kl_reads),  # mask: the transitions this leaf trains for its node
            needs_reference=self.kl.ever_positive,
            group_local_advantages=config.advantage.group_local,
            update_mean="entries",  # every trained transition weighs the same, as the authors' mean over transitions
            step_advantages=True,  # the advantage of a step is that of the node it lands on
        )

    def schedule(self, num_steps: int, generator: torch.Generator | None = None) -> FlowPlan:
        """Every step SDE, the tree's splits at `tree_split_points`, every step trained but the pruned depths'."""
        c = self.config
        if c.tree_split_points[-1] >= num_steps:
            raise ValueError(f"algorithm.tree_split_points {c.tree_split_points} must be below the {num_steps} "
                             "sampling steps (pipeline.num_steps): choose earlier split points.")
        trained = [i for i in range(num_steps) if i + 1 not in c.depth_pruning]
        if not trained:
            raise ValueError(f"algorithm.depth_pruning {c.depth_pruning} prunes every depth of {num_steps} steps: "
                             "leave some depth trained.")
        return FlowPlan(
            num_steps=num_steps, sde_steps=list(range(num_steps)), train_units=[[i] for i in trained],
            noise_level=c.sde.noise_level, sde_type=c.sde.sde_type, tree_split_points=list(c.tree_split_points),
            branch_factor=c.branch_factor, tree_split_noise_scale=c.tree_split_noise_scale,
            seed=int(torch.randint(0, 2**62, (1,), generator=generator)),
        )

    def advantages(self, scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
        """The leaves' depth-wise advantages `[N]` (the deepest level: each leaf against its tree's leaves)."""
        return normalize_nodes(_transformed(scores, self.config.advantage), group_ids, self.config.advantage)

    def step_advantages(self, scores: torch.Tensor, group_ids: torch.Tensor, member_ids: torch.Tensor,
                        plan: FlowPlan, log_probs: torch.Tensor | None = None) -> torch.Tensor:
        """Each sample's advantage at each step `[N, S]`: that of the node the step lands on in its tree
        ([`depth_advantages`] at the step's level); NaN where width pruning leaves the transition untrained.
        `log_probs` `[N, S]` (the rollout's recorded ones) are read by ``tree_prob_weighted`` only."""
        c = self.config
        split_log_probs = None
        if c.tree_prob_weighted:
            if log_probs is None:
                raise ValueError("tree_prob_weighted fuses rewards with the split transitions' log-probs: pass the "
                                 "rollout's log_probs.")
            split_log_probs = log_probs[:, plan.tree_split_points].float()  # [N, K]
        levels = depth_advantages(scores, group_ids, member_ids, plan.branch_factor, len(plan.tree_split_points),
                                  c.advantage, split_log_probs)  # [N, K + 1]
        advantages = levels[:, tree_levels(plan)]  # [N, S]
        if c.width_pruning_mode:
            last = [i for i in plan.trained_steps if i > plan.tree_split_points[-1]]
            pruned = width_pruned(advantages, group_ids, member_ids, sorted(last), c.width_pruning_mode,
                                  c.width_pruning_ratio)  # [N, S]
            advantages = advantages.masked_fill(pruned, float("nan"))
        return advantages

    def loss(self, new: Score, old_log_prob, advantages, ref: Score | None = None) -> LossOutput:
        """Clipped surrogate over the unit's trained transitions (``new.mask``), plus the KL term.

        Args:
            new ([`Score`]): ``log_prob`` and ``mask`` `[n, k]`; with a KL term ``mean`` and ``std``.
            old_log_prob (`torch.FloatTensor` of shape `[n, k]`): log-probs recorded at sampling.
            advantages (`torch.FloatTensor` of shape `[n, k]` (the unit's columns of ``step_advantages``; NaN: not
                trained) or `[n]`).
            ref ([`Score`], *optional*): the reference's ``mean`` for the KL term.
        """
        clip = self.config.clip
        mask = torch.ones_like(new.log_prob, dtype=torch.bool) if new.mask is None else new.mask  # [n, k]
        adv = advantages if advantages.dim() == 2 else advantages[:, None].expand_as(new.log_prob)  # [n, k]
        mask = mask & torch.isfinite(adv).to(mask.device)  # NaN: a transition width pruning leaves untrained
        entries = int(mask.sum())
        if entries == 0:  # no transition of this unit trained here: a zero loss that still reaches the graph
            loss = (new.log_prob * 0).sum()
            metrics = {"policy_loss": 0.0, "ratio_mean": 1.0, "clip_frac": 0.0, "approx_kl": 0.0}
        else:
            log_ratio = (new.log_prob - old_log_prob)[mask][:, None]  # [m, 1] one entry per trained transition
            loss, metrics = clipped_surrogate(log_ratio, adv[mask].to(log_ratio.dtype), clip.clip_low, clip.high)
        beta = self.kl()
        if beta > 0 and ref is not None and entries:
            kl = gaussian_mean_kl(new.mean, ref.mean, new.std, mask)
            loss = loss + beta * kl
            metrics.update(kl=kl.item(), kl_beta=float(beta))
        return LossOutput(loss=loss, entries=float(entries), metrics=metrics)


def _transformed(scores: torch.Tensor, options: AdvantageOptions) -> torch.Tensor:
    """The leaf rewards after the advantage options' transform (TempSamp-R1's soft transform or none)."""
    if options.advantage_transform == "tempsamp_soft":
        return tempsamp_soft(scores, options.soft_threshold, options.soft_alpha_high, options.soft_alpha_low)
    return scores.float()


def normalize_nodes(rewards: torch.Tensor, trees: torch.Tensor, options: AdvantageOptions) -> torch.Tensor:
    """The advantages `[M]` of `M` nodes of one depth, `rewards` `[M]` (NaN: no reward), `trees` `[M]` their trees:
    ``(R - mean_tree) / (std + adv_eps)`` ([`~mmgrpo.advantages.group_normalize`] with the options' scaling,
    estimator and clamp), and 0 for every node of a tree whose node rewards' std is below 1e-6 (or with fewer than two
    rewarded nodes), as the authors."""
    adv = group_normalize(rewards, trees, scale=options.scale_rewards, eps=options.adv_eps, clip=options.adv_clip_max,
                          std=options.adv_std)  # [M]
    finite = torch.isfinite(rewards)
    for tree in torch.unique(trees):
        members = trees == tree
        valid = rewards[members & finite]
        if valid.numel() < 2 or valid.std(unbiased=options.adv_std == "unbiased") < MIN_STD:
            adv[members] = 0.0
    return adv


def depth_advantages(scores: torch.Tensor, group_ids: torch.Tensor, member_ids: torch.Tensor, branch_factor: int,
                     splits: int, options: AdvantageOptions,
                     split_log_probs: torch.Tensor | None = None) -> torch.Tensor:
    """BranchGRPO's depth-wise advantages of every leaf at every level of its tree.

    Args:
        scores (`torch.FloatTensor` of shape `[N]`): the leaves' rewards (NaN: not applicable, left out of the means).
        group_ids (`torch.LongTensor` of shape `[N]`): each leaf's tree.
        member_ids (`torch.LongTensor` of shape `[N]`): each leaf's index in its tree, ``0 .. B ** K - 1`` (its path).
        branch_factor (`int`): ``B``. splits (`int`): ``K``, the split points.
        options ([`AdvantageOptions`]): the normalisation.
        split_log_probs (`torch.FloatTensor` of shape `[N, K]`, *optional*): each leaf's log-probability of the
            transition at each split point; given, rewards are fused with their softmax ([`prob_weighted_rewards`]).

    Returns:
        `torch.FloatTensor` of shape `[N, K + 1]`: column `k`, the advantage of the level-`k` node above each leaf
        (the node after `k` splits: the block of ``B ** (K - k)`` consecutive members), among its tree's level-`k`
        nodes, each rewarded with the mean of its leaves' rewards (or the probability-weighted fusion).
    """
    leaves = branch_factor ** splits
    group_ids, member_ids = group_ids.long(), member_ids.long()
    _, counts = torch.unique(group_ids, return_counts=True)
    if bool((counts != leaves).any()) or bool((member_ids < 0).any() | (member_ids >= leaves).any()):
        raise ValueError(f"A tree of {branch_factor}^{splits} leaves needs groups of exactly {leaves} samples with "
                         f"member ids 0..{leaves - 1}, got group sizes {sorted(set(counts.tolist()))}: set "
                         f"train.group_size to {leaves}.")
    scores = _transformed(scores, options)
    weighted = None if split_log_probs is None else prob_weighted_rewards(scores, group_ids, member_ids,
                                                                           branch_factor, splits, split_log_probs)
    finite = torch.isfinite(scores)
    out = torch.zeros(len(scores), splits + 1)  # [N, K + 1]
    for k in range(splits + 1):
        nodes_per_tree = branch_factor ** k
        node = group_ids * nodes_per_tree + member_ids // (leaves // nodes_per_tree)  # [N] a key per (tree, node)
        keys, inverse = torch.unique(node, return_inverse=True)
        if weighted is None:  # the mean of the node's rewarded leaves
            sums = torch.zeros(len(keys)).index_add_(0, inverse, torch.where(finite, scores, 0.0))  # [M]
            rewarded = torch.zeros(len(keys)).index_add_(0, inverse, finite.float())  # [M]
            rewards = torch.where(rewarded > 0, sums / rewarded.clamp_min(1), torch.full_like(sums, float("nan")))
        else:  # every leaf of a node carries the node's fused reward
            rewards = torch.zeros(len(keys)).index_copy_(0, inverse, weighted[:, k])  # [M]
        out[:, k] = normalize_nodes(rewards, keys // nodes_per_tree, options)[inverse]
    return out


def prob_weighted_rewards(scores: torch.Tensor, group_ids: torch.Tensor, member_ids: torch.Tensor,
                          branch_factor: int, splits: int, split_log_probs: torch.Tensor) -> torch.Tensor:
    """The authors' ``tree_prob_weighted`` fusion: each leaf's level-`k` node reward `[N, K + 1]`. Level `K` is the
    leaf's reward; a level-`k` node's is ``sum_b softmax_b(lp_b) R_b`` over its `B` children, ``lp_b`` the
    log-probability of the split transition into child `b` (column `k` of `split_log_probs` `[N, K]`, read from the
    child's first leaf). Children without a reward (NaN) are left out of the softmax; a node with none gets NaN."""
    leaves, B = branch_factor**splits, branch_factor
    trees, inverse = torch.unique(group_ids, return_inverse=True)
    grid = torch.full((len(trees), leaves), float("nan"))  # [T, G] the leaves of each tree, in member order
    grid[inverse, member_ids] = scores.float()
    lp = torch.zeros(len(trees), leaves, max(splits, 1))  # [T, G, K]
    lp[inverse, member_ids, :splits] = split_log_probs.float()
    levels = [grid]  # levels[j]: the node rewards of level K - j, [T, B ** (K - j)]
    for k in reversed(range(splits)):
        children = levels[-1].view(len(trees), B**k, B)  # [T, B^k, B] the level-(k + 1) nodes by parent
        child_lp = lp[:, :: B ** (splits - k - 1), k].reshape(len(trees), B**k, B)  # [T, B^k, B]
        rewarded = torch.isfinite(children)
        weights = torch.softmax(torch.where(rewarded, child_lp, float("-inf")), dim=-1)  # [T, B^k, B]
        fused = (torch.where(rewarded, weights, 0.0) * torch.where(rewarded, children, 0.0)).sum(dim=-1)
        levels.append(torch.where(rewarded.any(dim=-1), fused, float("nan")))  # [T, B^k]
    levels.reverse()  # levels[k]: level k
    return torch.stack([levels[k][inverse, member_ids // B ** (splits - k)] for k in range(splits + 1)], dim=1)


def width_pruned(advantages: torch.Tensor, group_ids: torch.Tensor, member_ids: torch.Tensor, steps: list[int],
                 mode: int, ratio: float) -> torch.Tensor:
    """The transitions the authors' width pruning leaves untrained, `[N, S]` bool (see the module docstring).

    Args:
        advantages (`torch.FloatTensor` of shape `[N, S]`): each leaf's advantage at each step.
        group_ids (`torch.LongTensor` of shape `[N]`), member_ids (`torch.LongTensor` of shape `[N]`): tree and leaf.
        steps (`list[int]`): the trained steps after the last split point, ascending.
        mode (`int`): 1 (the best of each leaf) or 2 (the best and worst of the tree). ratio (`float`): share kept.
    """
    pruned = torch.zeros_like(advantages, dtype=torch.bool)  # [N, S]
    if not steps:
        return pruned
    for tree in torch.unique(group_ids):
        rows = torch.nonzero(group_ids == tree).flatten()
        rows = rows[torch.argsort(member_ids[rows], stable=True)]  # the authors' depth-first order: member order
        values = advantages[rows][:, steps]  # [G, P]
        if mode == 1:  # per leaf: the highest, ties in step order
            keep = max(1, int(len(steps) * ratio))
            order = torch.argsort(-values, dim=1, stable=True)  # [G, P]
            drop = torch.zeros_like(values, dtype=torch.bool).scatter_(1, order[:, keep:], True)  # [G, P]
        else:  # over the tree: the k // 2 highest and the k - k // 2 lowest
            total = values.numel()
            keep = max(2, int(total * ratio))
            order = torch.argsort(-values.flatten(), stable=True)  # [G * P] leaf by leaf, step by step
            drop = torch.zeros(total, dtype=torch.bool)
            if keep < total:
                drop[order[keep // 2 : total - (keep - keep // 2)]] = True
            drop = drop.view_as(values)
        pruned[rows[:, None], torch.tensor(steps)[None, :]] = drop
    return pruned


PLUGIN = BranchGRPO
