"""vLLM colocated with the trainer (``rollout.engine: vllm``, ``rollout.mode: colocate``): one ``vllm.LLM`` per
training process, on that process's GPU, asleep while the trainer updates and awake while it samples.

The engine's life per step: the trainer's updates end and it calls ``sync_weights``, which only marks the weights as
stale. The next ``sample`` wakes the weights (``LLM.wake_up(tags=["weights"])``), loads the policy's current weights
into them when stale (a LoRA merged in: the pipeline's ``engine_weights()``, through ``LLM.apply_model`` and the
model's own ``load_weights``, which maps the checkpoint's names), wakes the KV cache, generates, and sleeps again
(``LLM.sleep(level=1)``: weights offloaded to CPU memory, KV cache discarded), so the trainer's forward and optimizer
have the GPU's memory back. The engine is built with ``enable_sleep_mode=True`` and, under a multi-process launch,
``distributed_executor_backend="external_launcher"`` (each process its own engine, as TRL's colocate mode does);
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps the engine in the trainer's process so weights load without a copy.

Requests: each sample's ``{"prompt_token_ids": ..., "multi_modal_data": {"image": [...]}, "mm_processor_kwargs":
{"min_pixels", "max_pixels"}}`` from the pipeline's [`~mmgrpo.engines.EnginePrompt`] (one placeholder per image,
the images resized as the trainer's processor saw them, the same pixel budget), with ``SamplingParams(max_tokens,
temperature (0: greedy), top_p, top_k, stop_token_ids, logit_bias (-100 on the tokens outside
the policy's support), logprobs=0, seed)``; a sample's seed is drawn from the
trainer's generator, so a run is reproducible. vLLM reports the prompt tokens it saw after its processor's
expansion (``RequestOutput.prompt_token_ids``), kept in `seen` for the prompt-equality check; ``logprobs=0`` returns
the sampled token's log-prob, the engine's log-probs of the rollout; the engine is built with
``logprobs_mode="processed_logprobs"``, so they are taken after the temperature and the logit bias, as the policy's
(vLLM's default, raw log-probs, ignores the temperature).
"""

from __future__ import annotations

import os

import torch

from .plans import SamplingPlan
from .types import PromptBatch, Rollout

SEED_SPAN = 2**31 - 1  # vLLM's per-request seeds


class VLLMColocateEngine:
    """A ``vllm.LLM`` in the trainer's process; see the module docstring.

    Args:
        policy: the trained policy (a pipeline declaring ``engine_rollout``).
        rollout ([`~mmgrpo.sections.RolloutConfig`]): the engine's arguments.
    """

    name = "vllm_colocate"
    holds_weights = True

    def __init__(self, policy, rollout):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM

        self.policy = policy
        kwargs = dict(model=policy.engine_model(), gpu_memory_utilization=rollout.gpu_memory_utilization,
                      tensor_parallel_size=rollout.tensor_parallel_size, enable_sleep_mode=True,
                      enforce_eager=rollout.enforce_eager, seed=rollout.seed,
                      logprobs_mode="processed_logprobs")  # after temperature and the logit bias, as the policy's
        if rollout.max_model_len:
            kwargs["max_model_len"] = rollout.max_model_len
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            kwargs["distributed_executor_backend"] = "external_launcher"
        self.llm = LLM(**kwargs)
        self.stale = True  # the policy's weights (a resumed or LoRA-initialised model) load before the first rollout
        self.seen: list[list[int]] = []  # the prompt tokens vLLM saw in the last rollout, one list per sample
        self.llm.sleep(level=1)

    def sync_weights(self, policy) -> None:
        """Marks the engine's weights stale: the next `sample` loads the policy's (see the module docstring)."""
        self.policy, self.stale = policy, True

    def load_weights(self) -> None:
        """Copies the policy's current weights (a LoRA merged) into the awake engine."""
        weights = self.policy.engine_weights()  # name -> tensor, the checkpoint's names
        self.llm.apply_model(lambda model: model.load_weights(weights=list(weights.items())))
        self.stale = False

    def sample(self, batch: PromptBatch, plan: SamplingPlan, *, generator: torch.Generator | None = None) -> Rollout:
        """Wakes the engine, loads stale weights, generates `batch` under `plan`, and puts the engine back to sleep."""
        from vllm import SamplingParams

        prompts = self.policy.engine_prompts(batch)
        sampling = self.policy.engine_sampling(plan)
        seeds = torch.randint(SEED_SPAN, (len(prompts),), generator=generator).tolist()
        options = dict(max_tokens=sampling.max_tokens, temperature=0.0 if sampling.greedy else sampling.temperature,
                       top_p=sampling.top_p, stop_token_ids=list(sampling.stop_ids), logprobs=0,
                       skip_special_tokens=False, logit_bias={token: -100.0 for token in sampling.suppress_ids})
        if sampling.top_k > 0:
            options["top_k"] = sampling.top_k
        params = [SamplingParams(seed=seed, **options) for seed in seeds]
        requests = []
        for p in prompts:
            request = {"prompt_token_ids": list(p.prompt_ids)}
            if p.images:
                request["multi_modal_data"] = {"image": list(p.images)}
                request["mm_processor_kwargs"] = dict(p.processor_kwargs)
            requests.append(request)
        self.llm.wake_up(tags=["weights"])
        if self.stale:
            self.load_weights()
        self.llm.wake_up(tags=["kv_cache"])
        try:
            outputs = self.llm.generate(requests, params, use_tqdm=False)
        finally:
            self.llm.sleep(level=1)
        self.seen = [list(out.prompt_token_ids) for out in outputs]
        tokens = [list(out.outputs[0].token_ids) for out in outputs]
        log_probs = [[step[token].logprob for step, token in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)]
                     for out in outputs]
        return self.policy.engine_rollout(batch, prompts, tokens, log_probs, sampling.max_tokens)
