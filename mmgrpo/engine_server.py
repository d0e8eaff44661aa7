"""A rollout engine that samples on a running vLLM or SGLang server (``rollout.mode: server``), over HTTP.

Requests (SGLang: one per step, one entry per sample; vLLM: one per group, see Seeds below; the policy's
[`~mmgrpo.engines.EnginePrompt`] s):

- SGLang (``rollout.engine: sglang``): its native ``POST /generate`` with ``input_ids`` (the chat template's tokens,
  one placeholder per image, which SGLang's processor expands), ``image_data`` (the images as PNG data URLs, already
  resized as the trainer's processor saw them), ``sampling_params`` (``max_new_tokens``, ``temperature`` (0 for
  greedy), ``top_p``, ``top_k`` (-1 for all), ``stop_token_ids``, ``skip_special_tokens: false``, ``logit_bias``
  -100 on the tokens outside the policy's support, ``no_stop_trim: true``) and ``return_logprob: true``; each
  answer's ``output_ids`` and ``meta_info.output_token_logprobs`` (``[logprob, token_id, text]`` per token) make
  the rollout. Weights: the
  trainer writes the whole model (a LoRA merged) to ``rollout.weights_dir`` and posts ``POST
  /update_weights_from_disk`` ``{"model_path": <folder>}`` (answer ``{"success": bool, "message": str}``).
- vLLM (``rollout.engine: vllm``): the OpenAI-compatible ``POST /v1/completions`` with the token ids as ``prompt``,
  ``logprobs: 1``, ``return_token_ids: true`` and the same sampling options; each choice's ``token_ids`` and
  ``logprobs.token_logprobs`` make the rollout. The completions API takes no images: image prompts need the
  colocated vLLM or SGLang. Weights: the trainer writes the LoRA adapter to ``rollout.weights_dir`` and posts ``POST
  /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}`` (the server started with ``--enable-lora`` and
  ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``); later requests name the adapter as their ``model``. A fully fine-tuned
  policy needs the colocated vLLM or SGLang.

Seeds: with the step's generator, the same run seed sends the same requests. SGLang: one ``sampling_seed`` per sample
(``sampling_params`` a list, one entry per prompt), drawn from the generator; SGLang honours it only when launched
with ``--enable-deterministic-inference`` (without it the field is ignored). vLLM: a completions request's ``seed``
applies to each of its prompts, and its ``n`` children draw with ``seed + i`` (child ``i``); so each group goes as one
request (its prompt once, ``n`` the group's size, the group's seed drawn from the generator), the groups' requests
concurrently, and group member ``i`` draws with ``seed + i``. Without a generator the requests carry no seed (one
request for the whole batch) and the server draws its own noise.

The engine's log-probs are the server's (raw or processed as the server is launched: see ``docs/distributed.md``);
the algorithm's ``rollout_correction`` recomputes the trainer's before any update (the default). Errors (no answer
within ``rollout.timeout_s``, a refused or dropped connection, an HTTP error, an answer without the fields above) stop
the run with one line naming the server and the fix. Requests are not retried: a step samples once.
"""

from __future__ import annotations

import base64
import http.client
import io
import json
import shutil
import socket
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from .engines import EnginePrompt, EngineSampling
from .engines_vllm import SEED_SPAN
from .plans import SamplingPlan
from .types import PromptBatch, Rollout


class EngineServerError(RuntimeError):
    """A rollout server did not answer as expected (the message names the server and the fix)."""


def png_data_url(image) -> str:
    """A PIL image as a lossless ``data:image/png;base64,...`` URL (the server decodes exactly these pixels)."""
    buffer = io.BytesIO()
    image.convert("RGB").save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def sampling_options(sampling: EngineSampling) -> dict:
    """The sampling options both servers read, from the policy's."""
    return {"temperature": 0.0 if sampling.greedy else sampling.temperature, "top_p": sampling.top_p,
            "top_k": sampling.top_k if sampling.top_k > 0 else -1, "stop_token_ids": list(sampling.stop_ids),
            "skip_special_tokens": False, "logit_bias": {str(token): -100.0 for token in sampling.suppress_ids}}


MAX_CONCURRENT = 16  # vLLM: the most group requests in flight at once


def prompt_groups(batch: PromptBatch, prompts: list[EnginePrompt]) -> list[range]:
    """The samples of `batch` as runs of consecutive samples that share their group id (where the batch has ids) and
    their prompt: one vLLM request each."""
    def same(a: int, b: int) -> bool:
        grouped = batch.group_ids is None or int(batch.group_ids[a]) == int(batch.group_ids[b])
        return grouped and prompts[a].prompt_ids == prompts[b].prompt_ids

    runs, start = [], 0
    for j in range(1, len(prompts) + 1):
        if j == len(prompts) or not same(j - 1, j):
            runs.append(range(start, j))
            start = j
    return runs


class ServerEngine:
    """Samples on a vLLM or SGLang server; see the module docstring.

    Args:
        policy: the trained policy (a pipeline declaring the ``engine_rollout`` capability).
        engine (`str`): ``"vllm"`` or ``"sglang"``: the server's API.
        url (`str`): the server's base address (``http://host:port``).
        timeout_s (`float`): seconds a request may take.
        weights_dir (`str`): where the trainer writes the weights the server reloads (a folder both see).
    """

    holds_weights = True

    def __init__(self, policy, engine: str, url: str, timeout_s: float, weights_dir: str):
        self.policy, self.engine, self.url, self.timeout_s = policy, engine, url.rstrip("/"), timeout_s
        self.name = f"{engine}_server"
        self.weights_dir = Path(weights_dir)
        self.adapter: str | None = None  # vLLM: the LoRA adapter the requests name, once one is loaded
        self.version = 0  # weight pushes so far
        self.sent: list[list[int]] = []  # the prompt token ids of the last request, one list per sample

    # ---------------------------------------------------------------------------------------------------- HTTP
    def post(self, route: str, payload: dict, text: bool = False):
        """The JSON answer of ``POST <url><route>`` (its text with `text`: vLLM's adapter routes answer plain text);
        raises [`EngineServerError`]."""
        body = json.dumps(payload).encode("utf-8")
        request = urllib.request.Request(f"{self.url}{route}", data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
        where = f"rollout server {self.url}{route}"
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                raw = response.read()
        except urllib.error.HTTPError as err:
            detail = " ".join(err.read().decode("utf-8", "replace").split())[:300]
            raise EngineServerError(f"{where} answered HTTP {err.code}: {detail}") from None
        except (TimeoutError, socket.timeout) as err:
            raise EngineServerError(f"{where}: no answer within rollout.timeout_s={self.timeout_s:g} s ({err}); "
                                    "raise rollout.timeout_s or check the server's load.") from None
        except urllib.error.URLError as err:  # refused, unreachable, or timed out while connecting
            if isinstance(err.reason, (TimeoutError, socket.timeout)):
                raise EngineServerError(f"{where}: no answer within rollout.timeout_s={self.timeout_s:g} s; raise "
                                        "rollout.timeout_s or check the server's load.") from None
            raise EngineServerError(f"{where}: the connection failed ({err.reason}): is the server running at "
                                    "rollout.server_url?") from None
        except (OSError, http.client.HTTPException) as err:  # reset or closed without an answer
            raise EngineServerError(f"{where}: the connection was dropped ({type(err).__name__}: {err}): is the "
                                    "server running at rollout.server_url?") from None
        if text:
            return raw.decode("utf-8", "replace")
        try:
            return json.loads(raw)
        except ValueError:
            raise EngineServerError(f"{where} answered something that is not JSON: {raw[:120]!r}") from None

    # -------------------------------------------------------------------------------------------------- sampling
    def sample(self, batch: PromptBatch, plan: SamplingPlan, *, generator: torch.Generator | None = None) -> Rollout:
        """The server's rollout of `batch`: its tokens and log-probs in the policy's replayable rollout, in the batch's
        order. The request seeds are drawn from `generator` (see the module docstring); without it, no seed."""
        prompts = self.policy.engine_prompts(batch)
        sampling = self.policy.engine_sampling(plan)
        self.sent = [list(p.prompt_ids) for p in prompts]
        if self.engine == "sglang":
            seeds = None if generator is None else torch.randint(SEED_SPAN, (len(prompts),),
                                                                 generator=generator).tolist()  # [N]: one per sample
            tokens, log_probs = self._sglang(prompts, sampling, seeds)
        else:
            tokens, log_probs = self._vllm(batch, prompts, sampling, generator)
        return self.policy.engine_rollout(batch, prompts, tokens, log_probs, sampling.max_tokens)

    def _sglang(self, prompts: list[EnginePrompt], sampling: EngineSampling,
                seeds: list[int] | None) -> tuple[list, list]:
        params = {"max_new_tokens": sampling.max_tokens, "no_stop_trim": True, **sampling_options(sampling)}
        payload = {"input_ids": self.sent, "return_logprob": True,
                   "sampling_params": params if seeds is None else [{**params, "sampling_seed": s} for s in seeds]}
        if any(p.images for p in prompts):
            payload["image_data"] = [[png_data_url(image) for image in p.images] for p in prompts]
        answers = self.post("/generate", payload)
        answers = answers if isinstance(answers, list) else [answers]
        if len(answers) != len(prompts):
            raise EngineServerError(f"rollout server {self.url}/generate answered {len(answers)} results for "
                                    f"{len(prompts)} prompts.")
        try:
            tokens = [[int(t) for t in answer["output_ids"]] for answer in answers]
            log_probs = [[float(entry[0]) for entry in answer["meta_info"]["output_token_logprobs"]]
                         for answer in answers]
        except (KeyError, TypeError, IndexError, ValueError) as err:
            raise EngineServerError(f"rollout server {self.url}/generate: an answer lacks output_ids or "
                                    f"meta_info.output_token_logprobs ({err!r}); is it an SGLang server?") from None
        return tokens, log_probs

    def _vllm(self, batch: PromptBatch, prompts: list[EnginePrompt], sampling: EngineSampling,
              generator: torch.Generator | None) -> tuple[list, list]:
        if any(p.images for p in prompts):
            raise EngineServerError("rollout.engine: vllm with rollout.mode: server samples text prompts only (vLLM's "
                                    "completions API takes no images): use rollout.mode: colocate, or "
                                    "rollout.engine: sglang as the server.")
        base = {"model": self.adapter or self.served_model(), "max_tokens": sampling.max_tokens, "logprobs": 1,
                "return_token_ids": True, **sampling_options(sampling)}
        if generator is None:  # one request, no seed: the server draws its own noise
            return self._complete({**base, "prompt": self.sent, "n": 1})
        groups = prompt_groups(batch, prompts)
        seeds = torch.randint(SEED_SPAN, (len(groups),), generator=generator).tolist()  # [groups]: member i: seed + i
        payloads = [{**base, "prompt": [self.sent[group[0]]], "n": len(group), "seed": seed}
                    for group, seed in zip(groups, seeds)]
        with ThreadPoolExecutor(max_workers=min(len(payloads), MAX_CONCURRENT)) as pool:
            answers = list(pool.map(self._complete, payloads))  # in the groups' order
        return [t for tokens, _ in answers for t in tokens], [lp for _, log_probs in answers for lp in log_probs]

    def _complete(self, payload: dict) -> tuple[list, list]:
        """The choices' tokens and log-probs of one ``/v1/completions`` request, in the choices' order (prompt by
        prompt, each prompt's ``n`` children in order)."""
        answer = self.post("/v1/completions", payload)
        try:
            choices = sorted(answer["choices"], key=lambda choice: choice["index"])
            tokens = [[int(t) for t in choice["token_ids"]] for choice in choices]
            log_probs = [[float(x) for x in choice["logprobs"]["token_logprobs"]] for choice in choices]
        except (KeyError, TypeError, ValueError) as err:
            raise EngineServerError(f"rollout server {self.url}/v1/completions: an answer lacks choices[].token_ids "
                                    f"or logprobs.token_logprobs ({err!r}); is it a vLLM server?") from None
        expected = len(payload["prompt"]) * payload["n"]
        if len(tokens) != expected:
            raise EngineServerError(f"rollout server {self.url}/v1/completions answered {len(tokens)} choices for "
                                    f"{expected} completions.")
        return tokens, log_probs

    def served_model(self) -> str:
        """The model name the vLLM server serves (its first ``GET /v1/models`` entry)."""
        request = urllib.request.Request(f"{self.url}/v1/models", method="GET")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return json.loads(response.read())["data"][0]["id"]
        except (OSError, http.client.HTTPException, ValueError, KeyError, IndexError, TypeError) as err:
            raise EngineServerError(f"rollout server {self.url}/v1/models: no served model ({err!r}): is a vLLM "
                                    "server running at rollout.server_url?") from None

    # --------------------------------------------------------------------------------------------------- weights
    def sync_weights(self, policy) -> None:
        """Writes the policy's weights to a new folder under ``weights_dir`` and has the server load them (see the
        module docstring); the previous push's folder is then removed."""
        self.version += 1
        folder = self.weights_dir / f"v{self.version}"
        if self.engine == "sglang":
            policy.engine_weights_to(str(folder), adapter=False)
            answer = self.post("/update_weights_from_disk", {"model_path": str(folder)})
            if not isinstance(answer, dict) or not answer.get("success"):
                raise EngineServerError(f"rollout server {self.url}/update_weights_from_disk refused the weights in "
                                        f"{folder}: {answer!r}; rollout.weights_dir must be a folder the server "
                                        "reads.")
        else:
            policy.engine_weights_to(str(folder), adapter=True)
            name = f"mmgrpo-v{self.version}"
            self.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(folder)}, text=True)
            previous, self.adapter = self.adapter, name
            if previous is not None:
                self.post("/v1/unload_lora_adapter", {"lora_name": previous}, text=True)
        shutil.rmtree(self.weights_dir / f"v{self.version - 1}", ignore_errors=True)  # loaded: no longer read
