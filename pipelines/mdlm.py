"""Masked-diffusion LMs (LLaDA, Dream, any bidirectional token model) as a stochastic policy over decoding steps.

A completion of ``gen_length`` tokens starts fully masked and is decoded in blocks (``block_length < gen_length``:
semi-autoregressive; ``== gen_length``: full diffusion) by [`mmgrpo.samplers.masked_diffusion.unmask_step`]:
low-confidence or random remasking, temperature, EOSER (EOS confidence damped early) and a fixed or ASS (2^i tokens at
step i) schedule. The rollout records, per completion token, the step that committed it; `log_prob` rebuilds each
state from that record and scores the tokens committed at the step (CJ-GRPO's trajectory replay), and `likelihood`
is d1's one-step estimate (completion fully masked, prompt tokens masked at random) or, when the plan asks for
``likelihood="elbo"``, GDPO's semi-deterministic Monte Carlo ELBO of the completion (`pipelines/_mdlm_elbo.py`).

Models: LLaDA (https://arxiv.org/abs/2502.09992) and Dream (https://hkunlp.github.io/blog/2025/dream) through
``trust_remote_code`` (mask id from the config, Dream's one-position logit shift, EOS / end-of-turn ids, LoRA targets
that exist in each), or any transformers model mapping ``input_ids -> logits`` whose attention is made bidirectional
(``config.is_causal = False``), such as the tests' tiny builder (`tests/builders/mdlm.py`).
CJ-GRPO: https://arxiv.org/abs/2509.23924
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from mmgrpo.hub import DTYPES, resolve_pretrained
from mmgrpo.model_limits import (
    VOCAB_LIMIT, check_limit, check_lora, check_temperature, find_int, hidden_size, max_positions, read_json,
)
from mmgrpo.pipelines._checkpointing import checkpoint_transformers
from mmgrpo.reference import ReferenceSwitch
from mmgrpo.samplers.masked_diffusion import eoser_gamma, make_schedule, rebuild_state, token_log_probs, unmask_step
from mmgrpo.types import PromptBatch, Rollout, Score
from mmgrpo.plans import MaskedPlan, TokenPlan
from mmgrpo.validation import check_fields, check_range

from mmgrpo.pipelines import _mdlm_elbo

ADAPTER_FILE = "adapter_model.safetensors"
# family -> (LoRA targets, whether logit j predicts token j + 1, extra end-of-turn tokens)
FAMILIES = {
    # LLaDA's blocks name their projections q/k/v_proj, attn_out, ff_proj, up_proj, ff_out (no o/gate/down_proj)
    "llada": (["q_proj", "k_proj", "v_proj", "attn_out", "ff_proj", "up_proj", "ff_out"], False, ["<|eot_id|>"]),
    "dream": (["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], True, ["<|im_end|>"]),
    "generic": (["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "query", "key", "value"],
                False, []),
}


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


def make_bidirectional(model: torch.nn.Module) -> torch.nn.Module:
    """Turns off causal masking in a transformers decoder (the config flag and every module's ``is_causal``)."""
    model.config.is_causal = False
    for module in model.modules():
        if hasattr(module, "is_causal"):
            module.is_causal = False
    return model


def _load(config: MDLMConfig):
    """``(model, tokenizer, family)`` for `config`: remote code for LLaDA / Dream, a bidirectional stock model else."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForMaskedLM, AutoTokenizer

    kwargs = {"revision": config.revision, "trust_remote_code": config.trust_remote_code}
    location = resolve_pretrained(config.pretrained, "pipeline.pretrained")
    try:
        model_config = AutoConfig.from_pretrained(location, **kwargs)
    except ValueError as err:
        raise ValueError(
            f"pipeline.pretrained {config.pretrained!r} could not be configured ({err}). LLaDA and Dream ship their "
            "code on the hub: set pipeline.trust_remote_code: true (and pin pipeline.revision)."
        ) from err
    family = config.family
    if family == "auto":
        kind = str(getattr(model_config, "model_type", "")).lower()
        family = "llada" if kind.startswith("llada") else "dream" if kind == "dream" else "generic"
    dtype = DTYPES[config.weights_dtype]
    tokenizer = AutoTokenizer.from_pretrained(location, **kwargs)
    if family in ("llada", "dream"):
        model = AutoModel.from_pretrained(location, dtype=dtype, use_safetensors=True, **kwargs)
    elif any("MaskedLM" in a for a in getattr(model_config, "architectures", None) or []):
        model = AutoModelForMaskedLM.from_pretrained(location, dtype=dtype, use_safetensors=True, **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(location, dtype=dtype, use_safetensors=True, **kwargs)
        model = make_bidirectional(model)
    return model.requires_grad_(False).eval(), tokenizer, family


class MDLMPolicy:
    """A masked-diffusion LM's decoder as a policy: `sample` decodes and records each token's commit step,
    `log_prob` replays chosen steps exactly, `likelihood` is d1's one-step estimate."""

    Config = MDLMConfig
    modalities = frozenset({"text"})
    plan_families = ("masked", "token")  # its own MaskedPlan, and token algorithms' TokenPlan (a decision per step)
    plan_features = frozenset({"likelihood", "elbo", "token_scores"})
    # scoring method -> the Score fields it fills (both through `_pack`)
    provides = dict.fromkeys(("log_prob", "likelihood"),
                             frozenset({"log_prob", "mask", "token_log_prob", "token_mask", "old_token_log_prob"}))
    capabilities = frozenset()  # no teacher_rollout: mmgrpo sft does not fine-tune masked-diffusion LMs

    def __init__(self, config: MDLMConfig):
        self.config = config
        model, self.tokenizer, self.family = _load(config)
        targets, shift, end_of_turn = FAMILIES[self.family]
        self.shift_logits = shift if config.shift_logits is None else config.shift_logits
        self.mask_id = self._mask_id(model)
        self.eos_ids = self._eos_ids(end_of_turn)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_ids[0]
        if self.pad_id == self.mask_id:
            raise ValueError("The tokenizer's pad token is the mask token: give it another pad token.")
        self.lora = config.lora_rank > 0
        if self.lora:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(
                r=config.lora_rank, lora_alpha=config.lora_alpha, lora_dropout=0.0,
                target_modules=self._lora_targets(model, config.lora_targets or targets, config.lora_targets is None),
            ))
            model.peft_config["default"].base_model_name_or_path = config.pretrained  # as configured, not resolved
            for param in model.parameters():
                if param.requires_grad:
                    param.data = param.data.float()
        else:
            model.float().requires_grad_(True)
        self.model = model.eval()  # no dropout: replay must see the rollout's logits
        if config.gradient_checkpointing:
            checkpoint_transformers(model)
        self.switch = ReferenceSwitch(model, model.disable_adapter if self.lora else None)
        self.device = torch.device("cpu")

    # ----------------------------------------------------------------------------------------------------- set-up
    def _mask_id(self, model) -> int:
        for value in (self.config.mask_token_id, getattr(model.config, "mask_token_id", None), self.tokenizer.mask_token_id):
            if value is not None:
                return int(value)
        raise ValueError("No mask token id: set pipeline.mask_token_id (LLaDA: 126336, Dream: 151666).")

    def _eos_ids(self, end_of_turn: list[str]) -> list[int]:
        if self.config.eos_token_ids:
            return list(self.config.eos_token_ids)
        ids = [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else []
        vocab = self.tokenizer.get_vocab()
        ids += [vocab[t] for t in end_of_turn if t in vocab and vocab[t] not in ids]
        if not ids:
            raise ValueError("The tokenizer has no EOS token: set pipeline.eos_token_ids.")
        return ids

    @staticmethod
    def _lora_targets(model, wanted: list[str], defaults: bool) -> list[str]:
        """The target names that exist in `model` (peft ignores missing names silently; we refuse them)."""
        names = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        present = [t for t in wanted if t in names]
        missing = [t for t in wanted if t not in names]
        if (missing and not defaults) or not present:
            raise ValueError(
                f"LoRA targets {missing or wanted} are not linear layers of this model; its linear layers are named "
                f"{sorted(names)}: set pipeline.lora_targets from these."
            )
        return present

    def trainable_parameters(self):
        return [p for p in self.model.parameters() if p.requires_grad]

    def trainable_modules(self) -> dict[str, torch.nn.Module]:
        return {"model": self.model}

    @property
    def num_steps(self) -> int:
        return self.config.decoding.num_steps

    @property
    def eval_num_steps(self) -> int:
        return self.config.decoding.num_steps

    @property
    def forward(self) -> torch.nn.Module:
        """What forwards run through: the model, its DDP wrapper, or the frozen reference in [`~MDLMPolicy.reference`]."""
        return self.switch.forward

    @forward.setter
    def forward(self, module: torch.nn.Module) -> None:
        self.switch.forward = module

    @property
    def frozen(self) -> torch.nn.Module | None:
        """The frozen initial model (full fine-tuning only)."""
        return self.switch.frozen

    def prepare(self, accelerator) -> list[torch.nn.Module]:
        """Moves the model (and the frozen reference) to the accelerator's device and wraps it for distribution."""
        self.device = accelerator.device
        return self.switch.prepare(accelerator)

    def reference(self):
        """Forwards run through the reference: LoRA adapter disabled, or the frozen initial model."""
        return self.switch.reference()

    # --------------------------------------------------------------------------------------------------- model
    def encode_prompts(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded prompt ids `[N, P]` and their attention mask `[N, P]` (bool)."""
        if self.config.chat_template:
            prompts = [self.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                          tokenize=False) for p in prompts]
        rows = [self.tokenizer(p, add_special_tokens=not self.config.chat_template)["input_ids"] for p in prompts]
        width = max(1, max(len(r) for r in rows))
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros(len(rows), width, dtype=torch.bool)
        for i, row in enumerate(rows):
            if row:
                ids[i, width - len(row):] = torch.tensor(row)
                attention[i, width - len(row):] = True
        return ids, attention

    def logits(self, input_ids: torch.Tensor, attention: torch.Tensor | None, module=None) -> torch.Tensor:
        """Aligned logits `[n, T, V]` (float32; logit `j` predicts token `j`, Dream's shift undone) for `input_ids`
        `[n, T]`; `attention` `[n, T]` (bool) is passed only when some position is padding. The mask token is never
        a prediction (its logit is -inf), in sampling and in replay alike."""
        module = self.forward if module is None else module
        kwargs = {}
        if attention is not None and not bool(attention.all()):
            if self.family == "dream":  # Dream's forward takes a 4-D mask and positions that skip the padding
                kwargs["attention_mask"] = (attention[:, None, None, :] & attention[:, None, :, None])
                kwargs["position_ids"] = (attention.long().cumsum(-1) - 1).clamp_min(0)
            else:
                kwargs["attention_mask"] = attention.long()
        out = module(input_ids=input_ids, **kwargs)
        logits = (out.logits if hasattr(out, "logits") else out[0]).float()  # [n, T, V]
        if self.shift_logits:
            logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
        return logits.index_fill(-1, torch.tensor([self.mask_id], device=logits.device), float("-inf"))

    def _completion_logits(self, prompt_ids, prompt_attention, completion, module=None) -> torch.Tensor:
        """Logits `[n, L, V]` of the completion positions of the state ``prompt + completion``."""
        state = torch.cat([prompt_ids, completion], dim=1).to(self.device)  # [n, P + L]
        attention = torch.cat([prompt_attention, torch.ones_like(completion, dtype=torch.bool)], dim=1).to(self.device)
        return self.logits(state, attention, module)[:, prompt_ids.shape[1]:]

    # --------------------------------------------------------------------------------------------------- sampling
    def _step_gamma(self, step: int) -> float:
        c = self.config
        if not c.eoser:
            return 1.0
        kind = c.eoser_kind if c.eoser_kind != "auto" else ("power" if c.schedule == "ass" else "linear")
        return eoser_gamma(step, self.num_steps, c.eoser_gamma_min, c.eoser_gamma_max, kind)

    @torch.no_grad()
    def sample(self, batch: PromptBatch, plan: MaskedPlan | TokenPlan, *, generator: torch.Generator | None = None) -> Rollout:
        """Decodes one completion per prompt at `temperature`, or at `eval_temperature` when the plan is greedy
        (evaluation). A masked plan may ask for likelihood scoring (d1's prompt-mask draws); a token plan trains its
        decoding steps as tokens.

        The trajectory holds the prompt `[N, P]` and its attention mask, the final completion `[N, L]`, each token's
        commit step `[N, L]` and log-prob `[N, L]`, and the temperature of every step; nothing per intermediate state.
        ``old_log_probs`` `[N, S]` is the log-prob of each step's transition (sum over the tokens it committed).
        """
        c, d = self.config, self.config.decoding
        if plan.num_steps != d.num_steps:
            raise ValueError(f"The plan has {plan.num_steps} steps but this decoding schedule takes {d.num_steps}.")
        n, length = len(batch), c.gen_length
        prompt_ids, prompt_attention = self.encode_prompts(batch.prompts)
        seed = int(torch.randint(0, 2**62, (1,), generator=generator))
        device_generator = torch.Generator(self.device).manual_seed(seed)
        completion = torch.full((n, length), self.mask_id, dtype=torch.long, device=self.device)  # [N, L]
        commit_step = torch.full((n, length), -1, dtype=torch.long, device=self.device)  # [N, L]
        token_lp = torch.zeros(n, length, device=self.device)  # [N, L]
        temperatures = torch.tensor([c.eval_temperature if plan.greedy else c.temperature for _ in range(d.num_steps)])
        position = torch.arange(length, device=self.device)
        for s in range(d.num_steps):
            block = d.block_of_step[s]
            in_block = (position >= block * d.block_length) & (position < (block + 1) * d.block_length)  # [L]
            logits = self._completion_logits(prompt_ids, prompt_attention, completion)  # [N, L, V]
            step = unmask_step(
                logits, completion, (completion == self.mask_id) & in_block, d.tokens_per_step[s],
                temperature=float(temperatures[s]), remasking=c.remasking, eos_ids=self.eos_ids,
                eos_gamma=self._step_gamma(s), generator=device_generator,
            )
            completion = step.state
            commit_step[step.committed] = s
            token_lp = torch.where(step.committed, step.log_prob, token_lp)
        steps = torch.arange(d.num_steps, device=self.device)
        committed = commit_step[:, None, :] == steps[None, :, None]  # [N, S, L]
        old = (token_lp[:, None, :] * committed).sum(-1).cpu()  # [N, S]
        mask = torch.zeros(n, d.num_steps, dtype=torch.bool)
        mask[:, plan.trained_steps] = True
        trajectory = {
            "prompt_ids": prompt_ids, "prompt_attention": prompt_attention,  # [N, P]
            "completion": completion.cpu(), "commit_step": commit_step.cpu(), "token_log_probs": token_lp.cpu(),  # [N, L]
            "shared_temperatures": temperatures,  # [S]
        }
        if "elbo" in plan.features():
            old, mask = _mdlm_elbo.record(self, trajectory, plan)
        elif "likelihood" in plan.features():
            old, mask = self._record_likelihood(trajectory, plan)
        else:
            mask &= committed.any(-1).cpu()
        texts = [self.decode_text(row) for row in completion.cpu()]
        return Rollout(
            group_ids=batch.group_ids if batch.group_ids is not None else torch.arange(n),
            outputs={"texts": texts}, old_log_probs=old, mask=mask, trajectory=trajectory,
        )

    def completion_mask(self, completion: torch.Tensor) -> torch.Tensor:
        """`[n, L]` bool: the tokens up to and including the first EOS."""
        is_eos = torch.isin(completion, torch.tensor(self.eos_ids, device=completion.device))
        return (is_eos.long().cumsum(-1) - is_eos.long()) == 0

    def decode_text(self, row: torch.Tensor) -> str:
        """The text of a completion `[L]`, cut at its first EOS."""
        keep = row[self.completion_mask(row[None])[0] & ~torch.isin(row, torch.tensor(self.eos_ids))]
        return self.tokenizer.decode(keep.tolist(), skip_special_tokens=True)

    # ----------------------------------------------------------------------------------------------------- replay
    def log_prob(self, rollout: Rollout, steps: list[int]) -> Score:
        """Replays decoding steps `steps`: rebuilds each state from the commit steps (exactly the state the rollout
        saw) and scores the tokens committed at that step, with gradients, one forward per step.

        Returns:
            [`Score`] with `log_prob` `[n, k]` (sum over the step's tokens), `token_log_prob` `[n, k, L]`,
            `token_mask` `[n, k, L]` (the step's tokens), `old_token_log_prob` `[n, k, L]` (recorded at
            sampling) and `mask` `[n, k]` (trained steps that committed a token).
        """
        t = rollout.trajectory
        completion, commit = t["completion"].to(self.device), t["commit_step"].to(self.device)  # [n, L]
        prompt_ids = t["prompt_ids"].to(self.device)
        token_lp, token_mask = [], []
        for s in steps:
            state = rebuild_state(prompt_ids, completion, commit, s, self.mask_id)[:, prompt_ids.shape[1]:]
            logits = self._completion_logits(prompt_ids, t["prompt_attention"].to(self.device), state)  # [n, L, V]
            token_lp.append(token_log_probs(logits, completion, float(t["shared_temperatures"][s])))
            token_mask.append(commit == s)
        return self._pack(torch.stack(token_lp, 1), torch.stack(token_mask, 1), t["token_log_probs"], rollout, steps)

    def _pack(self, token_lp, token_mask, recorded, rollout, steps) -> Score:
        """The [`Score`] from per-token log-probs `[n, k, L]` and the scored tokens `[n, k, L]`."""
        old_token = recorded.to(self.device)
        old_token = old_token[:, None].expand_as(token_lp) if old_token.dim() == 2 else old_token[:, steps]
        return Score(
            log_prob=(token_lp * token_mask).sum(-1),  # [n, k]
            token_log_prob=token_lp, token_mask=token_mask, old_token_log_prob=old_token,  # [n, k, L]
            mask=rollout.mask[:, steps].to(self.device) & token_mask.any(-1),  # [n, k]
        )

    # ------------------------------------------------------------------------------------------------- likelihood
    def _one_step(self, prompt_ids, prompt_attention, completion, prompt_masked) -> torch.Tensor:
        """d1's one-step token log-probs `[n, L]`: the prompt with `prompt_masked` `[n, P]` tokens masked, the
        completion fully masked, one forward."""
        prompt = torch.where(prompt_masked, torch.full_like(prompt_ids, self.mask_id), prompt_ids)
        logits = self._completion_logits(prompt, prompt_attention, torch.full_like(completion, self.mask_id))
        return token_log_probs(logits, completion)  # [n, L]

    def _record_likelihood(self, trajectory: dict, plan: MaskedPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """Draws the prompt masks of the plan's likelihood draws (from ``plan.seed``) and records the sampling
        policy's one-step log-probs (d1 computes its "old" log-probs at rollout time with the same masks)."""
        generator = torch.Generator().manual_seed(plan.seed)
        prompt_ids, attention = trajectory["prompt_ids"], trajectory["prompt_attention"]
        n, steps = prompt_ids.shape[0], plan.num_steps
        draws = torch.rand((n, steps, prompt_ids.shape[1]), generator=generator) < self.config.prompt_mask_prob
        trajectory["prompt_masked"] = draws & attention[:, None]  # [N, S, P]
        old_tokens = torch.zeros(n, steps, self.config.gen_length)  # [N, S, L]
        completion = trajectory["completion"].to(self.device)
        keep = self.completion_mask(trajectory["completion"])  # [N, L]
        for j in plan.trained_steps:
            masked = trajectory["prompt_masked"][:, j].to(self.device)
            old_tokens[:, j] = self._one_step(prompt_ids.to(self.device), attention.to(self.device), completion, masked).cpu()
        trajectory["likelihood_token_log_probs"] = old_tokens
        mask = torch.zeros(n, steps, dtype=torch.bool)
        mask[:, plan.trained_steps] = True
        return (old_tokens * keep[:, None]).sum(-1), mask  # [N, S], [N, S]

    def likelihood(self, rollout: Rollout, steps: list[int]) -> Score:
        """d1's one-step estimate for the draws `steps` (prompt masks recorded at sampling), with gradients: every
        completion token up to the first EOS is scored from the fully masked completion in one forward. A rollout
        sampled with an ``"elbo"`` plan is scored by GDPO's ELBO instead ([`_mdlm_elbo.score`]).

        Returns:
            The [`Score`] of [`~MDLMPolicy.log_prob`], with `token_mask` the completion mask and
            `old_token_log_prob` the sampling policy's one-step log-probs under the same masks.
        """
        t = rollout.trajectory
        if "elbo_masked" in t:
            return _mdlm_elbo.score(self, rollout, steps)
        if "prompt_masked" not in t:
            raise ValueError("This rollout was not sampled with a likelihood plan: no prompt masks were drawn.")
        prompt_ids, attention = t["prompt_ids"].to(self.device), t["prompt_attention"].to(self.device)
        completion = t["completion"].to(self.device)
        token_lp = torch.stack(
            [self._one_step(prompt_ids, attention, completion, t["prompt_masked"][:, j].to(self.device)) for j in steps], 1
        )  # [n, k, L]
        keep = self.completion_mask(completion)[:, None].expand_as(token_lp)  # [n, k, L]
        return self._pack(token_lp, keep, t["likelihood_token_log_probs"], rollout, steps)

    # ------------------------------------------------------------------------------------------------ checkpoints
    def save_pretrained(self, path: str) -> None:
        """Writes a peft adapter (``adapter_model.safetensors`` + ``adapter_config.json``) or, fully fine-tuned, the
        whole model with ``save_pretrained``, plus the tokenizer."""
        Path(path).mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)

    def load_trainable(self, path: str) -> None:
        """Loads weights written by [`~MDLMPolicy.save_pretrained`] into this policy."""
        from safetensors.torch import load_file

        path = Path(path)
        if self.lora:
            from peft.utils import set_peft_model_state_dict

            if not (path / ADAPTER_FILE).is_file():
                raise FileNotFoundError(f"No LoRA adapter {path / ADAPTER_FILE}: point at a folder written by save_pretrained.")
            set_peft_model_state_dict(self.model, load_file(path / ADAPTER_FILE))
        else:
            files = sorted(path.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"No *.safetensors weights in {path}: point at a folder written by save_pretrained.")
            state = {k: v for f in files for k, v in load_file(f).items()}
            missing, unexpected = self.model.load_state_dict(state, strict=False)
            if unexpected:
                raise ValueError(f"Weights in {path} have keys this model lacks: {unexpected[:3]}")

    def export_pretrained(self, path: str, merge_lora: bool = False) -> None:
        """Writes the whole model and its tokenizer (a LoRA merged by peft, or the base model plus the adapter in
        ``lora/``), loadable with the transformers class's ``from_pretrained`` (see
        [`mmgrpo.export.export_transformers`])."""
        from mmgrpo.export import export_transformers

        c = self.config
        base = self.model.get_base_model() if self.lora else self.model
        export_transformers(self, type(base), resolve_pretrained(c.pretrained, "pipeline.pretrained"), path, merge_lora,
                            self.lora, self.tokenizer, revision=c.revision, trust_remote_code=c.trust_remote_code)


PLUGIN = MDLMPolicy
