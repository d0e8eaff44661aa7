"""A rollout server on loopback that serves, from a real tiny Qwen2-VL, the API subset the server engine speaks
(`mmgrpo.engine_server`): SGLang's ``POST /generate`` and ``POST /update_weights_from_disk``, and vLLM's ``GET
/v1/models``, ``POST /v1/completions`` (token-id prompts), ``POST /v1/load_lora_adapter`` and
``/v1/unload_lora_adapter``, in the shapes those servers answer.

Like the real servers it receives the chat template's tokens with one placeholder per image and the images; its own
processor (``AutoProcessor`` of the served folder) expands the placeholders, and it records the prompt tokens the
model then sees (`prompts_seen`). Decoding is a plain loop over the model's full forward (no cache): greedy at
temperature 0, otherwise a draw from ``softmax((logits + bias) / T)`` after top-k / top-p; a token's log-prob is
that of the tempered, biased distribution (what vLLM calls processed log-probs, truncation aside).

Seeds, as the real servers define them: a sample's draws come from a ``torch.Generator`` seeded with its seed. vLLM: a
completions request's ``seed`` applies to each of its prompts, and its ``n`` children of a prompt draw with ``seed +
i`` (child ``i``), the choices prompt by prompt, children in order. SGLang: each prompt's ``sampling_params`` entry
(one dict for all, or a list with one per prompt) may carry ``sampling_seed``; the stand-in honours it as an SGLang
server launched with ``--enable-deterministic-inference`` does. Without a seed a sample draws fresh noise. Every
request's route and body are kept in `requests`.

Faults for the error tests (`fault`): ``"stall"`` (no answer until the server stops), ``"drop"`` (the connection
closed without an answer).
"""

from __future__ import annotations

import base64
import io
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from PIL import Image


def decode_image(url: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB")


class TinyEngineServer:
    """The server (see the module docstring); `url` is its base address."""

    def __init__(self, model_dir: str):
        self.model_dir = model_dir
        self.model = self.load(model_dir)
        from transformers import AutoProcessor

        self.processor = AutoProcessor.from_pretrained(model_dir)
        self.adapters: dict[str, torch.nn.Module] = {}
        self.prompts_seen: list[list[int]] = []
        self.requests: list[tuple[str, dict]] = []  # (route, body) of every POST, in arrival order
        self.fault: str | None = None
        self.release = threading.Event()
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):
                server.reply(self, {"object": "list", "data": [{"id": "tiny-qwen2-vl"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                if server.fault == "stall":
                    server.release.wait()
                    return
                if server.fault == "drop":
                    self.close_connection = True
                    return
                with server.lock:
                    server.requests.append((self.path, body))
                    server.route(self, self.path, body)

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.http.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        self.thread = threading.Thread(target=self.http.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)

    @staticmethod
    def load(path: str) -> torch.nn.Module:
        from transformers import Qwen2VLForConditionalGeneration

        return Qwen2VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()

    def start(self) -> "TinyEngineServer":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.release.set()
        self.http.shutdown()
        self.http.server_close()

    @staticmethod
    def reply(handler, answer, text: bool = False, status: int = 200) -> None:
        data = (answer if text else json.dumps(answer)).encode("utf-8")
        handler.send_response(status)
        handler.send_header("Content-Type", "text/plain" if text else "application/json")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)

    def route(self, handler, path: str, body: dict) -> None:
        if path == "/generate":
            self.reply(handler, self.generate_sglang(body))
        elif path == "/v1/completions":
            self.reply(handler, self.complete_vllm(body))
        elif path == "/update_weights_from_disk":
            try:
                self.model = self.load(body["model_path"])
                self.reply(handler, {"success": True, "message": "Succeeded to update model weights."})
            except (OSError, ValueError) as err:
                self.reply(handler, {"success": False, "message": str(err)})
        elif path == "/v1/load_lora_adapter":
            from peft import PeftModel

            base = self.load(self.model_dir)
            self.adapters[body["lora_name"]] = PeftModel.from_pretrained(base, body["lora_path"]).merge_and_unload()
            self.reply(handler, f"Success: LoRA adapter '{body['lora_name']}' added successfully.", text=True)
        elif path == "/v1/unload_lora_adapter":
            self.adapters.pop(body["lora_name"])
            self.reply(handler, f"Success: LoRA adapter '{body['lora_name']}' removed successfully.", text=True)
        else:
            self.reply(handler, {"error": f"no route {path}"}, status=404)

    # ---------------------------------------------------------------------------------------------- decoding
    def decode(self, model, ids: list[int], images: list, options: dict, max_tokens: int,
               seed: int | None) -> tuple[list, list]:
        """The completion tokens and their log-probs of prompt `ids` (one placeholder per image) and `images`, drawn
        with `seed` (fresh noise when None)."""
        text = self.processor.tokenizer.decode(ids, skip_special_tokens=False)
        inputs = self.processor(text=[text], images=images or None, return_tensors="pt")
        self.prompts_seen.append(inputs["input_ids"][0].tolist())
        bias = torch.zeros(model.config.get_text_config().vocab_size)
        for token, value in options.get("logit_bias", {}).items():
            bias[int(token)] = float(value)
        temperature = float(options.get("temperature", 1.0))
        top_k, top_p = int(options.get("top_k", -1)), float(options.get("top_p", 1.0))
        stops = set(options.get("stop_token_ids", []))
        generator = torch.Generator()
        if seed is None:
            generator.seed()  # nondeterministic, as a server's own noise
        else:
            generator.manual_seed(seed)
        tokens, log_probs = [], []
        for _ in range(max_tokens):
            n = inputs["input_ids"].shape[1]
            with torch.no_grad():
                logits = model(**inputs).logits[0, -1].float() + bias[: model.config.get_text_config().vocab_size]
            logp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)  # [V]
            if temperature == 0:
                token = int(logp.argmax())
            else:
                probs = logp.exp()
                if top_k > 0:
                    probs[probs < probs.topk(top_k).values[-1]] = 0
                if top_p < 1:
                    ordered, order = probs.sort(descending=True)
                    probs[order[(ordered.cumsum(0) - ordered) > top_p * ordered.sum()]] = 0
                token = int(torch.multinomial(probs, 1, generator=generator))
            tokens.append(token)
            log_probs.append(float(logp[token]))
            if token in stops:
                break
            inputs["input_ids"] = torch.cat([inputs["input_ids"], torch.tensor([[token]])], dim=1)
            inputs["attention_mask"] = torch.ones(1, n + 1, dtype=torch.long)
            if "mm_token_type_ids" in inputs:
                inputs["mm_token_type_ids"] = torch.cat([inputs["mm_token_type_ids"], torch.zeros(1, 1, dtype=torch.long)],
                                                        dim=1)
        return tokens, log_probs

    def generate_sglang(self, body: dict) -> list[dict]:
        images = body.get("image_data") or [[] for _ in body["input_ids"]]
        params = body["sampling_params"]
        params = params if isinstance(params, list) else [params] * len(body["input_ids"])
        answers = []
        for ids, urls, options in zip(body["input_ids"], images, params):
            tokens, log_probs = self.decode(self.model, ids, [decode_image(u) for u in urls], options,
                                            options["max_new_tokens"], options.get("sampling_seed"))
            answers.append({"text": self.processor.tokenizer.decode(tokens), "output_ids": tokens,
                            "meta_info": {"output_token_logprobs": [[lp, t, None] for lp, t in zip(log_probs, tokens)],
                                          "finish_reason": {"type": "stop"}}})
        return answers

    def complete_vllm(self, body: dict) -> dict:
        model = self.adapters[body["model"]] if body["model"] in self.adapters else self.model
        choices, seed = [], body.get("seed")
        for ids in body["prompt"]:
            for child in range(body.get("n", 1)):
                tokens, log_probs = self.decode(model, ids, [], body, body["max_tokens"],
                                                None if seed is None else seed + child)
                choices.append({"index": len(choices), "text": self.processor.tokenizer.decode(tokens),
                                "token_ids": tokens, "logprobs": {"token_logprobs": log_probs}})
        return {"object": "text_completion", "choices": choices}


@pytest.fixture
def engine_server(tiny_qwen2_vl_dir):
    """A [`TinyEngineServer`] of the tiny Qwen2-VL on a free loopback port, in background threads."""
    server = TinyEngineServer(tiny_qwen2_vl_dir).start()
    yield server
    server.stop()
