"""Base-trains (supervised) the tiny Qwen2-VL-architecture model shipped as ``mmgrpo:vlm_shapes``.

A random tiny ``Qwen2VLForConditionalGeneration`` (offline BPE tokenizer; the tests' tiny builder
`tests/builders/qwen_vl.py`) learns to answer the
synthetic shapes questions of `vlm_shapes.py` in the R1 layout (``<think>...</think><answer>...</answer>``) by
teacher forcing on the completion tokens. Training stops as soon as the greedy held-out accuracy reaches
``--stop-accuracy`` (checked every ``--eval-every`` steps), so the base model is clearly imperfect and RL has room::

    python scripts/train_vlm_shapes.py --out data/weights/vlm_shapes

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
def held_out_accuracy(path: str, n_eval: int, size: int) -> float:
    from mmgrpo.pipelines.qwen_vl import QwenVLConfig, QwenVLPolicy
    from mmgrpo.prompt_stream import items_to_batch
    from mmgrpo.rewards.accuracy import AccuracyReward
    from mmgrpo.plans import TokenPlan

    policy = QwenVLPolicy(QwenVLConfig(pretrained=path, max_new_tokens=20, lora_rank=0))
    data = VLMShapes(VLMShapesConfig(n_train=0, n_eval=n_eval, size=size))
    reward = AccuracyReward()
    scores = []
    items = data.eval_items()
    for start in range(0, len(items), 50):
        batch = items_to_batch(items[start : start + 50])
        batch.group_ids = torch.arange(len(batch))
        rollout = policy.sample(batch, TokenPlan.deterministic(20))
        scores.append(reward(rollout.outputs, batch).scores)
    return float(torch.cat(scores).nan_to_num(0.0).mean())


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
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    model, processor = build(args.seed, args.hidden, args.layers, args.size)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    source = VLMShapes(VLMShapesConfig(n_train=0, size=args.size))
    start, accuracy, history = time.time(), 0.0, []
    for step in range(1, args.steps + 1):
        indices = [2_000_000 + (step * args.batch + i) for i in range(args.batch)]  # never the RL / eval indices
        items = [source.item(i) for i in indices]
        targets = [target_text(question(i, scene(i, args.size), source.config.tasks)) for i in indices]
        loss = supervised_step(model, optimizer, processor, items, targets)
        if step % args.eval_every == 0:
            model.save_pretrained(args.out)
            processor.save_pretrained(args.out)
            accuracy = held_out_accuracy(args.out, args.n_eval, args.size)
            history.append({"step": step, "loss": round(loss.item(), 4), "held_out_accuracy": accuracy})
            print(json.dumps(history[-1]), flush=True)
            if accuracy >= args.stop_accuracy:
                break
    metrics = {"held_out_accuracy": accuracy, "steps": step, "seconds": round(time.time() - start, 1),
               "args": vars(args), "history": history}
    Path(args.out, "metrics.json").write_text(json.dumps(metrics, indent=2), encoding="utf-8")
    return metrics


if __name__ == "__main__":
    main()
