"""Qwen2-VL / Qwen2.5-VL / Qwen3-VL (dense and MoE) / Qwen3.5 as a token-level stochastic policy (reasoning,
counting, grounding), with LoRA and a prefix-shared group forward.

Wraps transformers' `Qwen2VLForConditionalGeneration`, `Qwen2_5_VLForConditionalGeneration`,
`Qwen3VLForConditionalGeneration`, `Qwen3VLMoeForConditionalGeneration`, `Qwen3_5ForConditionalGeneration` and
`Qwen3_5MoeForConditionalGeneration` (the checkpoint's ``model_type`` picks the class, see
`_qwen_vl_config.FAMILIES`) and their processor; vision inputs go through `qwen_vl_utils.process_vision_info` (16-pixel
patches for the Qwen3 families, and timestamped videos). Papers: Qwen2-VL https://arxiv.org/abs/2409.12191,
Qwen2.5-VL https://arxiv.org/abs/2502.13923, Qwen3-VL https://arxiv.org/abs/2511.21631.

**Token-level contract.** A decision is a completion token: ``num_steps`` is ``max_new_tokens``, and a rollout's
``old_log_probs`` and ``mask`` are `[N, max_new_tokens]` (``mask`` false after the end-of-turn token, and on the
padding). The token algorithms (`grpo`, `dr_grpo`, `dapo`, `gspo`, `sapo`) train the whole completion as one unit,
``train_units = [[0, ..., T - 1]]``; `log_prob(rollout, steps)` returns ``log_prob`` and ``mask`` `[n, len(steps)]`.
A greedy plan (``TokenPlan.deterministic``, evaluation) decodes greedily.

**The policy.** ``pi(token) = softmax(logits / temperature)`` with Qwen's vision special tokens (image / video pads,
vision start / end / pad) removed from the support: they are never sampled and never scored. ``top_p`` / ``top_k``
only truncate the sampling distribution; the recorded and replayed log-probs are those of the untruncated tempered
policy (as TRL and verl do), so the importance ratio is exactly 1 on-policy.

**Inputs** (per prompt, from the prompt source's items): ``prompt`` (text), ``images`` (one image or a list: PIL
images, local paths, ``file://`` URIs, base64), ``video`` (one video: a path or a list of frames) or ``videos`` (a
list of them). Each prompt's messages are rendered with the processor's chat template (optional system prompt).
Each image (each video frame) is resized once, by qwen-vl-utils, within one pixel budget per modality: the configured
``min_pixels`` / ``max_pixels`` (``video_min_pixels`` / ``video_max_pixels``), an unset one taken from the processor's
saved budget; the processor does not resize again, and its saved budget becomes this one (see `_qwen_vl_inputs.py`).
When a prompt has images and its metadata has ``image_size``, `sample` writes ``input_size`` = the first image's
``[width, height]`` as the model saw it (the frame Qwen2.5-VL answers boxes in; see `rewards/box_iou.py`).

**Box frame.** Each family writes boxes and points in its own frame: pixels of the resized input (Qwen2.5-VL) or
0-1000 relative to the image (Qwen2-VL, Qwen3-VL, Qwen3.5). The policy declares it as ``box_frame`` (from the
checkpoint's ``model_type``) and `sample` writes it into every prompt's metadata as ``coords``, which the grounding
and segmentation rewards read with ``coords: model``.

**Modules.** This file holds the policy (sampling, replay, teacher-forced rollouts); its options and their checks
are `_qwen_vl_config.py`, the prompt and vision inputs `_qwen_vl_inputs.py`, the prefix-shared group forward
`_qwen_vl_forward.py`, the decode loop (static KV cache, masks and rotary tables once per rollout, batched sampling)
`_qwen_vl_decode.py`, the prompt forward handed from sampling to the first update (``share_prompt_forward``)
`_qwen_vl_shared_prompt.py`, the LoRA adapter and the saved weights `_qwen_vl_weights.py`.
"""

from __future__ import annotations

import contextlib

import torch

from mmgrpo.hub import DTYPES, resolve_pretrained
from mmgrpo.reference import ReferenceSwitch
from mmgrpo.pipelines._checkpointing import checkpoint_transformers
from mmgrpo.pipelines._qwen_vl_config import FAMILIES, QwenVLConfig  # (QwenVLConfig: imported from here by tests)
from mmgrpo.pipelines import _qwen_vl_engine as engine_side
from mmgrpo.pipelines._qwen_vl_decode import LeanStep, ModelStep, TokenSampler, decode, lean_supported
from mmgrpo.pipelines._qwen_vl_forward import GroupForward, collate_prompts, unique_rows
from mmgrpo.pipelines._qwen_vl_inputs import PromptEncoder, vision_inputs
from mmgrpo.pipelines._qwen_vl_shared_prompt import SharedPromptForward
from mmgrpo.pipelines._qwen_vl_weights import PEFT_PREFIX  # noqa: F401 (imported from here by tests)
from mmgrpo.pipelines._qwen_vl_weights import adapters_off, inject_lora, load_weights, save_weights
from mmgrpo.types import PromptBatch, Rollout, Score
from mmgrpo.plans import TokenPlan

MODEL_CLASSES = {model_type: family.model_class for model_type, family in FAMILIES.items()}  # (read by bench/)
VISION_TOKENS = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>")


class QwenVLPolicy:
    """A Qwen-VL model as a policy over completion tokens: `sample` decodes with a KV cache and records per-token
    log-probs; `log_prob` replays them with gradients (prefix-shared across each group)."""

    Config = QwenVLConfig
    modalities = frozenset({"text"})
    plan_families = ("token",)  # it reads TokenPlan only
    plan_features = frozenset({"ground_truth_member"})  # TempSamp-R1's teacher-forced ground-truth member
    provides = {"log_prob": frozenset({"log_prob", "mask"})}  # scoring method -> the Score fields it fills
    # mmgrpo sft trains on teacher-forced rollouts of given answers; vLLM / SGLang sample for it (`_qwen_vl_engine.py`)
    capabilities = frozenset({"teacher_rollout", "engine_rollout", "chunked_rollouts"})

    def __init__(self, config: QwenVLConfig):
        import transformers
        from transformers import AutoConfig, AutoProcessor

        self.config = config
        location = resolve_pretrained(config.pretrained, "pipeline.pretrained")
        model_type = AutoConfig.from_pretrained(location).model_type
        if model_type not in FAMILIES:
            raise ValueError(
                f"pipeline.pretrained {config.pretrained!r} is a {model_type!r} model; the qwen_vl pipeline takes "
                f"{sorted(FAMILIES)} (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5)."
            )
        family = FAMILIES[model_type]
        self.box_frame: str = family.box_frame  # the frame of its boxes and points (written as metadata["coords"])
        self.processor = AutoProcessor.from_pretrained(location)
        # resolves the pixel budgets before the weights load
        self.inputs = PromptEncoder(self.processor, config)
        model_cls = getattr(transformers, family.model_class)
        self.model = model_cls.from_pretrained(
            location, dtype=DTYPES[config.weights_dtype], attn_implementation=config.attn_implementation,
            use_safetensors=True,  # never a pickle
        ).eval()
        tok = self.processor.tokenizer
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        vocab = tok.get_vocab()
        self.stop_ids = sorted({tok.eos_token_id, *[vocab[t] for t in ("<|im_end|>", "<|endoftext|>") if t in vocab]})
        suppress = [vocab[t] for t in VISION_TOKENS if t in vocab]
        self.model.requires_grad_(False)
        self.lora = config.lora_rank > 0
        self.lora_config = inject_lora(self.model, config) if self.lora else None
        if not self.lora:  # full fine-tuning runs in float32 (weights_dtype then only sets the loading dtype)
            self.model.float()
            for name, param in self.model.named_parameters():
                param.requires_grad_(not (config.freeze_vision and ".visual." in f".{name}"))
        # the group forward that training runs through (its DDP/FSDP wrapper after prepare), and the reference: the
        # same forward with the adapter off, or a frozen copy of the initial model when fully fine-tuned
        if config.gradient_checkpointing:
            checkpoint_transformers(self.model)
        self.switch = ReferenceSwitch(GroupForward(self.model, suppress), adapters_off(self.model) if self.lora else None)
        self.device = torch.device("cpu")
        self.autocast = contextlib.nullcontext  # the run's autocast after `prepare` (what the training forward runs in)
        self.shared_prompt = SharedPromptForward()  # pipeline.share_prompt_forward: sampling's prompt states

    # ------------------------------------------------------------------------------------------------------ set-up
    @property
    def num_steps(self) -> int:
        return self.config.max_new_tokens

    @property
    def eval_num_steps(self) -> int:
        return self.config.eval_max_new_tokens or self.config.max_new_tokens

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def trainable_modules(self) -> dict[str, torch.nn.Module]:
        return {"model": self.model}

    def prepare(self, accelerator) -> list[torch.nn.Module]:
        """Moves the model (and a frozen reference) to the accelerator's device; wraps the group forward."""
        self.device = accelerator.device
        self.autocast = accelerator.autocast
        self.model.to(self.device)
        return self.switch.prepare(accelerator)

    def reference(self):
        """The reference policy: LoRA adapter disabled, or the frozen initial model when fully fine-tuned."""
        return self.switch.reference()

    # -------------------------------------------------------------------------------------------------- prompts
    def messages(self, prompt: str, images: list, videos: list) -> list[dict]:
        """The chat messages of one prompt (see [`PromptEncoder.messages`])."""
        return self.inputs.messages(prompt, images, videos)

    def encode_prompt(self, prompt: str, images: list, videos: list) -> dict[str, torch.Tensor]:
        """One prompt's model inputs on the CPU, resized once within the pixel budgets (see
        [`PromptEncoder.encode`]): ``input_ids`` `[L]`, ``mm_token_type_ids`` `[L]` and the vision tensors."""
        return self.inputs.encode(prompt, images, videos, self.model.dtype)

    def _encode_batch(self, batch: PromptBatch) -> list[dict]:
        """Encoded prompts, one entry per sample; the samples of one group share one entry (the same object)."""
        group_ids = batch.group_ids.tolist() if batch.group_ids is not None else list(range(len(batch)))
        first: dict[int, int] = {}  # group -> its first sample
        for i, gid in enumerate(group_ids):
            if gid not in first:
                first[gid] = i
            elif batch.prompts[i] != batch.prompts[first[gid]]:
                raise ValueError(f"Samples of group {gid} have different prompts; a group must share its prompt.")
        prompts = [(batch.prompts[i], *vision_inputs(batch.conditions, i)) for i in first.values()]
        encoded = dict(zip(first, self.inputs.encode_many(prompts, self.model.dtype)))  # one processor call
        for gid, i in first.items():
            self.inputs.record_input_size(batch.metadata[i], encoded[gid])
        for i in range(len(group_ids)):
            batch.metadata[i]["coords"] = self.box_frame  # the frame the rewards map boxes from (coords: model)
        return [encoded[gid] for gid in group_ids]

    # ------------------------------------------------------------------------------------------------- sampling
    def _shares_prompt_forward(self) -> bool:
        """Whether this forward may hand its prompt states to an update (``share_prompt_forward``, with gradients
        enabled, through the trained module itself: not its reference, not a distribution wrapper)."""
        switch = self.switch
        return (self.config.share_prompt_forward and torch.is_grad_enabled() and switch.forward is switch.module
                and not switch.in_reference)

    def sample(self, batch: PromptBatch, plan: TokenPlan, *, generator: torch.Generator | None = None) -> Rollout:
        """Decodes up to ``plan.num_steps`` tokens per sample with a KV cache: sampled (temperature, top-p, top-k)
        unless the plan is greedy, drawn from `generator` as ``torch.multinomial`` draws (see
        `_qwen_vl_decode.py`). The prompt and images of a group are forwarded once. With
        ``plan.ground_truth_member``, member 0 of each group decodes its ``metadata["completion"]`` instead of drawing
        (TempSamp-R1's off-policy member; its log-probs are the policy's on those tokens).

        Returns:
            [`Rollout`]: ``outputs["texts"]`` (`N` strings), ``old_log_probs`` `[N, S]`, ``mask`` `[N, S]` (completion
            tokens up to and including the end-of-turn token) and, in the trajectory, the completion ids `[N, S]`
            and the encoded prompts (one shared object per group).

        With ``share_prompt_forward`` (and gradients enabled, as in training) the prompt forward keeps its graph for
        the next update (see `_qwen_vl_shared_prompt.py`); greedy plans (evaluation) never keep one.
        """
        prompts = self._encode_batch(batch)
        unique, inverse = unique_rows(prompts)
        prefix = collate_prompts(unique, self.pad_id, self.device)
        module = self.switch.module
        self.shared_prompt.drop()
        if self._shares_prompt_forward() and not plan.greedy:
            with self.autocast():
                states = module.prompt_states(prefix)  # [U] rows, with a graph
            self.shared_prompt.keep(states, unique, self.trainable_parameters(), self.model.training)
        else:
            with torch.no_grad():
                states = module.prompt_states(prefix)
        with torch.no_grad():
            return self._decode(batch, plan, prompts, states.expand(inverse), generator)  # [N, V], cache of N rows

    def _decode(self, batch: PromptBatch, plan: TokenPlan, prompts: list[dict], expanded: tuple,
                generator: torch.Generator | None) -> Rollout:
        """The decode loop of [`sample`] from the prompts' states expanded to the `N` samples."""
        n, steps = len(batch), plan.num_steps
        forced = self._forced_tokens(batch, plan)  # [N, S]: a ground truth's tokens, -1 where the row samples
        logits, cache, prompt_mask, start = expanded  # [N, V], cache of N rows, [N, P], [N]
        module = self.switch.module
        model = module.model
        if lean_supported(model):
            step = LeanStep(model, cache, prompt_mask, start, steps, compiled=self.config.compile_decode)
        else:
            step = ModelStep(module, cache, prompt_mask, start)
        tokens, log_probs, mask = decode(
            step, logits, steps, log_softmax=lambda x: module.log_softmax(x, self.config.temperature),
            choose=TokenSampler(greedy=plan.greedy, top_k=self.config.top_k, top_p=self.config.top_p,
                                generator=generator), forced=forced,
            stop_ids=self.stop_ids, pad_id=self.pad_id, module=module,
        )  # [N, S] each
        texts = self.processor.tokenizer.batch_decode(
            [row[m].tolist() for row, m in zip(tokens, mask)], skip_special_tokens=True
        )
        group_ids = batch.group_ids if batch.group_ids is not None else torch.arange(n)
        return Rollout(
            group_ids=group_ids,
            outputs={"texts": texts, "num_tokens": mask.sum(dim=1)},
            old_log_probs=log_probs,  # [N, S]
            mask=mask,  # [N, S]
            trajectory={"completion_ids": tokens, "prompt_inputs": prompts},  # [N, S], N dicts (shared per group)
        )

    def _target_ids(self, texts: list[str]) -> list[list[int]]:
        """The token ids of each target text followed by the end-of-turn token (a stop token)."""
        tok = self.processor.tokenizer
        end = tok.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tok.get_vocab() else tok.eos_token_id
        return [tok(text, add_special_tokens=False)["input_ids"] + [end] for text in texts]

    def _forced_tokens(self, batch: PromptBatch, plan: TokenPlan) -> torch.Tensor:
        """`[N, S]` tokens that `sample` decodes instead of drawing (-1: drawn): with ``plan.ground_truth_member``,
        member 0 of each group decodes ``metadata["completion"]`` and the end-of-turn token (TempSamp-R1's
        off-policy ground-truth member)."""
        forced = torch.full((len(batch), plan.num_steps), -1, dtype=torch.long)
        if not plan.ground_truth_member:
            return forced
        if batch.member_ids is None:
            raise ValueError("ground_truth_member needs the prompts' member_ids (PromptBatch.repeat sets them).")
        rows = [int(i) for i in torch.nonzero(batch.member_ids == 0).flatten()]
        missing = [i for i in rows if not isinstance((batch.metadata[i] or {}).get("completion"), str)]
        if missing:
            raise ValueError(
                f"ground_truth_member: prompt {batch.prompts[missing[0]]!r} has no ground-truth text in "
                "metadata['completion']: use a prompt source that writes it (vlm_shapes with_targets: true; a JSONL "
                "'completion' field) or set algorithm.ground_truth_member: false."
            )
        for row, target in zip(rows, self._target_ids([batch.metadata[i]["completion"] for i in rows])):
            if len(target) > plan.num_steps:
                raise ValueError(f"ground_truth_member: the ground truth of {batch.prompts[row]!r} takes {len(target)} "
                                 f"tokens, more than the {plan.num_steps} of pipeline.max_new_tokens: raise it.")
            forced[row, : len(target)] = torch.tensor(target)
        return forced

    # ---------------------------------------------------------------------------------------------------- replay
    def log_prob(self, rollout: Rollout, steps: list[int]) -> Score:
        """Per-token log-probs of the sampled completions at token positions `steps`, under the current parameters,
        with gradients. Only the tokens up to the longest completion of the minibatch are forwarded.

        Returns:
            [`Score`] with `log_prob` `[n, len(steps)]` (0 where not a completion token) and `mask`
            `[n, len(steps)]` (the completion tokens).
        """
        length = int(rollout.mask.any(dim=0).nonzero().max()) + 1 if rollout.mask.any() else 1
        unique, inverse = unique_rows(rollout.trajectory["prompt_inputs"])
        completion = rollout.trajectory["completion_ids"][:, :length].to(self.device)  # [n, T']
        module = self.switch.forward  # the reference's inside `reference()`
        kept = None
        if self._shares_prompt_forward():  # sampling's prompt states, once (see `_qwen_vl_shared_prompt.py`)
            kept = self.shared_prompt.take(unique, self.model.training, inverse, self.model.config)
        if kept is not None:
            with self.autocast():
                scored = self.switch.module.continuation(*kept, completion, self.config.temperature)  # [n, T']
        else:
            prefix = collate_prompts(unique, self.pad_id, self.device)
            scored = module(prefix, inverse.to(self.device), completion, self.config.temperature,
                            shared=self.config.prefix_sharing)  # [n, T']
        n, full = rollout.mask.shape
        log_prob = torch.cat([scored, scored.new_zeros(n, full - length)], dim=1) if full > length else scored
        index = torch.as_tensor(steps, dtype=torch.long)
        mask = rollout.mask[:, index].to(self.device)
        return Score(log_prob=log_prob[:, index.to(self.device)] * mask, mask=mask)  # [n, k], [n, k]

    def teacher_rollout(self, batch: PromptBatch, completions: list[str]) -> Rollout:
        """A teacher-forced rollout: `completions` (one text per prompt of `batch`, followed by the end-of-turn token)
        as if they had been sampled, so that [`~QwenVLPolicy.log_prob`] scores them given their prompts (supervised
        fine-tuning, ``mmgrpo sft``). Nothing is forwarded here.

        Returns:
            [`Rollout`]: ``trajectory["completion_ids"]`` `[N, T]` (right-padded with the pad token), ``mask`` `[N, T]`
            (the target tokens, end-of-turn included), ``old_log_probs`` `[N, T]` zeros, ``outputs["texts"]`` the
            completions, ``trajectory["prompt_inputs"]`` the encoded prompts (shared within a group, as in `sample`).
        """
        if len(completions) != len(batch):
            raise ValueError(f"teacher_rollout: {len(completions)} completions for {len(batch)} prompts.")
        ids = self._target_ids(completions)
        length = max(len(row) for row in ids)
        tokens = torch.full((len(ids), length), self.pad_id, dtype=torch.long)  # [N, T]
        mask = torch.zeros(len(ids), length, dtype=torch.bool)  # [N, T]
        for row, target in enumerate(ids):
            tokens[row, : len(target)] = torch.tensor(target, dtype=torch.long)
            mask[row, : len(target)] = True
        group_ids = batch.group_ids if batch.group_ids is not None else torch.arange(len(batch))
        return Rollout(
            group_ids=group_ids,
            outputs={"texts": list(completions), "num_tokens": mask.sum(dim=1)},
            old_log_probs=torch.zeros(len(ids), length),  # [N, T]
            mask=mask,
            trajectory={"completion_ids": tokens, "prompt_inputs": self._encode_batch(batch)},
        )

    # ------------------------------------------------------------------------------------------ rollout engines
    def engine_prompts(self, batch: PromptBatch) -> list:
        """One [`~mmgrpo.engines.EnginePrompt`] per sample (see `_qwen_vl_engine.py`)."""
        return engine_side.engine_prompts(self, batch)

    def engine_sampling(self, plan: TokenPlan):
        """The [`~mmgrpo.engines.EngineSampling`] of `plan` under this policy's options."""
        return engine_side.engine_sampling(self, plan, VISION_TOKENS)

    def engine_rollout(self, batch: PromptBatch, prompts: list, tokens: list[list[int]],
                       log_probs: list[list[float]], steps: int) -> Rollout:
        """The replayable rollout of an engine's completions and log-probs (see `_qwen_vl_engine.py`)."""
        return engine_side.engine_rollout(self, batch, prompts, tokens, log_probs, steps)

    def engine_model(self) -> str:
        """The base model's folder or hub id, which an engine loads before the policy's weights replace its own."""
        return resolve_pretrained(self.config.pretrained, "pipeline.pretrained")

    def engine_weights(self) -> dict[str, torch.Tensor]:
        """The model's weights in the checkpoint's names, a LoRA merged in (for an engine that loads tensors)."""
        return engine_side.merged_weights(self.model)

    def engine_weights_to(self, path: str, adapter: bool) -> None:
        """Writes what an engine loads from disk: the LoRA adapter alone (`adapter`) or the merged model."""
        engine_side.write_weights(self, path, adapter)

    # ----------------------------------------------------------------------------------------------- checkpoints
    def save_pretrained(self, path: str) -> None:
        """Writes the LoRA adapter in peft's format (``adapter_config.json`` + ``adapter_model.safetensors``, which
        ``PeftModel.from_pretrained(base_model, path)`` reads) or, when fully fine-tuned, the whole model; the
        processor is saved beside it."""
        save_weights(self.model, self.lora_config, path)
        self.processor.save_pretrained(path)

    def load_trainable(self, path: str) -> None:
        """Loads weights written by [`~QwenVLPolicy.save_pretrained`] into this policy."""
        load_weights(self.model, self.lora, path)

    def export_pretrained(self, path: str, merge_lora: bool = False) -> None:
        """Writes the whole model and its processor (a LoRA merged by peft, or the base model plus the adapter in
        ``lora/``), loadable with the transformers class's ``from_pretrained`` (see
        [`mmgrpo.export.export_transformers`])."""
        from mmgrpo.export import export_transformers

        location = resolve_pretrained(self.config.pretrained, "pipeline.pretrained")
        export_transformers(self, type(self.model), location, path, merge_lora, self.lora, self.processor)


PLUGIN = QwenVLPolicy
