"""Rewards scored while the next chunk samples (``train.sample_chunks``, ``train.overlap_scoring``): wall time per
training step with a reward of injected latency, one chunk against chunks scored after each other against chunks
scored while the next one samples.

The run is the tiny text-to-image default (``configs/tiny/t2i_shapes.yaml``: DGPO on the shipped SD3-architecture toy)
with fewer prompts per step and the reward replaced by a plain function reward ([`latency_reward`]) that waits
``--call-s`` seconds per call plus ``--sample-s`` seconds per sample (time that releases the GIL, as a reward server or
a VLM judge over HTTP does) and returns each image's mean brightness. Three trainers are built once:

- ``1 chunk``: ``sample_chunks: 1``, the reward called once per step after sampling;
- ``K chunks, synchronous``: ``sample_chunks: K``, ``overlap_scoring: false`` (each chunk scored right after it);
- ``K chunks, overlapped``: ``sample_chunks: K``, ``overlap_scoring: true``.

They then take turns, ``--steps`` training steps each per round, for ``--rounds`` rounds (the order rotated every
round, so a slow spell of the shared machine does not fall on one mode); the first round is a warm-up and not counted.
The table gives, per mode, the reward time the trainer's thread was not spared (the median over steps of the time it
spent in reward calls or waiting for the worker: ``ChunkedScoring.last.exposed_s``, which the machine's load barely
moves), then the median wall time of a step (``time/step_s``: sampling, reward, updates), its range, and its ratio to
the one-chunk and the synchronous-chunks medians. The two
K-chunk trainers compute the same numbers bit for bit (tested in ``tests/core/test_overlapped_scoring.py``); against
one chunk the noise differs.

Run from the repository root:

    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 OMP_NUM_THREADS=1 nice -n 5 .venv/bin/python bench/overlap.py \\
        --output outputs/bench_overlap

Writes ``results.json`` and ``table.md`` under ``--output`` and prints the table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def latency_reward(outputs, batch, call_s: float = 0.0, sample_s: float = 0.0):
    """Mean brightness of each image, after waiting ``call_s + sample_s * n`` seconds (a reward's latency)."""
    time.sleep(call_s + sample_s * len(batch))
    return outputs["images"].mean(dim=(1, 2, 3))


def modes(chunks: int) -> list[tuple[str, int, bool]]:
    """(label, train.sample_chunks, train.overlap_scoring) of each trainer."""
    return [("1 chunk", 1, True), (f"{chunks} chunks, synchronous", chunks, False),
            (f"{chunks} chunks, overlapped", chunks, True)]


def build(args, label: str, chunks: int, overlap: bool):
    """A trainer of the tiny text-to-image config with the latency reward and this mode's options."""
    from mmgrpo import config as config_mod, registry
    from mmgrpo.config_yaml import read_yaml
    from mmgrpo.trainer import Trainer

    registry.allow_user_code()  # the reward is this script's function
    if latency_reward.__module__ not in sys.modules:  # loaded from its file by a test: importable by its name
        holder = types.ModuleType(latency_reward.__module__)
        holder.latency_reward = latency_reward
        sys.modules[latency_reward.__module__] = holder
    raw = read_yaml(ROOT / "configs/tiny/t2i_shapes.yaml")
    raw["output_dir"] = str(args.output / label.replace(" ", "_").replace(",", ""))
    raw["reward"] = {"name": f"{latency_reward.__module__}:latency_reward", "modalities": ["image"],
                     "kwargs": {"call_s": args.call_s, "sample_s": args.sample_s}}
    raw["pipeline"]["num_steps"] = args.num_steps
    raw["train"].update(prompts_per_step=args.prompts, group_size=args.group, sample_chunks=chunks,
                        overlap_scoring=overlap)
    raw["eval"]["every"], raw["checkpoint"]["every"] = 0, 0
    raw["tracking"] = {"log_with": []}
    return Trainer(config_mod.from_dict(raw))


def run(args) -> dict:
    """Builds the trainers, runs the interleaved rounds and returns every step's wall time by mode."""
    import torch

    torch.set_num_threads(args.threads)
    trainers = {label: build(args, label, chunks, overlap) for label, chunks, overlap in modes(args.chunks)}
    labels = list(trainers)
    times: dict[str, list[float]] = {label: [] for label in labels}
    exposed: dict[str, list[float]] = {label: [] for label in labels}  # reward time the trainer's thread waited
    for r in range(args.rounds):
        order = labels[r % len(labels):] + labels[: r % len(labels)]
        for label in order:
            trainer = trainers[label]
            for _ in range(args.steps):
                trainer.step += 1
                seconds = trainer.timed_train_step()["time/step_s"]
                if r > 0:  # round 0 warms up
                    times[label].append(seconds)
                    exposed[label].append(trainer.scoring.last.exposed_s)
        print(f"round {r}: " + ", ".join(f"{k} {statistics.median(v):.2f} s" for k, v in times.items() if v),
              flush=True)
    return {"step_s": times, "reward_exposed_s": exposed}


def table(measured: dict[str, dict[str, list[float]]], args) -> str:
    """The markdown table: the latency the reward adds per step, the part of it the trainer's thread waited for, and
    the step times (medians and range)."""
    samples = args.prompts * args.group
    times, exposed = measured["step_s"], measured["reward_exposed_s"]
    rows = ["| mode | reward calls per step | reward latency per step (s) | reward time not hidden (s) | "
            "step time, median (s) | range (s) | vs 1 chunk | vs synchronous chunks |", "|---|---|---|---|---|---|---|---|"]
    one, sync = (statistics.median(times[label]) for label, _, _ in modes(args.chunks)[:2])
    for label, chunks, _ in modes(args.chunks):
        values = times[label]
        median = statistics.median(values)
        latency = chunks * args.call_s + samples * args.sample_s
        rows.append(f"| {label} | {chunks} | {latency:.2f} | {statistics.median(exposed[label]):.2f} | {median:.2f} | "
                    f"{min(values):.2f}-{max(values):.2f} | {median / one:.2f}x | {median / sync:.2f}x |")
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=Path("outputs/bench_overlap"))
    parser.add_argument("--chunks", type=int, default=4, help="train.sample_chunks of the chunked modes")
    parser.add_argument("--prompts", type=int, default=4, help="train.prompts_per_step")
    parser.add_argument("--group", type=int, default=8, help="train.group_size")
    parser.add_argument("--num-steps", type=int, default=10, help="denoising steps of a rollout")
    parser.add_argument("--call-s", type=float, default=0.2, help="reward latency per call (s)")
    parser.add_argument("--sample-s", type=float, default=0.0, help="reward latency per sample (s)")
    parser.add_argument("--rounds", type=int, default=4, help="rounds, the first one a warm-up")
    parser.add_argument("--steps", type=int, default=2, help="steps of each mode per round")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args(argv)
    if args.rounds < 2:
        parser.error("--rounds must be >= 2 (the first round is a warm-up)")
    args.output.mkdir(parents=True, exist_ok=True)
    measured = run(args)
    text = table(measured, args)
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    (args.output / "results.json").write_text(json.dumps({"settings": settings, **measured}, indent=2))
    (args.output / "table.md").write_text(text)
    print(text)
    return measured


if __name__ == "__main__":
    main()
