"""Contract tests parametrised over every registry entry: a new plugin is tested by these without new tests.

Each registered pipeline must have a tiny builder in `PIPELINE_BUILDERS`; the test that checks this fails for a new
pipeline until one is added."""

import dataclasses

import pytest
import torch

from mmgrpo import registry
from mmgrpo.protocols import Algorithm, RewardFn, StochasticPolicy
from mmgrpo.types import PromptBatch


def _sd3(tiny_sd3_dir):
    from mmgrpo.pipelines.sd3 import SD3Config, SD3Policy

    return SD3Policy(SD3Config(pretrained=tiny_sd3_dir, resolution=32, num_steps=3, guidance_scale=1.0, lora_rank=4, max_sequence_length=16))


PIPELINE_BUILDERS = {"sd3": _sd3}
SAMPLE_OUTPUTS = {"image": lambda n: {"images": torch.rand(n, 3, 32, 32, generator=torch.Generator().manual_seed(n))}}
REWARD_OPTIONS = {}  # reward name -> options needed to build it in tests (defaults otherwise)


def _shapes_batch(n):
    from mmgrpo.data.shapes import ShapesPrompts
    from mmgrpo.prompt_stream import items_to_batch

    return items_to_batch(ShapesPrompts().train_items()[:n])


REWARD_BATCHES = {"mini_geneval": _shapes_batch}  # rewards that need per-prompt metadata


def test_every_pipeline_has_a_tiny_builder():
    assert set(registry.available("pipeline")) == set(PIPELINE_BUILDERS)


@pytest.mark.parametrize("name", sorted(registry.available("pipeline")))
@pytest.mark.parametrize("algorithm_name", sorted(registry.available("algorithm")))
def test_pipeline_contract(name, algorithm_name, tiny_sd3_dir):
    """Replay consistency, on-policy ratio 1 and zero advantage -> zero gradient, for every pipeline x algorithm."""
    policy = PIPELINE_BUILDERS[name](tiny_sd3_dir)
    assert isinstance(policy, StochasticPolicy)
    algorithm = registry.get("algorithm", algorithm_name)(registry.get("algorithm", algorithm_name).Config())
    plan = algorithm.schedule(policy.num_steps, torch.Generator().manual_seed(0))
    batch = PromptBatch(["a red circle", "a blue square"]).repeat(2)
    rollout = policy.sample(batch, plan, generator=torch.Generator().manual_seed(1))
    assert rollout.old_log_probs.shape[0] == 4 and rollout.mask.shape == rollout.old_log_probs.shape
    assert torch.equal(rollout.group_ids, torch.tensor([0, 0, 1, 1]))
    for unit in plan.train_units:
        new = policy.log_prob(rollout, unit)
        torch.testing.assert_close(new["log_prob"].detach(), rollout.old_log_probs[:, unit], rtol=0, atol=1e-5)
        out = algorithm.loss(new, rollout.old_log_probs[:, unit], torch.zeros(4), None)
        assert out.metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
        out.loss.backward()
        assert all(p.grad is None or torch.count_nonzero(p.grad) == 0 for p in policy.trainable_parameters())


@pytest.mark.parametrize("name", sorted(registry.available("algorithm")))
def test_algorithm_contract(name):
    cls = registry.get("algorithm", name)
    algorithm = cls(cls.Config())
    assert isinstance(algorithm, Algorithm) and algorithm.scoring in ("trajectory", "likelihood")
    scores = torch.tensor([1.0, 0.0, float("nan"), 2.0, 2.0, 0.5])
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    adv = algorithm.advantages(scores, groups)
    assert adv.shape == (6,) and torch.isfinite(adv).all() and adv[2] == 0  # NaN = not applicable
    assert adv[0] > 0 > adv[1]
    plan = algorithm.schedule(6, torch.Generator().manual_seed(0))
    assert all(s in plan.sde_steps for unit in plan.train_units for s in unit)


@pytest.mark.parametrize("name", sorted(registry.available("reward")))
def test_reward_contract(name):
    cls = registry.get("reward", name)
    assert dataclasses.is_dataclass(cls.Config)
    reward = cls(cls.Config(**REWARD_OPTIONS.get(name, {})))
    assert isinstance(reward, RewardFn)
    (modality,) = reward.modalities
    outputs = SAMPLE_OUTPUTS[modality](5)
    batch = REWARD_BATCHES.get(name, lambda n: PromptBatch(["a red circle"] * n))(5)
    first, second = reward(outputs, batch), reward(outputs, batch)
    assert first.scores.shape == (5,) and first.scores.dtype == torch.float32
    assert torch.isfinite(first.scores).all()
    torch.testing.assert_close(first.scores, second.scores, rtol=0, atol=0)  # deterministic
    # an item the reward does not apply to is NaN or a number, never an exception
    no_metadata = reward(outputs, PromptBatch(["?"] * 5))
    assert no_metadata.scores.shape == (5,)
    for values in first.components.values():
        assert values.shape == (5,)


@pytest.mark.parametrize("name", sorted(registry.available("data")))
def test_registered_entries_import_and_define_config(name):
    cls = registry.get("data", name)
    assert dataclasses.is_dataclass(cls.Config)
