"""DanceGRPO: its plan (SDE on every step but the last, a random share of those trained per sample), the group-shared
initial noise, its loss against the authors' rule written out plainly, on-policy ratio 1 and zero advantage -> zero
gradient through the real tiny SD3, its options' checks, and the multi-reward advantages (`composite`'s
``advantage_aggr``) against the authors' loop."""

import pytest
import torch

from algorithm_options import algo_config
from mmgrpo.algorithms.dance_grpo import DanceGRPO, DanceGRPOConfig
from mmgrpo.pipelines.sd3 import SD3Config, SD3Policy
from mmgrpo.types import PromptBatch, Score
from mmgrpo.validation import ConfigError


def dance(**options) -> DanceGRPO:
    return DanceGRPO(algo_config(DanceGRPOConfig, **options))


def tiny_sd3(path, num_steps=4) -> SD3Policy:
    return SD3Policy(SD3Config(pretrained=path, resolution=32, num_steps=num_steps, guidance_scale=1.0, lora_rank=4,
                               max_sequence_length=16))


def test_plan_is_sde_but_the_last_step_with_the_authors_share_per_sample():
    plan = dance().schedule(16, torch.Generator().manual_seed(0))  # the authors' FLUX script: 16 steps, 0.6
    assert plan.sde_steps == list(range(15)) and plan.train_units == [[s] for s in range(15)]
    assert plan.units_per_sample == int(0.6 * 15) == 9 and plan.sde_type == "dance" and plan.noise_level == 0.3
    assert plan.init_same_noise and plan.features() == {"unit_selection", "init_same_noise"}
    every = dance(timestep_fraction=1.0, init_same_noise=False).schedule(16, torch.Generator().manual_seed(0))
    assert every.units_per_sample == 0 and every.features() == set()  # all 15 steps trained by every sample
    with pytest.raises(ValueError, match="trains no step"):
        dance(timestep_fraction=0.1).schedule(6, torch.Generator().manual_seed(0))  # int(0.1 * 5) = 0


def test_config_checks():
    with pytest.raises(ConfigError, match="timestep_fraction"):
        dance(timestep_fraction=0.0)
    with pytest.raises(ConfigError, match="timestep_fraction"):
        dance(timestep_fraction=1.5)
    with pytest.raises(ValueError, match="sde_type"):
        dance(sde_type="flow")
    with pytest.raises(ValueError, match="noise_level"):
        dance(noise_level=0.0)
    with pytest.raises(ValueError, match="clip_ratio"):
        dance(clip_ratio=0.1)  # unknown key: named
    assert not dance().traits.needs_reference and dance(kl_beta=0.01).traits.needs_reference
    for bad in (1, 0, 5000):
        with pytest.raises(ConfigError, match="bestofn"):
            dance(bestofn=bad)


def authors_loss(log_prob, old_log_prob, advantages, trained, clip=1e-4, adv_clip=5.0):
    """The authors' loss of one optimizer update (``train_grpo_flux.py``): for each sample and each of its
    `train_timesteps` trained steps, ``max(-A r, -A clip(r))`` with ``A`` clamped to 5, divided by
    ``gradient_accumulation_steps * train_timesteps``, summed. `trained`: the trained step indices of each sample."""
    grad_acc, total = len(trained), 0.0
    for i, steps in enumerate(trained):
        a = min(max(float(advantages[i]), -adv_clip), adv_clip)
        for j in steps:
            r = float(torch.exp(log_prob[i, j] - old_log_prob[i, j]))
            total += max(-a * r, -a * min(max(r, 1 - clip), 1 + clip)) / (grad_acc * len(steps))
    return total


def test_loss_of_an_update_equals_the_authors_mean_over_trained_pairs():
    """The trainer weighs each step's pass by its ``entries`` and divides by their sum (``update_mean: entries``):
    the update's loss is the authors' sum over (sample, step) pairs / (samples * steps per sample)."""
    g = torch.Generator().manual_seed(0)
    n, steps = 4, 5
    old = torch.randn(n, steps, generator=g) * 0.1
    new = old + torch.randn(n, steps, generator=g) * 2e-4  # ratios inside and outside the clip
    advantages = torch.tensor([7.0, -0.5, 1.5, -9.0])  # two beyond the clamp
    trained = [[0, 3, 1], [4, 2, 0], [1, 2, 3], [0, 4, 2]]  # 3 of 5 steps each, as a unit selection draws
    algorithm = dance()
    weighted, entries = 0.0, 0.0
    for j in range(steps):
        mask = torch.tensor([[j in t] for t in trained])  # [n, 1]
        out = algorithm.loss(Score(log_prob=new[:, j : j + 1], mask=mask), old[:, j : j + 1], advantages)
        weighted += float(out.loss) * out.entries
        entries += out.entries
    assert entries == 12 and algorithm.traits.update_mean == "entries"
    assert weighted / entries == pytest.approx(authors_loss(new, old, advantages, trained), rel=1e-6, abs=1e-9)


def test_each_sample_trains_its_own_share_and_the_group_shares_its_initial_noise(tiny_sd3_dir):
    policy = tiny_sd3(tiny_sd3_dir, num_steps=6)
    algorithm = dance()  # int(0.6 * 5) = 3 of the first 5 steps per sample
    plan = algorithm.schedule(6, torch.Generator().manual_seed(3))
    batch = PromptBatch(["a red circle", "a blue square", "a green triangle"]).repeat(4)
    rollout = policy.sample(batch, plan, generator=torch.Generator().manual_seed(1))
    assert rollout.mask.sum(1).tolist() == [3] * 12 and not rollout.mask[:, 5].any()
    assert len({tuple(row.tolist()) for row in rollout.mask}) > 1  # drawn per sample
    assert (rollout.old_log_probs[:, 5] == 0).all() and (rollout.old_log_probs[:, :5] != 0).all()  # last step: ODE
    start = rollout.trajectory["latents"][:, 0]  # [12, ...] the initial noise
    for g in range(3):
        members = start[4 * g : 4 * g + 4]
        assert all(torch.equal(members[0], m) for m in members[1:])  # one noise per group
        assert not torch.equal(rollout.trajectory["latents"][4 * g, -1], rollout.trajectory["latents"][4 * g + 1, -1])
    assert not torch.equal(start[0], start[4]) and not torch.equal(start[4], start[8])  # another per group
    # a second process holding samples 6..11 with its own generator draws the same noise for the same groups
    other = policy.sample(batch.select(range(6, 12)), plan, generator=torch.Generator().manual_seed(99))
    torch.testing.assert_close(other.trajectory["latents"][:, 0], start[6:], rtol=0, atol=0)
    # the next step's plan (another seed) draws other noises; without the option each sample has its own
    later = policy.sample(batch, algorithm.schedule(6, torch.Generator().manual_seed(4)),
                          generator=torch.Generator().manual_seed(1))
    assert not torch.equal(later.trajectory["latents"][0, 0], start[0])
    own = policy.sample(batch, dance(init_same_noise=False).schedule(6, torch.Generator().manual_seed(3)),
                        generator=torch.Generator().manual_seed(1))
    assert not torch.equal(own.trajectory["latents"][0, 0], own.trajectory["latents"][1, 0])


def test_on_policy_ratio_is_one_and_zero_advantage_gives_zero_gradient(tiny_sd3_dir):
    policy = tiny_sd3(tiny_sd3_dir)
    algorithm = dance(timestep_fraction=0.7)  # int(0.7 * 3) = 2 of 3 steps
    plan = algorithm.schedule(4, torch.Generator().manual_seed(0))
    batch = PromptBatch(["a red circle", "a blue square"]).repeat(3)
    rollout = policy.sample(batch, plan, generator=torch.Generator().manual_seed(2))
    for unit in plan.train_units:
        new = policy.log_prob(rollout, unit)
        assert new.mask[:, 0].tolist() == rollout.mask[:, unit[0]].tolist()
        trained = new.mask
        torch.testing.assert_close(new.log_prob.detach()[trained], rollout.old_log_probs[:, unit][trained], rtol=0,
                                   atol=1e-6)
        out = algorithm.loss(new, rollout.old_log_probs[:, unit], torch.zeros(6))
        assert out.metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-6) and out.entries == float(trained.sum())
        out.loss.backward()
        assert all(p.grad is None or torch.count_nonzero(p.grad) == 0 for p in policy.trainable_parameters())
        signal = algorithm.loss(policy.log_prob(rollout, unit), rollout.old_log_probs[:, unit],
                                torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0]))
        signal.loss.backward()
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in policy.trainable_parameters())
        for p in policy.trainable_parameters():
            p.grad = None


def authors_advantage_aggr(rewards: dict, weights: dict, num_generations: int) -> torch.Tensor:
    """MixGRPO's ``advantage_aggr`` (``train_grpo_flux.py``): per reward, each group of `num_generations` consecutive
    samples ``(r - mean) / (std + 1e-8)`` (torch's unbiased std), then the weighted sum."""
    merged = torch.zeros(len(next(iter(rewards.values()))))
    for name, values in rewards.items():
        advantages = torch.zeros_like(values)
        for start in range(0, len(values), num_generations):
            group = values[start : start + num_generations]
            advantages[start : start + num_generations] += (group - group.mean()) / (group.std() + 1e-8)
        merged += advantages * weights[name]
    return merged


def test_composite_advantage_aggr_is_the_authors_multi_reward_rule():
    """Existing modes are other rules (TRL's normalize_then_sum z-scores the sum over the batch again; the per-group
    variants use the population std and are normalised again by the algorithm); ``advantage_aggr`` is the authors'."""
    from mmgrpo.rewards.composite import CompositeConfig, CompositeReward
    from mmgrpo.types import RewardResult

    g = torch.Generator().manual_seed(0)
    hps, clip_score = torch.rand(8, generator=g), torch.rand(8, generator=g) * 0.1
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    expected = authors_advantage_aggr({"a": hps, "b": clip_score}, {"a": 0.7, "b": 1.4}, 4)
    config = CompositeConfig(rewards={"a": {"name": "jpeg", "weight": 0.7}, "b": {"name": "jpeg", "weight": 1.4}},
                             normalize="advantage_aggr")
    reward = CompositeReward(config)
    raw = RewardResult(scores=0.7 * hps + 1.4 * clip_score, components={"a": hps, "b": clip_score})
    staged = reward.group_stage(raw, groups)
    assert staged.scores_are_advantages and config.scores_are_advantages
    torch.testing.assert_close(staged.scores, expected, rtol=1e-5, atol=1e-6)
    trl = CompositeReward(CompositeConfig(rewards=config.rewards, normalize="normalize_then_sum"))
    assert not torch.allclose(trl.group_stage(raw, groups).scores, expected, atol=1e-3)
    # a component not applicable to a sample (NaN) is left out of its group's statistics and of the sum
    partial = RewardResult(scores=raw.scores, components={"a": hps, "b": torch.where(torch.arange(8) == 1,
                                                                                     float("nan"), clip_score)})
    kept = [0, 2, 3]
    b_group = clip_score[kept]
    b_adv = (clip_score[0] - b_group.mean()) / (b_group.std() + 1e-8)
    a_adv = (hps[0] - hps[:4].mean()) / (hps[:4].std() + 1e-8)
    result = reward.group_stage(partial, groups).scores
    assert float(result[0]) == pytest.approx(float(0.7 * a_adv + 1.4 * b_adv), rel=1e-5)
    assert float(result[1]) == pytest.approx(float(0.7 * (hps[1] - hps[:4].mean()) / (hps[:4].std() + 1e-8)), rel=1e-5)


def authors_best_of_n(vq_rewards, mq_rewards, num_generations, bestofn, vq_coef=1.0, mq_coef=0.0):
    """The authors' HunyuanVideo selection (``train_grpo_hunyuan.py``): per reward, groups of `num_generations`
    normalised ``(r - mean) / (std + 1e-8)``; ``total = vq_coef * A_vq + mq_coef * A_mq``; ``argsort``; the indices
    ``sorted[-bestofn//2:]`` and ``sorted[:bestofn//2]`` are trained (all when ``num_generations == bestofn``;
    Python reads ``-bestofn//2`` as ``(-bestofn) // 2``). Returns the kept indices and the total scores."""
    total = authors_advantage_aggr({"vq": vq_rewards, "mq": mq_rewards}, {"vq": vq_coef, "mq": mq_coef},
                                   num_generations)
    order = torch.argsort(total)
    if num_generations == bestofn:
        return set(range(len(total))), total
    return set(order[-bestofn // 2 :].tolist()) | set(order[: bestofn // 2].tolist()), total


def test_best_of_n_trains_the_authors_selection():
    """One group of 24 (the authors' process batch), bestofn 8: the 4 highest and 4 lowest advantages are kept with
    their values in the whole group; the others get 0 and leave the batch (Flow-GRPO's filter)."""
    from mmgrpo.advantages import kept_samples, reward_advantages
    from mmgrpo.types import RewardResult

    g = torch.Generator().manual_seed(1)
    vq = torch.rand(24, generator=g)
    algorithm = dance(bestofn=8)
    assert algorithm.traits.selects_samples and algorithm.traits.drop_zero_advantage
    assert not dance().traits.drop_zero_advantage
    groups = torch.zeros(24, dtype=torch.long)
    got = reward_advantages(algorithm, RewardResult(scores=vq), groups)  # [24]
    expected_kept, total = authors_best_of_n(vq, torch.zeros(24), 24, 8)
    assert set(torch.nonzero(got).flatten().tolist()) == expected_kept and len(expected_kept) == 8
    torch.testing.assert_close(got[sorted(expected_kept)], total[sorted(expected_kept)], rtol=1e-5, atol=1e-6)
    assert kept_samples(got, 2).tolist() == sorted(expected_kept)
    every = reward_advantages(dance(), RewardResult(scores=vq), groups)
    torch.testing.assert_close(every, total, rtol=1e-5, atol=1e-6)  # without bestofn: every sample, same values
    # two groups of 6 (ours selects per group), bestofn 4 and an odd 5 (the 3 highest and the 2 lowest)
    rewards = torch.rand(12, generator=g)
    two = torch.tensor([0] * 6 + [1] * 6)
    for b in (4, 5):
        got = reward_advantages(dance(bestofn=b), RewardResult(scores=rewards), two)
        for start in (0, 6):
            kept, total = authors_best_of_n(rewards[start : start + 6], torch.zeros(6), 6, b)
            assert set(torch.nonzero(got[start : start + 6]).flatten().tolist()) == kept and len(kept) == b
    assert torch.equal(reward_advantages(dance(bestofn=6), RewardResult(scores=rewards), two),
                       reward_advantages(dance(), RewardResult(scores=rewards), two))  # bestofn == group size: all
    with pytest.raises(ValueError, match="set train.group_size to at least 8"):
        reward_advantages(dance(bestofn=8), RewardResult(scores=rewards), two)


def test_best_of_n_ranks_the_summed_advantages_of_several_rewards():
    """With the `composite` reward's ``advantage_aggr`` (scores that are already advantages), the selection ranks
    their weighted sum, as the authors' ``vq_coef * A_vq + mq_coef * A_mq``."""
    from mmgrpo.advantages import reward_advantages
    from mmgrpo.rewards.composite import CompositeConfig, CompositeReward
    from mmgrpo.types import RewardResult

    g = torch.Generator().manual_seed(4)
    vq, mq = torch.rand(24, generator=g), torch.rand(24, generator=g)
    reward = CompositeReward(CompositeConfig(rewards={"vq": {"name": "jpeg", "weight": 1.0},
                                                      "mq": {"name": "jpeg", "weight": 0.5}},
                                             normalize="advantage_aggr"))
    groups = torch.zeros(24, dtype=torch.long)
    staged = reward.group_stage(RewardResult(scores=vq + 0.5 * mq, components={"vq": vq, "mq": mq}), groups)
    got = reward_advantages(dance(bestofn=8), staged, groups)
    kept, total = authors_best_of_n(vq, mq, 24, 8, vq_coef=1.0, mq_coef=0.5)
    assert set(torch.nonzero(got).flatten().tolist()) == kept
    torch.testing.assert_close(got[sorted(kept)], total[sorted(kept)], rtol=1e-5, atol=1e-6)
