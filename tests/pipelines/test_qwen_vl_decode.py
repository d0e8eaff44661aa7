"""The lean decode loop of the Qwen-VL adapter (`pipelines/_qwen_vl_decode.py`) on tiny real-class models: its tokens,
log-probs and masks equal those of the loop through the model's forward (the path of sharded models), for every family
(static cache; Qwen3.5's dynamic hybrid cache), with rows ending at different steps; the recorded log-probs equal a
naive full forward of prompt + completion; and the token sampler draws from the truncated policy."""

from functools import partial

import pytest
import torch

import mmgrpo.pipelines.qwen_vl as qwen_vl
from mmgrpo.pipelines._qwen_vl_decode import LeanStep, TokenSampler, lean_supported
from mmgrpo.plans import TokenPlan
from builders._qwen_vl_batches import vision_batch, vl_policy

FAMILIES = ["tiny_qwen2_vl_dir", "tiny_qwen2_5_vl_dir", "tiny_qwen3_vl_dir", "tiny_qwen3_5_dir"]
policy = partial(vl_policy, max_new_tokens=7)


def end_often(pol) -> None:
    """Gives the LM head a bias towards the end-of-turn tokens (about 1 in 4 per step), so that rows end at different
    steps (a random tiny model rarely draws them)."""
    head = pol.model.lm_head
    bias = torch.zeros(head.out_features)
    bias[pol.stop_ids] = 5.0
    head.bias = torch.nn.Parameter(bias, requires_grad=False)


def sample_both(pol, monkeypatch, plan, seed: int):
    """The rollout of the lean loop and of the loop through the model's forward, same prompts and generator."""
    lean = pol.sample(vision_batch(3), plan, generator=torch.Generator().manual_seed(seed))
    with monkeypatch.context() as patch:
        patch.setattr(qwen_vl, "lean_supported", lambda model: False)  # the loop a sharded model runs
        through_model = pol.sample(vision_batch(3), plan, generator=torch.Generator().manual_seed(seed))
    return lean, through_model


@pytest.mark.parametrize("fixture", FAMILIES)
def test_lean_loop_equals_the_loop_through_the_model_and_the_naive_forward(request, fixture, monkeypatch):
    pol = policy(request, fixture)
    assert lean_supported(pol.model)
    plan = TokenPlan(num_steps=pol.num_steps, train_units=[list(range(pol.num_steps))])
    end_often(pol)
    lean, through_model = sample_both(pol, monkeypatch, plan, seed=4)
    lengths = lean.mask.sum(dim=1)
    assert lengths.min() < pol.num_steps and lengths.max() > 1  # rows end at different steps
    assert torch.equal(lean.trajectory["completion_ids"], through_model.trajectory["completion_ids"])
    assert torch.equal(lean.mask, through_model.mask)
    torch.testing.assert_close(lean.old_log_probs, through_model.old_log_probs, rtol=0, atol=1e-5)
    assert lean.outputs["texts"] == through_model.outputs["texts"]
    # after the end: pad tokens, log-prob 0
    assert (lean.trajectory["completion_ids"][~lean.mask] == pol.pad_id).all()
    assert (lean.old_log_probs[~lean.mask] == 0).all()
    # the recorded log-probs are the policy's: every sample forwarded whole, prompt + completion, images included
    pol.config.prefix_sharing = False
    with torch.no_grad():
        naive = pol.log_prob(lean, list(range(pol.num_steps)))
    torch.testing.assert_close(naive.log_prob[lean.mask], lean.old_log_probs[lean.mask], rtol=0, atol=1e-5)


def test_greedy_lean_loop_equals_the_loop_through_the_model(request, monkeypatch):
    pol = policy(request, "tiny_qwen2_5_vl_dir", lora_rank=0)
    plan = TokenPlan.deterministic(pol.num_steps)
    end_often(pol)
    lean, through_model = sample_both(pol, monkeypatch, plan, seed=0)
    assert lean.mask.sum(dim=1).min() < pol.num_steps
    assert torch.equal(lean.trajectory["completion_ids"], through_model.trajectory["completion_ids"])
    torch.testing.assert_close(lean.old_log_probs, through_model.old_log_probs, rtol=0, atol=1e-5)


def test_static_cache_holds_the_prompt_then_each_token_in_place(request):
    """The static buffers are allocated once (P + S - 1 positions) and written in place by every step."""
    pol = policy(request, "tiny_qwen2_vl_dir")
    from mmgrpo.pipelines._qwen_vl_forward import collate_prompts, unique_rows

    unique, inverse = unique_rows(pol._encode_batch(vision_batch(2)))
    module = pol.switch.module
    with torch.no_grad():
        states = module.prompt_states(collate_prompts(unique, pol.pad_id, pol.device))
        _, cache, prompt_mask, start = states.expand(inverse)
        prompt_keys = cache.layers[0].keys.clone()  # [N, heads, P, d]
        step = LeanStep(pol.model, cache, prompt_mask, start, steps=5)
        buffer = step.cache.layers[0].keys
        assert buffer.shape[2] == prompt_mask.shape[1] + 4
        pointer = buffer.data_ptr()
        for t in range(4):
            step(torch.full((len(inverse),), 7), t)
        assert step.cache.layers[0].keys.data_ptr() == pointer
        torch.testing.assert_close(buffer[:, :, : prompt_mask.shape[1]], prompt_keys, rtol=0, atol=0)
        assert buffer[:, :, prompt_mask.shape[1]:].abs().sum(dim=(1, 3)).gt(0).all()  # every step wrote its key


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sampler_exponentials_are_exponential_s_numbers(dtype):
    """On the CPU the race's exponentials equal exponential_'s (float32: computed from the uniforms it reads), and the
    generator is left in the same state."""
    probs = torch.rand(100, 100_000 if dtype == torch.float32 else 1000, dtype=dtype)  # 10^7 float32 draws
    ours, theirs = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    sampler = TokenSampler(greedy=False, top_k=0, top_p=1.0, generator=ours)
    for _ in range(2):
        expected = torch.empty(probs.shape, dtype=dtype).exponential_(generator=theirs)
        assert torch.equal(sampler.exponentials(probs), expected)
    assert torch.equal(ours.get_state(), theirs.get_state())


def test_sampler_draws_the_truncated_policy_as_torch_multinomial():
    probs = torch.tensor([0.0, 0.1, 0.2, 0.0, 0.3, 0.4])  # zeros: excluded tokens (vision tokens: -inf logits)
    n = 20000
    logp = probs.log().expand(n, -1)

    def draw(seed, **options):
        options = {"top_k": 0, "top_p": 1.0, **options}
        return TokenSampler(greedy=False, generator=torch.Generator().manual_seed(seed), **options)(logp)

    tokens = draw(0)
    assert torch.equal(tokens, torch.multinomial(logp.exp(), 1, generator=torch.Generator().manual_seed(0))[:, 0])
    counts = torch.bincount(tokens, minlength=6).float() / n
    assert counts[0] == 0 and counts[3] == 0
    assert (counts - probs).abs().max() < 0.015  # ~4 standard errors at n = 20000
    top2 = draw(1, top_k=2)
    assert set(top2.tolist()) == {4, 5} and abs((top2 == 5).float().mean().item() - 4 / 7) < 0.015
    assert set(draw(2, top_p=0.5).tolist()) == {4, 5}  # 0.4 < 0.5: the second most likely token completes the nucleus
    greedy = TokenSampler(greedy=True, top_k=0, top_p=1.0, generator=None)
    assert (greedy(logp[:3]) == 5).all()
