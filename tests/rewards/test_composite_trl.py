"""composite's TRL rules, ``sum_then_normalize`` and ``normalize_then_sum`` (TRL's ``multi_objective_aggregation``
with ``reward_weights``), against the advantages worked out from TRL's published rule (unbiased std + 1e-4; a batch
z-score after the per-group sum; ``None`` rewards dropped from the sums and the statistics): through the group stage and
the algorithm's advantage step, and through a real `Trainer` (its gather, the group stage, the advantages it trains on,
one training step). Also the declared ``scores_are_advantages`` and the refusals that keep them from being normalised
again."""

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from mmgrpo import registry
from mmgrpo.advantages import reward_advantages
from mmgrpo.config import ConfigError, build_dataclass
from mmgrpo.rewards.composite import CompositeReward, nanstd_unbiased, trl_normalize_then_sum
from mmgrpo.types import RewardResult

NAN = float("nan")
# the worked example: weights [1.0, 0.5], groups {0, 1, 2} and {3, 4, 5}
R1 = [1.0, 0.0, 1.0, 0.0, 0.0, 1.0]
R2 = [0.2, 0.8, 0.5, 0.9, 0.1, 0.4]
R2_NONE = [0.2, NAN, 0.5, 0.9, 0.1, 0.4]  # the second reward returned None for sample 1
GROUPS = torch.tensor([0, 0, 0, 1, 1, 1])
TRL = {  # TRL's advantages, from the published rule (independent numbers)
    ("sum_then_normalize", "group", False): [0.404006, -1.138562, 0.734556, -0.199803, -0.884841, 1.084643],
    ("sum_then_normalize", "batch", False): [0.362686, -1.022115, 0.659429, -0.2308, -1.022115, 1.252916],
    ("sum_then_normalize", "group", True): [0.463899, -1.14754, 0.683641, -0.199803, -0.884841, 1.084643],
    ("normalize_then_sum", None, False): [0.100245, -0.847713, 0.747468, -0.053442, -1.33472, 1.388163],
    ("normalize_then_sum", None, True): [0.236936, -1.221918, 0.984982, -0.043682, -1.090963, 1.134645],
}
COMPONENTS = {"accuracy": {"weight": 1.0, "mode": "numeric"}, "format": {"weight": 0.5}}


def composite(normalize: str) -> CompositeReward:
    return CompositeReward(build_dataclass(CompositeReward.Config, {"rewards": COMPONENTS, "normalize": normalize},
                                           "reward"))


def gathered(none: bool) -> RewardResult:
    """The per-sample result of the whole batch as the group stage receives it (the components' scores)."""
    r2 = torch.tensor(R2_NONE if none else R2)
    total = torch.tensor(R1) + 0.5 * torch.nan_to_num(r2)  # [N] the weighted sum, NaN terms left out
    return RewardResult(scores=total, components={"accuracy": torch.tensor(R1), "format": r2, "weighted_sum": total})


def grpo(**options):
    cls = registry.get("algorithm", "grpo")
    return cls(build_dataclass(cls.Config, options, "algorithm"))  # as a config's algorithm section


@pytest.mark.parametrize("scale, none", [("group", False), ("batch", False), ("group", True)])
def test_sum_then_normalize_gives_trl_advantages_through_the_algorithm(scale, none):
    reward = composite("sum_then_normalize")
    assert reward.group_stage is None  # the weighted sum is the score; TRL's normalisation is the advantage step
    result = gathered(none)
    advantages = reward_advantages(grpo(scale_rewards=scale), result, GROUPS)  # TRL's std: unbiased, eps 1e-4
    torch.testing.assert_close(advantages, torch.tensor(TRL["sum_then_normalize", scale, none]), rtol=0, atol=2e-6)


@pytest.mark.parametrize("none", [False, True])
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_normalize_then_sum_gives_trl_advantages_whatever_the_algorithm_scales(scale, none):
    reward = composite("normalize_then_sum")
    staged = reward.group_stage(gathered(none), GROUPS)
    assert staged.scores_are_advantages and staged.scores.dtype == torch.float32
    advantages = reward_advantages(grpo(scale_rewards=scale), staged, GROUPS)  # TRL ignores scale_rewards here
    torch.testing.assert_close(advantages, torch.tensor(TRL["normalize_then_sum", None, none]), rtol=0, atol=2e-6)
    # the plain weighted sum is still logged; the normalised one would be re-normalised by the algorithm: not TRL's
    assert staged.components["weighted_sum"].tolist() == pytest.approx(gathered(none).scores.tolist())
    again = grpo(scale_rewards="group").advantages(staged.scores, GROUPS)
    assert (again - advantages).abs().max() > 0.1


def test_unscorable_samples_and_small_batches():
    rewards = torch.tensor([[1.0, NAN], [NAN, NAN], [0.0, 0.3], [1.0, 0.9]])  # sample 1: every reward None
    weights = torch.tensor([1.0, 2.0])
    groups = torch.tensor([0, 0, 1, 1])
    advantages = trl_normalize_then_sum(rewards, weights, groups)
    assert math.isnan(advantages[1])  # unscorable: NaN score, advantage 0 and not scored by the trainer
    # group 0 holds one value per reward: std NaN -> z NaN -> sample 0 sums to 0; group 1: z = -+1/sqrt(2)/(s + 1e-4)
    z = (0.5 / (math.sqrt(0.5) + 1e-4), 0.3 / (math.sqrt(2 * 0.3**2) + 1e-4))
    s = torch.tensor([0.0, -(z[0] + 2 * z[1]), z[0] + 2 * z[1]], dtype=torch.float64)
    expected = (s - s.mean()) / (s.std() + 1e-4)
    torch.testing.assert_close(advantages[[0, 2, 3]], expected, rtol=0, atol=1e-9)
    result = RewardResult(scores=advantages.float(), scores_are_advantages=True)
    assert reward_advantages(None, result, groups)[1] == 0.0  # no algorithm asked: the scores are the advantages
    single = trl_normalize_then_sum(torch.tensor([[1.0, 2.0]]), weights, None)  # one sample: std NaN -> 0 (TRL)
    assert single.tolist() == [0.0]
    assert nanstd_unbiased(torch.tensor([1.0, NAN, 3.0])).item() == pytest.approx(math.sqrt(2))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([0.0, 1.0, NAN]), st.floats(0, 1) | st.just(NAN)), min_size=8,
                max_size=8))
def test_group_means_of_the_advantages_are_zero_and_scores_finite_unless_unscorable(rows):
    """After the per-group z-scores every group's sums average 0 over its scorable samples, so the batch z-score keeps
    them at 0: no group baseline is left for an algorithm to remove."""
    rewards = torch.tensor(rows, dtype=torch.float64)  # [8, 2]
    advantages = trl_normalize_then_sum(rewards, torch.tensor([1.0, 0.5]), torch.arange(8) // 4)
    unscorable = torch.isnan(rewards).all(dim=1)
    assert torch.equal(torch.isnan(advantages), unscorable)
    for g in range(2):
        members = (torch.arange(8) // 4 == g) & ~unscorable
        if members.any():
            assert abs(float(advantages[members].sum())) < 1e-6 * max(1.0, float(advantages.abs().max()))


def test_refusals_keep_the_advantages_from_being_normalised_again():
    inner = {"name": "composite", "normalize": "normalize_then_sum", "rewards": {"format": {}}}
    with pytest.raises(ConfigError, match="rewards.inner has normalize: normalize_then_sum"):
        build_dataclass(CompositeReward.Config, {"rewards": {"inner": inner}}, "reward")
    with pytest.raises(ConfigError, match="eps applies to normalize: sum_then_group_normalize"):
        build_dataclass(CompositeReward.Config, {"rewards": {"format": {}}, "normalize": "normalize_then_sum",
                                                 "eps": 1e-3}, "reward")
    assert composite("normalize_then_sum").config.scores_are_advantages
    assert not composite("group_normalize_then_sum").config.scores_are_advantages


def _run_config(tmp_path, tiny_mdlm_dir, normalize, scale="group", placement="spread"):
    return {
        "output_dir": str(tmp_path / "out"), "seed": 3,
        "pipeline": {"name": "mdlm", "pretrained": tiny_mdlm_dir, "gen_length": 4, "steps_per_block": 4,
                     "lora_rank": 0},
        "algorithm": {"name": "grpo", "kl_beta": 0.0, "scale_rewards": scale},
        "reward": {"name": "composite", "normalize": normalize, "rewards": COMPONENTS},
        "data": {"name": "arith", "digits": 2, "n_train": 12, "n_eval": 4},
        "train": {"max_steps": 1, "prompts_per_step": 2, "group_size": 3, "minibatch_size": 6, "learning_rate": 1e-2,
                  "group_placement": placement},
        "eval": {"every": 0},
    }


@pytest.mark.parametrize("normalize, scale", [("normalize_then_sum", "group"), ("normalize_then_sum", "batch"),
                                              ("sum_then_normalize", "group"), ("sum_then_normalize", "batch")])
def test_the_trainer_trains_on_trl_advantages(tmp_path, tiny_mdlm_dir, normalize, scale):
    from mmgrpo import config as config_mod
    from mmgrpo.trainer import Trainer

    trainer = Trainer(config_mod.from_dict(_run_config(tmp_path, tiny_mdlm_dir, normalize, scale)))
    for none in (False, True):
        whole, groups, advantages = trainer.global_advantages(gathered(none), GROUPS)  # gather, stage, advantages
        key = (normalize, None if normalize == "normalize_then_sum" else scale, none)
        if key in TRL:
            torch.testing.assert_close(advantages, torch.tensor(TRL[key]), rtol=0, atol=2e-6)
        assert whole.scores_are_advantages == (normalize == "normalize_then_sum")
    trainer.step = 1
    metrics = trainer.train_step()  # a real step: rollouts, rewards, the advantages above, an update
    assert math.isfinite(metrics["reward/accuracy"]) and "train/skipped_updates" in metrics


def test_preflight_refuses_contiguous_placement_with_batch_advantages(tmp_path, tiny_mdlm_dir):
    from mmgrpo import config as config_mod
    from mmgrpo.preflight import check_reward_advantages

    raw = _run_config(tmp_path, tiny_mdlm_dir, "normalize_then_sum", placement="contiguous")
    with pytest.raises(ConfigError, match="group_placement: contiguous .* use spread"):
        check_reward_advantages(config_mod.from_dict(raw))
    raw["reward"]["normalize"] = "group_normalize_then_sum"  # per group: each process holds whole groups
    check_reward_advantages(config_mod.from_dict(raw))
