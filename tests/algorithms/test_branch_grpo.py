"""BranchGRPO: depth-wise advantages against the authors' rule on a hand-made tree, the loss against their formula,
on-policy ratio 1 and shared prefixes through the tiny SD3 pipeline, pruning masks and option checks."""

from pathlib import Path

import pytest
import torch

from algorithm_options import algo_config
from mmgrpo import config as config_mod
from mmgrpo.advantages import groups_with_signal, kept_samples, reward_advantages
from mmgrpo.algorithms.branch_grpo import BranchGRPO
from mmgrpo.components import score_unit
from mmgrpo.preflight import check_plan
from mmgrpo.types import PromptBatch, RewardResult, Score
from mmgrpo.validation import ConfigError

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny" / "t2i_shapes_branch_grpo.yaml"


def _algorithm(**options):
    return BranchGRPO(algo_config(BranchGRPO.Config, **options))


class Node:
    """A node of the authors' tree: children in split order, the reward of a leaf or the mean of its leaves'."""

    def __init__(self, depth):
        self.depth, self.children, self.reward, self.advantage = depth, [], None, None

    def leaves(self):
        return [self] if not self.children else [leaf for c in self.children for leaf in c.leaves()]


def _authors_tree(rewards, splits, num_steps, edge_log_probs=None):
    """The authors' tree of one prompt (a child per step, two at a split), rewards fused up (the mean of the leaves,
    or with `edge_log_probs` their ``tree_prob_weighted`` rule: from the deepest level up, a node with several children
    takes ``sum softmax(child.log_prob) * child.reward``, one child passes its reward), depth-wise advantages (torch's
    unbiased std, 0 below 1e-6, + 1e-8); returns each leaf's path of nodes below the root."""
    root, current = Node(0), None
    current = [root]
    draws = iter(edge_log_probs or [])
    for i in range(num_steps):
        nxt = []
        for node in current:
            for _ in range(2 if i in splits else 1):
                node.children.append(Node(node.depth + 1))
                node.children[-1].step, node.children[-1].log_prob = i, next(draws, 0.0)  # the edge into it
                nxt.append(node.children[-1])
        current = nxt
    for leaf, r in zip(root.leaves(), rewards):
        leaf.reward = torch.tensor(r)
    by_depth, stack = {}, [root]
    while stack:
        node = stack.pop()
        by_depth.setdefault(node.depth, []).append(node)
        stack.extend(node.children)
    for depth in sorted(by_depth, reverse=True):  # the authors fuse from the deepest level up ...
        for node in by_depth[depth]:
            if node.children and edge_log_probs is not None:
                if len(node.children) == 1:
                    node.reward = node.children[0].reward
                else:
                    weights = torch.softmax(torch.tensor([c.log_prob for c in node.children]), dim=0)
                    node.reward = torch.sum(weights * torch.stack([c.reward for c in node.children]))
            elif node.children:
                node.reward = torch.stack([leaf.reward for leaf in node.leaves()]).mean()
    for nodes in by_depth.values():  # ... then normalise each depth
        values = torch.stack([node.reward for node in nodes])
        if len(nodes) <= 1 or values.std() < 1e-6:
            adv = torch.zeros_like(values)
        else:
            adv = (values - values.mean()) / (values.std() + 1e-8)
        for node, a in zip(nodes, adv):
            node.advantage = float(a.clamp(-5, 5))  # the authors clamp in the loss (adv_clip_max 5)

    def path(leaf, node=root):
        if node is leaf:
            return [node]
        for child in node.children:
            found = path(leaf, child)
            if found:
                return [node] + found
        return None

    return [path(leaf)[1:] for leaf in root.leaves()]


def _tree_plan(algorithm, num_steps):
    return algorithm.schedule(num_steps, torch.Generator().manual_seed(0))


def test_depth_wise_advantages_follow_the_authors_rule_on_a_hand_made_tree():
    algorithm = _algorithm(tree_split_points=[0, 2])
    plan = _tree_plan(algorithm, 4)
    trees = [[1.0, 0.0, 0.25, 0.75], [0.3, 0.3, 0.3, 0.3], [2.0, 2.0, 0.0, 10.0]]  # one flat tree: all zero
    scores = torch.tensor([r for t in trees for r in t])
    groups = torch.tensor([5] * 4 + [6] * 4 + [9] * 4)
    members = torch.arange(4).repeat(3)
    adv = algorithm.step_advantages(scores, groups, members, plan)  # [12, 4]
    assert adv.shape == (12, 4)
    for t, rewards in enumerate(trees):
        paths = _authors_tree(rewards, {0, 2}, 4)
        for m, path in enumerate(paths):
            expected = torch.tensor([node.advantage for node in path])  # the node each step lands on
            torch.testing.assert_close(adv[4 * t + m], expected, rtol=1e-5, atol=1e-6)
    assert torch.count_nonzero(adv[4:8]) == 0
    # the trainer's readings of per-step advantages: a sample with any non-zero step has signal
    assert groups_with_signal(adv, groups).tolist() == [True] * 4 + [False] * 4 + [True] * 4
    assert kept_samples(adv[4:], 2).tolist() == [4, 5, 6, 7]  # the flat tree's samples are dropped
    result = RewardResult(scores=scores)
    torch.testing.assert_close(reward_advantages(algorithm, result, groups, members, plan), adv)
    with pytest.raises(ValueError, match="member ids and the plan"):
        reward_advantages(algorithm, result, groups)


def test_probability_weighted_fusion_follows_the_authors_rule():
    """``tree_prob_weighted``: each split node's reward is the softmax of its children's edge log-probs times their
    rewards (the authors' ``compute_node_rewards_from_leaves``), here with per-edge log-probs drawn at random."""
    algorithm = _algorithm(tree_split_points=[0, 2], tree_prob_weighted=True)
    plan = _tree_plan(algorithm, 4)
    g = torch.Generator().manual_seed(3)
    trees = [[1.0, 0.0, 0.25, 0.75], [2.0, 2.0, 0.0, 10.0]]
    scores, log_probs = torch.tensor([r for t in trees for r in t]), torch.zeros(8, 4)
    expected = torch.zeros(8, 4)
    for t, rewards in enumerate(trees):
        edges = (torch.randn(16, generator=g) * 2).tolist()  # more than the tree's 12 edges
        paths = _authors_tree(rewards, {0, 2}, 4, edges)
        for m, path in enumerate(paths):
            log_probs[4 * t + m] = torch.tensor([node.log_prob for node in path])  # each step's recorded log-prob
            expected[4 * t + m] = torch.tensor([node.advantage for node in path])
    groups, members = torch.tensor([0] * 4 + [1] * 4), torch.arange(4).repeat(2)
    adv = algorithm.step_advantages(scores, groups, members, plan, log_probs)
    torch.testing.assert_close(adv, expected, rtol=1e-5, atol=1e-6)
    uniform = _algorithm(tree_split_points=[0, 2]).step_advantages(scores, groups, members, plan)
    assert not torch.allclose(adv[:, :2], uniform[:, :2])  # the upper levels differ from the mean fusion
    torch.testing.assert_close(adv[:, 2:], uniform[:, 2:])  # the leaves' level is the same
    with pytest.raises(ValueError, match="log-probs"):
        algorithm.step_advantages(scores, groups, members, plan)
    nan = algorithm.step_advantages(torch.tensor([1.0, float("nan"), 0.0, 1.0]), torch.tensor([0] * 4),
                                    torch.arange(4), plan, log_probs[:4])
    assert torch.isfinite(nan).all()  # a child without reward is left out of the softmax


def _authors_width_pruning(paths, last_split, mode, ratio, depth_pruned=()):
    """The authors' width pruning on one tree: transitions collected depth first (parent step, child advantage), those
    whose parent step is after the last split point kept by mode 1 (per last-split branch, the best
    ``max(1, int(n * ratio))``, Python's stable sort) or mode 2 (all, sorted, the best ``k // 2`` and worst
    ``k - k // 2`` of ``k = max(2, int(n * ratio))``). Returns the kept (leaf, step) pairs."""
    last = [(m, node.step, node.advantage) for m, path in enumerate(paths) for node in path
            if node.step > last_split and node.step + 1 not in depth_pruned]
    if mode == 1:
        kept = []
        for m in range(len(paths)):
            group = sorted([e for e in last if e[0] == m], key=lambda e: e[2], reverse=True)
            kept += group[: max(1, int(len(group) * ratio))]
    else:
        ordered = sorted(last, key=lambda e: e[2], reverse=True)
        keep = max(2, int(len(ordered) * ratio))
        kept = ordered[: keep // 2] + ordered[len(ordered) - (keep - keep // 2):]
    return {(m, i) for m, i, _ in kept}


@pytest.mark.parametrize(("mode", "ratio", "depth_pruning"), [(2, 0.5, []), (2, 0.4, []), (1, 0.5, []),
                                                              (1, 0.7, [5]), (2, 0.3, [6])])
def test_width_pruning_keeps_the_authors_transitions(mode, ratio, depth_pruning):
    algorithm = _algorithm(tree_split_points=[0, 2], width_pruning_mode=mode, width_pruning_ratio=ratio,
                           depth_pruning=depth_pruning)
    plan = _tree_plan(algorithm, 6)  # after the last split (step 2): steps 3, 4, 5 of each of the 4 leaves
    trees = [[1.0, 0.0, 0.25, 0.75], [0.5, 3.0, 0.0, 1.0]]
    scores, groups = torch.tensor([r for t in trees for r in t]), torch.tensor([7] * 4 + [2] * 4)
    members = torch.tensor([0, 1, 2, 3, 3, 1, 0, 2])  # any order: the rule reads the members
    scores = scores[torch.tensor([0, 1, 2, 3, 4, 5, 6, 7])]
    adv = algorithm.step_advantages(scores, groups, members, plan)  # [8, 6]
    plain = _algorithm(tree_split_points=[0, 2], depth_pruning=depth_pruning).step_advantages(scores, groups, members,
                                                                                              plan)
    for t, rows in enumerate((range(0, 4), range(4, 8))):
        by_member = {int(members[r]): r for r in rows}
        rewards = [float(scores[by_member[m]]) for m in range(4)]
        kept = _authors_width_pruning(_authors_tree(rewards, {0, 2}, 6), 2, mode, ratio, depth_pruning)
        for m, r in by_member.items():
            for i in range(6):
                trained = i + 1 not in depth_pruning
                pruned = trained and i > 2 and (m, i) not in kept
                assert bool(torch.isnan(adv[r, i])) == pruned, (t, m, i)
                if not pruned:
                    assert adv[r, i] == plain[r, i]
    assert torch.isnan(adv).any()
    flat = algorithm.step_advantages(torch.ones(8), groups, members, plan)  # equal rewards: zeros, pruned NaN
    assert torch.isnan(flat).any() and not groups_with_signal(flat, groups).any()  # a pruned entry is no signal
    mask = torch.ones(8, 6, dtype=torch.bool)
    out = algorithm.loss(Score(log_prob=torch.zeros(8, 6), mask=mask), torch.zeros(8, 6), adv)
    assert out.entries == float(torch.isfinite(adv).sum()) and torch.isfinite(out.loss)


def test_nan_leaves_are_left_out_and_wrong_groups_refused():
    algorithm = _algorithm(tree_split_points=[0])
    plan = _tree_plan(algorithm, 2)
    adv = algorithm.step_advantages(torch.tensor([1.0, float("nan"), 0.0, 1.0]), torch.tensor([0, 0, 1, 1]),
                                    torch.tensor([0, 1, 0, 1]), plan)
    assert torch.isfinite(adv).all() and torch.count_nonzero(adv[:2]) == 0  # one rewarded leaf: no comparison
    with pytest.raises(ValueError, match="set train.group_size to 2"):
        algorithm.step_advantages(torch.zeros(3), torch.zeros(3, dtype=torch.long), torch.arange(3), plan)


def test_loss_is_the_authors_clipped_mean_over_trained_transitions():
    algorithm = _algorithm(tree_split_points=[0])
    g = torch.Generator().manual_seed(0)
    old = torch.randn(4, 2, generator=g) * 0.01
    new_lp = (old + torch.randn(4, 2, generator=g) * 2e-3).requires_grad_()
    mask = torch.tensor([[True, True], [False, True], [True, False], [False, False]])
    adv = torch.randn(4, 2, generator=g)
    out = algorithm.loss(Score(log_prob=new_lp, mask=mask), old, adv)
    ratio = torch.exp(new_lp.detach() - old)[mask]
    a = adv[mask]
    expected = torch.maximum(-a * ratio, -a * ratio.clamp(1 - 1e-3, 1 + 1e-3)).mean()  # the authors' per transition
    torch.testing.assert_close(out.loss.detach(), expected, rtol=1e-6, atol=1e-7)
    assert out.entries == 4.0
    empty = algorithm.loss(Score(log_prob=new_lp, mask=torch.zeros(4, 2, dtype=torch.bool)), old, adv)
    assert empty.entries == 0.0 and float(empty.loss.detach()) == 0.0 and empty.loss.requires_grad


def test_tiny_sd3_tree_shares_prefixes_ratio_one_and_zero_advantage_zero_gradient(request):
    from builders.sd3 import build_policy

    policy = build_policy(request)  # 3 steps
    algorithm = _algorithm(tree_split_points=[0, 1])  # 4 leaves per prompt
    plan = _tree_plan(algorithm, policy.num_steps)
    batch = PromptBatch(["a red circle", "two blue squares"]).repeat(4)
    rollout = policy.sample(batch, plan, generator=torch.Generator().manual_seed(1))
    latents = rollout.trajectory["latents"]  # [8, 4, ...]
    assert rollout.trajectory["shared_tree_forwards"] == 2 * (1 + 2 + 4)  # the node count, not 8 * 3
    assert torch.equal(latents[0, :2], latents[1, :2]) and not torch.equal(latents[0, 2], latents[1, 2])
    assert torch.equal(latents[0, :1], latents[3, :1]) and not torch.equal(latents[0, 1], latents[2, 1])
    assert not torch.equal(latents[0, 0], latents[4, 0])
    assert rollout.mask.sum(0).tolist() == [4, 8, 8]  # 2 nodes per tree after step 0, 4 after steps 1 and 2
    advantages = algorithm.step_advantages(torch.arange(8.0), rollout.group_ids, batch.member_ids, plan)  # [8, 3]
    for unit in plan.train_units:
        new, old, ref = score_unit(policy, algorithm, rollout, unit, torch.device("cpu"))
        torch.testing.assert_close(new.log_prob.detach()[new.mask], old[new.mask], rtol=0, atol=1e-5)
        assert algorithm.loss(new, old, advantages[:, unit]).metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
        algorithm.loss(new, old, torch.zeros(8, len(unit))).loss.backward()
    assert all(p.grad is None or torch.count_nonzero(p.grad) == 0 for p in policy.trainable_parameters())


def test_depth_pruning_masks():
    algorithm = _algorithm(tree_split_points=[0, 3], depth_pruning=[2, 5])
    plan = _tree_plan(algorithm, 5)
    assert plan.train_units == [[0], [2], [3]]  # depth d is the node after step d - 1
    from mmgrpo.samplers.flow_tree import tree_mask

    mask = tree_mask(plan, torch.arange(4))
    assert mask.tolist() == [[True, False, True, True, False], [False, False, False, True, False],
                             [True, False, True, True, False], [False, False, False, True, False]]


@pytest.mark.parametrize(("options", "message"), [
    ({"tree_split_points": []}, "non-empty increasing"),
    ({"tree_split_points": [3, 0]}, "non-empty increasing"),
    ({"tree_split_points": [-1, 2]}, "tree_split_points must be >= 0"),
    ({"branch_factor": 1}, "branch_factor must be >= 2"),
    ({"tree_split_noise_scale": 0.0}, "tree_split_noise_scale must be > 0"),
    ({"depth_pruning": [0]}, "depth_pruning must be >= 1"),
    ({"tree_split_points": list(range(13))}, "leaves per group is above"),
    ({"width_pruning_mode": 3}, "width_pruning_mode must be <= 2"),
    ({"width_pruning_ratio": 0.0}, "width_pruning_ratio must be > 0"),
    ({"width_pruning_ratio": 1.5}, "width_pruning_ratio must be <= 1"),
])
def test_config_validation_errors(options, message):
    with pytest.raises(ConfigError, match=message):
        _algorithm(**options)


def test_plan_and_group_size_errors():
    with pytest.raises(ValueError, match=r"tree_split_points \[0, 3, 6, 9\] must be below the 5 sampling steps"):
        _tree_plan(_algorithm(), 5)
    with pytest.raises(ValueError, match="prunes every depth"):
        _tree_plan(_algorithm(tree_split_points=[0], depth_pruning=[1, 2]), 2)
    check_plan(config_mod.load(CONFIG))  # group 8 = 2^3
    with pytest.raises(ConfigError, match=r"train.group_size 4 must equal .* = 2\^3 = 8: set train.group_size: 8"):
        check_plan(config_mod.load(CONFIG, ["train.group_size=4"]))


@pytest.mark.parametrize("options", [{}, {"tree_prob_weighted": True, "width_pruning_mode": 2}])
def test_a_tree_spread_over_two_processes_trains_as_on_one(tmp_path, tiny_sd3_dir, options):
    """Node-keyed noise: the leaves of one tree on two processes share their prefixes exactly, the per-step
    advantages (with the probability-weighted fusion of the gathered log-probs and width pruning too) are computed on
    the gathered batch, and the step equals the one-process step."""
    import json
    import os
    import subprocess
    import sys

    worker = Path(__file__).with_name("tree_worker.py")
    (tmp_path / "prompts.txt").write_text("a red circle\n")
    env = dict(os.environ, ACCELERATE_USE_CPU="true", OMP_NUM_THREADS="1")
    for launch in ([sys.executable, str(worker)],
                   [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(worker)]):
        proc = subprocess.run([*launch, tiny_sd3_dir, str(tmp_path), json.dumps(options)], capture_output=True,
                              text=True, timeout=600, env=env)
        assert proc.returncode == 0, proc.stderr[-4000:]
    one, two = (json.loads((tmp_path / f"result_{w}.json").read_text()) for w in (1, 2))
    assert two["world"] == 2
    latents = torch.tensor(two["latents"])  # [4, 4, ...] leaves 0, 1 from rank 0, leaves 2, 3 from rank 1
    assert torch.equal(latents[0, :1], latents[2, :1]) and torch.equal(latents[2, :2], latents[3, :2])
    torch.testing.assert_close(latents, torch.tensor(one["latents"]), rtol=1e-4, atol=1e-4)  # batch-size rounding
    for key in ("reward/mean", "train/grad_norm"):  # the loss metrics are rank 0's own transitions
        assert two["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-4, abs=1e-7), key
    assert one["metrics"]["train/grad_norm"] > 0
