"""The Qwen-VL adapter (`qwen_vl`) seen from a rollout engine (vLLM, SGLang; see [`mmgrpo.engines`]).

**Prompts.** An engine's processor expands each image's placeholder itself, so it is sent the chat template's tokens
with one ``<|image_pad|>`` per image (the trainer's prompt tokens with each run of image placeholders collapsed to
one: the exact inverse of the processor's expansion) and the images as qwen-vl-utils resized them for the trainer
(one resize, within the configured pixel budget; the engine's processor gets the same budget, under which a resized
image is kept as it is). The trainer's expanded tokens travel along (``EnginePrompt.expanded_ids``), so an engine's
or a test's view of the prompt can be compared with the trainer's. Video prompts sample with the local engine
(refused here with that fix).

**Rollouts.** The engine's completion tokens and their log-probs become the rollout `sample` would have written
(``completion_ids`` `[N, S]` padded, ``mask`` up to and including the first end-of-turn token, the encoded prompts
in the trajectory), with the engine's log-probs as ``old_log_probs`` and ``engine_log_probs``: the algorithm's
rollout correction recomputes the trainer's before any update.

**Weights.** [`merged_weights`]: the model's weights in the checkpoint's names, a LoRA merged in (``W + B A *
scale`` by peft's own ``get_delta_weight``), for an engine that loads tensors (the colocated vLLM);
[`write_weights`]: the same on disk (the merged model, or the adapter alone for an engine that loads adapters).

Not a plugin: the name starts with an underscore and it defines no ``PLUGIN``.
"""

from __future__ import annotations

import torch

from mmgrpo.engines import EnginePrompt, EngineSampling
from mmgrpo.pipelines._qwen_vl_inputs import vision_inputs
from mmgrpo.plans import TokenPlan
from mmgrpo.types import PromptBatch, Rollout


def collapse_placeholders(ids: list[int], placeholder: int) -> list[int]:
    """`ids` with each run of `placeholder` tokens collapsed to one (the inverse of the processor's expansion)."""
    out: list[int] = []
    for token in ids:
        if not (token == placeholder and out and out[-1] == placeholder):
            out.append(token)
    return out


def engine_prompts(policy, batch: PromptBatch) -> list[EnginePrompt]:
    """One [`EnginePrompt`] per sample of `batch` (the samples of a group share one object); see the module
    docstring."""
    from qwen_vl_utils import process_vision_info

    encoded = policy._encode_batch(batch)  # [N] dicts, one per group (also writes coords / input_size metadata)
    placeholder = policy.processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    budget = policy.inputs.image_budget
    made: dict[int, EnginePrompt] = {}
    out = []
    for i, prompt in enumerate(encoded):
        if id(prompt) not in made:
            images, videos = vision_inputs(batch.conditions, i)
            if videos:
                raise ValueError("rollout.engine: vllm / sglang samples text and image prompts; a prompt with a video "
                                 "samples with rollout.engine: local.")
            resized = []
            if images:
                messages = policy.inputs.messages(batch.prompts[i], images, [])
                resized = process_vision_info(messages, image_patch_size=policy.inputs.patch_size)[0]
            expanded = prompt["input_ids"].tolist()
            made[id(prompt)] = EnginePrompt(
                prompt_ids=collapse_placeholders(expanded, placeholder), images=list(resized or []),
                processor_kwargs={"min_pixels": budget.min_pixels, "max_pixels": budget.max_pixels} if images else {},
                expanded_ids=expanded, encoded=prompt,
            )
        out.append(made[id(prompt)])
    return out


def engine_sampling(policy, plan: TokenPlan, outside: tuple[str, ...]) -> EngineSampling:
    """The policy's sampling options for an engine: the plan's tokens, the configured temperature, top-p and top-k,
    the end-of-turn tokens, and the tokens `outside` the policy's support (Qwen's vision tokens) never drawn."""
    c = policy.config
    vocab = policy.processor.tokenizer.get_vocab()
    return EngineSampling(max_tokens=plan.num_steps, temperature=c.temperature, top_p=c.top_p, top_k=c.top_k,
                          greedy=plan.greedy, stop_ids=tuple(policy.stop_ids),
                          suppress_ids=tuple(vocab[t] for t in outside if t in vocab))


def engine_rollout(policy, batch: PromptBatch, prompts: list[EnginePrompt], tokens: list[list[int]],
                   log_probs: list[list[float]], steps: int) -> Rollout:
    """The replayable rollout of an engine's completions `tokens` (one list per sample, at most `steps` each) and
    their engine log-probs (see the module docstring)."""
    n = len(batch)
    if len(tokens) != n or len(log_probs) != n:
        raise ValueError(f"The engine returned {len(tokens)} completions for {n} prompts.")
    ids = torch.full((n, steps), policy.pad_id, dtype=torch.long)  # [N, S]
    lp = torch.zeros(n, steps)  # [N, S]
    mask = torch.zeros(n, steps, dtype=torch.bool)  # [N, S]
    stops = set(policy.stop_ids)
    for row, (completion, values) in enumerate(zip(tokens, log_probs)):
        if len(completion) > steps or len(values) != len(completion):
            raise ValueError(f"The engine returned {len(completion)} tokens and {len(values)} log-probs for a "
                             f"completion of at most {steps} tokens.")
        end = next((t + 1 for t, token in enumerate(completion) if token in stops), len(completion))
        ids[row, :end] = torch.tensor(completion[:end], dtype=torch.long)
        lp[row, :end] = torch.tensor(values[:end], dtype=torch.float32)
        mask[row, :end] = True
    texts = policy.processor.tokenizer.batch_decode([row[m].tolist() for row, m in zip(ids, mask)],
                                                    skip_special_tokens=True)
    return Rollout(
        group_ids=batch.group_ids if batch.group_ids is not None else torch.arange(n),
        outputs={"texts": texts, "num_tokens": mask.sum(dim=1)},
        old_log_probs=lp.clone(),  # [N, S]; recomputed by the trainer under the rollout correction
        mask=mask,  # [N, S]
        trajectory={"completion_ids": ids, "prompt_inputs": [p.encoded for p in prompts]},
        engine_log_probs=lp,  # [N, S]
    )


@torch.no_grad()
def merged_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights of `model` under the checkpoint's names, each LoRA layer's delta merged into its base weight."""
    from peft.tuners.lora import LoraLayer

    out = {}
    for name, tensor in model.state_dict().items():
        if "lora_" not in name:
            out[name.replace(".base_layer.", ".")] = tensor
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            delta = sum(module.get_delta_weight(adapter) for adapter in module.active_adapters)
            out[f"{name}.weight"] = module.base_layer.weight + delta
    return out


def write_weights(policy, path: str, adapter: bool) -> None:
    """Writes the weights an engine loads from disk into folder `path`: the LoRA adapter alone in peft's format
    (`adapter`), or the whole model with its processor (a LoRA merged in)."""
    if adapter and not policy.lora:
        raise ValueError("rollout.engine: vllm with rollout.mode: server loads LoRA adapters only; a fully "
                         "fine-tuned policy (pipeline.lora_rank: 0) needs rollout.mode: colocate or "
                         "rollout.engine: sglang.")
    if adapter:
        policy.save_pretrained(path)
    else:
        policy.export_pretrained(path, merge_lora=True)
