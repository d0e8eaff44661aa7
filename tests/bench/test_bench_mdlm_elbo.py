"""bench/mdlm_elbo.py's exact ELBO and estimators on hand-made tables of subset log-probs (no model runs)."""

import math

import pytest
import torch


@pytest.fixture(scope="module")
def bench(load_bench):
    return load_bench("mdlm_elbo")


def _table(values: dict[tuple, float]) -> dict:
    return {frozenset(): 0.0, **{frozenset(k): v for k, v in values.items()}}


def test_exact_elbo_weights_each_subset_by_its_beta_integral(bench):
    """int_0^1 t^(k-1) (1-t)^(L-k) dt = 1 / (k C(L, k)): two tokens, (a + b + c) / 2; three tokens, singles / 3,
    pairs / 6, the triple / 3."""
    two = _table({(0,): -1.0, (1,): -2.0, (0, 1): -4.0})
    assert bench.exact_elbo(two, 2) == pytest.approx((-1 - 2 - 4) / 2)
    three = _table({(0,): -1.0, (1,): -1.5, (2,): -0.5, (0, 1): -3.0, (0, 2): -2.0, (1, 2): -2.5, (0, 1, 2): -6.0})
    assert bench.exact_elbo(three, 3) == pytest.approx((-1 - 1.5 - 0.5) / 3 + (-3 - 2 - 2.5) / 6 - 6 / 3)


def test_unbiased_estimators_average_to_the_exact_elbo(bench):
    """Double Monte Carlo, LLaDA's estimator and SDMC with Bernoulli masks (two Gauss-Legendre nodes integrate the
    degree-2 integrand of three tokens exactly) average to the exact ELBO; fixed-size masks do not need to."""
    table = _table({(0,): -1.0, (1,): -1.5, (2,): -0.5, (0, 1): -3.0, (0, 2): -2.0, (1, 2): -2.5, (0, 1, 2): -6.0})
    exact = bench.exact_elbo(table, 3)
    values = bench.estimates(table, 3, 4000, torch.Generator().manual_seed(0))
    for name in ("double_mc", "llada_mc", "sdmc_bernoulli"):
        mean = sum(values[name]) / len(values[name])
        spread = math.sqrt(sum((v - mean) ** 2 for v in values[name]) / len(values[name]))
        assert abs(mean - exact) < 4 * spread / math.sqrt(len(values[name])), name
    assert set(values) == {"sdmc_count", "sdmc_bernoulli", "double_mc", "llada_mc"}
