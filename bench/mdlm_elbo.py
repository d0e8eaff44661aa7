"""ELBO estimators of a masked-diffusion completion at the same cost (two forwards), on the shipped model.

For completions sampled by the shipped ``mmgrpo:mdlm_arith`` model (temperature 1) on held-out prompts, every
estimator's value is looked up in a table of ``sum_{i in S} log pi(y^i | y with S masked)`` over all subsets `S` of
the scored tokens (at most 4 here: 15 subsets, one forward each), so the exact ELBO is known,

    ELBO = sum_S sum_{i in S} log pi(y^i | y_S) / (|S| * C(L, |S|))        (t ~ U(0, 1), Bernoulli(t) masks)

and each estimator is repeated with fresh randomness. Compared, each with two forwards:

  * ``sdmc_count``: GDPO's semi-deterministic Monte Carlo as the pipeline computes it (2 Gauss-Legendre ratios, one
    fixed-size mask each, weights ``w_n L / k_n``; `pipelines/_mdlm_elbo.py`);
  * ``sdmc_bernoulli``: the same ratios with Bernoulli(t_n) masks, weights ``w_n / t_n``;
  * ``double_mc``: two draws of ``t ~ U(0, 1)`` and a Bernoulli(t) mask each, weight ``1 / t`` (the vanilla double
    Monte Carlo);
  * ``llada_mc``: two draws of a mask size ``k ~ U{1..L}`` and a uniform mask of that size, weight ``L / k``
    (LLaDA's likelihood estimator).

Reported over completions: the mean bias (estimator mean minus the exact ELBO) and the mean of its absolute value
(SDMC's fixed ratios make its per-completion bias a quadrature error, not zero), the mean standard deviation over
repeats, and the root mean squared error. Run from the repository root (about a minute):

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 .venv/bin/python bench/mdlm_elbo.py --repeats 2000
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from pathlib import Path

import torch

from mmgrpo import registry
from mmgrpo.config import load
from mmgrpo.pipelines import _mdlm_elbo
from mmgrpo.prompt_stream import items_to_batch
from mmgrpo.samplers.masked_diffusion import token_log_probs
from mmgrpo.plans import MaskedPlan

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "configs/tiny/mdlm_arith_gdpo.yaml"


def subset_table(policy, rollout) -> tuple[list[dict], list[int]]:
    """Per completion, ``{frozenset S: sum_{i in S} log pi(y^i | y_S)}`` over the nonempty subsets of its scored
    tokens (and the empty set: 0), and its number of scored tokens."""
    t = rollout.trajectory
    completion, prompt_ids, attention = t["completion"], t["prompt_ids"], t["prompt_attention"]
    lengths = policy.completion_mask(completion).sum(-1).tolist()
    rows, subsets = [], []
    for row, length in enumerate(lengths):
        for k in range(1, length + 1):
            for subset in itertools.combinations(range(length), k):
                rows.append(row)
                subsets.append(frozenset(subset))
    hidden = torch.zeros(len(rows), completion.shape[1], dtype=torch.bool)  # [R, L]
    for j, subset in enumerate(subsets):
        hidden[j, list(subset)] = True
    index = torch.tensor(rows)
    targets = completion[index]  # [R, L]
    noisy = torch.where(hidden, torch.full_like(targets, policy.mask_id), targets)
    with torch.no_grad():
        logits = policy._completion_logits(prompt_ids[index], attention[index], noisy)  # [R, L, V]
        sums = (token_log_probs(logits, targets) * hidden).sum(-1).tolist()  # [R]
    table = [{frozenset(): 0.0} for _ in lengths]
    for row, subset, value in zip(rows, subsets, sums):
        table[row][subset] = value
    return table, lengths


def exact_elbo(table: dict, length: int) -> float:
    return sum(value / (len(s) * math.comb(length, len(s))) for s, value in table.items() if s)


def estimates(table: dict, length: int, repeats: int, generator: torch.Generator) -> dict[str, list[float]]:
    """`repeats` values of each two-forward estimator for one completion (see the module docstring)."""
    scored = torch.ones(1, length, dtype=torch.bool)
    out = {}
    for masking in ("count", "bernoulli"):
        masked, weights = _mdlm_elbo.draw_masks(scored, repeats, 2, 1, masking, generator)  # [1, R, 2, L], [1, R, 2]
        out[f"sdmc_{masking}"] = [
            sum(float(weights[0, r, m]) * table[frozenset(torch.nonzero(masked[0, r, m]).flatten().tolist())]
                for m in range(2))
            for r in range(repeats)
        ]
    double, llada = [], []
    for _ in range(repeats):
        t = torch.rand(2, generator=generator, dtype=torch.float64).clamp_min(1e-12)
        draws = torch.rand(2, length, generator=generator, dtype=torch.float64) < t[:, None]
        double.append(sum(table[frozenset(torch.nonzero(draws[j]).flatten().tolist())] / float(t[j]) for j in range(2)) / 2)
        sizes = torch.randint(1, length + 1, (2,), generator=generator)
        total = 0.0
        for k in sizes.tolist():
            chosen = torch.randperm(length, generator=generator)[:k].tolist()
            total += length / k * table[frozenset(chosen)]
        llada.append(total / 2)
    out["double_mc"], out["llada_mc"] = double, llada
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="outputs/bench_mdlm_elbo")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    cfg = load(ROOT / CONFIG)
    policy_cls = registry.get("pipeline", "mdlm")
    policy = policy_cls(cfg.pipeline.options)
    items = registry.get("data", cfg.data.name)(cfg.data.options).eval_items()[: args.prompts]
    batch = items_to_batch(items)
    rollout = policy.sample(batch, MaskedPlan(policy.num_steps, []), generator=torch.Generator().manual_seed(args.seed))
    tables, lengths = subset_table(policy, rollout)
    generator = torch.Generator().manual_seed(args.seed + 1)
    stats: dict[str, dict[str, list[float]]] = {}
    for table, length in zip(tables, lengths):
        exact = exact_elbo(table, length)
        for name, values in estimates(table, length, args.repeats, generator).items():
            mean = sum(values) / len(values)
            entry = stats.setdefault(name, {"bias": [], "std": [], "mse": []})
            entry["bias"].append(mean - exact)
            entry["std"].append(math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)))
            entry["mse"].append(sum((v - exact) ** 2 for v in values) / len(values))
    mean_elbo = sum(exact_elbo(t, n) for t, n in zip(tables, lengths)) / len(tables)
    lines = [f"{len(tables)} completions, {sum(lengths) / len(lengths):.2f} scored tokens and exact ELBO "
             f"{mean_elbo:.3f} nats on average; {args.repeats} repeats each", "",
             "| estimator (2 forwards) | mean bias (nats) | mean abs. bias | mean std | RMSE |", "|---|---|---|---|---|"]
    for name, entry in stats.items():
        n = len(entry["bias"])
        lines.append(f"| {name} | {sum(entry['bias']) / n:+.4f} | {sum(abs(b) for b in entry['bias']) / n:.4f} | "
                     f"{sum(entry['std']) / n:.4f} | "
                     f"{math.sqrt(sum(entry['mse']) / n):.4f} |")
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    (output / "table.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (output / "results.json").write_text(json.dumps({"lengths": lengths, "stats": stats}, indent=1), encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
