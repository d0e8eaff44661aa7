"""Base-trains (supervised) the tiny Qwen2-VL-architecture model shipped as ``mmgrpo:vlm_seg``: it answers the
referring questions of `seg_shapes` ("the red triangle", "the circle", "the largest blue shape") in Seg-Zero's layout,

    <think>top left red circle, top right none, bottom left blue square, bottom right red triangle: bottom
    right</think><answer>{"bbox": [x1, y1, x2, y2], "points_1": [x, y], "points_2": [x, y]}</answer>

(each quadrant followed by the shape in it, then the quadrant of the named one; then its tight box and two points
inside it, whole pixels of the 56 x 56 image). ``--thought list`` writes the four shapes without their quadrants
(``red circle, none, blue square, red triangle: bottom right``): the model learns the same inventory, but then names
the right quadrant for only about half of the questions, and GRPO did not improve on such a base. ``--thought match``
goes through the quadrants up to the named shape's, each with a yes / no (``top left blue circle no, top right red
triangle yes``); the layouts are `mmgrpo.data.seg_shapes.target_text`'s.

The shipped ``vlm_shapes`` base (a tiny Qwen2-VL whose vision tower already tells the colours of the quadrants
apart; ``--init ''`` starts instead from a random tiny model of the tests' builder `tests/builders/qwen_vl.py` with a
byte-level BPE learnt offline from the prompt and the words of the task) learns by teacher forcing on the completion
tokens, from scene indices that neither the RL training nor the held-out items use, with a short prompt (`TEMPLATE`;
the RL config uses the same). Every ``--eval-every`` steps the greedy answers to the held-out items go through the
shipped tiny SAM 2 (the `sam_mask` reward, ``coords: original``); training stops after ``--steps`` or as soon as the
held-out gIoU (mean IoU of the masks) reaches ``--stop-giou``, so the base model is clearly imperfect and RL has
room::

    python scripts/train_vlm_seg.py --out data/weights/vlm_seg --sam data/weights/tiny_sam2

``--prior-quadrant`` / ``--prior-share`` skew the supervised questions towards one quadrant (the held-out ones stay
uniform), ``--final-lr-ratio`` lets the learning rate decay along a cosine; with ``--init data/weights/vlm_seg`` they
continue the shipped base into the skewed bases of `docs/results/seg_shapes_top_left.md`; ``--ood`` trains the
default's base (`docs/results/seg_shapes.md`).

Writes the model, the processor and ``metrics.json`` (held-out gIoU / cIoU curve, steps, seconds) to ``--out``;
with ``--keep``, the model of every evaluation too, in ``OUT/checkpoint-STEP``. ``--eval-seed`` evaluates on other
scenes than the RL configs' held-out ones, so that a base (a step, a skew) can be chosen on validation scenes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the tiny-model builders (tests/builders/)
sys.path.insert(0, str(ROOT / "scripts"))

import torch  # noqa: E402

from builders._tokenizers import QWEN_CORPUS, qwen_tokenizer  # noqa: E402
from builders.qwen_vl import tiny_qwen_vl  # noqa: E402
from mmgrpo.data.seg_shapes import QUADRANTS, THOUGHTS, SegShapes, SegShapesConfig, target_quadrant  # noqa: E402
from mmgrpo.sections import TrainConfig  # noqa: E402
from mmgrpo.data.vlm_shapes import COLOURS, SHAPES  # noqa: E402
from mmgrpo.optim import build_optimizer  # noqa: E402
from train_vlm_shapes import supervised_step  # noqa: E402

TEMPLATE = 'Find "{question}": the box and two points, as JSON.'  # short: the tiny model reads it in every step
SFT_FIRST = 2_000_000  # scene indices of the supervised data (RL trains from 0, evaluates from 500_000)


def build(seed: int, hidden: int, layers: int, size: int, vocab: int):
    words = " ".join([*COLOURS, *SHAPES, *QUADRANTS, "the largest shape none, yes no", TEMPLATE,
                      '<think></think><answer>{"bbox": [], "points_1": [], "points_2": []}</answer>'] * 3)
    tokenizer = qwen_tokenizer(QWEN_CORPUS + " " + words, vocab_size=vocab)
    return tiny_qwen_vl("qwen2_vl", seed=seed, hidden_size=hidden, num_layers=layers, min_pixels=size * size,
                        max_pixels=size * size, tokenizer=tokenizer)


@torch.no_grad()
def deepen(model, extra: int) -> None:
    """Appends `extra` decoder layers to the text model of the Qwen2-VL `model`, each starting as the identity (its
    attention output and MLP down-projections zeroed, so the residual stream passes unchanged and the model answers
    as before); the config's layer count follows, so ``save_pretrained`` / ``from_pretrained`` keep them."""
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLDecoderLayer

    text = model.model.language_model
    config = model.config.text_config
    first = config.num_hidden_layers
    config.num_hidden_layers = first + extra
    config.layer_types = list(config.layer_types) + [config.layer_types[-1]] * extra
    for index in range(first, first + extra):
        layer = Qwen2VLDecoderLayer(config, layer_idx=index)
        for module in layer.modules():
            if isinstance(module, torch.nn.Linear):
                torch.nn.init.normal_(module.weight, std=config.initializer_range)
                if module.bias is not None:
                    torch.nn.init.zeros_(module.bias)
        torch.nn.init.zeros_(layer.self_attn.o_proj.weight)
        torch.nn.init.zeros_(layer.mlp.down_proj.weight)
        text.layers.append(layer)


def optimizer_config(args: argparse.Namespace) -> TrainConfig:
    """The optimisation of the supervised run as the trainer's `TrainConfig`, for `mmgrpo.optim.build_optimizer`:
    AdamW at ``--lr`` without weight decay, constant, or with ``--final-lr-ratio`` below 1 a cosine down to that
    fraction of it at the last of the ``--steps`` updates."""
    return TrainConfig(max_steps=args.steps, learning_rate=args.lr, weight_decay=0.0, min_lr_ratio=args.final_lr_ratio,
                       lr_schedule="constant" if args.final_lr_ratio == 1 else "cosine")


class QuadrantPrior:
    """Admits items so that a share `share` of those admitted name a shape in `quadrant`: an item is taken when its
    side (in `quadrant` or not) is below its quota of the admitted items counting it, so after `n` admitted items the
    count in `quadrant` is within 1 of ``share * n`` (deterministic; the others wait). With `quadrant` None, every
    item."""

    def __init__(self, quadrant: str | None, share: float | None):
        self.quadrant = None if quadrant is None else QUADRANTS.index(quadrant)
        self.share, self.taken, self.inside = share, 0, 0

    def admits(self, item: dict) -> bool:
        if self.quadrant is None:
            return True
        inside = target_quadrant(item["metadata"]) == self.quadrant
        wanted = self.inside < self.share * (self.taken + 1) if inside else \
            self.taken - self.inside < (1 - self.share) * (self.taken + 1)
        if wanted:
            self.taken, self.inside = self.taken + 1, self.inside + int(inside)
        return wanted


def supervised_source(args: argparse.Namespace) -> SegShapes:
    """The script's `seg_shapes` source: items with their supervised completion, whose held-out items are the scenes
    of ``--eval-seed`` (the supervised stream itself is read by scene index from `SFT_FIRST` on, whatever the seed);
    with ``--ood``, no item asks a combination of `seg_shapes.HELD_OUT` but those of the ``ood`` split."""
    return SegShapes(SegShapesConfig(n_train=0, n_eval=args.n_eval, size=args.size, prompt_template=args.template,
                                     with_targets=True, thought=args.thought,  # metadata["completion"]: the target
                                     seed=args.eval_seed, ood=args.ood))


@torch.no_grad()
def held_out(path: str, sam: str, splits: dict[str, list[dict]], max_new_tokens: int) -> dict[str, dict]:
    """Greedy answers of the model at `path` to the items of each split in `splits`, scored through the tiny SAM 2 at
    `sam`: per split, gIoU, cIoU, and the share of answers without a usable box. The model and the segmenter are
    loaded once for all splits."""
    from mmgrpo.pipelines.qwen_vl import QwenVLConfig, QwenVLPolicy
    from mmgrpo.prompt_stream import items_to_batch
    from mmgrpo.rewards.sam_mask import SamMask, SamMaskConfig
    from mmgrpo.plans import TokenPlan

    policy = QwenVLPolicy(QwenVLConfig(pretrained=path, max_new_tokens=max_new_tokens, lora_rank=0))
    reward = SamMask(SamMaskConfig(model=sam, coords="original", device="cpu", attach_masks=False))
    scores = {}
    for split, items in splits.items():
        columns = {"iou": [], "intersection": [], "union": [], "no_box": []}
        for start in range(0, len(items), 50):
            batch = items_to_batch(items[start : start + 50])
            batch.group_ids = torch.arange(len(batch))
            rollout = policy.sample(batch, TokenPlan.deterministic(max_new_tokens))
            result = reward(rollout.outputs, batch)
            for name in columns:
                columns[name].append(result.components[name])
        c = {name: torch.cat(v) for name, v in columns.items()}  # [n] each
        scores[split] = {"giou": float(c["iou"].mean()), "ciou": float(c["intersection"].mean() / c["union"].mean()),
                         "no_box": float(c["no_box"].mean())}
    return scores


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="data/weights/vlm_seg")
    parser.add_argument("--sam", default="data/weights/tiny_sam2", help="the segmenter the held-out gIoU goes through")
    parser.add_argument("--steps", type=int, default=1600)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1.5e-3)
    parser.add_argument("--final-lr-ratio", type=float, default=1.0,
                        help="the learning rate follows a cosine from --lr to this fraction of it at the last of "
                             "--steps (1: constant; a decay ends the run at a settled model rather than wherever the "
                             "noise is)")
    parser.add_argument("--template", default=TEMPLATE, help="seg_shapes' prompt_template (the RL config's too)")
    parser.add_argument("--init", default="data/weights/vlm_shapes",
                        help="start from this model folder ('': a random tiny model with its own tokenizer)")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--extra-layers", type=int, default=0,
                        help="decoder layers appended to the --init model's text model, starting as the identity")
    parser.add_argument("--vocab", type=int, default=600)
    parser.add_argument("--size", type=int, default=56)
    parser.add_argument("--max-new-tokens", type=int, default=144)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--n-eval", type=int, default=100)
    parser.add_argument("--eval-seed", type=int, default=0,
                        help="seg_shapes' data.seed of the evaluated scenes: 0, the RL configs' held-out scenes; "
                             "another seed, validation scenes that neither those configs nor the supervised stream use "
                             "(to choose a base without looking at the held-out set)")
    parser.add_argument("--ood", action="store_true",
                        help="never train on a question whose (kind, shape, colour) combination seg_shapes' data.ood "
                             "holds out, and record the held-out gIoU of its ood split too (the base of an RL config "
                             "with data.ood: true, for which that split is then out of distribution)")
    parser.add_argument("--keep", action="store_true",
                        help="also keep the model of every evaluation in OUT/checkpoint-STEP (--out is overwritten)")
    parser.add_argument("--stop-giou", type=float, default=0.55)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prior-quadrant", choices=list(QUADRANTS), default=None,
                        help="skew the supervised questions towards this quadrant (with --prior-share)")
    parser.add_argument("--prior-share", type=float, default=None,
                        help="the share of supervised questions whose named shape lies in --prior-quadrant (a "
                             "uniform stream has about 0.25); the held-out questions stay uniform")
    parser.add_argument("--thought", choices=list(THOUGHTS), default="labelled",
                        help="the inventory in <think> (seg_shapes' data.thought): the four shapes in reading order, "
                             "each after its quadrant, or each up to the target's with a yes / no match")
    args = parser.parse_args(argv)
    if args.extra_layers < 0 or (args.extra_layers and not args.init):
        parser.error(f"--extra-layers {args.extra_layers}: give a count >= 0, appended to an --init model "
                     "(a random model takes its depth from --layers)")
    if not 0 < args.final_lr_ratio <= 1:
        parser.error(f"--final-lr-ratio {args.final_lr_ratio}: give a fraction in (0, 1] (1: constant rate)")
    if (args.prior_quadrant is None) != (args.prior_share is None) or (
            args.prior_share is not None and not 0 < args.prior_share < 1):
        parser.error("--prior-quadrant and --prior-share go together, the share strictly between 0 and 1 (got "
                     f"{args.prior_quadrant!r}, {args.prior_share!r})")
    torch.manual_seed(args.seed)
    if args.init:  # a trained model and its processor (e.g. the shipped vlm_shapes base)
        from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

        model = Qwen2VLForConditionalGeneration.from_pretrained(args.init)
        processor = AutoProcessor.from_pretrained(args.init)
        deepen(model, args.extra_layers)
    else:
        model, processor = build(args.seed, args.hidden, args.layers, args.size, args.vocab)
    model.train()
    optimizer, schedule = build_optimizer(model.parameters(), optimizer_config(args))
    source = supervised_source(args)
    splits = source.eval_splits()  # eval (and ood with --ood): the stop rule reads eval
    longest = 0
    for index in range(SFT_FIRST, SFT_FIRST + 200):
        item = source.item(index)
        if item is not None:
            longest = max(longest, len(processor.tokenizer(item["metadata"]["completion"])["input_ids"]))
    if longest + 2 > args.max_new_tokens:
        raise ValueError(f"--max-new-tokens {args.max_new_tokens} cannot hold a {longest}-token answer; raise it.")
    prior = QuadrantPrior(args.prior_quadrant, args.prior_share)
    start, scores, history, index = time.time(), {"giou": 0.0}, [], SFT_FIRST  # never the RL / held-out scenes
    for step in range(1, args.steps + 1):
        items, targets = [], []
        while len(items) < args.batch:  # fresh scenes every step
            item = source.item(index)
            if item is not None and prior.admits(item):
                items.append(item)
                targets.append(item["metadata"]["completion"])
            index += 1
        loss = supervised_step(model, optimizer, processor, items, targets)
        schedule.step()
        if step % args.eval_every == 0:
            model.save_pretrained(args.out)
            processor.save_pretrained(args.out)
            by_split = held_out(args.out, args.sam, splits, args.max_new_tokens)
            scores = by_split["eval"]
            if args.ood:
                scores["ood"] = by_split["ood"]
            model.train()
            if args.keep:
                model.save_pretrained(Path(args.out, f"checkpoint-{step}"))
                processor.save_pretrained(Path(args.out, f"checkpoint-{step}"))
            history.append({"step": step, "loss": round(loss.item(), 4), **scores,
                            "seconds": round(time.time() - start, 1)})
            print(json.dumps(history[-1]), flush=True)
            if scores["giou"] >= args.stop_giou:
                break
    metrics = {"held_out_giou": scores["giou"], "held_out_ciou": scores.get("ciou"), "steps": step,
               "seconds": round(time.time() - start, 1), "answer_tokens": longest, "args": vars(args),
               "history": history}
    Path(args.out, "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n", encoding="utf-8")
    return metrics


if __name__ == "__main__":
    main()
