"""Base-trains (supervised) the tiny Qwen2-VL-architecture model shipped as ``mmgrpo:vlm_shapes``.

A random tiny ``Qwen2VLForConditionalGeneration`` (offline BPE tokenizer; the tests' tiny builder
`tests/builders/qwen_vl.py`) learns to answer the
synthetic shapes questions of `vlm_shapes.py` in the R1 layout (``<think>...</think><answer>...</answer>``) by
teacher forcing on the completion tokens. Training stops as soon as the greedy held-out accuracy reaches
``--stop-accuracy`` (checked every ``--eval-every`` steps), so the base model is clearly imperfect and RL has room::

    python scripts/train_vlm_shapes.py --out data/weights/vlm_shapes

``--max-objects N`` (below 4) draws every training and held-out scene with at most N shapes, as an RL config with
``data.max_objects: N`` and ``data.ood: true`` does (``mmgrpo:vlm_shapes_in_dist``, ``--max-objects 3``): the base
never sees a scene of the ``ood`` split (more than N shapes) or a count above N, so that split is out of distribution
for it too. Its accuracy on the ``ood`` split is then recorded as well (``held_out_ood_accuracy``; it does not decide
when training stops)::

    python scripts/train_vlm_shapes.py --max-objects 3 --out data/weights/vlm_shapes_in_dist

Writes the model, the processor and ``metrics.json`` (held-out accuracy, steps, seconds) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tiny-model builders (tests/builders/)

import torch

from mmgrpo.data.vlm_shapes import COLOURS, NUMBERS, SHAPES, TEMPLATE, VLMShapes, VLMShapesConfig, question, scene, target_text

from builders._tokenizers import QWEN_CORPUS, qwen_tokenizer
from builders.qwen_vl import tiny_qwen_vl


def build(seed: int, hidden: int, layers: int, size: int):
    words = " ".join([*COLOURS, *SHAPES, *NUMBERS, "none", "How many shapes are there? What colour is the I see",
                      TEMPLATE, "<think></think><answer></answer>", "the is"] * 3)
    tokenizer = qwen_tokenizer(QWEN_CORPUS + " " + words, vocab_size=420)
    return tiny_qwen_vl("qwen2_vl", seed=seed, hidden_size=hidden, num_layers=layers, min_pixels=size * size,
                        max_pixels=size * size, tokenizer=tokenizer)


def training_batch(source: VLMShapes, step: int, batch: int) -> tuple[list[dict], list[str]]:
    """The `batch` training items of `step` and their target completions: scenes drawn as `source`'s options say
    (``size``, ``max_objects``, ``tasks``), from indices that no RL training, ``eval`` or ``ood`` item uses."""
    c = source.config
    indices = [2_000_000 + (step * batch + i) for i in range(batch)]
    scenes = [scene(i, c.size, c.max_objects) for i in indices]
    items = [source.item(i, shapes) for i, shapes in zip(indices, scenes)]
    return items, [target_text(question(i, shapes, c.tasks)) for i, shapes in zip(indices, scenes)]


def batch_inputs(processor, items: list[dict], targets: list[str]) -> dict:
    """Right-padded prompt + target tensors with ``labels`` on the target tokens only."""
    processor.tokenizer.padding_side = "right"  # prompt tokens first: the prompt length masks the labels
    messages = [[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": it["prompt"]}]}] for it in items]
    prompts = [processor.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in messages]
    images = [it["images"][0] for it in items]
    full = processor(text=[p + t + "<|im_end|>" for p, t in zip(prompts, targets)], images=images, padding=True,
                     return_tensors="pt")
    prompt_only = processor(text=prompts, images=images, padding=True, return_tensors="pt")
    labels = full["input_ids"].clone()
    for row, length in enumerate(prompt_only["attention_mask"].sum(dim=1).tolist()):
        labels[row, :length] = -100
    labels[full["attention_mask"] == 0] = -100
    full["labels"] = labels
    return full


def supervised_step(model, optimizer, processor, items: list[dict], targets: list[str]) -> torch.Tensor:
    """One teacher-forced update on `targets` (the completions of `items`), gradient norm clipped at 1; returns the
    loss."""
    loss = model(**batch_inputs(processor, items, targets)).loss
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return loss


@torch.no_grad()
def held_out_accuracy(path: str, n_eval: int, size: int, max_objects: int = 4,
                      splits: tuple[str, ...] = ("eval",)) -> dict[str, float]:
    """The greedy answer accuracy of the model at `path` on the first `n_eval` items of each held-out split in
    `splits` of `vlm_shapes` (``eval``, and ``ood`` with `max_objects` below 4), as the RL config's evaluation draws
    them; the model is loaded once for all of them."""
    from mmgrpo.pipelines.qwen_vl import QwenVLConfig, QwenVLPolicy
    from mmgrpo.prompt_stream import items_to_batch
    from mmgrpo.rewards.accuracy import AccuracyReward
    from mmgrpo.plans import TokenPlan

    policy = QwenVLPolicy(QwenVLConfig(pretrained=path, max_new_tokens=20, lora_rank=0))
    data = VLMShapes(VLMShapesConfig(n_train=0, n_eval=n_eval, size=size, max_objects=max_objects,
                                     ood="ood" in splits))
    reward = AccuracyReward()
    held_out = data.eval_splits()
    accuracies = {}
    for split in splits:
        scores, items = [], held_out[split]
        for start in range(0, len(items), 50):
            batch = items_to_batch(items[start : start + 50])
            batch.group_ids = torch.arange(len(batch))
            rollout = policy.sample(batch, TokenPlan.deterministic(20))
            scores.append(reward(rollout.outputs, batch).scores)
        accuracies[split] = float(torch.cat(scores).nan_to_num(0.0).mean())
    return accuracies


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="data/weights/vlm_shapes")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--size", type=int, default=56)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--n-eval", type=int, default=100)
    parser.add_argument("--stop-accuracy", type=float, default=0.45)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-objects", type=int, default=4, choices=range(1, 5),
                        help="at most this many shapes per training and held-out scene (the RL config's "
                             "data.max_objects); below 4 the ood split's accuracy is recorded too")
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    model, processor = build(args.seed, args.hidden, args.layers, args.size)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    source = VLMShapes(VLMShapesConfig(n_train=0, size=args.size, max_objects=args.max_objects))
    start, accuracy, history = time.time(), 0.0, []
    for step in range(1, args.steps + 1):
        items, targets = training_batch(source, step, args.batch)
        loss = supervised_step(model, optimizer, processor, items, targets)
        if step % args.eval_every == 0:
            model.save_pretrained(args.out)
            processor.save_pretrained(args.out)
            splits = ("eval", "ood") if args.max_objects < 4 else ("eval",)  # ood: recorded only, the stop reads eval
            scores = held_out_accuracy(args.out, args.n_eval, args.size, args.max_objects, splits)
            accuracy = scores["eval"]
            history.append({"step": step, "loss": round(loss.item(), 4), "held_out_accuracy": accuracy})
            if "ood" in scores:
                history[-1]["held_out_ood_accuracy"] = scores["ood"]
            print(json.dumps(history[-1]), flush=True)
            if accuracy >= args.stop_accuracy:
                break
    ood = args.max_objects < 4 and history
    extra = {"held_out_ood_accuracy": history[-1]["held_out_ood_accuracy"]} if ood else {}
    metrics = {"held_out_accuracy": accuracy, **extra, "steps": step, "seconds": round(time.time() - start, 1),
               "args": vars(args), "history": history}
    Path(args.out, "metrics.json").write_text(json.dumps(metrics, indent=2), encoding="utf-8")
    return metrics


if __name__ == "__main__":
    main()
