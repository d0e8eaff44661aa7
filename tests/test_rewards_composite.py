"""composite: the weighted sum and its two per-group normalisations against hand-computed values; NaN handling."""

import math

import pytest
import torch

from mmgrpo.config import ConfigError, build_dataclass
from mmgrpo.rewards.composite import CompositeReward
from mmgrpo.types import PromptBatch

# format scores [1, 0, 1, 1]; accuracy scores [1, 1, 0, NaN] (the last sample has no ground truth)
TEXTS = ["<think>a</think><answer>7</answer>", "<answer>7</answer>", "<think>a</think><answer>8</answer>",
         "<think>a</think><answer>9</answer>"]
METADATA = [{"answer": "7"}, {"answer": "7"}, {"answer": "7"}, {}]
GROUPS = torch.tensor([0, 0, 1, 1])
EPS = 1e-4


def run(normalize, rewards=None):
    rewards = rewards or {"format": {"weight": 0.5}, "accuracy": {"weight": 1.0, "mode": "numeric"}}
    config = build_dataclass(CompositeReward.Config, {"rewards": rewards, "normalize": normalize}, "reward")
    batch = PromptBatch(["p"] * 4, metadata=METADATA, group_ids=GROUPS)
    return CompositeReward(config)({"texts": TEXTS}, batch)


def test_plain_weighted_sum_skips_not_applicable_components():
    result = run("none")
    # 0.5 * format + 1.0 * accuracy, NaN accuracy left out of the last sum
    assert result.scores.tolist() == pytest.approx([1.5, 1.0, 0.5, 0.5])
    assert result.components["format"].tolist() == [1.0, 0.0, 1.0, 1.0]
    assert result.components["accuracy"][:3].tolist() == [1.0, 1.0, 0.0] and math.isnan(result.components["accuracy"][3])
    assert "accuracy/malformed" in result.components and "weighted_sum" in result.components


def test_sum_then_normalize_by_hand():
    # group 0 sums [1.5, 1.0]: mean 1.25, population std 0.25; group 1 sums [0.5, 0.5]: std 0
    z = 0.25 / (0.25 + EPS)
    assert run("sum_then_normalize").scores.tolist() == pytest.approx([z, -z, 0.0, 0.0], abs=1e-6)


def test_normalize_then_sum_by_hand():
    # format per group: [1, 0] -> [+-0.5 / (0.5 + eps)], [1, 1] -> [0, 0]
    # accuracy per group: [1, 1] -> [0, 0]; [0, NaN] -> [0, NaN] (statistics over the finite value only)
    z = 0.5 / (0.5 + EPS)
    result = run("normalize_then_sum")
    assert result.scores.tolist() == pytest.approx([0.5 * z, -0.5 * z, 0.0, 0.0], abs=1e-6)
    assert result.components["weighted_sum"].tolist() == pytest.approx([1.5, 1.0, 0.5, 0.5])  # before normalising


def test_all_components_not_applicable_gives_nan():
    for mode in ("none", "sum_then_normalize", "normalize_then_sum"):
        result = run(mode, {"accuracy": {}})
        assert math.isnan(result.scores[3]) and torch.isfinite(result.scores[:3]).all()


def test_config_errors_name_the_component_key():
    with pytest.raises(ConfigError, match=r"reward\.rewards\.accuracy\.bogus"):
        build_dataclass(CompositeReward.Config, {"rewards": {"accuracy": {"bogus": 1}}}, "reward")
    with pytest.raises(ConfigError, match="Unknown reward 'nope'"):
        build_dataclass(CompositeReward.Config, {"rewards": {"nope": {}}}, "reward")
    with pytest.raises(ConfigError, match="weight"):
        build_dataclass(CompositeReward.Config, {"rewards": {"format": {"weight": "high"}}}, "reward")


def test_modalities_are_the_union_of_the_components():
    config = build_dataclass(CompositeReward.Config, {"rewards": {"format": {}, "ink": {"name": "jpeg"}}}, "reward")
    assert CompositeReward(config).modalities == {"text", "image"}


def test_trainer_refuses_to_split_a_normalised_group_across_processes(tmp_path, tiny_sd3_dir):
    from mmgrpo import config as config_mod
    from mmgrpo.trainer import build_components

    (tmp_path / "prompts.txt").write_text("a red circle\na blue square\n")
    raw = {
        "output_dir": str(tmp_path / "run"),
        "pipeline": {"name": "sd3", "pretrained": tiny_sd3_dir, "resolution": 32, "num_steps": 2},
        "algorithm": {"name": "flow_grpo"},
        "reward": {"name": "composite", "normalize": "sum_then_normalize", "rewards": {"jpeg": {"weight": 1.0}}},
        "data": {"name": "prompt_file", "train_file": str(tmp_path / "prompts.txt")},
        "train": {"prompts_per_step": 3, "group_size": 2},
    }
    config = config_mod.from_dict(raw)
    # 6 samples over 2 processes = 3 each: group 1 would be normalised in two halves
    with pytest.raises(ValueError, match="split groups of 2 across processes"):
        build_components(config, samples_per_process=3)
    policy, _, reward, _ = build_components(config, samples_per_process=6)  # one process: whole groups
    assert reward.needs_whole_groups and policy is not None
    raw["reward"]["normalize"] = "none"  # the algorithm's normalisation after the gather: any layout works
    assert not build_components(config_mod.from_dict(raw), samples_per_process=3)[2].needs_whole_groups
