"""The options of the `mdlm` pipeline, [`MDLMConfig`], and their checks (completion length within the model's
positions, block and step schedule, token ids within the vocabulary, temperatures, EOSER, the likelihood estimators'
keys, LoRA), run before any weight loads; the decoding schedule is built here once.

Not a plugin: `mmgrpo.pipelines.mdlm` holds the policy and exposes this `Config` as ``MDLMPolicy.Config``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mmgrpo.hub import resolve_pretrained
from mmgrpo.model_limits import (
    VOCAB_LIMIT, check_limit, check_lora, check_temperature, find_int, hidden_size, max_positions, read_json,
)
from mmgrpo.pipelines import _mdlm_elbo
from mmgrpo.samplers.masked_diffusion import make_schedule
from mmgrpo.validation import check_fields, check_range


@dataclass
class MDLMConfig:
    """Options of [`MDLMPolicy`].

    Args:
        pretrained (`str`): a local folder, a hub id, or ``mmgrpo:<name>`` for a shipped toy model.
        family (`str`): ``"llada"``, ``"dream"``, ``"generic"`` (any transformers model, made bidirectional) or
            ``"auto"`` (from the config's ``model_type``).
        trust_remote_code (`bool`): needed by LLaDA and Dream (their code lives on the hub); never turned on for you.
        revision (`str`, *optional*): hub revision (pin a commit with remote code).
        mask_token_id (`int`, *optional*): default: the model config's ``mask_token_id``, else the tokenizer's.
        eos_token_ids (`list[int]`, *optional*): tokens that end a completion (EOSER damps them). Default: the
            tokenizer's EOS plus the family's end-of-turn token (LLaDA ``<|eot_id|>``, Dream ``<|im_end|>``).
        shift_logits (`bool`, *optional*): logit `j` predicts token `j + 1` (Dream). Default: the family's.
        chat_template (`bool`): wrap each prompt as a user turn with the tokenizer's chat template.
        gen_length (`int`): completion tokens `L`.
        block_length (`int`, *optional*): tokens per block; default `gen_length` (full diffusion).
        steps_per_block (`int`): steps per block of the ``"fixed"`` schedule.
        schedule (`str`): ``"fixed"`` (LLaDA's uniform tokens per step) or ``"ass"`` (2^i tokens at step i in each
            block, ``ceil(log2(block_length + 1))`` steps per block).
        remasking (`str`): ``"low_confidence"`` or ``"random"``.
        temperature (`float`): sampling temperature of training rollouts (log-probs use the same temperature).
        eval_temperature (`float`): temperature of evaluation samples (0: greedy).
        eoser (`bool`): EOS early rejection.
        eoser_gamma_min (`float`), eoser_gamma_max (`float`): EOSER's factor at the first and last step.
        eoser_kind (`str`): ``"linear"``, ``"power"`` or ``"auto"`` (power with ASS, linear otherwise).
        prompt_mask_prob (`float`): `likelihood` (d1's estimator) masks each prompt token with this probability.
        elbo_points (`int`): Gauss-Legendre nodes of GDPO's ELBO over the masking ratio (see `pipelines/_mdlm_elbo.py`).
        elbo_masks (`int`): masks drawn per node of the ELBO.
        elbo_masking (`str`): ``"count"`` (a fixed share of the scored tokens per node) or ``"bernoulli"``.
        lora_rank (`int`): LoRA rank; 0 trains the whole model (a frozen copy is then the reference).
        lora_alpha (`int`): LoRA scaling numerator.
        lora_targets (`list[str]`, *optional*): module names that get LoRA; default: the family's names that exist.
        weights_dtype (`str`): dtype of the frozen weights; trainable parameters are float32.
        gradient_checkpointing (`bool`): recompute each transformer layer in the backward pass (same gradients,
            activations of one layer at a time, about one more forward per backward); the model's class must support
            transformers' activation checkpointing (remote-code models may not: a clear error says so).
    """

    pretrained: str
    family: Literal["auto", "llada", "dream", "generic"] = "auto"
    trust_remote_code: bool = False
    revision: str | None = None
    mask_token_id: int | None = None
    eos_token_ids: list[int] | None = None
    shift_logits: bool | None = None
    chat_template: bool = False
    gen_length: int = 64
    block_length: int | None = None
    steps_per_block: int = 16
    schedule: Literal["fixed", "ass"] = "fixed"
    remasking: Literal["low_confidence", "random"] = "low_confidence"
    temperature: float = 1.0
    eval_temperature: float = 0.0
    eoser: bool = False
    eoser_gamma_min: float = 0.4
    eoser_gamma_max: float = 1.0
    eoser_kind: Literal["auto", "linear", "power"] = "auto"
    prompt_mask_prob: float = 0.15
    elbo_points: int = 2
    elbo_masks: int = 1
    elbo_masking: Literal["count", "bernoulli"] = "count"
    lora_rank: int = 32
    lora_alpha: int = 64
    lora_targets: list[str] | None = None
    weights_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    gradient_checkpointing: bool = False

    def __post_init__(self):
        check_fields(self)
        location = resolve_pretrained(self.pretrained, "pipeline.pretrained")  # kept as configured (adapters record it)
        model = read_json(location)  # {} when not readable here (a hub id not in the local cache)
        check_limit("gen_length", self.gen_length, 1, max_positions(model), 65536, "max_position_embeddings",
                    fix="the completion must fit in the model's positions")
        self.block_length = self.block_length or self.gen_length
        check_range("block_length", self.block_length, 1, self.gen_length, fix="it divides gen_length")
        if self.schedule == "fixed":
            check_range("steps_per_block", self.steps_per_block, 1, self.block_length,
                        fix="a fixed schedule commits at least one token per step")
        vocab = find_int(model, "vocab_size", "embedding_size")
        tokens = [(f"eos_token_ids[{i}]", token) for i, token in enumerate(self.eos_token_ids or [])]
        for key, token in tokens + ([("mask_token_id", self.mask_token_id)] if self.mask_token_id is not None else []):
            check_limit(key, token, 0, vocab - 1 if vocab else None, VOCAB_LIMIT, "the last token id")
        check_lora(self, hidden_size(model))
        self.decoding = make_schedule(self.gen_length, self.block_length, self.steps_per_block, self.schedule)
        check_temperature("temperature", self.temperature, greedy=True)
        check_temperature("eval_temperature", self.eval_temperature, greedy=True)
        check_range("eoser_gamma_max", self.eoser_gamma_max, high=10.0, fix="EOSER damps EOS by a factor up to 1")
        if not 0 < self.eoser_gamma_min <= self.eoser_gamma_max:
            raise ValueError(f"need 0 < eoser_gamma_min <= eoser_gamma_max, got {self.eoser_gamma_min}, {self.eoser_gamma_max}.")
        if not 0 <= self.prompt_mask_prob < 1:
            raise ValueError(f"prompt_mask_prob must be in [0, 1), got {self.prompt_mask_prob}.")
        _mdlm_elbo.check_options(self)
        if self.lora_rank < 0:
            raise ValueError(f"lora_rank must be >= 0 (0 = full fine-tuning), got {self.lora_rank}.")

    @property
    def num_steps(self) -> int:
        """Decoding steps of one completion (set by the schedule, not a key)."""
        return self.decoding.num_steps

    def output_size(self) -> tuple[int, str]:
        """Bytes one sample's rollout record holds at least (token ids, log-probs, mask per completion token), and the
        key that sets them: the memory check of [`~mmgrpo.preflight.preflight`] reads it."""
        return self.gen_length * (8 + 4 + 1), "pipeline.gen_length"
