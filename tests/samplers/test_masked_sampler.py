"""The masked-diffusion decoding math refuses what it cannot decode (property tests): over the valid domain a schedule
decodes every token and a step commits what it should with finite log-probabilities; outside it, a ValueError naming
the argument, never a silent NaN or a completion that stays masked."""

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from mmgrpo.samplers.masked_diffusion import eoser_gamma, make_schedule, token_log_probs, unmask_step

PROPERTY = settings(derandomize=True, max_examples=60, deadline=None)
MASK = 99  # the mask id of the states below (outside the vocabulary of the logits)


@st.composite
def valid_schedules(draw):
    block = draw(st.integers(1, 16))
    blocks = draw(st.integers(1, 4))
    return block * blocks, block, draw(st.integers(1, block)), draw(st.sampled_from(["fixed", "ass"]))


@PROPERTY
@given(args=valid_schedules())
def test_valid_schedules_decode_every_token(args):
    gen_length, block_length, steps_per_block, kind = args
    schedule = make_schedule(gen_length, block_length, steps_per_block, kind)
    assert sum(schedule.tokens_per_step) == gen_length and min(schedule.tokens_per_step) >= 1
    for block in range(gen_length // block_length):  # each block's steps decode exactly that block
        assert sum(k for b, k in zip(schedule.block_of_step, schedule.tokens_per_step) if b == block) == block_length


@PROPERTY
@given(gen_length=st.integers(-4, 40), block_length=st.integers(-4, 40), steps=st.integers(-2, 40),
       kind=st.sampled_from(["fixed", "ass", "linear"]))
def test_any_schedule_is_refused_or_decodes_every_token(gen_length, block_length, steps, kind):
    try:
        schedule = make_schedule(gen_length, block_length, steps, kind)
    except ValueError:
        return
    assert sum(schedule.tokens_per_step) == gen_length >= 1 and min(schedule.tokens_per_step) >= 1


@pytest.mark.parametrize("args,match", [
    ((0, 1, 1, "fixed"), "gen_length 0"),  # nothing to decode: an empty schedule
    ((10, 4, 2, "fixed"), "multiple of block_length"),  # blocks that do not divide the completion
    ((8, 0, 1, "fixed"), "multiple of block_length"),
    ((8, 4, 5, "fixed"), "cannot decode 4 tokens"),  # more steps than tokens: steps that commit nothing
    ((8, 4, 0, "fixed"), "cannot decode 4 tokens"),
])
def test_schedules_that_cannot_decode_are_refused(args, match):
    with pytest.raises(ValueError, match=match):
        make_schedule(*args)


def _step_inputs(seed: int, scale: float, n: int = 3, length: int = 6, vocab: int = 5):
    g = torch.Generator().manual_seed(seed)
    logits = scale * torch.randn(n, length, vocab, generator=g)  # [n, T, V]
    candidates = torch.rand(n, length, generator=g) < 0.6  # [n, T]
    state = torch.where(candidates, torch.full((n, length), MASK), torch.randint(0, vocab, (n, length), generator=g))
    return logits, state, candidates


@PROPERTY
@given(seed=st.integers(0, 2**16), scale=st.floats(1e-3, 1e3), k=st.integers(1, 6),
       temperature=st.one_of(st.just(0.0), st.floats(1e-2, 10.0)), remasking=st.sampled_from(["low_confidence", "random"]),
       eos_gamma=st.floats(0.0, 2.0))
def test_valid_unmask_steps_commit_k_tokens_with_finite_log_probs(seed, scale, k, temperature, remasking, eos_gamma):
    logits, state, candidates = _step_inputs(seed, scale)
    out = unmask_step(logits, state, candidates, k, temperature=temperature, remasking=remasking, eos_ids=[1],
                      eos_gamma=eos_gamma, generator=torch.Generator().manual_seed(seed))
    assert torch.equal(out.committed.sum(1), candidates.sum(1).clamp(max=k))  # min(k, candidates) per row
    assert not bool((out.committed & ~candidates).any())
    assert torch.equal(out.state[~out.committed], state[~out.committed])
    assert bool((out.state[out.committed] != MASK).all()) and bool(torch.isfinite(out.log_prob).all())
    assert bool(torch.isfinite(token_log_probs(logits, out.state.clamp(max=4), temperature)).all())


@PROPERTY
@given(seed=st.integers(0, 2**16), k=st.integers(-2, 4),
       temperature=st.one_of(st.floats(-1.0, 2.0), st.sampled_from([0.0, 1e-40, float("nan"), float("inf")])),
       poison=st.sampled_from([None, float("nan"), float("inf")]), eos_gamma=st.floats(-1.0, 2.0))
def test_any_unmask_step_is_refused_or_finite(seed, k, temperature, poison, eos_gamma):
    """Arbitrary k, temperatures (also ones that overflow logits of scale 100), NaN / inf logits, EOSER factors: a
    ValueError, or a step that commits ``min(k, candidates)`` tokens with finite log-probabilities."""
    logits, state, candidates = _step_inputs(seed, 100.0)
    if poison is not None:
        logits[0, 0, 0] = poison
    try:
        out = unmask_step(logits, state, candidates, k, temperature=temperature, remasking="low_confidence",
                          eos_ids=[1], eos_gamma=eos_gamma, generator=torch.Generator().manual_seed(seed))
    except ValueError:
        return
    assert k >= 1 and torch.equal(out.committed.sum(1), candidates.sum(1).clamp(max=k))
    assert bool(torch.isfinite(out.log_prob).all())


@pytest.mark.parametrize("kwargs,match", [
    (dict(k=0), "k, the tokens a step commits"),  # zero tokens to unmask: the completion would stay masked
    (dict(temperature=-1.0), "temperature must be"),
    (dict(temperature=float("nan")), "temperature must be"),
    (dict(temperature=1e-40), "too small for these logits"),  # logits / temperature overflows: softmax NaN
    (dict(remasking="top_k"), "remasking"),
    (dict(eos_gamma=-0.5), "eos_gamma"),
])
def test_unmask_steps_that_would_be_nan_are_refused(kwargs, match):
    logits, state, candidates = _step_inputs(0, 10.0)
    args = {"k": 2, "temperature": 1.0, "remasking": "low_confidence", "eos_ids": [1], **kwargs}
    with pytest.raises(ValueError, match=match):
        unmask_step(logits, state, candidates, args.pop("k"), **args)


def test_nan_logits_are_refused_and_ruled_out_tokens_are_not():
    logits, state, candidates = _step_inputs(0, 1.0)
    logits[..., 3] = -math.inf  # a token the model rules out everywhere: allowed, never sampled
    out = unmask_step(logits, state, candidates, 2, temperature=1.0, remasking="random",
                      generator=torch.Generator().manual_seed(0))
    assert not bool((out.state[out.committed] == 3).any()) and bool(torch.isfinite(out.log_prob).all())
    logits[1, 2, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        token_log_probs(logits, state.clamp(max=4))


@PROPERTY
@given(num_steps=st.integers(1, 12), data=st.data(), kind=st.sampled_from(["linear", "power"]),
       low=st.floats(0.0, 1.0), high=st.floats(0.0, 1.0))
def test_eoser_factor_is_finite_between_its_bounds(num_steps, data, kind, low, high):
    step = data.draw(st.integers(0, num_steps - 1))
    gamma = eoser_gamma(step, num_steps, low, high, kind)
    assert math.isfinite(gamma) and min(low, high) - 1e-12 <= gamma <= max(low, high) + 1e-12


@pytest.mark.parametrize("args,match", [
    ((5, 5, 0.1, 1.0, "linear"), "step must be in"),
    ((-1, 5, 0.1, 1.0, "linear"), "step must be in"),
    ((0, 0, 0.1, 1.0, "power"), "step must be in"),
    ((0, 5, float("nan"), 1.0, "linear"), "gamma_min and gamma_max"),
])
def test_eoser_refuses_steps_outside_the_decoding(args, match):
    with pytest.raises(ValueError, match=match):
        eoser_gamma(*args)
