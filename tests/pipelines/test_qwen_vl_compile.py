"""The compiled decode step of the Qwen-VL adapter (``pipeline.compile_decode``, `pipelines/_qwen_vl_compile.py`) on a
tiny real-class Qwen2-VL: the same tokens, masks and (to float32 rounding) log-probs as eager decoding for the same
generator, before and after an in-place weight update; the recorded log-probs replay with an on-policy ratio of 1;
Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE (LoRA) draw the eager tokens too; and the option is refused, before any weight
loads, where the step does not compile."""

import pytest
import torch

import mmgrpo.pipelines._qwen_vl_decode as decode_module
from mmgrpo.algorithms.grpo import GRPO, GRPOConfig
from mmgrpo.components import score_unit
from mmgrpo.pipelines.qwen_vl import QwenVLConfig
from mmgrpo.plans import TokenPlan
from mmgrpo.validation import ConfigError
from builders._qwen_vl_batches import vision_batch, vl_policy


def sample_eager_and_compiled(pol, group_size: int, seed: int, monkeypatch):
    """The rollouts of the same prompts and generator, decoded eagerly and compiled; the number of compiled steps."""
    plan = TokenPlan(num_steps=pol.num_steps, train_units=[list(range(pol.num_steps))])
    calls = []
    compiled = decode_module.compiled_token_logits

    def counted(*args):
        calls.append(1)
        return compiled(*args)

    rollouts = []
    with monkeypatch.context() as patch:
        patch.setattr(decode_module, "compiled_token_logits", counted)
        for on in (False, True):
            pol.config.compile_decode = on
            rollouts.append(pol.sample(vision_batch(group_size), plan, generator=torch.Generator().manual_seed(seed)))
    return *rollouts, len(calls)


def assert_same_rollout(eager, compiled) -> None:
    assert torch.equal(compiled.trajectory["completion_ids"], eager.trajectory["completion_ids"])
    assert torch.equal(compiled.mask, eager.mask)
    torch.testing.assert_close(compiled.old_log_probs, eager.old_log_probs, rtol=0, atol=1e-5)


def test_compiled_decode_equals_eager_and_replays_at_ratio_one(request, monkeypatch):
    pol = vl_policy(request, "tiny_qwen2_vl_dir", max_new_tokens=6, lora_rank=0)
    head = pol.model.lm_head
    bias = torch.zeros(head.out_features)
    bias[pol.stop_ids] = 5.0  # rows end at different steps (about 1 in 4 per step)
    head.bias = torch.nn.Parameter(bias, requires_grad=False)
    eager, compiled, calls = sample_eager_and_compiled(pol, group_size=2, seed=3, monkeypatch=monkeypatch)
    assert calls > 0  # the compiled step ran
    assert pol.model.config.text_config._attn_implementation == "sdpa"  # the decode attention was switched back
    lengths = compiled.mask.sum(dim=1)
    assert lengths.min() < pol.num_steps and lengths.max() > 1
    assert_same_rollout(eager, compiled)
    # the old log-probs are the decode's: the training forward replays them at ratio 1
    algorithm = GRPO(GRPOConfig())
    new, old, _ = score_unit(pol, algorithm, compiled, list(range(pol.num_steps)), torch.device("cpu"))
    torch.testing.assert_close(new.log_prob.detach()[new.mask], old[new.mask], rtol=0, atol=1e-5)
    assert algorithm.loss(new, old, torch.ones(len(compiled)), None).metrics["ratio_mean"] == pytest.approx(1, abs=1e-5)
    # an optimizer-like in-place update is read by the next compiled rollout (no recompilation: the same shapes)
    with torch.no_grad():
        for param in pol.model.model.language_model.parameters():
            param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(param.numel())) * 0.05)
        replayed = pol.log_prob(compiled, list(range(pol.num_steps))).log_prob  # [6, S]
    assert (replayed - compiled.old_log_probs)[compiled.mask].abs().max() > 1e-2  # the update moves the policy
    eager_after, compiled_after, _ = sample_eager_and_compiled(pol, group_size=2, seed=5, monkeypatch=monkeypatch)
    assert_same_rollout(eager_after, compiled_after)
    # a rollout that fails part-way sets the model's attention back all the same
    draws, choose = [], decode_module.TokenSampler.__call__

    def failing(sampler, logp):
        draws.append(1)
        if len(draws) == 3:
            raise RuntimeError("draw failed")
        return choose(sampler, logp)

    monkeypatch.setattr(decode_module.TokenSampler, "__call__", failing)
    with pytest.raises(RuntimeError, match="draw failed"):
        pol.sample(vision_batch(2), TokenPlan(num_steps=6, train_units=[list(range(6))]),
                   generator=torch.Generator().manual_seed(6))
    assert pol.model.config.text_config._attn_implementation == "sdpa"


@pytest.mark.parametrize("fixture", ["tiny_qwen2_5_vl_dir", "tiny_qwen3_vl_dir", "tiny_qwen3_vl_moe_dir"])
def test_every_compiled_family_draws_the_eager_tokens(request, monkeypatch, fixture):
    from torch._dynamo.utils import counters

    pol = vl_policy(request, fixture, max_new_tokens=5)  # LoRA
    graphs = counters["stats"]["unique_graphs"]
    eager, compiled, calls = sample_eager_and_compiled(pol, group_size=2, seed=4, monkeypatch=monkeypatch)
    assert calls > 0 and counters["stats"]["unique_graphs"] > graphs  # this model's step compiled (not run eagerly)
    assert_same_rollout(eager, compiled)


def test_compile_decode_refused_where_the_step_does_not_compile(request):
    with pytest.raises(ConfigError, match="compile_decode takes the families"):
        QwenVLConfig(pretrained=request.getfixturevalue("tiny_qwen3_5_dir"), compile_decode=True)
    with pytest.raises(ConfigError, match="compile_decode needs attn_implementation"):
        QwenVLConfig(pretrained=request.getfixturevalue("tiny_qwen2_vl_dir"), compile_decode=True,
                     attn_implementation="flash_attention_2")
    QwenVLConfig(pretrained=request.getfixturevalue("tiny_qwen2_vl_dir"), compile_decode=True)
