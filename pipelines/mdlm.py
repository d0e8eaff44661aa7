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

**Modules.** This file holds the policy: decoding (`sample`) and the trajectory replay (`log_prob`); its options and
their checks are `_mdlm_config.py`, loading the model (families, mask / EOS ids, LoRA) `_mdlm_model.py`, and the two
likelihood estimators `_mdlm_one_step.py` (d1) and `_mdlm_elbo.py` (GDPO).
"""

from __future__ import annotations

from pathlib import Path

import torch

from mmgrpo.hub import resolve_pretrained
from mmgrpo.pipelines import _mdlm_elbo, _mdlm_one_step
from mmgrpo.pipelines._checkpointing import checkpoint_transformers
from mmgrpo.pipelines._mdlm_config import MDLMConfig  # the options (imported from here by configs and tests)
from mmgrpo.pipelines._mdlm_model import FAMILIES, add_lora, eos_token_ids, load_model, lora_targets, mask_token_id
from mmgrpo.reference import ReferenceSwitch
from mmgrpo.samplers.masked_diffusion import eoser_gamma, rebuild_state, token_log_probs, unmask_step
from mmgrpo.types import PromptBatch, Rollout, Score
from mmgrpo.plans import MaskedPlan, TokenPlan

ADAPTER_FILE = "adapter_model.safetensors"


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
        model, self.tokenizer, self.family = load_model(config)
        targets, shift, end_of_turn = FAMILIES[self.family]
        self.shift_logits = shift if config.shift_logits is None else config.shift_logits
        self.mask_id = mask_token_id(config, model, self.tokenizer)
        self.eos_ids = eos_token_ids(config, self.tokenizer, end_of_turn)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_ids[0]
        if self.pad_id == self.mask_id:
            raise ValueError("The tokenizer's pad token is the mask token: give it another pad token.")
        self.lora = config.lora_rank > 0
        if self.lora:
            model = add_lora(model, config, targets)
        else:
            model.float().requires_grad_(True)
        self.model = model.eval()  # no dropout: replay must see the rollout's logits
        if config.gradient_checkpointing:
            checkpoint_transformers(model)
        self.switch = ReferenceSwitch(model, model.disable_adapter if self.lora else None)
        self.device = torch.device("cpu")

    _lora_targets = staticmethod(lora_targets)  # the LoRA target names that exist in a model

    # ----------------------------------------------------------------------------------------------------- set-up
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
            old, mask = _mdlm_one_step.record(self, trajectory, plan)
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
    def likelihood(self, rollout: Rollout, steps: list[int]) -> Score:
        """The likelihood draws `steps` of a rollout, with gradients, by the estimator its plan asked for (masks
        drawn at sampling): d1's one-step estimate ([`mmgrpo.pipelines._mdlm_one_step.score`]) or GDPO's ELBO
        ([`mmgrpo.pipelines._mdlm_elbo.score`]).

        Returns:
            The [`Score`] of [`~MDLMPolicy.log_prob`], with `token_mask` the scored tokens and `old_token_log_prob`
            the sampling policy's per-token terms under the same masks.
        """
        if "elbo_masked" in rollout.trajectory:
            return _mdlm_elbo.score(self, rollout, steps)
        return _mdlm_one_step.score(self, rollout, steps)

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
