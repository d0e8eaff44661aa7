"""Chunk-GRPO: chunks are train units, the chunk ratio is the geometric mean of the step ratios, each sample trains
its own random (or latent-change weighted) share of the chunks."""

import pytest
import torch

from mmgrpo.algorithms.chunk_grpo import ChunkGRPO, ChunkGRPOConfig
from mmgrpo.pipelines.sd3 import SD3Config, SD3Policy
from mmgrpo.samplers.flow_plan import select_units
from mmgrpo.types import PromptBatch, Score
from mmgrpo.plans import FlowPlan
from algorithm_options import algo_config

PROMPTS = ["a red circle", "two blue squares"]


def test_chunks_are_consecutive_units():
    assert ChunkGRPO(algo_config(ChunkGRPOConfig, chunks=[2, 3, 4, 7])).chunk_units(17) == [
        [0, 1], [2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15]
    ]
    # uniform chunks over every step but the last, the last chunk taking the remainder
    assert ChunkGRPO(algo_config(ChunkGRPOConfig, chunk_size=4)).chunk_units(11) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    plan = ChunkGRPO(algo_config(ChunkGRPOConfig, chunks=[2, 3, 4, 7], timestep_fraction=0.5)).schedule(17)
    assert plan.sde_steps == list(range(17)) and plan.units_per_sample == 2 and len(plan.train_units) == 4
    with pytest.raises(ValueError, match="sum to at most pipeline.num_steps"):
        ChunkGRPO(algo_config(ChunkGRPOConfig, chunks=[4, 4])).schedule(6)
    with pytest.raises(ValueError, match=r"chunks\[1\] must be >= 1"):
        algo_config(ChunkGRPOConfig, chunks=[2, 0])


def test_chunk_ratio_is_the_geometric_mean_of_the_step_ratios():
    g = torch.Generator().manual_seed(0)
    old = torch.randn(5, 3, generator=g)
    new = (old + 0.01 * torch.randn(5, 3, generator=g)).requires_grad_(True)
    algorithm = ChunkGRPO(algo_config(ChunkGRPOConfig, clip_low=0.2, clip_high=0.3))
    advantages = torch.tensor([1.0, -1.0, 0.5, 2.0, -0.3])
    out = algorithm.loss(Score(log_prob=new), old, advantages)
    step_ratios = torch.exp(new.detach() - old)  # [5, 3]
    geometric = step_ratios.prod(dim=1) ** (1 / 3)  # independent: the k-th root of the product
    assert out.metrics["ratio_mean"] == pytest.approx(geometric.mean().item(), rel=1e-6)
    clipped = geometric.clamp(1 - 0.2, 1 + 0.3)
    expected = torch.maximum(-advantages * geometric, -advantages * clipped).mean()
    assert out.loss.item() == pytest.approx(expected.item(), rel=1e-6)
    # asymmetric clip: a ratio of 1.25 is inside [0.8, 1.3], a ratio of 0.75 is clipped
    for ratio, inside in ((1.25, True), (0.75, False)):
        lp = torch.full((1, 2), float(torch.log(torch.tensor(ratio))), requires_grad=True)
        ChunkGRPO(algo_config(ChunkGRPOConfig, clip_low=0.2, clip_high=0.3)).loss(
            Score(log_prob=lp), torch.zeros(1, 2), torch.tensor([-1.0])
        ).loss.backward()
        assert (lp.grad.abs().sum() > 0) == inside


def test_samples_not_training_a_chunk_are_ignored():
    old = torch.zeros(4, 2)
    new = torch.full((4, 2), 0.01, requires_grad=True)
    mask = torch.tensor([[True, True], [False, False], [True, True], [False, False]])
    advantages = torch.tensor([1.0, 5.0, -1.0, 5.0])
    algorithm = ChunkGRPO(algo_config(ChunkGRPOConfig, clip_low=0.5))
    out = algorithm.loss(Score(log_prob=new, mask=mask), old, advantages)
    out.loss.backward()
    assert torch.count_nonzero(new.grad[~mask]) == 0 and torch.count_nonzero(new.grad[mask]) == 4
    only = algorithm.loss(Score(log_prob=new.detach()[[0, 2]]), old[[0, 2]], advantages[[0, 2]])
    assert out.loss.item() == pytest.approx(only.loss.item())


def test_each_sample_trains_its_share_of_chunks():
    plan = FlowPlan(num_steps=6, sde_steps=list(range(6)), train_units=[[0, 1], [2, 3], [4]], units_per_sample=2)
    mask = select_units(plan, 200, None, torch.Generator().manual_seed(0))
    per_unit = torch.stack([mask[:, u].all(1) for u in plan.train_units], 1)  # [200, 3]
    assert (per_unit.sum(1) == 2).all() and not mask[:, 5].any()
    assert (per_unit.float().mean(0) - 2 / 3).abs().max() < 0.12  # uniform
    weighted = FlowPlan(num_steps=6, sde_steps=list(range(6)), train_units=[[0, 1], [2, 3], [4]],
                            units_per_sample=1, unit_weighting="latent_change")
    change = torch.tensor([[0.3, 0.3, 0.0, 0.0, 0.1, 0.0]]).repeat(300, 1)  # chunk means 0.3, 0, 0.1
    picked = torch.stack([select_units(weighted, 300, change, torch.Generator().manual_seed(1))[:, u].all(1)
                          for u in weighted.train_units], 1).float().mean(0)
    assert picked[1] == 0 and abs(picked[0].item() - 0.75) < 0.08  # probability proportional to the change


def test_rollout_and_replay_of_chunks(tiny_sd3_dir):
    policy = SD3Policy(SD3Config(pretrained=tiny_sd3_dir, resolution=32, num_steps=4, guidance_scale=1.0, lora_rank=4,
                                 max_sequence_length=16))
    algorithm = ChunkGRPO(algo_config(ChunkGRPOConfig, chunks=[1, 2], timestep_fraction=0.5, weighting="latent_change"))
    plan = algorithm.schedule(4, torch.Generator().manual_seed(0))
    rollout = policy.sample(PromptBatch(PROMPTS).repeat(4), plan, generator=torch.Generator().manual_seed(2))
    trained = torch.stack([rollout.mask[:, u].all(1) for u in plan.train_units], 1)  # [8, 2]
    assert (trained.sum(1) == 1).all() and not rollout.mask[:, 3].any()
    with torch.no_grad():
        for p in policy.trainable_parameters():
            p.add_(0.01 * torch.randn_like(p))  # off-policy: ratios differ from 1
    for unit in plan.train_units:
        new = policy.log_prob(rollout, unit)
        assert torch.equal(new.mask, rollout.mask[:, unit])
        rows = new.mask.all(1)
        out = algorithm.loss(new, rollout.old_log_probs[:, unit], torch.ones(8), None)
        step_ratios = torch.exp(new.log_prob.detach() - rollout.old_log_probs[:, unit])[rows]  # [r, k]
        expected = (step_ratios.prod(1) ** (1 / len(unit))).mean()
        assert out.metrics["ratio_mean"] == pytest.approx(expected.item(), rel=1e-5)
        assert abs(out.metrics["ratio_mean"] - 1) > 1e-6


def test_a_chunk_no_sample_trains_gives_a_zero_loss_connected_to_the_graph():
    new = torch.full((2, 2), 0.3, requires_grad=True)
    out = ChunkGRPO(ChunkGRPOConfig()).loss(Score(log_prob=new, mask=torch.zeros(2, 2, dtype=torch.bool)),
                                            torch.zeros(2, 2), torch.ones(2))
    out.loss.backward()  # every process runs the same backward, even with nothing to train
    assert out.loss.item() == 0 and torch.count_nonzero(new.grad) == 0 and out.metrics["ratio_mean"] == 1.0
