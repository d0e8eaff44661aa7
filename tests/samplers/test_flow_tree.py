"""BranchGRPO's tree rollout (`mmgrpo.samplers.flow_tree`) against a plain per-leaf computation."""

import math

import pytest
import torch

from mmgrpo.plans import FlowPlan
from mmgrpo.samplers.flow_plan import run_plan
from mmgrpo.samplers.flow_sde import flow_sde_step
from mmgrpo.samplers.flow_tree import NOISE_OFFSET, sample_tree, tree_levels, tree_mask, tree_widths
from mmgrpo.seeding import mix_seed

SHAPE = (2, 3)


def _plan(num_steps=5, points=(0, 2), factor=2, scale=4.0, **kw):
    return FlowPlan(num_steps=num_steps, sde_steps=list(range(num_steps)), train_units=[[i] for i in range(num_steps)],
                    tree_split_points=list(points), branch_factor=factor, tree_split_noise_scale=scale, seed=5, **kw)


def _noise(count, generator):
    return torch.randn(count, *SHAPE, generator=generator)


class Model:
    """A toy velocity with per-sample conditioning (the same within a group, as a prompt); counts the latents it is
    forwarded."""

    def __init__(self, groups):
        base = torch.randn(int(groups.max()) + 1, *SHAPE, generator=torch.Generator().manual_seed(3))
        self.cond = base[groups]
        self.forwards = 0

    def __call__(self, x, sigma, rows):
        self.forwards += len(x)
        return 0.5 * x + self.cond[rows] * (1 + float(sigma))


def _sigmas(num):
    return torch.linspace(1, 0, num + 1)


def _leaf_by_leaf(model, plan, group, member, row):
    """One leaf's path computed alone: its own root noise, velocity and node-keyed draws at every step."""
    gen = torch.Generator().manual_seed(mix_seed(plan.seed, group, -1, offset=NOISE_OFFSET))
    x = _noise(1, gen)
    sigmas, states, log_probs = _sigmas(plan.num_steps), [x], []
    leaves = plan.branch_factor ** len(plan.tree_split_points)
    splits = 0
    for i in range(plan.num_steps):
        splits += i in plan.tree_split_points
        node = member // (leaves // plan.branch_factor**splits)
        draw = _noise(1, torch.Generator().manual_seed(mix_seed(plan.seed, group, i, node, offset=NOISE_OFFSET)))
        draw = draw * (plan.tree_split_noise_scale if i in plan.tree_split_points else 1.0)
        v = model(x, sigmas[i], torch.tensor([row]))
        out = flow_sde_step(v, x, sigmas[i], sigmas[i + 1], noise_level=plan.noise_level, sigma_at_one=sigmas[1],
                            noise=draw)
        # the density of the sample under the transition's unscaled std (the authors' log-prob of a split child)
        by_hand = (-((out.prev_sample - out.mean) ** 2) / (2 * out.std**2) - torch.log(out.std)
                   - 0.5 * math.log(2 * math.pi)).mean()
        x = out.prev_sample
        states.append(x)
        log_probs.append(by_hand)
    return torch.cat(states), torch.stack(log_probs)


def test_tree_equals_each_leaf_computed_alone_and_forwards_once_per_node():
    plan = _plan()
    groups = torch.tensor([7] * 4 + [9] * 4)
    members = torch.arange(4).repeat(2)
    model = Model(groups)
    trajectory, log_probs, mask = sample_tree(model, _noise, _sigmas(5), plan, groups, members)
    # nodes entering each step: the root, 2 after the split at 0 (steps 1, 2), 4 after the split at 2 (steps 3, 4)
    assert model.forwards == trajectory["shared_tree_forwards"] == 2 * (1 + 2 + 2 + 4 + 4)
    for n in range(8):
        states, lp = _leaf_by_leaf(Model(groups), plan, int(groups[n]), int(members[n]), n)
        torch.testing.assert_close(trajectory["latents"][n], states, rtol=0, atol=1e-6)
        torch.testing.assert_close(log_probs[n], lp, rtol=0, atol=1e-5)
    latents = trajectory["latents"]
    # siblings share their prefix exactly and differ after it
    assert torch.equal(latents[0, :3], latents[1, :3]) and not torch.equal(latents[0, 3], latents[1, 3])
    assert torch.equal(latents[0, :1], latents[2, :1]) and not torch.equal(latents[0, 1], latents[2, 1])
    assert not torch.equal(latents[0, 0], latents[4, 0])  # one root noise per tree
    # each node transition is trained once: by its first leaf
    assert mask.sum(0).tolist() == [4, 4, 8, 8, 8]
    assert mask[:4, 1].tolist() == [True, False, True, False]


def test_a_group_split_over_processes_samples_the_same_prefixes():
    plan = _plan()
    groups, members = torch.zeros(4, dtype=torch.long), torch.arange(4)
    whole, _, _ = sample_tree(Model(groups), _noise, _sigmas(5), plan, groups, members)
    # the second process holds members 2 and 3 only
    part, _, _ = sample_tree(Model(groups[2:]), _noise, _sigmas(5), plan, groups[2:], members[2:])
    torch.testing.assert_close(part["latents"], whole["latents"][2:], rtol=0, atol=1e-6)


def test_run_plan_hook_and_helpers():
    plan = _plan(num_steps=4, points=(1,), factor=3, scale=1.0, noise_level=0.5)
    assert tree_levels(plan) == [0, 1, 1, 1] and tree_widths(plan) == [3, 1, 1, 1] and plan.tree_leaves == 3
    assert plan.features() == {"tree"}
    groups, members = torch.tensor([0, 0, 0]), torch.arange(3)
    trajectory, log_probs, mask, out_groups = run_plan(Model(groups), _noise, _sigmas(4), plan, groups, members, None)
    assert torch.equal(out_groups, groups) and trajectory["latents"].shape == (3, 5, *SHAPE)
    assert torch.equal(mask, tree_mask(plan, members)) and mask[:, 0].tolist() == [True, False, False]
    assert torch.isfinite(log_probs).all()


def test_invalid_tree_plans_and_members_are_refused():
    with pytest.raises(ValueError, match="increasing, distinct SDE steps"):
        _plan(points=(2, 0))
    with pytest.raises(ValueError, match="branch_factor >= 2"):
        _plan(factor=1)
    for other in ({"branch": True}, {"record_mean": True}, {"units_per_sample": 1}):
        with pytest.raises(ValueError, match="combines with no other"):
            _plan(**other)
    with pytest.raises(ValueError, match="set train.group_size to 4"):
        sample_tree(Model(torch.zeros(8, dtype=torch.long)), _noise, _sigmas(5), _plan(), torch.zeros(8, dtype=torch.long),
                    torch.arange(8))
    with pytest.raises(ValueError, match="member_ids"):
        sample_tree(Model(torch.zeros(4, dtype=torch.long)), _noise, _sigmas(5), _plan(), torch.zeros(4, dtype=torch.long),
                    None)
