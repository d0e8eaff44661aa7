"""RL correctness of the SD3 adapter with Flow-GRPO, on real diffusers classes built from tiny configs: checks run on
SD3 only (the checks shared with FLUX are in `test_flow_image_policies.py`)."""

import torch

from mmgrpo.algorithms.flow_grpo import FlowGRPO, FlowGRPOConfig
from mmgrpo.pipelines.sd3 import SD3Config, SD3Policy
from mmgrpo.types import PromptBatch
from algorithm_options import algo_config

PROMPTS = ["a red circle", "two blue squares", "a green triangle left of a yellow circle"]


def make_policy(path, **overrides):
    options = dict(pretrained=path, resolution=32, num_steps=4, guidance_scale=1.0, lora_rank=4, max_sequence_length=16)
    options.update(overrides)
    return SD3Policy(SD3Config(**options))


def test_window_plan_marks_only_window_steps(tiny_sd3_dir):
    policy = make_policy(tiny_sd3_dir)
    plan = FlowGRPO(algo_config(FlowGRPOConfig, sde_window_size=2, sde_window_range=[1, 3])).schedule(4, torch.Generator().manual_seed(0))
    rollout = policy.sample(PromptBatch(PROMPTS[:2]).repeat(2), plan, generator=torch.Generator().manual_seed(0))
    assert rollout.mask.sum(1).tolist() == [2] * 4
    ode = [i for i in range(4) if i not in plan.sde_steps]
    assert torch.equal(rollout.old_log_probs[:, ode], torch.zeros(4, len(ode)))


def test_gradient_accumulation_1x4_equals_4x1(tiny_sd3_dir):
    policy = make_policy(tiny_sd3_dir)
    algorithm = FlowGRPO(algo_config(FlowGRPOConfig, clip_low=0.2))
    plan = algorithm.schedule(4)
    rollout = policy.sample(PromptBatch(PROMPTS[:2]).repeat(2), plan, generator=torch.Generator().manual_seed(0))
    advantages = torch.tensor([1.0, -0.5, 2.0, -1.0])
    params = policy.trainable_parameters()

    def accumulate(chunks):
        for p in params:
            p.grad = None
        for index in torch.arange(4).split(4 // chunks):
            sub = rollout.select(index)
            out = algorithm.loss(policy.log_prob(sub, [2]), sub.old_log_probs[:, [2]], advantages[index], None)
            (out.loss * len(index) / 4).backward()
        return [p.grad.clone() for p in params]

    for a, b in zip(accumulate(1), accumulate(4)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)
