"""``pipeline.gradient_checkpointing`` of every adapter on its tiny real-class model: the replayed log-probabilities
and the gradient of a loss on them are those of the same policy without checkpointing, and the option really
checkpoints (a layer inside the first transformer block runs again in the backward pass, once per forward).

Both policies of a comparison start from the same seed (the same LoRA initialisation) and run in eval mode (no
dropout), so the only difference is the recomputation."""

import pytest
import torch
from PIL import Image

from mmgrpo import sharding
from mmgrpo.types import PromptBatch
from mmgrpo.validation import ConfigError

PROMPTS = ["a red circle", "two blue squares", "a green triangle"]


def flow_case(name: str, lora: bool):
    import importlib

    from mmgrpo.algorithms.flow_grpo import FlowGRPO, FlowGRPOConfig

    module = importlib.import_module(f"mmgrpo.pipelines.{name}")
    policy_cls, config_cls = {"sd3": ("SD3Policy", "SD3Config"), "flux": ("FluxPolicy", "FluxConfig")}[name]
    options = dict(resolution=32, num_steps=3, lora_rank=4 if lora else 0, lora_alpha=8, max_sequence_length=16)
    if name == "sd3":
        options["guidance_scale"] = 1.0

    def make(path, checkpointing):
        return getattr(module, policy_cls)(getattr(module, config_cls)(
            pretrained=path, gradient_checkpointing=checkpointing, **options))

    return make, PromptBatch(PROMPTS).repeat(2), FlowGRPO(FlowGRPOConfig()).schedule(3), [0, 2]


def qwen_vl_case(lora: bool):
    from mmgrpo.algorithms.grpo import GRPO, GRPOConfig
    from mmgrpo.pipelines.qwen_vl import QwenVLConfig, QwenVLPolicy

    options = dict(max_new_tokens=5, lora_rank=4 if lora else 0, lora_alpha=8, prefix_sharing=False,
                   freeze_vision=lora)  # full fine-tuning trains (and checkpoints) the vision blocks too

    def make(path, checkpointing):
        return QwenVLPolicy(QwenVLConfig(pretrained=path, gradient_checkpointing=checkpointing, **options))

    images = [Image.new("RGB", (56, 56), (255, 0, 0)), None, Image.new("RGB", (64, 56), (0, 0, 255))]
    batch = PromptBatch(["how many circles?", "say yes", "what colour?"], conditions={"images": images}).repeat(2)
    return make, batch, GRPO(GRPOConfig()).schedule(5), list(range(5))


def mdlm_case(lora: bool):
    from mmgrpo.algorithms.cj_grpo import CJGRPO, CJGRPOConfig
    from mmgrpo.pipelines.mdlm import MDLMConfig, MDLMPolicy

    options = dict(gen_length=8, block_length=4, steps_per_block=2, lora_rank=4 if lora else 0, lora_alpha=8)

    def make(path, checkpointing):
        return MDLMPolicy(MDLMConfig(pretrained=path, gradient_checkpointing=checkpointing, **options))

    plan = CJGRPO(CJGRPOConfig()).schedule(4, torch.Generator().manual_seed(0))
    return make, PromptBatch(["12+34=", "7+8=", "305+9="]).repeat(2), plan, [0, 1, 3]


CASES = {  # name -> (tiny model fixture, case builder)
    "sd3_lora": ("tiny_sd3_dir", lambda: flow_case("sd3", lora=True)),
    "sd3_full": ("tiny_sd3_dir", lambda: flow_case("sd3", lora=False)),
    "flux_lora": ("tiny_flux_dir", lambda: flow_case("flux", lora=True)),
    "qwen_vl_lora": ("tiny_qwen2_vl_dir", lambda: qwen_vl_case(lora=True)),
    "qwen_vl_full": ("tiny_qwen2_vl_dir", lambda: qwen_vl_case(lora=False)),
    "mdlm_lora": ("tiny_mdlm_dir", lambda: mdlm_case(lora=True)),
    "mdlm_full": ("tiny_mdlm_dir", lambda: mdlm_case(lora=False)),
}


def trained_module(policy) -> torch.nn.Module:
    return next(iter(policy.trainable_modules().values()))


def replay(policy, batch, plan, steps):
    """Log-probs `[n, k]` of a rollout's `steps`, the gradients of a weighted sum of them, and the calls of the first
    linear layer of the first block during the forward and during forward + backward."""
    torch.manual_seed(1)
    rollout = policy.sample(batch, plan, generator=torch.Generator().manual_seed(0))
    block = sharding.find_blocks(trained_module(policy))[0]
    linear = next(m for m in block.modules() if isinstance(m, torch.nn.Linear))
    calls = []
    hook = linear.register_forward_hook(lambda *args: calls.append(1))
    score = policy.log_prob(rollout, steps)
    forward_calls = len(calls)
    weights = torch.linspace(-1, 1, score.log_prob.numel()).view_as(score.log_prob)  # [n, k]
    mask = score.mask if score.mask is not None else torch.ones_like(score.log_prob, dtype=torch.bool)
    (score.log_prob * weights)[mask].sum().backward()
    hook.remove()
    grads = [p.grad.clone() for p in policy.trainable_parameters()]
    return score.log_prob.detach(), grads, forward_calls, len(calls)


@pytest.mark.parametrize("case", list(CASES))
def test_checkpointing_recomputes_blocks_with_the_same_gradient(request, case):
    fixture, build = CASES[case]
    make, batch, plan, steps = build()
    path = request.getfixturevalue(fixture)
    results = {}
    for checkpointing in (False, True):
        torch.manual_seed(0)  # the same LoRA initialisation in both policies
        results[checkpointing] = replay(make(path, checkpointing), batch, plan, steps)
    (plain_lp, plain_grads, plain_fwd, plain_all), (ckpt_lp, ckpt_grads, ckpt_fwd, ckpt_all) = results[0], results[1]
    assert plain_fwd > 0 and plain_all == plain_fwd  # without checkpointing, nothing runs again
    assert ckpt_fwd == plain_fwd and ckpt_all == 2 * ckpt_fwd  # each forward of the block, recomputed once
    torch.testing.assert_close(ckpt_lp, plain_lp, rtol=0, atol=1e-6)
    assert len(plain_grads) == len(ckpt_grads) and any(g.abs().max() > 0 for g in plain_grads)
    for plain, ckpt in zip(plain_grads, ckpt_grads):
        torch.testing.assert_close(ckpt, plain, rtol=1e-5, atol=1e-7)


def test_option_turns_the_models_flags_on(tiny_sd3_dir, tiny_qwen2_vl_dir, tiny_mdlm_dir):
    make, *_ = flow_case("sd3", lora=True)
    assert make(tiny_sd3_dir, True).transformer.gradient_checkpointing
    assert not make(tiny_sd3_dir, False).transformer.gradient_checkpointing
    make, *_ = qwen_vl_case(lora=True)
    policy = make(tiny_qwen2_vl_dir, True)
    assert policy.model.is_activation_checkpointing and not policy.model.training  # the model stays in eval mode
    assert not make(tiny_qwen2_vl_dir, False).model.is_activation_checkpointing
    make, *_ = mdlm_case(lora=True)
    assert make(tiny_mdlm_dir, True).model.get_base_model().is_activation_checkpointing


def test_qwen_vl_refuses_checkpointing_with_prefix_sharing(tiny_qwen2_vl_dir):
    from mmgrpo.pipelines.qwen_vl import QwenVLConfig

    with pytest.raises(ConfigError, match="gradient_checkpointing needs prefix_sharing: false"):
        QwenVLConfig(pretrained=tiny_qwen2_vl_dir, gradient_checkpointing=True)
