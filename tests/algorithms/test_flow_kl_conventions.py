"""Flow-GRPO's KL to the reference under its two conventions, against an independent transcription of each formula on
the same tensors, and the shipped config that names Flow-GRPO's beta uses Flow-GRPO's convention."""

import math
from pathlib import Path

import pytest
import torch

from mmgrpo import config as config_mod, registry
from mmgrpo.samplers.flow_sde import flow_sde_step
from mmgrpo.types import Score
from algorithm_options import algo_config

ROOT = Path(__file__).resolve().parents[2]
SIGMAS = [(1.0, 0.9, 0.8), (0.6, 0.45, 0.3)]  # (sigma, sigma_next, sigma_at_one): one step at sigma 1, one inside


def _steps(seed: int, velocity_shift: float):
    """Two SDE transitions of 3 latents [3, 4, 2, 2] re-scored at fixed next latents, stacked as a [3, 2] Score."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 4, 2, 2, generator=g)
    prev = torch.randn(3, 4, 2, 2, generator=torch.Generator().manual_seed(99))
    outs = []
    for sigma, sigma_next, at_one in SIGMAS:
        v = torch.randn(3, 4, 2, 2, generator=g) + velocity_shift
        outs.append(flow_sde_step(v, x, sigma, sigma_next, noise_level=0.7, sigma_at_one=at_one, prev_sample=prev))
    return Score(
        log_prob=torch.stack([o.log_prob for o in outs], 1),  # [3, 2]
        mean=torch.stack([o.mean for o in outs], 1),  # [3, 2, 4, 2, 2]
        std=torch.stack([o.std for o in outs], 1),  # [3, 2, 1, 1, 1, 1]
        noise_scale=torch.stack([o.noise_scale for o in outs], 1),
        mask=torch.ones(3, 2, dtype=torch.bool),
    )


def _authors_kl(new: Score, ref: Score, with_dt: bool) -> float:
    """Flow-GRPO's training loop, one timestep at a time: ``((mu - mu_ref)^2).mean(dims) / (2 std_dev_t^2)`` with
    ``std_dev_t = eta * sqrt(sigma / (1 - sigma))`` (sigma 1 replaced by the step's `sigma_at_one`), averaged over
    samples and then timesteps; ``with_dt`` multiplies ``std_dev_t`` by ``sqrt(sigma - sigma_next)``."""
    per_step = []
    for j, (sigma, sigma_next, at_one) in enumerate(SIGMAS):
        std_dev_t = 0.7 * math.sqrt(sigma / (1 - (at_one if sigma >= 1 else sigma)))
        if with_dt:
            std_dev_t *= math.sqrt(sigma - sigma_next)
        squared = ((new.mean[:, j] - ref.mean[:, j]) ** 2).mean(dim=(1, 2, 3))  # [3]
        per_step.append((squared / (2 * std_dev_t**2)).mean())
    return float(sum(per_step) / len(per_step))


@pytest.mark.parametrize("convention, with_dt", [("flow_grpo", False), ("transition", True)])
def test_kl_term_is_the_conventions_formula(convention, with_dt):
    new, ref = _steps(0, 0.0), _steps(0, 0.3)  # same latents, the reference's velocity differs
    algorithm = registry.get("algorithm", "flow_grpo")(
        algo_config(registry.get("algorithm", "flow_grpo").Config, kl_beta=0.04, kl_convention=convention)
    )
    out = algorithm.loss(new, new.log_prob.detach(), torch.zeros(3), ref)
    assert out.metrics["kl"] == pytest.approx(_authors_kl(new, ref, with_dt), rel=1e-5)
    assert out.metrics["kl"] > 0
    assert out.loss.item() == pytest.approx(0.04 * out.metrics["kl"], rel=1e-5)  # zero advantage: the KL term alone


def test_transition_kl_is_flow_grpo_kl_over_dt_per_step():
    """Per step, the two conventions differ by exactly ``|dt|``: at 10 steps the same beta is ~10x stronger in ours."""
    new, ref = _steps(1, 0.0), _steps(1, -0.2)
    for j, (sigma, sigma_next, _) in enumerate(SIGMAS):
        one = lambda field: Score(log_prob=new.log_prob[:, j:j + 1], mean=new.mean[:, j:j + 1],  # noqa: E731
                                  std=getattr(new, field)[:, j:j + 1], noise_scale=new.noise_scale[:, j:j + 1])
        kls = {}
        for convention in ("transition", "flow_grpo"):
            cls = registry.get("algorithm", "flow_grpo")
            algorithm = cls(algo_config(cls.Config, kl_beta=1.0, kl_convention=convention))
            ref_j = Score(log_prob=ref.log_prob[:, j:j + 1], mean=ref.mean[:, j:j + 1])
            kls[convention] = algorithm.loss(one("std"), new.log_prob[:, j:j + 1].detach(), torch.zeros(3), ref_j).metrics["kl"]
        assert kls["transition"] * (sigma - sigma_next) == pytest.approx(kls["flow_grpo"], rel=1e-5)


def test_each_convention_reads_the_field_it_divides_by():
    cls = registry.get("algorithm", "flow_grpo")
    assert cls(algo_config(cls.Config, kl_beta=0.1)).traits.reads == {"log_prob", "mean", "std"}
    assert cls(algo_config(cls.Config, kl_beta=0.1, kl_convention="flow_grpo")).traits.reads == {"log_prob", "mean", "noise_scale"}
    assert cls(algo_config(cls.Config, kl_beta=0.0, kl_convention="flow_grpo")).traits.reads == {"log_prob"}
    with pytest.raises(ValueError, match="kl_convention"):
        algo_config(cls.Config, kl_beta=0.1, kl_convention="sigma")


def test_configs_with_flow_grpo_betas_use_flow_grpos_convention():
    """A config that copies Flow-GRPO's KL beta must mean by it what Flow-GRPO means."""
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        algorithm = config_mod.load(path).algorithm
        if algorithm.name == "flow_grpo" and algorithm.options.kl.kl_beta > 0:
            assert algorithm.options.kl_convention == "flow_grpo", path.name
