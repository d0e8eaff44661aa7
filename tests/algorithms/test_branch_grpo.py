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


def _authors_tree(rewards, splits, num_steps):
    """The authors' tree of one prompt (a child per step, two at a split), rewards fused up, depth-wise advantages
    (torch's unbiased std, 0 below 1e-6, + 1e-8); returns each leaf's path of nodes below the root."""
    root, current = Node(0), None
    current = [root]
    for i in range(num_steps):
        nxt = []
        for node in current:
            for _ in range(2 if i in splits else 1):
                node.children.append(Node(node.depth + 1))
                nxt.append(node.children[-1])
        current = nxt
    for leaf, r in zip(root.leaves(), rewards):
        leaf.reward = torch.tensor(r)
    by_depth, stack = {}, [root]
    while stack:
        node = stack.pop()
        by_depth.setdefault(node.depth, []).append(node)
        stack.extend(node.children)
    for nodes in by_depth.values():
        for node in nodes:
            if node.children:
                node.reward = torch.stack([leaf.reward for leaf in node.leaves()]).mean()
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


def test_a_tree_spread_over_two_processes_trains_as_on_one(tmp_path, tiny_sd3_dir):
    """Node-keyed noise: the leaves of one tree on two processes share their prefixes exactly, the per-step
    advantages are computed on the gathered batch, and the step equals the one-process step."""
    import json
    import os
    import subprocess
    import sys

    worker = Path(__file__).with_name("tree_worker.py")
    (tmp_path / "prompts.txt").write_text("a red circle\n")
    env = dict(os.environ, ACCELERATE_USE_CPU="true", OMP_NUM_THREADS="1")
    for launch in ([sys.executable, str(worker)],
                   [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(worker)]):
        proc = subprocess.run([*launch, tiny_sd3_dir, str(tmp_path)], capture_output=True, text=True, timeout=600,
                              env=env)
        assert proc.returncode == 0, proc.stderr[-4000:]
    one, two = (json.loads((tmp_path / f"result_{w}.json").read_text()) for w in (1, 2))
    assert two["world"] == 2
    latents = torch.tensor(two["latents"])  # [4, 4, ...] leaves 0, 1 from rank 0, leaves 2, 3 from rank 1
    assert torch.equal(latents[0, :1], latents[2, :1]) and torch.equal(latents[2, :2], latents[3, :2])
    torch.testing.assert_close(latents, torch.tensor(one["latents"]), rtol=1e-4, atol=1e-4)  # batch-size rounding
    for key in ("reward/mean", "train/grad_norm"):  # the loss metrics are rank 0's own transitions
        assert two["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-4, abs=1e-7), key
    assert one["metrics"]["train/grad_norm"] > 0
