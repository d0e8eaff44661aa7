"""Multi-digit addition prompts with checkable answers (``"042+517="`` -> ``"559"``), for masked-diffusion LMs.

Operands are zero-padded to `digits` digits so every prompt has the same length (no padding inside a batch); the
answer is the plain sum, in ``metadata["answer"]`` for the `accuracy` reward. Training and held-out pairs are disjoint
(held-out pairs are drawn first from a separate seed and removed from the training draw).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from mmgrpo.validation import check_fields, check_range, check_seed, check_template


def format_prompt(a: int, b: int, digits: int) -> str:
    """``"042+517="`` for ``a=42, b=517, digits=3``."""
    return f"{a:0{digits}d}+{b:0{digits}d}="


@dataclass
class ArithConfig:
    """Options of [`ArithPrompts`].

    Args:
        digits (`int`): digits per operand.
        n_train (`int`): training prompts.
        n_eval (`int`): held-out prompts.
        seed (`int`): seed of the draw.
        template (`str`, *optional*): a prompt template with fields ``a`` and ``b`` (e.g. ``"What is {a} + {b}?"`` for
            an instruction-tuned model); default the compact zero-padded ``"042+517="``.
    """

    digits: int = 3
    n_train: int = 5000
    n_eval: int = 200
    seed: int = 0
    template: str | None = None

    def __post_init__(self):
        check_fields(self)
        check_seed("seed", self.seed)
        check_range("n_train", self.n_train, 0, 10**6, fix="items are built in memory; training needs some")
        check_range("n_eval", self.n_eval, 0, 10**6, fix="0: no held-out items (then set eval.every=0)")
        if not 1 <= self.digits <= 6:
            raise ValueError(f"data.digits must be in 1..6, got {self.digits}.")
        if self.n_train + self.n_eval > (10**self.digits) ** 2 // 2:
            raise ValueError(f"data.n_train + n_eval too large for {self.digits}-digit pairs: use more digits.")
        if self.template is not None:
            check_template("template", self.template, a=1, b=2)


def addition_pairs(config: ArithConfig) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Disjoint ``(train, eval)`` lists of operand pairs."""
    top = 10**config.digits
    rng = random.Random(config.seed)
    held_out: dict[tuple[int, int], None] = {}
    while len(held_out) < config.n_eval:
        held_out[(rng.randrange(top), rng.randrange(top))] = None
    train: dict[tuple[int, int], None] = {}
    while len(train) < config.n_train:
        pair = (rng.randrange(top), rng.randrange(top))
        if pair not in held_out:
            train[pair] = None
    return list(train), list(held_out)


class ArithPrompts:
    """Addition prompts ``{"prompt": "042+517=", "metadata": {"answer": "559", "answer_type": "numeric"}}``."""

    Config = ArithConfig
    disjoint_splits = True  # held-out operand pairs are never training pairs

    def __init__(self, config: ArithConfig):
        self.config = config
        self.train, self.held_out = addition_pairs(config)

    def _items(self, pairs) -> list[dict]:
        c = self.config
        return [
            {"prompt": c.template.format(a=a, b=b) if c.template else format_prompt(a, b, c.digits),
             "metadata": {"answer": str(a + b), "answer_type": "numeric"}}
            for a, b in pairs
        ]

    def train_items(self) -> list[dict]:
        return self._items(self.train)

    def eval_items(self) -> list[dict]:
        return self._items(self.held_out)

    def eval_splits(self) -> dict[str, list[dict]]:
        return {"eval": self.eval_items()}  # one held-out split


PLUGIN = ArithPrompts
