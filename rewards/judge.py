"""VLM judge: scores each output with a vision-language model served behind an OpenAI-compatible chat-completions
API (``vllm serve``, SGLang), as Flow-GRPO's and DiffusionNFT's ``unifiedreward`` and Flow-Factory's
``vllm_evaluate`` rewards do.

Each sample is one request: its image (a video: `num_frames` frames spread evenly, first and last included) as a PNG
data URL, then `template` with ``{prompt}`` (and, for text outputs, ``{output}``: the completion) filled in. The
answer becomes a score by `parser`:

- ``"score"`` (Flow-GRPO's UnifiedReward rule): the number after the first `score_marker` (``Final Score:``), which
  must lie in ``[score_min, score_max]``, divided by `score_max`: ``r = x / score_max`` (1..5 -> 0.2..1).
- ``"yes_no"`` (Flow-Factory's ``vllm_evaluate``): the judge answers one token and ``r = P(Yes) / (P(Yes) + P(No))``
  from its ``top_logprobs`` (`top_logprobs` alternatives asked for; `canonicalize` also counts ``yes``, `` YES``...);
  a server that returns no log-probs gives 1 / 0 for an answer starting with yes / no.

Differences from the authors: a failed request (after `retries`) or an answer the parser cannot read scores NaN, not 0
(Flow-GRPO, Flow-Factory), so it is left out of its group's statistics instead of pulling the group down; the
components ``failed`` and ``unparsable`` (0 / 1 per sample) count them, and the trainer's ``reward/invalid`` counts the
NaN. Flow-GRPO's pattern reads a single digit 1-5; here the whole number is read and refused outside the range. Images
are sent as PNG (lossless) where the authors send JPEG. The default template is written for this project in the
authors' answer format (paste the authors' own template into `template` to reproduce their prompt exactly).

It scores what the judge says and nothing else: a judge can be fooled (reward hacking); evaluate on other rewards too
(``eval.rewards``). The server's options (address, timeouts, retries, concurrency, cache, API key) are
[`~mmgrpo.rewards._judge.JudgeServer`]'s, written flat beside these.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import torch

from mmgrpo.rewards._common import MEDIA_KEYS, fixed_artifacts, modality_option, nans, texts
from mmgrpo.rewards._judge import (
    JudgeClient, JudgeServer, answer_text, chat_body, media_urls, parse_score, yes_probability,
)
from mmgrpo.types import PromptBatch, RewardResult
from mmgrpo.validation import ConfigError, check_fields, check_range, check_template, check_text, embedded

TEMPLATE = (
    "You are given a text caption and an output generated from it. Judge (1) how well the output matches the "
    "caption: the objects, their attributes, counts and relations; and (2) its overall quality: clarity, detail, "
    "colour and composition. Based on both, give a score from 1 to 5 after 'Final Score:'.\n"
    "Text Caption: [{prompt}]"
)
FRAMES_LIMIT = 256


@dataclass
class JudgeConfig:
    """Configuration of [`JudgeReward`] (the server's options, [`~mmgrpo.rewards._judge.JudgeServer`], flat beside).

    Args:
        modality (`str`, defaults to `"image"`): what it scores: ``"image"``, ``"video"`` (`num_frames` frames per
            request) or ``"text"`` (the completion fills ``{output}``).
        template (`str`): the request's text; ``{prompt}`` is the prompt, ``{output}`` the completion (text only);
            other braces doubled. Defaults to a caption-alignment and quality question answered after
            ``Final Score:`` (1 to 5).
        parser (`str`, defaults to `"score"`): ``"score"`` (the number after `score_marker`, divided by `score_max`)
            or ``"yes_no"`` (P(Yes) / (P(Yes) + P(No)) from the first answer token's log-probs).
        score_marker (`str`, defaults to `"Final Score:"`): the text the score follows.
        score_min (`float`, defaults to 1.0), score_max (`float`, defaults to 5.0): the range a score must lie in
            (outside: unparsable); the reward is ``score / score_max``.
        top_logprobs (`int`, defaults to 20): alternatives asked for the answer token (``yes_no``).
        canonicalize (`bool`, defaults to `False`): ``yes_no`` counts every token reading yes / no once stripped and
            lower-cased (Flow-Factory's option), not only ``Yes`` / ``No``.
        num_frames (`int`, defaults to 8): frames sent per video, spread evenly.
    """

    server: JudgeServer = embedded(JudgeServer)
    modality: Literal["image", "video", "text"] = "image"
    template: str = TEMPLATE
    parser: Literal["score", "yes_no"] = "score"
    score_marker: str = "Final Score:"
    score_min: float = 1.0
    score_max: float = 5.0
    top_logprobs: int = 20
    canonicalize: bool = False
    num_frames: int = 8

    def __post_init__(self):
        check_fields(self)
        fields = {"prompt": "p", "output": "o"} if self.modality == "text" else {"prompt": "p"}
        check_template("template", self.template, **fields)
        if self.modality == "text" and "{output}" not in self.template:
            raise ConfigError("template must hold {output} with modality: text (where the completion goes).")
        check_text("score_marker", self.score_marker)
        check_range("score_max", self.score_max, 0, 1e6, low_open=True, fix="the judge's highest score, e.g. 5")
        check_range("score_min", self.score_min, -1e6, self.score_max, fix="at most score_max")
        check_range("top_logprobs", self.top_logprobs, 1, 20, fix="vLLM and OpenAI give at most 20")
        check_range("num_frames", self.num_frames, 1, FRAMES_LIMIT, fix="frames sent per video")


class JudgeReward:
    """Asks a served VLM to score each output; NaN (counted) where it gives no usable answer."""

    Config = JudgeConfig
    modalities = frozenset()  # the `modality` option's
    artifacts = frozenset()
    group_stage = None

    modalities_for = classmethod(modality_option)
    artifacts_for = classmethod(fixed_artifacts)

    def __init__(self, config: JudgeConfig | None = None):
        self.config = config = config or JudgeConfig()
        self.modalities = self.modalities_for(config)
        if config.parser == "score":
            parse = partial(_score, marker=config.score_marker, low=config.score_min, high=config.score_max)
        else:
            parse = partial(yes_probability, canonicalize=config.canonicalize)
        self.client = JudgeClient(config.server, parse, "judge")

    def requests(self, outputs: dict[str, Any], batch: PromptBatch) -> list[dict | None]:
        """The request body of each sample (None for a malformed text output)."""
        cfg, n = self.config, len(batch)
        one_token = cfg.parser == "yes_no"
        extra = {"max_tokens": 1, "top_logprobs": cfg.top_logprobs} if one_token else {}
        if cfg.modality == "text":
            entries = texts(outputs, n, "judge")
            return [None if t is None else chat_body(cfg.server, cfg.template.format(prompt=p, output=t), [], **extra)
                    for p, t in zip(batch.prompts, entries)]
        media = outputs.get(MEDIA_KEYS[cfg.modality])
        ndim = 4 if cfg.modality == "image" else 5
        if not isinstance(media, torch.Tensor) or media.dim() != ndim or media.shape[0] != n:
            raise ValueError(f"judge: expected outputs[{MEDIA_KEYS[cfg.modality]!r}] as a tensor of {n} "
                             f"{cfg.modality}s; set reward.modality to what the pipeline produces.")
        return [chat_body(cfg.server, cfg.template.format(prompt=p), media_urls(media[i], cfg.num_frames), **extra)
                for i, p in enumerate(batch.prompts)]

    def __call__(self, outputs: dict[str, Any], batch: PromptBatch) -> RewardResult:
        """Returns `scores` `[N]` (NaN where the judge gave no usable answer) and the components ``failed`` and
        ``unparsable`` (each `[N]`, 0 / 1)."""
        bodies = self.requests(outputs, batch)
        asked = [i for i, body in enumerate(bodies) if body is not None]
        values, status = self.client.ask([bodies[i] for i in asked]) if asked else ([], [])
        scores, failed, unparsable = nans(len(batch)), torch.zeros(len(batch)), torch.zeros(len(batch))
        for i, value, state in zip(asked, values, status):
            if value is not None:
                scores[i] = value
            failed[i], unparsable[i] = float(state == "failed"), float(state == "unparsable")
        for i in set(range(len(batch))) - set(asked):
            unparsable[i] = 1.0  # a malformed text output: nothing to ask
        return RewardResult(scores=scores, components={"failed": failed, "unparsable": unparsable})


def _score(answer: dict, marker: str, low: float, high: float) -> float | None:
    """The ``score`` parser: the number after `marker` in the answer text, divided by `high`."""
    text = answer_text(answer)
    value = None if text is None else parse_score(text, marker, low, high)
    return None if value is None else value / high


PLUGIN = JudgeReward
