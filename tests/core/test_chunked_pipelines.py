"""The ``chunked_rollouts`` capability tells the truth: the rollouts of a pipeline that declares it, sampled in two chunks
(``train.sample_chunks``) holding prompts of different lengths, join into one rollout that replays to the log-probs
each chunk recorded; those of a pipeline that does not are refused by the join, and preflight refuses
``train.sample_chunks`` > 1 for it before any model loads."""

import importlib
from types import SimpleNamespace

import pytest
import torch

from mmgrpo import registry
from mmgrpo.components import score_unit
from mmgrpo.overlapped_scoring import CAPABILITY, cat_rollouts, check_pipeline
from mmgrpo.types import PromptBatch
from mmgrpo.validation import ConfigError

ALGORITHM_OF_FAMILY = {"flow": "flow_grpo", "token": "grpo", "masked": "diffu_grpo"}
PROMPTS = ["a red circle", "a big blue square above a small green triangle and a yellow star"]


def conditions(policy, n: int) -> dict:
    """An input image per prompt for pipelines that read one (image editing), none otherwise."""
    if "input_images" not in policy.capabilities:
        return {}
    generator = torch.Generator().manual_seed(3)
    return {"images": [[torch.rand(3, 32, 32, generator=generator)] for _ in range(n)]}


@pytest.mark.parametrize("name", sorted(registry.available("pipeline")))
def test_two_chunks_join_and_replay(name, request):
    policy = importlib.import_module(f"builders.{name}").build_policy(request)
    family = next(f for f in ALGORITHM_OF_FAMILY if f in policy.plan_families)
    cls = registry.get("algorithm", ALGORITHM_OF_FAMILY[family])
    algorithm = cls(cls.Config())
    plan = algorithm.schedule(policy.num_steps, torch.Generator().manual_seed(0))
    batch = PromptBatch(PROMPTS, conditions=conditions(policy, 2)).repeat(2)
    parts = [policy.sample(batch.select(rows), plan, generator=torch.Generator().manual_seed(seed))
             for rows, seed in (([0, 1], 1), ([2, 3], 2))]
    if CAPABILITY not in policy.capabilities:
        with pytest.raises(ValueError, match="pads each batch to its longest item"):
            cat_rollouts(parts)
        return
    joined = cat_rollouts(parts)
    assert len(joined) == 4 and torch.equal(joined.group_ids, batch.group_ids)
    for unit in plan.train_units:
        new, old, _ = score_unit(policy, algorithm, joined, unit, torch.device("cpu"))
        scored = torch.ones_like(old, dtype=torch.bool) if new.mask is None else new.mask
        torch.testing.assert_close(new.log_prob.detach()[scored], old[scored], rtol=0, atol=1e-5)


def test_preflight_refuses_chunks_for_a_pipeline_that_pads_each_batch():
    pipeline, train = SimpleNamespace(name="z_image"), SimpleNamespace(sample_chunks=2)
    with pytest.raises(ConfigError, match="train.sample_chunks: pipeline z_image pads each batch.*can: .*sd3"):
        check_pipeline(SimpleNamespace(pipeline=pipeline, train=train))
    check_pipeline(SimpleNamespace(pipeline=SimpleNamespace(name="sd3"), train=train))
    check_pipeline(SimpleNamespace(pipeline=pipeline, train=SimpleNamespace(sample_chunks=1)))
