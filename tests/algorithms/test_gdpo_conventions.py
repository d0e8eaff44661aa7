"""GDPO's two ELBO conventions (``elbo_convention``) against numbers computed independently from the rules of the
authors' released code (github.com/KevinRojas1499/GDPO: every completion position scored, ``int(t W)`` masked positions
per Gauss-Legendre node weighted ``w_n / t_n``, the log-ratio divided by the fixed width `W`, the k3 KL on the raw
ELBOs), and mmgrpo's default (the tokens up to the first EOS, ``round(t L_y)`` weighted ``w_n L_y / k``, per scored
token, KL on the length-normalised ELBOs).

Worked example (W = 8, the first EOS at position 4, Gauss-Legendre with 2 nodes): node 1 masks position 2, node 2
positions 0, 1, 2, 3, 5, 6; the token log-probs below give E_new = -2.51435935, E_old = -3.17775681,
E_ref = -2.90311580, ratio exp(0.66339746 / 8) = 1.08645998 and, with A = 0.5, clip 0.5 and kl_beta 0.04, the loss
-0.54322999 + 0.04 * 0.06665580 = -0.54056376.
"""

import math

import pytest
import torch

from mmgrpo.algorithms.gdpo import GDPO, GDPOConfig
from mmgrpo.pipelines import _mdlm_elbo
from mmgrpo.components import score_unit
from mmgrpo.types import PromptBatch, Score
from mmgrpo.validation import build_dataclass

WIDTH = 8
MASKS = [[2], [0, 1, 2, 3, 5, 6]]  # node 1, node 2
LOG_PROBS = {  # policy -> per node, the log-probs of the masked positions (in MASKS' order)
    "new": [[-0.5], [-0.1, -0.2, -0.9, -0.3, -0.4, -0.2]],
    "old": [[-0.7], [-0.15, -0.25, -1.0, -0.3, -0.5, -0.2]],
    "ref": [[-0.6], [-0.12, -0.22, -0.95, -0.35, -0.45, -0.25]],
}
ELBO = {"new": -2.51435935, "old": -3.17775681, "ref": -2.90311580}


def algo_config(cls, **options):
    """The algorithm's Config from the flat keys of a config file's ``algorithm:`` section."""
    return build_dataclass(cls, options, "algorithm")


def _elbo(weights: torch.Tensor, policy: str) -> float:
    """sum over nodes of weight * (sum of the masked positions' log-probs), for the example's masks."""
    return sum(float(w) * sum(lp) for w, lp in zip(weights, LOG_PROBS[policy]))


def _one_draw(elbo: float, scored: int, width: int = WIDTH) -> Score:
    """A one-sample, one-draw score with `scored` of `width` positions in its token mask."""
    tokens = (torch.arange(width) < scored)[None, None, :]  # [1, 1, W]
    return Score(log_prob=torch.tensor([[elbo]]), mask=torch.ones(1, 1, dtype=torch.bool), token_mask=tokens)


def test_full_width_masks_and_weights_give_the_worked_elbos():
    """Every position scored: int(t_n W) = 1 and 6 positions, weights w_n / t_n = 0.5 / 0.2113 and 0.5 / 0.7887."""
    masked, weights = _mdlm_elbo.draw_masks(torch.ones(1, WIDTH, dtype=torch.bool), 1, 2, 1, "count",
                                            torch.Generator().manual_seed(0), "full_width")
    times = [0.5 - 0.5 / math.sqrt(3), 0.5 + 0.5 / math.sqrt(3)]
    assert masked[0, 0].sum(-1).tolist() == [math.floor(t * WIDTH) for t in times] == [1, 6]
    torch.testing.assert_close(weights[0, 0], torch.tensor([0.5 / t for t in times]))
    for policy, expected in ELBO.items():
        assert _elbo(weights[0, 0], policy) == pytest.approx(expected, abs=1e-6)


def test_to_first_eos_counts_round_the_scored_tokens_and_weigh_them_unbiased():
    """The default convention on the same completion scores its 5 tokens up to the EOS: round(t_n 5) = 1 and 4,
    weights w_n * 5 / k = 2.5 and 0.625 (a node never masks after the EOS)."""
    scored = torch.tensor([[True] * 5 + [False] * 3])
    masked, weights = _mdlm_elbo.draw_masks(scored, 1, 2, 1, "count", torch.Generator().manual_seed(0))
    assert masked[0, 0].sum(-1).tolist() == [1, 4] and not masked[0, 0, :, 5:].any()
    torch.testing.assert_close(weights[0, 0], torch.tensor([2.5, 0.625]))


def test_full_width_loss_is_the_worked_example():
    """ratio exp((E - E_old) / W), policy term -min(rho A, clip(rho) A), k3 on the raw ELBOs."""
    algorithm = GDPO(algo_config(GDPOConfig, elbo_convention="full_width", clip_low=0.5, kl_beta=0.04))
    out = algorithm.loss(_one_draw(ELBO["new"], WIDTH), torch.tensor([[ELBO["old"]]]), torch.tensor([0.5]),
                         _one_draw(ELBO["ref"], WIDTH))
    assert out.metrics["ratio_mean"] == pytest.approx(1.08645998, abs=1e-6)
    assert out.metrics["kl"] == pytest.approx(0.06665580, abs=1e-6)
    assert float(out.loss) == pytest.approx(-0.54056376, abs=1e-6)
    # the width, not the scored tokens: a token mask of 5 real tokens out of 8 gives the same loss
    same = algorithm.loss(_one_draw(ELBO["new"], 5), torch.tensor([[ELBO["old"]]]), torch.tensor([0.5]),
                          _one_draw(ELBO["ref"], 5))
    assert float(same.loss) == pytest.approx(-0.54056376, abs=1e-6)


def test_to_first_eos_loss_divides_by_the_scored_tokens():
    """The default on the same ELBOs with 5 scored tokens: ratio exp(0.66339746 / 5) = 1.14188396, k3 on E / 5
    = 0.00294579."""
    algorithm = GDPO(algo_config(GDPOConfig, clip_low=0.5, kl_beta=0.04))
    out = algorithm.loss(_one_draw(ELBO["new"], 5), torch.tensor([[ELBO["old"]]]), torch.tensor([0.5]),
                         _one_draw(ELBO["ref"], 5))
    assert out.metrics["ratio_mean"] == pytest.approx(1.14188396, abs=1e-6)
    assert out.metrics["kl"] == pytest.approx(0.00294579, abs=1e-7)
    assert float(out.loss) == pytest.approx(-0.5 * 1.14188396 + 0.04 * 0.00294579, abs=1e-6)


def test_the_convention_reaches_the_plan_and_full_width_keeps_the_width_divisor():
    plan = GDPO(algo_config(GDPOConfig, elbo_convention="full_width")).schedule(4, torch.Generator().manual_seed(0))
    assert plan.elbo_convention == "full_width" and plan.features() == {"likelihood", "elbo"}
    assert GDPO(GDPOConfig()).schedule(4).elbo_convention == "to_first_eos"
    with pytest.raises(ValueError, match="length_normalize: false does not go with elbo_convention: full_width"):
        algo_config(GDPOConfig, elbo_convention="full_width", length_normalize=False)
    with pytest.raises(ValueError, match="elbo_convention"):
        algo_config(GDPOConfig, elbo_convention="first_eos")


def test_full_width_scores_every_position_on_the_tiny_model(tiny_mdlm_dir):
    """On the tiny masked-diffusion LM, with the EOS fill after the answer: every one of the W positions is scored,
    each node masks int(t_n W) of them (positions after the first EOS too), the recorded ELBO is
    sum_n w_n / t_n sum_{i masked} log pi(y^i | masked input) written out with one plain forward per mask, and the
    replayed score carries a token mask of all W positions (so the ratio's divisor is W)."""
    from mmgrpo.pipelines.mdlm import MDLMConfig, MDLMPolicy

    width = 6
    policy = MDLMPolicy(MDLMConfig(pretrained=tiny_mdlm_dir, gen_length=width, steps_per_block=3, lora_rank=0,
                                   elbo_points=3))
    algorithm = GDPO(algo_config(GDPOConfig, elbo_convention="full_width", draws=2, kl_beta=0.04))
    plan = algorithm.schedule(policy.num_steps, torch.Generator().manual_seed(0))
    rollout = policy.sample(PromptBatch(["12+34=", "7+8=", "305+9="]).repeat(2), plan,
                            generator=torch.Generator().manual_seed(1))
    t = rollout.trajectory
    assert t["elbo_scored"].all()
    times = [0.5 - 0.5 * math.sqrt(0.6), 0.5, 0.5 + 0.5 * math.sqrt(0.6)]
    node_weights = [5 / 18, 8 / 18, 5 / 18]
    sizes = t["elbo_masked"].sum(-1)  # [N, D, M]
    assert (sizes == torch.tensor([math.floor(x * width) for x in times])).all()
    for row in range(len(rollout)):
        prompt, attention, completion = t["prompt_ids"][row], t["prompt_attention"][row], t["completion"][row]
        for draw in range(2):
            total = 0.0
            for n, (time, weight) in enumerate(zip(times, node_weights)):
                hidden = t["elbo_masked"][row, draw, n]
                state = torch.cat([prompt, torch.where(hidden, torch.tensor(policy.mask_id), completion)])[None]
                full = torch.cat([attention, torch.ones(width, dtype=torch.bool)])[None].long()
                with torch.no_grad():
                    logits = policy.model(input_ids=state, attention_mask=full).logits[0, len(prompt):].float()
                logits[:, policy.mask_id] = float("-inf")
                log_probs = torch.log_softmax(logits, -1).gather(1, completion[:, None])[:, 0]  # [W]
                total += weight / time * float(log_probs[hidden].sum())
            assert float(rollout.old_log_probs[row, draw]) == pytest.approx(total, abs=1e-5)
    after_eos = [t["elbo_masked"][row, :, :, i].any() for row in range(len(rollout))
                 for i in range(width) if i > policy.completion_mask(t["completion"][row][None])[0].sum() - 1]
    assert any(after_eos), "no mask reached past a first EOS: the completions end too late for this check"
    new, old, ref = score_unit(policy, algorithm, rollout, plan.train_units[0], torch.device("cpu"))
    assert bool(new.token_mask.all()) and new.token_mask.shape[-1] == width
    torch.testing.assert_close(new.log_prob.detach(), old, rtol=0, atol=1e-5)
    out = algorithm.loss(new, old, torch.linspace(-1, 1, len(rollout)), ref)
    assert out.metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-6) and out.metrics["kl"] == pytest.approx(0, abs=1e-9)
