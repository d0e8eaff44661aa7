"""Which edits of the shapes editing task need the instruction's names, and how well an editor's text encoders tell
those names apart.

Two measurements on `mmgrpo.data.shapes_edit` (the task of ``configs/tiny/edit_shapes.yaml``):

1. **Text-encoder separation** (``--model``, a `FluxKontextPipeline` folder): every instruction the task can write with
   a coloured name ("make the red circle blue", "remove the green square", "move the yellow triangle left") is
   encoded as the pipeline encodes prompts: the T5 token states `[B, L, D]` (flattened) and the CLIP pooled vector
   `[B, D]`. Each vector is centred on the mean over all instructions; the table gives, per kind, the mean cosine
   between instructions that differ in one word only: the named shape, the named colour, or the instruction word
   (the new colour of a recolour, the direction of a move). Near 1: the encoder's output barely tells the two
   instructions apart.
2. **Edits the scene determines** (``--eval NAME=eval/step_*.json`` of ``mmgrpo eval``, one or more): an edit is
   determined by its scene when the scene allows only one edit of its kind with its word (only one shape can move
   left into an empty quadrant; only one shape can be removed), so an editor that does not read which shape is named
   can still get it right. The table gives each evaluation's strict accuracy by kind, on the edits the scene
   determines and on the others, from the per-item values of the evaluation's JSON; the held-out items are rebuilt
   from ``--config``'s ``data`` section with ``--n-eval`` items, as the evaluation built them.

Run (the evaluations first, then this script)::

    HF_HUB_OFFLINE=1 mmgrpo eval configs/tiny/edit_shapes.yaml data.n_eval=1000 eval.num_prompts=1000 \\
        output_dir=outputs/edit_eval_base
    HF_HUB_OFFLINE=1 python bench/edit_grounding.py --model data/weights/edit_shapes \\
        --eval base=outputs/edit_eval_base/eval/step_00000.json --n-eval 1000 --output outputs/edit_grounding
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch

from mmgrpo.data.shapes_edit import DIRECTIONS, KINDS, ShapesEdit, candidates, instruction
from mmgrpo.data.vlm_shapes import COLOURS, SHAPES

ATTRIBUTES = ("shape", "colour", "word")  # the named shape, the named colour, the instruction's own word


def all_instructions() -> list[tuple[str, dict]]:
    """Every instruction with a coloured name: ``(text, {"kind", "shape", "colour", "word"})``."""
    out = []
    for kind, shape, colour in itertools.product(KINDS, SHAPES, COLOURS):
        words = {"remove": [""], "recolor": [c for c in COLOURS if c != colour], "move": list(DIRECTIONS)}[kind]
        for word in words:
            out.append((instruction(kind, f"the {colour} {shape}", word),
                        {"kind": kind, "shape": shape, "colour": colour, "word": word}))
    return out


def separation(embeddings: torch.Tensor, labels: list[dict]) -> dict[str, float]:
    """Mean centred cosine between the rows of `embeddings` `[B, ...]` whose `labels` share the kind and differ in
    exactly one attribute, as ``{"<kind>/<attribute>": cosine}`` (pairs that exist only)."""
    flat = embeddings.flatten(1).double()  # [B, F]
    unit = torch.nn.functional.normalize(flat - flat.mean(0), dim=-1)
    cosines = unit @ unit.T  # [B, B]
    sums: dict[str, list[float]] = {}
    for i, j in itertools.combinations(range(len(labels)), 2):
        a, b = labels[i], labels[j]
        differing = [name for name in ATTRIBUTES if a[name] != b[name]]
        if a["kind"] == b["kind"] and len(differing) == 1:
            sums.setdefault(f"{a['kind']}/{differing[0]}", []).append(float(cosines[i, j]))
    return {key: sum(values) / len(values) for key, values in sorted(sums.items())}


def encoder_separation(model: str, max_sequence_length: int) -> dict[str, dict[str, float]]:
    """[`separation`] of the T5 token states and the CLIP pooled vector of the pipeline in folder `model`."""
    from diffusers import FluxKontextPipeline

    pipe = FluxKontextPipeline.from_pretrained(model)
    texts, labels = zip(*all_instructions())
    with torch.no_grad():
        tokens, pooled, _ = pipe.encode_prompt(prompt=list(texts), prompt_2=list(texts),
                                               max_sequence_length=max_sequence_length)  # [B, L, D], [B, D]
    return {"T5 token states": separation(tokens, list(labels)), "CLIP pooled": separation(pooled, list(labels))}


def scene_choices(item: dict) -> int:
    """How many edits of the item's kind and word its scene allows, whichever shape is named (1: the scene
    determines the edit)."""
    kind = item["metadata"]["kind"]
    word = item["metadata"]["word"]
    size = item["metadata"]["source_image"].shape[-1]
    return sum(1 for _, w, _ in candidates(item["metadata"]["scene"], kind, size) if w == word)


def per_item_values(path: Path) -> dict[int, float]:
    """Held-out index -> metric value from an ``eval/step_*.json`` (unscorable items left out)."""
    rows = json.loads(path.read_text(encoding="utf-8"))
    return {index: value for row in rows for index, value in zip(row["items"], row["values"]) if value is not None}


def determined_breakdown(values: dict[int, float], items: list[dict]) -> dict[str, tuple[float, int]]:
    """Mean value and count by ``<kind>/determined`` and ``<kind>/named`` (the scene allows several edits: the name
    decides) over the items that have a value."""
    groups: dict[str, list[float]] = {}
    for index, value in values.items():
        item = items[index]
        key = "determined" if scene_choices(item) == 1 else "named"
        groups.setdefault(f"{item['metadata']['kind']}/{key}", []).append(value)
    return {key: (sum(v) / len(v), len(v)) for key, v in sorted(groups.items())}


def held_out_items(config_path: str, n_eval: int) -> list[dict]:
    """The held-out items of the config (loaded and validated as ``mmgrpo eval`` loads it, with ``data.n_eval`` set
    to `n_eval`), whose prompt source must be `shapes_edit`."""
    from mmgrpo import config as config_mod

    config = config_mod.load(config_path, [f"data.n_eval={n_eval}"])
    if config.data.name != "shapes_edit":
        raise SystemExit(f"{config_path}: data.name must be shapes_edit for this measurement.")
    return ShapesEdit(config.data.options).eval_items()


def tables(encoders: dict[str, dict[str, float]] | None, breakdowns: dict[str, dict[str, tuple[float, int]]]) -> str:
    """The markdown tables of both measurements."""
    lines = []
    if encoders:
        measured = next(iter(encoders.values()))
        keys = [f"{kind}/{name}" for kind in KINDS for name in ATTRIBUTES if f"{kind}/{name}" in measured]
        lines += ["| encoder | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
        lines += [f"| {name} | " + " | ".join(f"{values[k]:.2f}" for k in keys) + " |"
                  for name, values in encoders.items()]
        lines.append("")
    if breakdowns:
        keys = sorted({k for b in breakdowns.values() for k in b})
        counts = next(iter(breakdowns.values()))
        lines += ["| evaluation | " + " | ".join(f"{k} (n={counts[k][1]})" if k in counts else k for k in keys) + " |",
                  "|---|" + "---|" * len(keys)]
        lines += [f"| {name} | " + " | ".join(f"{b[k][0]:.3f}" if k in b else "" for k in keys) + " |"
                  for name, b in breakdowns.items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="a FluxKontextPipeline folder whose text encoders are measured")
    parser.add_argument("--max-sequence-length", type=int, default=8, help="T5 tokens, as the config's pipeline")
    parser.add_argument("--eval", action="append", default=[], metavar="NAME=PATH",
                        help="an evaluation's eval/step_*.json, under a name for the table (repeatable)")
    parser.add_argument("--config", default="configs/tiny/edit_shapes.yaml", help="the config the evaluations ran")
    parser.add_argument("--n-eval", type=int, default=1000, help="the evaluations' data.n_eval")
    parser.add_argument("--output", required=True, help="folder for table.md and results.json")
    args = parser.parse_args(argv)
    named = [spec.split("=", 1) for spec in args.eval]
    if any(len(pair) != 2 for pair in named):
        raise SystemExit("--eval takes NAME=PATH, e.g. --eval base=outputs/edit_eval_base/eval/step_00000.json")
    encoders = encoder_separation(args.model, args.max_sequence_length) if args.model else None
    items = held_out_items(args.config, args.n_eval) if named else []
    breakdowns = {name: determined_breakdown(per_item_values(Path(path)), items) for name, path in named}
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    text = tables(encoders, breakdowns)
    (output / "table.md").write_text(text, encoding="utf-8")
    (output / "results.json").write_text(json.dumps({"encoders": encoders, "breakdowns": breakdowns}, indent=1))
    print(text)


if __name__ == "__main__":
    main()
