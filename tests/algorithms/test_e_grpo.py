"""E-GRPO: merged SDE steps, branches from one shared anchor per group, advantages per (prompt, SDE step)."""

import math

import pytest
import torch

from mmgrpo.algorithms.e_grpo import EGRPO, EGRPOConfig
from mmgrpo.pipelines.sd3 import SD3Config, SD3Policy
from mmgrpo.samplers.flow_sde import entropy_merge_span, flow_sde_std, flow_sde_step, gaussian_entropy
from mmgrpo.types import PromptBatch
from algorithm_options import algo_config

PROMPTS = ["a red circle", "two blue squares", "a green triangle"]


def make_policy(path, num_steps=4):
    return SD3Policy(SD3Config(pretrained=path, resolution=32, num_steps=num_steps, guidance_scale=1.0, lora_rank=4,
                               max_sequence_length=16))


def sample(policy, config, prompts=2, group=4, seed=1):
    algorithm = EGRPO(config)
    plan = algorithm.schedule(policy.num_steps, torch.Generator().manual_seed(0))
    batch = PromptBatch(PROMPTS[:prompts]).repeat(group)
    return algorithm, plan, batch, policy.sample(batch, plan, generator=torch.Generator().manual_seed(seed))


def test_merged_step_std_is_the_one_step_sde_std_over_the_merged_interval(tiny_sd3_dir):
    policy = make_policy(tiny_sd3_dir)
    _, plan, _, rollout = sample(policy, algo_config(EGRPOConfig, sde_steps=[1], merge_steps=[2]))
    sigmas = rollout.trajectory["shared_sigmas"]
    assert rollout.trajectory["step_ends"][:, 1].tolist() == [3] * 8
    with torch.no_grad():
        replay = policy.log_prob(rollout, [1])
    expected = flow_sde_std(sigmas[1], sigmas[3], noise_level=0.7, sigma_at_one=sigmas[1])
    one_step = flow_sde_step(torch.zeros(1, 2), torch.zeros(1, 2), sigmas[1], sigmas[3], noise_level=0.7,
                             sigma_at_one=sigmas[1], generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(replay.std[:, 0].flatten(), expected.expand(8), rtol=1e-6, atol=0)
    torch.testing.assert_close(one_step.std.flatten()[0], expected, rtol=1e-6, atol=0)
    assert expected > flow_sde_std(sigmas[1], sigmas[2], noise_level=0.7)  # merging raises the entropy
    # the branch really lands on sigma_3 from the anchor at sigma_1: standardised residual ~ N(0, 1)
    z = (rollout.trajectory["latents"][:, 3] - replay.mean[:, 0]) / replay.std[:, 0]
    assert 0.8 < z.std().item() < 1.2 and abs(z.mean().item()) < 0.1
    # one stochastic transition per sample; log-prob replays exactly
    assert torch.count_nonzero(rollout.old_log_probs, dim=1).tolist() == [1] * 8
    torch.testing.assert_close(replay.log_prob[:, 0], rollout.old_log_probs[:, 1], rtol=0, atol=1e-5)


def test_entropy_and_adaptive_merge_span():
    sigmas = torch.tensor([1.0, 0.9, 0.75, 0.6, 0.4, 0.2, 0.0])
    std = flow_sde_std(sigmas[2], sigmas[3], noise_level=0.7, sigma_at_one=0.9)
    assert gaussian_entropy(std).item() == pytest.approx(0.5 * math.log(2 * math.pi * math.e * std.item() ** 2))
    entropies = [gaussian_entropy(flow_sde_std(sigmas[2], sigmas[2 + m], noise_level=0.7)).item() for m in (1, 2, 3)]
    assert entropies == sorted(entropies)
    threshold = (entropies[0] + entropies[1]) / 2  # one step is not enough, two are
    assert entropy_merge_span(sigmas, 2, threshold, noise_level=0.7, max_span=4) == 2
    assert entropy_merge_span(sigmas, 2, entropies[0] - 1, noise_level=0.7, max_span=4) == 1
    assert entropy_merge_span(sigmas, 2, 99.0, noise_level=0.7, max_span=2) == 2  # capped
    assert entropy_merge_span(sigmas, 5, 99.0, noise_level=0.7, max_span=4) == 1  # cannot pass the last sigma


def test_adaptive_plan_merges_until_the_threshold(tiny_sd3_dir):
    policy = make_policy(tiny_sd3_dir, num_steps=6)
    sigmas = policy.sigmas(6)
    one = gaussian_entropy(flow_sde_std(sigmas[2], sigmas[3], noise_level=0.7)).item()
    two = gaussian_entropy(flow_sde_std(sigmas[2], sigmas[4], noise_level=0.7)).item()
    _, _, _, rollout = sample(policy, algo_config(EGRPOConfig, sde_steps=[2], entropy_threshold=(one + two) / 2), group=2)
    assert rollout.trajectory["step_ends"][:, 2].tolist() == [4] * 4
    with torch.no_grad():
        std = policy.log_prob(rollout, [2]).std[:, 0].flatten()
    assert (gaussian_entropy(std) >= (one + two) / 2).all()


def test_group_ids_at_the_branch_and_shared_anchor(tiny_sd3_dir):
    policy = make_policy(tiny_sd3_dir)
    algorithm, plan, batch, rollout = sample(policy, algo_config(EGRPOConfig, sde_steps=[0, 2], merge_steps=[2, 1]))
    members = batch.member_ids
    assert torch.equal(rollout.group_ids, batch.group_ids * 2 + members % 2)  # (prompt, SDE step) groups
    latents, mask = rollout.trajectory["latents"], rollout.mask
    for n in range(8):
        step = plan.sde_steps[int(members[n]) % 2]
        assert mask[n].nonzero().flatten().tolist() == [step]  # each sample trains its own SDE step only
        assert rollout.old_log_probs[n].nonzero().flatten().tolist() == [step]
        for m in range(8):
            same_prompt = batch.group_ids[n] == batch.group_ids[m]
            shared = min(step, plan.sde_steps[int(members[m]) % 2])  # both still on the anchor up to here
            assert torch.equal(latents[n, : shared + 1], latents[m, : shared + 1]) == bool(same_prompt)
    different_branch = rollout.group_ids[0] != rollout.group_ids[1]
    assert different_branch and not torch.equal(rollout.outputs["images"][0], rollout.outputs["images"][2])
    # advantages are normalised within each (prompt, SDE step) sub-group
    scores = torch.arange(8.0) ** 2
    adv = algorithm.advantages(scores, rollout.group_ids)
    for g in rollout.group_ids.unique():
        assert adv[rollout.group_ids == g].sum().abs() < 1e-5
    # the anchor of a group does not depend on which process samples which members
    halves = [policy.sample(batch.select(range(k, k + 4)), plan, generator=torch.Generator().manual_seed(7))
              for k in (0, 4)]
    glued = torch.cat([h.trajectory["latents"][:, 0] for h in halves])
    torch.testing.assert_close(glued, latents[:, 0], rtol=0, atol=0)


def test_anchor_forward_runs_once_per_group(tiny_sd3_dir):
    policy = make_policy(tiny_sd3_dir, num_steps=3)
    rows = []
    hook = policy.transformer.register_forward_pre_hook(lambda m, a, kw: rows.append(kw["hidden_states"].shape[0]),
                                                        with_kwargs=True)
    try:
        _, plan, _, rollout = sample(policy, algo_config(EGRPOConfig, sde_steps=[1]), prompts=2, group=4)
        # anchor: steps 0 and 1 once per group (2 rows each); after the branch, step 2 for each of the 8 samples
        assert rows == [2, 2, 8]
        rows.clear()
        policy.log_prob(rollout, plan.train_units[0])
        assert rows == [2]  # the SDE step's input is the anchor: one forward per group, not per sample
        rows.clear()
        policy.log_prob(rollout.select(torch.tensor([5, 0, 6])), plan.train_units[0])  # a minibatch
        assert rows == [2]
    finally:
        hook.remove()


def test_shared_forward_gives_the_same_gradient_as_per_sample_forwards(tiny_sd3_dir):
    policy = make_policy(tiny_sd3_dir, num_steps=3)
    algorithm, plan, _, rollout = sample(policy, algo_config(EGRPOConfig, sde_steps=[1], clip_low=0.5), prompts=2, group=2)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])

    def grads(shared):
        policy.transformer.zero_grad(set_to_none=True)
        rollout.trajectory["shared_anchor"] = shared
        new = policy.log_prob(rollout, [1])
        algorithm.loss(new, rollout.old_log_probs[:, [1]], advantages, None).loss.backward()
        return [p.grad.clone() for p in policy.trainable_parameters()]

    for a, b in zip(grads(True), grads(False)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


def test_config_errors_are_clear():
    with pytest.raises(ValueError, match="one span >= 1 per SDE step"):
        algo_config(EGRPOConfig, sde_steps=[1, 2], merge_steps=[2])
    with pytest.raises(ValueError, match="not both"):
        algo_config(EGRPOConfig, merge_steps=[2], entropy_threshold=1.0)
    with pytest.raises(ValueError, match="end past the 4 sampling steps"):
        EGRPO(algo_config(EGRPOConfig, sde_steps=[3], merge_steps=[2])).schedule(4)


def test_trainer_refuses_a_plan_the_pipeline_cannot_follow():
    from types import SimpleNamespace

    from mmgrpo.algorithms.dgpo import DGPO, DGPOConfig
    from mmgrpo.components import check_plan

    class PlainPolicy:  # samples plain SDE/ODE plans only and has no likelihood
        num_steps = 6
        plan_families = ("flow",)
        plan_features = frozenset()
        provides = {"log_prob": frozenset({"log_prob", "mask"})}

        def log_prob(self, rollout, steps): ...

    config = SimpleNamespace(algorithm=SimpleNamespace(name="e_grpo"), pipeline=SimpleNamespace(name="plain"))
    with pytest.raises(ValueError, match=r"needs \['branch'\], which pipeline 'plain' does not implement"):
        check_plan(PlainPolicy(), EGRPO(EGRPOConfig()), config)
    with pytest.raises(ValueError, match=r"needs \['dpm', 'likelihood'\]"):
        check_plan(PlainPolicy(), DGPO(DGPOConfig()), config)
    PlainPolicy.plan_features = frozenset({"dpm", "likelihood"})
    with pytest.raises(ValueError, match="likelihood scoring"):
        check_plan(PlainPolicy(), DGPO(DGPOConfig()), config)
