"""Base-trains the tiny masked-diffusion LM shipped as ``mmgrpo:mdlm_arith`` on multi-digit addition.

``python scripts/train_mdlm_arith.py [--output data/weights/mdlm_arith]`` from the repository root. The model is the
bidirectional Llama of the tests' tiny builder (`tests/builders/mdlm.py`); training is LLaDA's masked-diffusion SFT
(mask each completion token with probability ``t ~ U(0, 1)``, cross-entropy on the masked tokens divided by `t`,
prompt never masked) on ``"042+517="`` -> ``"559"`` plus EOS padding to `gen_length`. Training stops at the first evaluation whose held-out greedy accuracy
(the pipeline's decoding: full diffusion, one token per step, low-confidence remasking) reaches ``--stop-at``, so the
shipped model is deliberately imperfect and RL has room to improve it. Writes the model, tokenizer and
``metrics.json`` (the accuracy curve).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the tiny-model builders (tests/builders/)

import torch

from mmgrpo.data.arith import ArithConfig, addition_pairs, format_prompt
from mmgrpo.samplers.masked_diffusion import make_schedule, unmask_step

from builders.mdlm import tiny_mdlm


def encode(tokenizer, a: int, b: int, digits: int, gen_length: int) -> tuple[list[int], list[int]]:
    """Prompt ids and completion ids (the sum, then EOS up to `gen_length`)."""
    prompt = tokenizer(format_prompt(a, b, digits), add_special_tokens=False)["input_ids"]
    answer = tokenizer(str(a + b), add_special_tokens=False)["input_ids"]
    return prompt, answer + [tokenizer.eos_token_id] * (gen_length - len(answer))


def aligned_logits(model, ids: torch.Tensor, mask_id: int) -> torch.Tensor:
    """Logits `[n, T, V]` with the mask token never predicted (as the `mdlm` pipeline)."""
    logits = model(input_ids=ids).logits.float()
    logits[..., mask_id] = float("-inf")
    return logits


@torch.no_grad()
def accuracy(model, tokenizer, pairs, digits: int, gen_length: int) -> float:
    """Held-out accuracy of greedy low-confidence decoding, one token per step, full diffusion."""
    model.eval()
    mask_id, eos = tokenizer.mask_token_id, tokenizer.eos_token_id
    schedule = make_schedule(gen_length, gen_length, gen_length, "fixed")
    prompts = torch.tensor([encode(tokenizer, a, b, digits, gen_length)[0] for a, b in pairs])  # [n, P]
    completion = torch.full((len(pairs), gen_length), mask_id)
    for k in schedule.tokens_per_step:
        logits = aligned_logits(model, torch.cat([prompts, completion], 1), mask_id)[:, prompts.shape[1]:]
        completion = unmask_step(logits, completion, completion == mask_id, k, temperature=0.0,
                                 remasking="low_confidence").state
    correct = 0
    for (a, b), row in zip(pairs, completion.tolist()):
        text = tokenizer.decode(row[: row.index(eos)] if eos in row else row, skip_special_tokens=True)
        correct += text.strip() == str(a + b)
    model.train()
    return correct / len(pairs)


def train(args) -> dict:
    torch.manual_seed(args.seed)
    model, tokenizer = tiny_mdlm(hidden_size=args.hidden, layers=args.layers, heads=args.heads, seed=args.seed)
    model.train()
    _, held_out = addition_pairs(ArithConfig(digits=args.digits, n_train=1, n_eval=args.n_eval, seed=0))
    excluded = set(held_out)
    rng = random.Random(args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    mask_id, top = tokenizer.mask_token_id, 10**args.digits
    curve, start, step = [], time.time(), 0
    while step < args.max_steps and time.time() - start < args.max_minutes * 60:
        step += 1
        pairs = []
        while len(pairs) < args.batch:
            pair = (rng.randrange(top), rng.randrange(top))
            if pair not in excluded:
                pairs.append(pair)
        rows = [encode(tokenizer, a, b, args.digits, args.gen_length) for a, b in pairs]
        prompt = torch.tensor([r[0] for r in rows])  # [n, P]
        target = torch.tensor([r[1] for r in rows])  # [n, L]
        t = torch.rand(args.batch, 1).clamp_min(1e-3)  # [n, 1]
        masked = torch.rand(target.shape) < t  # [n, L]
        masked[torch.arange(args.batch), torch.randint(0, args.gen_length, (args.batch,))] = True  # >= 1 masked
        noisy = torch.where(masked, torch.full_like(target, mask_id), target)
        logits = aligned_logits(model, torch.cat([prompt, noisy], 1), mask_id)[:, prompt.shape[1]:]  # [n, L, V]
        ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), target, reduction="none")  # [n, L]
        loss = ((ce * masked) / t).sum() / (args.batch * args.gen_length)
        lr = args.lr * min(1.0, step / 100)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % args.eval_every == 0:
            acc = accuracy(model, tokenizer, held_out, args.digits, args.gen_length)
            curve.append({"step": step, "loss": round(loss.item(), 4), "accuracy": acc, "seconds": round(time.time() - start, 1)})
            print(curve[-1], flush=True)
            if acc >= args.stop_at:
                break
    model.eval()
    output = Path(args.output)
    model.save_pretrained(output)
    tokenizer.save_pretrained(output)
    metrics = {"held_out_accuracy": curve[-1]["accuracy"] if curve else math.nan, "steps": step, "curve": curve,
               "args": {k: v for k, v in vars(args).items() if k != "output"}}  # no machine path in shipped files
    (output / "metrics.json").write_text(json.dumps(metrics, indent=2), encoding="utf-8")
    return metrics


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default=str(ROOT / "data" / "weights" / "mdlm_arith"))
    parser.add_argument("--digits", type=int, default=2)
    parser.add_argument("--gen-length", type=int, default=4)
    parser.add_argument("--n-eval", type=int, default=200)
    parser.add_argument("--hidden", type=int, default=96)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--max-steps", type=int, default=20000)
    parser.add_argument("--max-minutes", type=float, default=15.0)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--stop-at", type=float, default=0.4)
    parser.add_argument("--seed", type=int, default=0)
    print(train(parser.parse_args(argv))["held_out_accuracy"])


if __name__ == "__main__":
    main()
