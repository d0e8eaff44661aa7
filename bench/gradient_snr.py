"""How much the gradients of independent rollout batches agree, per flow algorithm, at the shipped base model.

For each flow algorithm's tiny config (``configs/tiny/t2i_shapes_<algorithm>.yaml``) a trainer is built as
``mmgrpo train`` builds it, and for each of `K` rollout batches, with the prompts and noise seeds of training steps
1..K of a run with ``--seed`` (the same prompts for every algorithm: the prompt stream depends only on the seed), it

1. samples and rewards the batch exactly as a training step does (``prompts_per_step x group_size`` samples, the
   step's plan and noise) and computes its advantages, through
   [`~mmgrpo.trainer.Trainer.rollout_batch`], the same code as a training step;
2. back-propagates the algorithm's loss over the whole batch as ONE update ([`mmgrpo.updates.accumulate`], the
   trainer's own scoring, weighting and skip rules): with several minibatches or updates per step (``minibatch_size``
   64 of 128, ``updates_per_step: 2``) this is the gradient of the first, on-policy update accumulated over the whole
   batch (the mean of the two minibatches' gradients). No optimizer step is taken, so every batch sees the base
   weights, and the gradient is read before clipping (``train.max_grad_norm``).

From the `K` flattened gradients ``g_k`` over every trained parameter it reports ([`gradient_agreement`]):

- leave-one-out cosine: the mean over `k` of ``cos(g_k, mean_{j != k} g_j)``, how much of one batch's gradient points
  where the other batches agree;
- the mean cosine between two batches' gradients;
- per-parameter SNR as Adam sees it: ``|mean_k g_k| / (std_k g_k + 1e-30)`` (std with ``K - 1``), its mean and median
  over the parameters that got a gradient; beside it the same with each batch's gradient multiplied by a random sign
  (the value of pure noise with these batches' scales, mean over 20 draws of signs);
- signal share: ``mean_{i != j} g_i . g_j / mean_k |g_k|^2``, the share of one batch's squared gradient norm that is
  the expected gradient (``g_i . g_j`` of independent batches estimates ``|E g|^2`` without bias), which, unlike the
  cosines, does not depend on `K`;
- the share of groups whose rewards were all equal (no signal), the rollouts' mean reward, the mean gradient norm and
  the wall time per batch (sampling, reward and backward);
- between every two algorithms, the cosine of their expected gradients with the batches' noise taken out
  ([`expected_cosine`]): do they push the weights the same way on average? (tabled for the algorithms whose signal
  share is at least 0.01; results.json has every pair)

Run from the repository root (about 1-5 s per batch at one thread on a 2-core CPU):

    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 OMP_NUM_THREADS=1 nice -n 5 \\
        .venv/bin/python bench/gradient_snr.py --output outputs/bench_gradient_snr --batches 8 --seed 0

``--batches-for ALGORITHM=K`` lowers `K` for one algorithm; ``--algorithms`` chooses which; ``--override KEY=VALUE``
(repeatable) changes every measured config as on ``mmgrpo train``'s command line (recorded in each row), e.g.
``--algorithms flow_grpo --override algorithm.sde_type=cps --override algorithm.noise_level=0.8``. Writes
``table.md`` and ``results.json`` under ``--output`` and prints the table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
ALGORITHMS = (  # the SDE algorithms with a per-step likelihood ratio, then the three that regress on velocities
    "flow_grpo", "grpo_guard", "flow_dppo", "e_grpo", "chunk_grpo", "dance_grpo", "mix_grpo", "branch_grpo",
    "diffusion_nft", "dgpo", "awm",
)
NULL_DRAWS = 20  # random sign patterns for the noise-only reference
TINY = 1e-30
MEASURABLE_SHARE = 0.01  # the signal share below which an expected gradient's direction is not tabled


def config_path(algorithm: str) -> Path:
    """The tiny config of `algorithm`: ``configs/tiny/t2i_shapes_<algorithm>.yaml``."""
    return ROOT / "configs" / "tiny" / f"t2i_shapes_{algorithm}.yaml"


# ------------------------------------------------------------------------------------------------------ statistics
def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine of two vectors `[P]` (0 when either is 0)."""
    norms = float(a.norm() * b.norm())
    return float(a @ b) / norms if norms > 0 else 0.0


def per_parameter_snr(grads: torch.Tensor) -> torch.Tensor:
    """``|mean_k g| / (std_k g + 1e-30)`` of each parameter that got a non-zero gradient in some batch.

    Args:
        grads (`torch.FloatTensor` of shape `[K, P]`): one flattened gradient per batch, `K` >= 2.

    Returns:
        `torch.FloatTensor` of shape `[P']`: the parameters whose gradient is not 0 in every batch.
    """
    touched = (grads != 0).any(dim=0)  # [P]
    kept = grads[:, touched].double()  # [K, P']
    return (kept.mean(dim=0).abs() / (kept.std(dim=0) + TINY)).float()  # [P']


def gradient_agreement(grads: torch.Tensor, generator: torch.Generator | None = None) -> dict[str, float]:
    """How much `K` batches' gradients agree.

    Args:
        grads (`torch.FloatTensor` of shape `[K, P]`): one flattened gradient per batch, `K` >= 2.
        generator (`torch.Generator`, *optional*): for the random signs of the noise-only reference.

    Returns:
        `dict`: ``loo_cosine`` (mean over `k` of ``cos(g_k, mean_{j != k} g_j)``), ``pairwise_cosine`` (mean over
        pairs), ``snr_mean`` / ``snr_median`` (of [`per_parameter_snr`]), ``null_snr_mean`` / ``null_snr_median``
        (the same with every ``g_k`` times a random sign, mean over `NULL_DRAWS` draws), ``grad_norm`` (mean of
        ``|g_k|``), ``mean_grad_norm`` (``|mean_k g_k|``) and ``parameters`` (those with a gradient).
    """
    k = len(grads)
    if k < 2:
        raise ValueError(f"The agreement of gradients needs at least 2 batches, got {k}.")
    grads = grads.double()
    total = grads.sum(dim=0)  # [P]
    loo = [cosine(grads[i], (total - grads[i]) / (k - 1)) for i in range(k)]
    pairs = [cosine(grads[i], grads[j]) for i in range(k) for j in range(i + 1, k)]
    snr = per_parameter_snr(grads)
    null_means, null_medians = [], []
    for _ in range(NULL_DRAWS):
        signs = torch.randint(0, 2, (k, 1), generator=generator).double() * 2 - 1  # [K, 1]
        null = per_parameter_snr(grads * signs)
        null_means.append(float(null.mean()))
        null_medians.append(float(null.median()))
    return {"loo_cosine": sum(loo) / k, "pairwise_cosine": sum(pairs) / len(pairs),
            "snr_mean": float(snr.mean()), "snr_median": float(snr.median()),
            "null_snr_mean": sum(null_means) / NULL_DRAWS, "null_snr_median": sum(null_medians) / NULL_DRAWS,
            "grad_norm": float(grads.norm(dim=1).mean()), "mean_grad_norm": float((total / k).norm()),
            "parameters": int(len(snr))}


def off_diagonal_mean(products: torch.Tensor) -> float:
    """The mean of ``products[i, j]`` over ``i != j`` (`products` `[K, K]`, `K` >= 2): products of different,
    independent batches only."""
    k = len(products)
    return float((products.sum() - products.diagonal().sum()) / (k * (k - 1)))


def signal_share(gram: torch.Tensor) -> float:
    """The share of one batch's squared gradient norm that is the expected gradient: ``mean_{i != j} g_i . g_j`` (an
    unbiased estimate of ``|E g|^2`` over independent batches) over ``mean_k |g_k|^2``, from the batches' Gram matrix
    `gram` `[K, K]`. Near 0 when each batch's gradient is mostly noise; it does not depend on `K` (the cosines do)."""
    return off_diagonal_mean(gram) / float(gram.diagonal().mean())


def expected_cosine(cross: torch.Tensor, gram_a: torch.Tensor, gram_b: torch.Tensor) -> float:
    """The cosine between two algorithms' expected gradients, with each batch's noise taken out: ``mean_{i != j}
    g_i^A . g_j^B`` over the square root of the same products within A and within B (batch `k` of both saw the same
    prompts, so only products of different batches are independent).

    Args:
        cross (`torch.FloatTensor` of shape `[K, K]`): ``g_i^A . g_j^B``.
        gram_a, gram_b (`torch.FloatTensor` of shape `[K, K]`): the Gram matrices of A's and of B's batches.

    Returns:
        `float`: NaN when the expected gradient of A or B is not measurable (its estimate of ``|E g|^2`` <= 0).
    """
    own_a, own_b = off_diagonal_mean(gram_a), off_diagonal_mean(gram_b)
    return off_diagonal_mean(cross) / math.sqrt(own_a * own_b) if own_a > 0 and own_b > 0 else float("nan")


# ------------------------------------------------------------------------------------------------------ gradients
def build_trainer(algorithm: str, seed: int, output: Path, overrides: list[str] = ()):
    """The trainer of `algorithm`'s tiny config with training seed `seed`, its run folder under `output`."""
    from mmgrpo.config import load
    from mmgrpo.trainer import Trainer

    config = load(config_path(algorithm), [f"seed={seed}", f"output_dir={output / f'{algorithm}_s{seed}'}",
                                           *overrides])
    return Trainer(config, record_config=False)


def batch_gradient(trainer, step: int) -> tuple[torch.Tensor, dict[str, float]]:
    """The gradient of the trainer's loss on the rollout batch of training step `step`, at the current weights.

    The batch is sampled, rewarded and given advantages as [`~mmgrpo.trainer.Trainer.train_step`] does; the loss of
    the whole batch is back-propagated as one update by [`mmgrpo.updates.accumulate`] (the trainer's skip rules: a
    batch whose update training would not take gives a zero gradient). The weights are not changed.

    Returns:
        `(torch.FloatTensor of shape [P], dict)`: the flattened gradient over the trainable parameters, before
        clipping; the batch's ``equal_reward_groups`` share, ``reward`` mean, ``taken`` (whether training would take
        the update) and ``seconds``.
    """
    from mmgrpo import updates
    from mmgrpo.advantages import kept_samples
    from mmgrpo.evaluation import reward_metrics

    start = time.perf_counter()
    train, traits, params = trainer.config.train, trainer.algorithm.traits, trainer.policy.trainable_parameters()
    batch = trainer.rollout_batch(step)  # the step's prompts, plan and generator, as train_step draws them
    rollout, plan, advantages, rewarded = batch.rollout, batch.inputs.plan, batch.advantages, batch.rewarded
    with_signal, generator = batch.with_signal, batch.inputs.generator
    scored, takes_update = updates.samples_to_score(traits, with_signal, rewarded)  # [N], bool
    taken = bool(plan.train_units) and takes_update
    trainer.optimizer.zero_grad(set_to_none=True)
    if taken:
        parts = math.ceil(len(rollout) / train.minibatch_size)
        kept = kept_samples(advantages, parts, generator) if traits.drop_zero_advantage else None
        minibatches = updates.epoch_minibatches(len(rollout), train.minibatch_size, kept, generator)
        entries = updates.count_rollout_entries(trainer, rollout, plan.train_units) \
            if traits.update_mean == "rollout_entries" else None
        updates.accumulate(trainer, rollout, plan.train_units, minibatches, scored, advantages, entries)
    grad = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().float().flatten().cpu()
                      for p in params])  # [P]
    trainer.optimizer.zero_grad(set_to_none=True)
    equal = reward_metrics(batch.scores, batch.groups, {})["reward/zero_std_groups"]
    info = {"equal_reward_groups": equal, "reward": float(batch.scores[rewarded].mean()), "taken": taken,
            "seconds": time.perf_counter() - start}
    return grad, info


def measure(algorithm: str, batches: int, seed: int, output: Path,
            overrides: list[str] = ()) -> tuple[dict, torch.Tensor]:
    """The gradients of `batches` rollout batches (training steps 1..`batches` of seed `seed`) of `algorithm` at
    the base weights (its config changed by `overrides`), and their agreement ([`gradient_agreement`],
    [`signal_share`]).

    Returns:
        `(dict, torch.FloatTensor of shape [K, P])`: the table's row, and the gradients.
    """
    trainer = build_trainer(algorithm, seed, output, overrides)
    grads, infos = [], []
    try:
        for step in range(1, batches + 1):
            grad, info = batch_gradient(trainer, step)
            if not torch.isfinite(grad).all():
                raise RuntimeError(f"{algorithm}: the gradient of batch {step} is not finite.")
            grads.append(grad)
            infos.append(info)
            print(f"{algorithm} batch {step}/{batches}: |g| {float(grad.norm()):.3g}, equal-reward groups "
                  f"{info['equal_reward_groups']:.2f}, {info['seconds']:.1f} s", flush=True)
    finally:
        trainer.scoring.close()
    grads = torch.stack(grads)  # [K, P]
    agreement = gradient_agreement(grads, torch.Generator().manual_seed(seed))
    train = trainer.config.train
    row = {"algorithm": algorithm, "config": str(config_path(algorithm).relative_to(ROOT)),
           "overrides": list(overrides), "batches": batches,
           "samples_per_batch": train.prompts_per_step * train.group_size, "minibatch_size": train.minibatch_size,
           "updates_per_step": train.updates_per_step, "learning_rate": train.learning_rate,
           "max_grad_norm": train.max_grad_norm, **agreement, "signal_share": signal_share(gram_of(grads, grads)),
           "equal_reward_groups": sum(i["equal_reward_groups"] for i in infos) / len(infos),
           "reward": sum(i["reward"] for i in infos) / len(infos),
           "updates_not_taken": sum(not i["taken"] for i in infos),
           "seconds_per_batch": sum(i["seconds"] for i in infos) / len(infos), "per_batch": infos}
    return row, grads


def gram_of(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The products ``a_i . b_j`` `[K, K]` of the first `K` rows of gradients `a` and `b` `[K_a, P]`, `[K_b, P]`
    (`K` the smaller count), in float64."""
    k = min(len(a), len(b))
    return a[:k].double() @ b[:k].double().T


def cross_cosines(gradients: dict[str, torch.Tensor]) -> dict[str, dict[str, float | None]]:
    """[`expected_cosine`] of every pair of algorithms in `gradients` (name -> `[K, P]`), over their common batches;
    None where it is NaN (an expected gradient not measurable)."""
    names = list(gradients)
    own = {a: gram_of(gradients[a], gradients[a]) for a in names}  # [K_a, K_a]
    out = {a: {} for a in names}
    for i, a in enumerate(names):
        for b in names[i:]:
            k = min(len(gradients[a]), len(gradients[b]))
            cross = own[a] if a == b else gram_of(gradients[a], gradients[b])  # [k, k]
            value = expected_cosine(cross, own[a][:k, :k], own[b][:k, :k])
            out[a][b] = out[b][a] = None if math.isnan(value) else value
    return out


# ------------------------------------------------------------------------------------------------------ report
def markdown_table(rows: list[dict]) -> str:
    """One row per algorithm: its agreement statistics, equal-reward share, gradient norm and time per batch."""
    lines = ["| algorithm | batches | leave-one-out cosine | pairwise cosine | signal share | SNR mean (noise only) | "
             "SNR median (noise only) | equal-reward groups | rollout reward | mean gradient norm | s per batch |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        name = r["algorithm"] + (f" ({', '.join(r['overrides'])})" if r["overrides"] else "")
        lines.append(
            f"| {name} | {r['batches']} | {r['loo_cosine']:.3f} | {r['pairwise_cosine']:.3f} | "
            f"{r['signal_share']:.3f} | {r['snr_mean']:.3f} ({r['null_snr_mean']:.3f}) | "
            f"{r['snr_median']:.3f} ({r['null_snr_median']:.3f}) | {r['equal_reward_groups']:.2f} | {r['reward']:.3f} | "
            f"{r['grad_norm']:.3g} | {r['seconds_per_batch']:.1f} |")
    return "\n".join(lines) + "\n"


def cosine_table(cosines: dict[str, dict[str, float | None]], shares: dict[str, float]) -> str:
    """The matrix of [`cross_cosines`] as markdown, over the algorithms whose [`signal_share`] (`shares`) is at least
    `MEASURABLE_SHARE`: below it the estimate of ``|E g|`` that the cosine divides by is mostly noise."""
    names = [name for name in cosines if shares[name] >= MEASURABLE_SHARE]
    lines = ["| expected gradient | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for a in names:
        cells = ["n/a" if cosines[a][b] is None else f"{cosines[a][b]:.2f}" for b in names]
        lines.append(f"| {a} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def batch_counts(args: argparse.Namespace) -> dict[str, int]:
    """`K` per algorithm: ``--batches`` unless ``--batches-for ALGORITHM=K`` says otherwise."""
    counts = {name: args.batches for name in args.algorithms}
    for item in args.batches_for:
        name, _, value = item.partition("=")
        if name not in counts or not value.isdigit() or int(value) < 2:
            raise SystemExit(f"--batches-for {item!r}: expected ALGORITHM=K with one of {args.algorithms} and K >= 2")
        counts[name] = int(value)
    return counts


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, required=True, help="folder for table.md and results.json")
    parser.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=ALGORITHMS)
    parser.add_argument("--batches", type=int, default=8, help="rollout batches per algorithm (K >= 2)")
    parser.add_argument("--batches-for", nargs="*", default=[], metavar="ALGORITHM=K", help="another K for one")
    parser.add_argument("--seed", type=int, default=0, help="the training seed whose steps 1..K give the batches")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every measured algorithm (repeatable)")
    args = parser.parse_args(argv)
    if args.batches < 2:
        parser.error("--batches must be at least 2")
    counts = batch_counts(args)
    args.output.mkdir(parents=True, exist_ok=True)
    settings = {"seed": args.seed, "batches": counts, "overrides": args.override, "threads": torch.get_num_threads(),
                "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "null_draws": NULL_DRAWS}
    rows, gradients = [], {}
    for name in args.algorithms:
        row, gradients[name] = measure(name, counts[name], args.seed, args.output, args.override)
        rows.append(row)
        write_report(args.output, {"settings": settings, "rows": rows})  # after each one: a stopped run keeps them
    report = {"settings": settings, "rows": rows, "expected_gradient_cosines": cross_cosines(gradients)}
    print(write_report(args.output, report), end="")
    return report


def write_report(output: Path, report: dict) -> str:
    """Writes `report` as ``results.json`` and its tables as ``table.md`` under `output`; returns the tables."""
    (output / "results.json").write_text(json.dumps(report, indent=2), encoding="utf-8")
    text = markdown_table(report["rows"])
    if "expected_gradient_cosines" in report:
        shares = {row["algorithm"]: row["signal_share"] for row in report["rows"]}
        text += "\n" + cosine_table(report["expected_gradient_cosines"], shares)
    (output / "table.md").write_text(text, encoding="utf-8")
    return text


if __name__ == "__main__":
    main()
