"""Pairwise VLM judge (Pref-GRPO): each member's reward is its win rate against the other members of its group.

Pref-GRPO: https://arxiv.org/abs/2508.20751 (code: CodeGoat24/Pref-GRPO, ``fastvideo/rewards/unifiedreward_think.py``).
A judge served behind an OpenAI-compatible chat-completions API (``vllm serve`` of UnifiedReward-Think, SGLang) is
shown two outputs of the same prompt, first and second, with `template` (``{prompt}`` filled in), and answers which is
better. For member ``i`` of a group ``G``:

    win_i = sum over judged comparisons c involving i of  w_c(i)       w = 1 win, 0 loss, 1/2 tie
    r_i   = win_i / (number of judged comparisons involving i)

The answer's first ``<answer_tag>...</answer_tag>`` block decides: it contains `first_better` -> the first output
wins, else `second_better` -> the second wins, else a tie; an answer without the block is a tie too (the authors'
rule) and counts as ``unparsable``.

- ``orders: both`` (default): every pair is judged in both orders (i first, then j first), so a judge that prefers
  a position gives each order's win to a different member and the bias cancels: ``2 * C(G, 2)`` calls per group.
- ``orders: one``: each unordered pair once, the lower member index first: the authors' code exactly
  (``itertools.combinations``), ``C(G, 2)`` calls.
- ``max_pairs`` > 0 judges at most that many pairs per group, drawn without replacement by a generator seeded with
  (`seed`, the group's global id): the same group gets the same pairs in every process and on a re-run.

Components (each `[N]`): ``judge_calls`` (the requests of the member's group: their batch mean is the calls per group
when groups are equal), ``failed`` and ``unparsable`` (the shares of the group's requests that got no answer after
the retries / no answer block).

Differences from the authors: a comparison whose request failed (after `retries`) is left out of both members'
counts, and a member with no judged comparison scores NaN (the authors' client stops on such a failure; a member
never compared scores 0 there); the win rate is not rounded to 3 decimals; images go as PNG, not JPEG. A member alone
in its group (every held-out sample in evaluation) has no opponent and scores 1/2, with no request: evaluate with a
pointwise reward (``eval.rewards``).

The group stage judges the groups where they were sampled: it reads the outputs and prompts of this process's last
call, so with several processes use ``train.group_placement: contiguous`` (each process judges its own groups;
under ``spread`` the stage refuses a group it did not sample). The server's options (address, timeouts, retries,
concurrency, cache, API key) are [`~mmgrpo.rewards._judge.JudgeServer`]'s, written flat beside these.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import torch

from mmgrpo.rewards._common import MEDIA_KEYS, check_tag, fixed_artifacts, modality_option
from mmgrpo.rewards._judge import JudgeClient, JudgeServer, answer_text, chat_body, media_urls, parse_preference
from mmgrpo.rewards.judge import FRAMES_LIMIT
from mmgrpo.seeding import mix_seed
from mmgrpo.types import PromptBatch, RewardResult
from mmgrpo.validation import check_fields, check_range, check_seed, check_template, check_text, embedded

TEMPLATE = (
    "You are given a text caption and two outputs generated from it: the first half of the images belong to output 1, "
    "the second half to output 2. Compare them on how well they follow the caption, their aesthetics and their "
    "realism. Reason inside <think> and </think>, then give your verdict inside <answer> and </answer> as exactly "
    "one of: Image 1 is better / Image 2 is better.\nThe caption is: [{prompt}]"
)


@dataclass
class JudgePairwiseConfig:
    """Configuration of [`JudgePairwiseReward`] (the server's options, [`~mmgrpo.rewards._judge.JudgeServer`], flat
    beside; `max_tokens` defaults to 4096 for a reasoning judge, as Pref-GRPO asks).

    Args:
        modality (`str`, defaults to `"image"`): ``"image"`` or ``"video"`` (`num_frames` frames of each output, the
            first output's then the second's).
        template (`str`): the request's text, ``{prompt}`` filled in (other braces doubled); defaults to a comparison
            answered inside ``<answer>`` tags with `first_better` / `second_better`.
        answer_tag (`str`, *optional*, defaults to `"answer"`): the tag whose first block holds the verdict; null
            reads the whole answer.
        first_better (`str`, defaults to `"Image 1 is better"`): the verdict that the first output wins (Pref-GRPO's
            video judge: ``Video 1 is better``).
        second_better (`str`, defaults to `"Image 2 is better"`): the verdict that the second output wins.
        orders (`str`, defaults to `"both"`): ``"both"`` judges every pair in both orders (position bias cancels);
            ``"one"`` once, lower index first (the authors' code).
        max_pairs (`int`, defaults to 0): pairs judged per group at most, drawn with a seeded generator; 0 judges all
            ``C(G, 2)``.
        seed (`int`, defaults to 0): seed of the pair draw (mixed with the group's global id).
        num_frames (`int`, defaults to 8): frames sent per video, spread evenly.
    """

    server: JudgeServer = embedded(JudgeServer, max_tokens=4096)
    modality: Literal["image", "video"] = "image"
    template: str = TEMPLATE
    answer_tag: str | None = "answer"
    first_better: str = "Image 1 is better"
    second_better: str = "Image 2 is better"
    orders: Literal["both", "one"] = "both"
    max_pairs: int = 0
    seed: int = 0
    num_frames: int = 8

    def __post_init__(self):
        check_fields(self)
        check_template("template", self.template, prompt="p")
        check_tag("answer_tag", self.answer_tag)
        check_text("first_better", self.first_better)
        check_text("second_better", self.second_better)
        if self.first_better in self.second_better or self.second_better in self.first_better:
            raise ValueError("first_better and second_better must not contain each other (the verdict would be "
                             f"ambiguous), got {self.first_better!r} and {self.second_better!r}.")
        check_range("max_pairs", self.max_pairs, 0, 1 << 20, fix="0 judges every pair")
        check_seed("seed", self.seed)
        check_range("num_frames", self.num_frames, 1, FRAMES_LIMIT, fix="frames sent per video")


def sample_pairs(size: int, max_pairs: int, seed: int, group: int) -> list[tuple[int, int]]:
    """The pairs ``(a, b)``, ``a < b``, of a group of `size` members to judge: all, or `max_pairs` of them drawn
    without replacement by a generator seeded with (`seed`, `group`), in increasing order."""
    pairs = list(itertools.combinations(range(size), 2))
    if max_pairs and len(pairs) > max_pairs:
        pairs = sorted(random.Random(mix_seed(seed, group)).sample(pairs, max_pairs))
    return pairs


def win_rates(n: int, judgements: list[tuple[int, int, float | None]], compared: torch.Tensor) -> torch.Tensor:
    """Each sample's win rate `[n]` from `judgements` ``(first, second, w)``: ``w`` the first's share of the win
    (1, 0 or 1/2 for a tie), None for a comparison without an answer (left out). `compared` `[n]` bool: the samples
    that have opponents; the others score 1/2. A sample with opponents but no judged comparison scores NaN."""
    wins, counts = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    for first, second, w in judgements:
        if w is None:
            continue
        wins[first] += w
        wins[second] += 1.0 - w
        counts[first] += 1
        counts[second] += 1
    rates = torch.where(counts > 0, wins / counts.clamp_min(1), torch.full_like(wins, float("nan")))
    return torch.where(compared, rates, torch.full_like(rates, 0.5)).float()


class JudgePairwiseReward:
    """Scores each member by its win rate against its group, as judged pair by pair by a served VLM."""

    Config = JudgePairwiseConfig
    modalities = frozenset()  # the `modality` option's
    artifacts = frozenset()
    group_stage = None  # the class default; an instance holds its stage

    modalities_for = classmethod(modality_option)
    artifacts_for = classmethod(fixed_artifacts)

    def __init__(self, config: JudgePairwiseConfig | None = None):
        self.config = config = config or JudgePairwiseConfig()
        self.modalities = self.modalities_for(config)
        parse = partial(_verdict, tag=config.answer_tag, first=config.first_better, second=config.second_better)
        self.client = JudgeClient(config.server, parse, "judge_pairwise")
        self.last: tuple[torch.Tensor | None, list[str], torch.Tensor] | None = None  # the last call's samples
        self.group_stage = self.stage_groups

    def __call__(self, outputs: dict[str, Any], batch: PromptBatch) -> RewardResult:
        """Keeps this call's outputs and prompts for the group stage; returns the placeholder score 1/2 `[N]` (a
        member without opponents) and zero components."""
        key = MEDIA_KEYS[self.config.modality]
        media = outputs.get(key)
        ndim = 4 if self.config.modality == "image" else 5
        if not isinstance(media, torch.Tensor) or media.dim() != ndim or media.shape[0] != len(batch):
            raise ValueError(f"judge_pairwise: expected outputs[{key!r}] as a tensor of {len(batch)} "
                             f"{self.config.modality}s; set reward.modality to what the pipeline produces.")
        ids = None if batch.group_ids is None else batch.group_ids.detach().cpu()
        self.last = (ids, list(batch.prompts), media.detach().cpu())
        zeros = torch.zeros(len(batch))
        return RewardResult(scores=torch.full((len(batch),), 0.5),
                            components={"judge_calls": zeros, "failed": zeros.clone(), "unparsable": zeros.clone()})

    def stage_groups(self, result: RewardResult, group_ids: torch.Tensor | None) -> RewardResult:
        """The group stage: judges the pairs of every group of two or more members (one batch of requests) and
        returns each member's win rate `[N]` with the components of the module docstring."""
        cfg, n = self.config, result.scores.shape[0]
        groups = torch.zeros(n, dtype=torch.long) if group_ids is None else group_ids.detach().cpu()
        members = {int(g): torch.nonzero(groups == g).flatten().tolist() for g in torch.unique(groups)}
        judged = {g: idx for g, idx in members.items() if len(idx) > 1}
        compared = torch.tensor([len(members[int(g)]) > 1 for g in groups], dtype=torch.bool)
        calls, failed, unparsable = torch.zeros(n), torch.zeros(n), torch.zeros(n)
        if not judged:
            return RewardResult(scores=torch.full((n,), 0.5), components={"judge_calls": calls, "failed": failed,
                                                                          "unparsable": unparsable})
        prompts, media = self._samples(n, groups)
        urls: dict[int, list[str]] = {}
        requests: list[tuple[int, int, int]] = []  # (group, first, second)
        for g, idx in judged.items():
            for a, b in sample_pairs(len(idx), cfg.max_pairs, cfg.seed, g):
                requests.append((g, idx[a], idx[b]))
                if cfg.orders == "both":
                    requests.append((g, idx[b], idx[a]))
        bodies = []
        for _, first, second in requests:
            for i in (first, second):
                if i not in urls:
                    urls[i] = media_urls(media[i], cfg.num_frames)
            bodies.append(chat_body(cfg.server, cfg.template.format(prompt=prompts[first]), urls[first] + urls[second]))
        values, status = self.client.ask(bodies)
        judgements = []
        for (g, first, second), value, state in zip(requests, values, status):
            judgements.append((first, second, None if state == "failed" else 0.5 if value is None else value))
            where = groups == g
            calls[where] += 1
            failed[where] += float(state == "failed")
            unparsable[where] += float(state == "unparsable")
        share = calls.clamp_min(1)
        return RewardResult(scores=win_rates(n, judgements, compared),
                            components={"judge_calls": calls, "failed": failed / share, "unparsable": unparsable / share})

    def _samples(self, n: int, groups: torch.Tensor) -> tuple[list[str], torch.Tensor]:
        """The prompts and outputs of the rows the group stage scores: those of the last call, which must be the same
        samples (the groups judged where they were sampled; see the module docstring)."""
        last = self.last
        same = last is not None and len(last[1]) == n and (last[0] is None or torch.equal(last[0], groups))
        if not same:
            raise ValueError(
                "judge_pairwise: the group stage got samples this process did not score last (a group split over "
                "processes, or the stage run without the call): with several processes set train.group_placement: "
                "contiguous, so each process judges its own groups."
            )
        return last[1], last[2]


def _verdict(answer: dict, tag: str | None, first: str, second: str) -> float | None:
    """The first output's share of the win (1, 0, 1/2), or None for an answer without a verdict block."""
    text = answer_text(answer)
    return None if text is None else parse_preference(text, tag, first, second)


PLUGIN = JudgePairwiseReward
