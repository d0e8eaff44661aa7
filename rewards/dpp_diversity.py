"""Set-level diversity of a group (DPP-GRPO): each member's marginal gain in the log-determinant of its group's kernel.

DPP-GRPO: https://arxiv.org/abs/2511.20647 . A determinantal point process over a group gives diminishing returns to
redundant members: the reward of member ``i`` of group ``G`` is its marginal gain
``Delta(i | R) = log det L(R u {i}) - log det L(R)`` with ``R`` the rest of its group (leave one out), plus a
relevance term:

    phi_i   = normalize(mean over kept frames of the L2-normalised open_clip image embeddings)   (an image: its own)
    L_G     = [phi_i . phi_j]_{i, j in G} + jitter * I                                             (cosine kernel)
    gain_i  = log det L_G - log det L_{G \\ {i}}     (log det of the empty matrix = 0)
            = -log (L_G^{-1})_{ii}                   (Schur complement: <= log(1 + jitter), 0 for an orthogonal member)
    rel_i   = cos(phi_i, text embedding of the prompt)
    score_i = gain_weight * gain_i + relevance_weight * rel_i

A member that repeats another one gets a gain near ``log(jitter)`` (very negative), a member unlike every other one
``log(1 + jitter)``; the gain depends on the whole group, so it is computed in the reward's group stage (see
`mmgrpo.protocols.RewardFn`): ``__call__`` embeds each process's samples (``features`` `[n, D]`, ``relevance`` as a
component, and, before the group stage, ``scores = relevance_weight * rel``), and the trainer calls ``group_stage`` on
the batch gathered from every process, with the global group ids, so a group that spans processes is scored as a
whole and the result does not depend on which process held which member. Members whose features are not finite are
left out of their group's kernel and score NaN. In evaluation every held-out sample is its own group, so its gain is
the constant ``log(1 + jitter)``: diversity shows in the training groups. It rewards diversity in CLIP space only: it
does not check quality or that the members follow the prompt beyond the relevance term (combine it with such rewards
in `composite`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F

from mmgrpo.rewards import _clip
from mmgrpo.rewards._common import (
    WEIGHT_LIMIT, check_frame_options, fixed_artifacts, frames, modality_option, nans, non_finite_samples,
)
from mmgrpo.types import PromptBatch, RewardResult
from mmgrpo.validation import check_fields, check_range


@dataclass
class DppDiversityConfig:
    """Configuration of [`DppDiversity`].

    Args:
        model_name (`str`, defaults to `"ViT-L-14"`): the open_clip model giving the features, as in `clip_score`.
        pretrained (`str`, *optional*, defaults to `"openai"`): its open_clip tag or a local checkpoint file; None
            builds random weights (tests only).
        modality (`str`, defaults to `"video"`): ``"video"`` (``outputs["videos"]`` `[N, F, 3, H, W]`) or ``"image"``.
        frame_stride (`int`, defaults to 1): with ``modality: video``, the frames ``0, k, 2k, ...`` averaged into a
            video's feature.
        gain_weight (`float`, defaults to 1.0): weight of the DPP gain (> 0).
        relevance_weight (`float`, defaults to 0.0): weight of the prompt relevance (>= 0; 0 leaves it out).
        jitter (`float`, defaults to 1e-3): added to the kernel's diagonal (> 0), so that the log-determinants of
            groups with repeated members stay finite.
        batch_size (`int`, defaults to 32): images per CLIP forward.
        device (`str`, defaults to `"auto"`): where the CLIP model runs (``"auto"``: CUDA when available).
    """

    model_name: str = "ViT-L-14"
    pretrained: str | None = "openai"
    modality: Literal["image", "video"] = "video"
    frame_stride: int = 1
    gain_weight: float = 1.0
    relevance_weight: float = 0.0
    jitter: float = 1e-3
    batch_size: int = 32
    device: str = "auto"

    def __post_init__(self):
        check_fields(self)
        check_frame_options("dpp_diversity", self.modality, self.frame_stride, "mean")
        check_range("dpp_diversity.gain_weight", self.gain_weight, 0, WEIGHT_LIMIT, low_open=True,
                    fix="the gain is the reward")
        check_range("dpp_diversity.relevance_weight", self.relevance_weight, 0, WEIGHT_LIMIT,
                    fix="0 leaves the relevance out")
        check_range("dpp_diversity.jitter", self.jitter, 1e-8, 10.0, fix="e.g. 1e-3; the gain of a repeat is about "
                    "log(jitter)")
        _clip.check_options("dpp_diversity", self)


def leave_one_out_gains(features: torch.Tensor, jitter: float) -> torch.Tensor:
    """``log det L_G - log det L_{G \\ {i}}`` `[M]` for every member of one group, ``L_G = features features^T +
    jitter * I`` with `features` `[M, D]` (float64 inside)."""
    phi = features.double()  # [M, D]
    kernel = phi @ phi.T + jitter * torch.eye(phi.shape[0], dtype=torch.float64)  # [M, M]
    _, whole = torch.linalg.slogdet(kernel)
    gains = []
    for i in range(phi.shape[0]):
        keep = [j for j in range(phi.shape[0]) if j != i]
        rest = torch.linalg.slogdet(kernel[keep][:, keep])[1] if keep else torch.zeros((), dtype=torch.float64)
        gains.append(whole - rest)
    return torch.stack(gains).float() if gains else torch.zeros(0)


class DppDiversity:
    """Scores each member of a group by the diversity it adds to the group (see the module docstring)."""

    Config = DppDiversityConfig
    modalities = frozenset({"video"})  # the default; an instance holds its configured modality
    artifacts = frozenset()  # adds nothing for the sample writers

    modalities_for = classmethod(modality_option)  # see mmgrpo.protocols.RewardFn
    artifacts_for = classmethod(fixed_artifacts)

    def __init__(self, config: DppDiversityConfig | None = None):
        self.config = config or DppDiversityConfig()
        self.modalities = self.modalities_for(self.config)
        self.model, self.tokenizer = _clip.load_open_clip(
            "dpp_diversity", self.config.model_name, self.config.pretrained, self.config.device
        )

    def __call__(self, outputs: dict[str, Any], batch: PromptBatch) -> RewardResult:
        """Per process: `features` `[N, D]` (``phi``), `components` ``relevance`` and ``malformed`` `[N]`, and `scores`
        ``relevance_weight * relevance`` `[N]` until [`group_stage`] adds the gain."""
        cfg = self.config
        pixels, per_sample = frames(outputs, cfg.modality, "dpp_diversity", cfg.frame_stride)  # [N * F', 3, H, W]
        image = _clip.image_embeddings(pixels, self.model, cfg.batch_size)  # [N * F', D]
        features = F.normalize(image.view(-1, per_sample, image.shape[-1]).mean(dim=1), dim=-1)  # [N, D]
        text = _clip.text_embeddings(list(batch.prompts), self.model, self.tokenizer, cfg.batch_size)  # [N, D]
        relevance = (features * text).sum(dim=-1).float()  # [N]
        return RewardResult(
            scores=cfg.relevance_weight * relevance,
            components={"relevance": relevance, "malformed": non_finite_samples(outputs, cfg.modality)},
            features=features.float(),
        )

    def group_stage(self, result: RewardResult, group_ids: torch.Tensor | None) -> RewardResult:
        """The group stage (the gain needs the whole group): `result` of the whole batch (``features`` `[N, D]`,
        ``components["relevance"]`` `[N]`) and its global `group_ids` `[N]` (`None`: one group) -> ``scores`` `[N]`
        and the components plus ``dpp_gain``."""
        cfg = self.config
        if result.features is None or "relevance" not in result.components:
            raise ValueError("dpp_diversity: the group stage needs the features and relevance that its __call__ "
                             "returns; pass it the gathered result of that call.")
        features = result.features.float().cpu().flatten(1)  # [N, D]
        n = features.shape[0]
        groups = torch.zeros(n, dtype=torch.long) if group_ids is None else group_ids.cpu()
        finite = torch.isfinite(features).all(dim=1)  # [N]
        gains = nans(n)  # [N]
        for group in torch.unique(groups):
            members = torch.nonzero((groups == group) & finite).flatten()  # [M]
            gains[members] = leave_one_out_gains(features[members], cfg.jitter)
        relevance = result.components["relevance"].float().cpu()  # [N]
        scores = cfg.gain_weight * gains + cfg.relevance_weight * relevance  # [N]
        return RewardResult(scores=scores.float(), components={**result.components, "dpp_gain": gains},
                            features=result.features)


PLUGIN = DppDiversity
