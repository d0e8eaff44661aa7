"""bench/gradient_snr.py: the agreement statistics on gradients whose answer is known, and the batch gradient it
measures against the first optimizer update a real training step takes on the same batch."""

import math

import pytest
import torch


def test_agreement_of_known_gradients(load_bench):
    bench = load_bench("gradient_snr")
    same = torch.tensor([[1.0, -2.0, 0.0], [1.0, -2.0, 0.0], [1.0, -2.0, 0.0]])  # [K=3, P=3], the last never touched
    agreement = bench.gradient_agreement(same, torch.Generator().manual_seed(0))
    assert agreement["loo_cosine"] == pytest.approx(1.0) and agreement["pairwise_cosine"] == pytest.approx(1.0)
    assert agreement["parameters"] == 2 and agreement["snr_median"] > 1e20  # no spread: all signal
    opposed = bench.gradient_agreement(torch.tensor([[1.0, 0.0], [-1.0, 0.0]]))
    assert opposed["pairwise_cosine"] == pytest.approx(-1.0) and opposed["loo_cosine"] == pytest.approx(-1.0)
    orthogonal = bench.gradient_agreement(torch.eye(4))  # [K=4, P=4]: each batch alone on its own parameter
    assert orthogonal["pairwise_cosine"] == pytest.approx(0.0)
    assert orthogonal["loo_cosine"] == pytest.approx(0.0)  # g_1 . (g_2 + g_3 + g_4) = 0
    # one parameter seen as 1 and 3: mean 2, std (K - 1) sqrt(2)
    snr = bench.per_parameter_snr(torch.tensor([[1.0, 0.0], [3.0, 0.0]]))
    assert snr.tolist() == pytest.approx([2 / math.sqrt(2)])


def test_signal_share_and_expected_cosine_take_the_noise_out(load_bench):
    bench = load_bench("gradient_snr")
    # batches g_k = mu + e_k with orthogonal noises e_k of norm 2 and |mu| = 1: |E g|^2 / E|g|^2 = 1 / 5
    mu = torch.zeros(10)
    mu[0] = 1.0
    a = mu + 2 * torch.eye(10)[1:5]  # [K=4, P=10]
    gram_a = bench.gram_of(a, a)
    assert bench.signal_share(gram_a) == pytest.approx(1 / 5)
    # B's expected gradient is mu rotated by 60 degrees in the (0, 9) plane, its noises orthogonal to everything
    nu = torch.zeros(10)
    nu[0], nu[9] = 0.5, math.sqrt(3) / 2
    b = nu + 3 * torch.eye(10)[5:9]
    cosine = bench.expected_cosine(bench.gram_of(a, b), gram_a, bench.gram_of(b, b))
    assert cosine == pytest.approx(0.5)  # cos 60 degrees, though the batches' own cosines are far smaller
    assert bench.cosine(a[0], b[0]) < 0.1
    noise_only = torch.eye(10)[:4]  # [K=4, P=10]: no product of two batches is positive
    assert math.isnan(bench.expected_cosine(bench.gram_of(noise_only, a), bench.gram_of(noise_only, noise_only), gram_a))
    assert bench.cross_cosines({"a": a, "noise": noise_only})["a"] == {"a": pytest.approx(1.0), "noise": None}
    table = bench.cosine_table(bench.cross_cosines({"a": a, "noise": noise_only}), {"a": 0.2, "noise": 0.0})
    assert "| a | 1.00 |" in table and "noise" not in table  # a direction below the measurable share is not tabled


def test_batch_gradient_is_the_direction_of_the_first_training_update(load_bench, tmp_path):
    """The same batch of step 1 in two trainers of one config: the first measures its gradient, the second takes its
    training step (one update over the whole batch). Adam's first update is ``-lr * g / (|g| + eps)`` whatever the
    clipping's scale, so it moves each parameter with a clear gradient by the learning rate against the gradient's
    sign."""
    bench = load_bench("gradient_snr")
    overrides = ["train.prompts_per_step=2", "train.group_size=4", "train.minibatch_size=8",
                 "train.updates_per_step=1", "train.weight_decay=0.0", "pipeline.num_steps=4",
                 "algorithm.level_fraction=0.5"]
    measured = bench.build_trainer("diffusion_nft", 3, tmp_path / "measured", overrides)
    grad, info = bench.batch_gradient(measured, 1)
    measured.scoring.close()
    assert info["taken"] and grad.norm() > 0
    assert all(p.grad is None for p in measured.policy.trainable_parameters())  # nothing left for a step
    trained = bench.build_trainer("diffusion_nft", 3, tmp_path / "trained", overrides)
    before = torch.cat([p.detach().flatten().clone() for p in trained.policy.trainable_parameters()])  # [P]
    trained.step += 1
    trained.train_step()
    trained.scoring.close()
    moved = torch.cat([p.detach().flatten() for p in trained.policy.trainable_parameters()]) - before  # [P]
    clear = grad.abs() > 1e-5
    assert clear.sum() > 0.5 * len(grad)
    lr = trained.config.train.learning_rate
    torch.testing.assert_close(moved[clear], -lr * grad[clear].sign(), rtol=0.0, atol=0.05 * lr)

