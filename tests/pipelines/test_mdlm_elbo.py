"""GDPO's semi-deterministic Monte Carlo ELBO on the `mdlm` pipeline (`pipelines/_mdlm_elbo.py`), against the formula
written out with plain loops on a tiny model."""

import math

import pytest
import torch

from mmgrpo.algorithms.gdpo import GDPO, GDPOConfig
from mmgrpo.pipelines import _mdlm_elbo
from mmgrpo.components import score_unit
from mmgrpo.types import PromptBatch
from mmgrpo.plans import MaskedPlan
from algorithm_options import algo_config

PROMPTS = ["12+34=", "7+8=", "305+9="]  # different lengths: left padding and an attention mask are exercised
# Gauss-Legendre on (0, 1), written out: nodes 1/2 -+ 1/(2 sqrt 3) with weights 1/2; 1/2 -+ sqrt(3/5)/2, 1/2 with 5/18,
# 8/18, 5/18
RULES = {
    1: ([0.5], [1.0]),
    2: ([0.5 - 0.5 / math.sqrt(3), 0.5 + 0.5 / math.sqrt(3)], [0.5, 0.5]),
    3: ([0.5 - 0.5 * math.sqrt(0.6), 0.5, 0.5 + 0.5 * math.sqrt(0.6)], [5 / 18, 8 / 18, 5 / 18]),
}


def _policy(path, **overrides):
    from mmgrpo.pipelines.mdlm import MDLMConfig, MDLMPolicy

    options = dict(pretrained=path, gen_length=6, steps_per_block=3, lora_rank=0)
    return MDLMPolicy(MDLMConfig(**{**options, **overrides}))


def _sample(policy, algorithm, seed=1):
    plan = algorithm.schedule(policy.num_steps, torch.Generator().manual_seed(0))
    return plan, policy.sample(PromptBatch(PROMPTS).repeat(2), plan, generator=torch.Generator().manual_seed(seed))


def _hand_log_probs(policy, prompt, attention, completion, hidden) -> list[float]:
    """log pi(y^i | y with `hidden` positions masked, prompt) for each completion position, one row, plain torch."""
    state = torch.cat([prompt, torch.where(hidden, torch.tensor(policy.mask_id), completion)])[None]
    full_attention = torch.cat([attention, torch.ones(len(completion), dtype=torch.bool)])[None].long()
    with torch.no_grad():
        logits = policy.model(input_ids=state, attention_mask=full_attention).logits[0, len(prompt):].float()
    logits[:, policy.mask_id] = float("-inf")  # the pipeline never predicts the mask token
    log_probs = torch.log_softmax(logits, -1)
    return [float(log_probs[i, completion[i]]) for i in range(len(completion))]


@pytest.mark.parametrize("points", [1, 2, 3])
def test_quadrature_is_gauss_legendre_on_the_unit_interval(points):
    times, weights = _mdlm_elbo.quadrature(points)
    nodes, expected = RULES[points]
    torch.testing.assert_close(times, torch.tensor(nodes, dtype=torch.float64))
    torch.testing.assert_close(weights, torch.tensor(expected, dtype=torch.float64))
    for degree in range(2 * points):  # exact for polynomials of degree < 2 * points
        assert float((weights * times**degree).sum()) == pytest.approx(1 / (degree + 1), abs=1e-12)


@pytest.mark.parametrize(("points", "masks", "masking"), [(2, 1, "count"), (3, 2, "count"), (2, 2, "bernoulli")])
def test_recorded_elbo_equals_the_formula_with_plain_loops(tiny_mdlm_dir, points, masks, masking):
    """Sampling records, per draw, sum_n w_n / K sum_k c_nk sum_{i masked} log pi(y^i | masked input): the masks have
    the stated size (count) or lie within the scored tokens (bernoulli), and the value is the formula's."""
    policy = _policy(tiny_mdlm_dir, elbo_points=points, elbo_masks=masks, elbo_masking=masking)
    plan, rollout = _sample(policy, GDPO(algo_config(GDPOConfig, draws=2)))
    t = rollout.trajectory
    nodes, node_weights = RULES[points]
    for row in range(len(rollout)):
        completion = t["completion"][row]
        tokens = completion.tolist()
        eos = next((i for i, token in enumerate(tokens) if token in policy.eos_ids), len(tokens) - 1)
        scored = [i <= eos for i in range(len(tokens))]  # up to and including the first EOS
        n_scored = sum(scored)
        for draw in range(2):
            total = 0.0
            for n, (time, weight) in enumerate(zip(nodes, node_weights)):
                for k in range(masks):
                    hidden = t["elbo_masked"][row, draw, n * masks + k]
                    assert all(scored[i] for i in range(len(tokens)) if hidden[i])
                    if masking == "count":
                        size = min(max(math.floor(time * n_scored + 0.5), 1), n_scored)
                        assert int(hidden.sum()) == size
                        c = n_scored / size
                    else:
                        c = 1 / time
                    log_probs = _hand_log_probs(policy, t["prompt_ids"][row], t["prompt_attention"][row], completion,
                                                hidden)
                    total += weight / masks * c * sum(log_probs[i] for i in range(len(tokens)) if hidden[i])
            assert float(rollout.old_log_probs[row, draw]) == pytest.approx(total, abs=1e-5)
    assert rollout.mask[:, :2].all() and not rollout.mask[:, 2:].any()


def test_masks_are_deterministic_given_the_seed_and_the_ratios_fixed():
    scored = torch.tensor([[True] * 5 + [False] * 3, [True] * 8])
    first = _mdlm_elbo.draw_masks(scored, 2, 3, 2, "count", torch.Generator().manual_seed(7))
    again = _mdlm_elbo.draw_masks(scored, 2, 3, 2, "count", torch.Generator().manual_seed(7))
    other = _mdlm_elbo.draw_masks(scored, 2, 3, 2, "count", torch.Generator().manual_seed(8))
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    assert not torch.equal(first[0], other[0])
    torch.testing.assert_close(first[1], other[1])  # the ratios (and so the weights) do not depend on the seed
    sizes = first[0].sum(-1)  # [N, D, M]: masked tokens per node, the same in every draw
    assert torch.equal(sizes[:, 0], sizes[:, 1])
    assert sizes[0, 0].tolist() == [1, 1, 3, 3, 4, 4] and sizes[1, 0].tolist() == [1, 1, 4, 4, 7, 7]
    plans = [GDPO(GDPOConfig()).schedule(4, torch.Generator().manual_seed(3)) for _ in range(2)]
    assert plans[0] == plans[1] and plans[0].likelihood == "elbo" and "elbo" in plans[0].features()


def test_one_token_elbo_is_the_exact_log_likelihood(tiny_mdlm_dir):
    """One scored token: every node masks it (weight L / k = 1), so the estimate is log pi(y | [M]) exactly."""
    policy = _policy(tiny_mdlm_dir)
    prompt, attention = policy.encode_prompts(["7+8="])
    completion = torch.tensor([[policy.tokenizer.convert_tokens_to_ids("1")]])
    masked, weights = _mdlm_elbo.draw_masks(torch.ones(1, 1, dtype=torch.bool), 1, 3, 1, "count",
                                            torch.Generator().manual_seed(0))
    with torch.no_grad():
        elbo = _mdlm_elbo.token_terms(policy, prompt, attention, completion, masked[:, 0], weights[:, 0], 1.0).sum()
    exact = _hand_log_probs(policy, prompt[0], attention[0], completion[0], torch.tensor([True]))[0]
    assert float(elbo) == pytest.approx(exact, abs=1e-6)


def test_two_token_elbo_is_a_lower_bound_of_the_any_order_likelihood(tiny_mdlm_dir):
    """Two tokens: the ELBO is the mean over the two unmasking orders of log pi(order), which is <= log of the mean
    of pi(order), the exact likelihood of decoding one random position at a time. Two Gauss-Legendre nodes mask 1 and
    2 tokens (weights 1/2 * 2/1 and 1/2 * 2/2): averaged over the two one-token masks, the estimate is that ELBO."""
    policy = _policy(tiny_mdlm_dir)
    prompt, attention = policy.encode_prompts(["12+34="])
    y = policy.tokenizer.convert_tokens_to_ids(["4", "6"])
    completion = torch.tensor(y)

    def lp(hidden):
        return _hand_log_probs(policy, prompt[0], attention[0], completion, torch.tensor(hidden))

    both = lp([True, True])
    first_then_second = both[0] + lp([False, True])[1]
    second_then_first = both[1] + lp([True, False])[0]
    elbo = (first_then_second + second_then_first) / 2
    exact = math.log((math.exp(first_then_second) + math.exp(second_then_first)) / 2)
    _, weights = _mdlm_elbo.draw_masks(torch.ones(1, 2, dtype=torch.bool), 1, 2, 1, "count",
                                       torch.Generator().manual_seed(0))
    torch.testing.assert_close(weights[0, 0], torch.tensor([1.0, 0.5]))
    estimates = []
    for one in ([True, False], [False, True]):
        masked = torch.tensor([[one, [True, True]]])  # [1, M=2, L=2]
        with torch.no_grad():
            estimates.append(float(_mdlm_elbo.token_terms(policy, prompt, attention, completion[None], masked,
                                                          weights[:, 0], 1.0).sum()))
    assert sum(estimates) / 2 == pytest.approx(elbo, abs=1e-5)
    assert elbo <= exact + 1e-6


@pytest.mark.parametrize("kl_beta", [0.0, 0.04])
def test_replay_is_consistent_and_zero_advantage_gives_zero_gradient(tiny_mdlm_dir, kl_beta):
    """Right after sampling the policy's ELBO equals the recorded one (same masks), the ratio is exactly 1, and with
    advantage 0 the gradient is 0 (with the KL to the frozen copy too: it is the policy at the start)."""
    policy = _policy(tiny_mdlm_dir, elbo_points=3, elbo_masks=2)
    algorithm = GDPO(algo_config(GDPOConfig, draws=2, kl_beta=kl_beta))
    plan, rollout = _sample(policy, algorithm)
    for unit in plan.train_units:
        new, old, ref = score_unit(policy, algorithm, rollout, unit, torch.device("cpu"))
        torch.testing.assert_close(new.log_prob.detach(), old, rtol=0, atol=1e-5)
        torch.testing.assert_close(new.token_log_prob.detach(), new.old_token_log_prob, rtol=0, atol=1e-5)
        assert (ref is not None) == (kl_beta > 0)
        out = algorithm.loss(new, old, torch.zeros(len(rollout)), ref)
        assert out.metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
        out.loss.backward()
        assert all(p.grad is None or torch.count_nonzero(p.grad) == 0 for p in policy.trainable_parameters())
        new, old, ref = score_unit(policy, algorithm, rollout, unit, torch.device("cpu"))
        algorithm.loss(new, old, torch.linspace(-1, 1, len(rollout)), ref).loss.backward()
        assert sum(float(p.grad.abs().sum()) for p in policy.trainable_parameters() if p.grad is not None) > 0
        for p in policy.trainable_parameters():
            p.grad = None


def test_a_rollout_sampled_for_another_estimator_is_not_scored_as_elbo(tiny_mdlm_dir):
    """The estimator follows the plan: a one-step plan's rollout is scored by d1's estimate, and a plan without
    likelihood scoring draws no masks."""
    policy = _policy(tiny_mdlm_dir)
    batch = PromptBatch(PROMPTS)
    one_step = policy.sample(batch, MaskedPlan(policy.num_steps, [[0]], scoring="likelihood", seed=3))
    assert "elbo_masked" not in one_step.trajectory and "prompt_masked" in one_step.trajectory
    plain = policy.sample(batch, MaskedPlan(policy.num_steps, [[0]]))
    assert "elbo_masked" not in plain.trajectory


@pytest.mark.parametrize(("key", "value", "message"), [
    ("elbo_points", 0, "elbo_points"), ("elbo_masks", 0, "elbo_masks"), ("elbo_masking", "uniform", "elbo_masking"),
])
def test_bad_elbo_options_are_refused_naming_the_key(tiny_mdlm_dir, key, value, message):
    from mmgrpo.pipelines.mdlm import MDLMConfig

    with pytest.raises(ValueError, match=message):
        MDLMConfig(pretrained=tiny_mdlm_dir, **{key: value})


def test_the_shipped_gdpo_config_trains_and_moves_the_weights(tmp_path):
    """Two trainer steps of `configs/tiny/mdlm_arith_gdpo.yaml` (shipped model, small batches): on-policy ratios,
    weights that moved, an evaluation."""
    from pathlib import Path

    from mmgrpo import config as config_mod
    from mmgrpo.metrics_log import read_records
    from mmgrpo.trainer import Trainer

    root = Path(__file__).resolve().parents[2]
    cfg = config_mod.load(root / "configs" / "tiny" / "mdlm_arith_gdpo.yaml", [
        f"output_dir={tmp_path / 'out'}", "train.max_steps=2", "train.max_seconds=0", "train.prompts_per_step=4",
        "train.minibatch_size=16", "train.updates_per_step=1", "eval.every=2", "eval.every_seconds=0",
        "eval.num_prompts=16", "checkpoint.every=2",
    ])
    trainer = Trainer(cfg)
    before = [p.detach().clone() for p in trainer.policy.trainable_parameters()]
    summary = trainer.train()
    assert summary["steps"] == 2 and "eval_score_last" in summary  # a step whose groups all tie is skipped
    trained = [r for r in read_records(tmp_path / "out" / "metrics.jsonl") if "train/ratio_mean" in r]
    assert trained and all(r["train/ratio_mean"] == pytest.approx(1.0, abs=1e-5) for r in trained)  # one update a step
    assert any(not torch.equal(a, b.detach()) for a, b in zip(before, trainer.policy.trainable_parameters()))
