"""dpp_diversity: each member's leave-one-out gain in log det of its group's cosine kernel, plus the relevance term,
against numpy `slogdet` on features computed independently (open_clip's own PIL preprocessing), against closed forms on
hand-made features, and independent of which process held which member (the group stage on the gathered batch)."""

import math

import numpy as np
import pytest
import torch
from PIL import Image

from mmgrpo.config import ConfigError
from mmgrpo.rewards.dpp_diversity import DppDiversity, leave_one_out_gains
from mmgrpo.types import PromptBatch, RewardResult
from reward_fixtures import clip_of, random_levels, tiny_clip_dir  # noqa: F401 (fixture)

PROMPTS = ["a red circle moving right"] * 3 + ["two blue squares moving down"] * 3
GROUPS = torch.tensor([0, 0, 0, 1, 1, 1])


@pytest.fixture(scope="module")
def dpp(tiny_clip_dir):
    return lambda **o: DppDiversity(DppDiversity.Config(model_name=f"local-dir:{tiny_clip_dir}", device="cpu", **o))


def numpy_gains(phi: np.ndarray, jitter: float) -> list[float]:
    """log det L_G - log det L_{G without i} for each row of `phi` `[M, D]`, with numpy's slogdet."""
    kernel = phi @ phi.T + jitter * np.eye(len(phi))
    whole = np.linalg.slogdet(kernel)[1]
    gains = []
    for i in range(len(phi)):
        rest = np.delete(np.delete(kernel, i, axis=0), i, axis=1)
        gains.append(whole - (np.linalg.slogdet(rest)[1] if len(rest) else 0.0))
    return gains


def independent_features(tiny_clip_dir, levels: np.ndarray, stride: int) -> tuple[np.ndarray, np.ndarray]:
    """(phi `[N, D]`, relevance `[N]`) through open_clip's own PIL transforms and tokenizer, in float64."""
    import open_clip

    model, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{tiny_clip_dir}")
    tokenizer = open_clip.get_tokenizer(f"local-dir:{tiny_clip_dir}")
    with torch.no_grad():
        frames = np.array([[model.eval().encode_image(preprocess(Image.fromarray(f))[None])[0].double().numpy()
                            for f in video[::stride]] for video in levels])  # [N, F', D]
        text = model.encode_text(tokenizer(PROMPTS)).double().numpy()  # [N, D]
    frames /= np.linalg.norm(frames, axis=-1, keepdims=True)
    phi = frames.mean(axis=1)
    phi /= np.linalg.norm(phi, axis=-1, keepdims=True)
    text /= np.linalg.norm(text, axis=-1, keepdims=True)
    return phi, (phi * text).sum(-1)


def test_scores_equal_slogdet_by_hand_on_independent_features(dpp, tiny_clip_dir):
    levels = random_levels(seed=3, n=6, f=4)
    reward = dpp(frame_stride=2, relevance_weight=0.5, gain_weight=2.0, jitter=1e-2)
    per_sample = reward({"videos": clip_of(levels)}, PromptBatch(PROMPTS, group_ids=GROUPS))
    result = reward.group_stage(per_sample, GROUPS)
    phi, relevance = independent_features(tiny_clip_dir, levels, stride=2)
    gains = numpy_gains(phi[:3], 1e-2) + numpy_gains(phi[3:], 1e-2)  # each group's own kernel
    expected = [2.0 * g + 0.5 * r for g, r in zip(gains, relevance)]
    assert result.scores.tolist() == pytest.approx(expected, abs=1e-4)
    assert result.components["dpp_gain"].tolist() == pytest.approx(gains, abs=1e-4)
    assert per_sample.scores.tolist() == pytest.approx((0.5 * relevance).tolist(), abs=1e-5)  # before the stage
    assert np.ptp(gains) > 1e-3  # members that differ in what they add


def test_closed_forms_on_hand_made_features():
    j = 0.1
    e = torch.eye(3)
    # orthonormal members: L = (1 + j) I, every gain log(1 + j)
    assert leave_one_out_gains(e, j).tolist() == pytest.approx([math.log(1 + j)] * 3, abs=1e-6)
    # two identical members and an orthogonal one: det of the pair block (1 + j)^2 - 1 = j (2 + j)
    gains = leave_one_out_gains(torch.stack([e[0], e[0], e[1]]), j).tolist()
    duplicate = math.log(j * (2 + j) * (1 + j)) - math.log((1 + j) ** 2)
    assert gains == pytest.approx([duplicate, duplicate, math.log(1 + j)], abs=1e-6)
    assert duplicate < math.log(1 + j) - 1.5  # a repeat is worth far less than a new direction
    # a group of one: log det [1 + j] - log det [] = log(1 + j)
    assert leave_one_out_gains(e[:1], j).tolist() == pytest.approx([math.log(1 + j)])


def test_the_gain_is_minus_log_of_the_inverse_diagonal():
    features = torch.nn.functional.normalize(torch.randn(5, 4, generator=torch.Generator().manual_seed(0)), dim=-1)
    kernel = features.double() @ features.double().T + 1e-3 * torch.eye(5, dtype=torch.float64)
    schur = -torch.log(torch.diagonal(torch.linalg.inv(kernel)))  # the Schur-complement form of the docstring
    torch.testing.assert_close(leave_one_out_gains(features, 1e-3), schur.float(), rtol=1e-5, atol=1e-5)


def gather(parts: list[RewardResult]) -> RewardResult:
    """What the trainer's gather makes of the processes' results: each field concatenated in rank order."""
    return RewardResult(scores=torch.cat([p.scores for p in parts]),
                        components={k: torch.cat([p.components[k] for p in parts]) for k in parts[0].components},
                        features=torch.cat([p.features for p in parts]))


def test_independent_of_which_process_holds_which_member(dpp):
    levels = random_levels(seed=4, n=6, f=3)
    videos = clip_of(levels)  # [6, 3, 3, 32, 32]
    batch = PromptBatch(PROMPTS, group_ids=GROUPS)
    reward = dpp(relevance_weight=0.3)
    whole = reward.group_stage(reward({"videos": videos}, batch), GROUPS)
    # two processes holding [0, 1] and [2..5] (group 0 split across them), gathered in rank order
    splits = [[0, 1], [2, 3, 4, 5]]
    parts = [reward({"videos": videos[s]}, batch.select(s)) for s in splits]
    torch.testing.assert_close(reward.group_stage(gather(parts), GROUPS).scores, whole.scores, rtol=0, atol=1e-6)
    # another layout: members dealt round-robin to three processes ([0, 3], [1, 4], [2, 5]), gathered in that order
    order = [0, 3, 1, 4, 2, 5]
    parts = [reward({"videos": videos[order[i : i + 2]]}, batch.select(order[i : i + 2])) for i in range(0, 6, 2)]
    shuffled = reward.group_stage(gather(parts), GROUPS[order]).scores
    torch.testing.assert_close(shuffled, whole.scores[order], rtol=0, atol=1e-6)
    # scoring a process's members alone (a group split in two) is not the same: the group stage matters
    alone = reward.group_stage(reward({"videos": videos[:2]}, batch.select([0, 1])), GROUPS[:2]).scores
    assert not torch.allclose(alone, whole.scores[:2], atol=1e-4)


def test_non_finite_features_are_left_out_of_their_group(dpp):
    reward = dpp(jitter=0.1)
    features = torch.eye(4)[:3].clone()
    features[1, 0] = float("nan")
    result = RewardResult(scores=torch.zeros(3), components={"relevance": torch.zeros(3)}, features=features)
    scores = reward.group_stage(result, None).scores
    assert math.isnan(scores[1]) and scores[[0, 2]].tolist() == pytest.approx([math.log(1.1)] * 2)


def test_group_stage_without_features_and_config_errors(dpp):
    reward = dpp()
    with pytest.raises(ValueError, match="needs the features and relevance"):
        reward.group_stage(RewardResult(scores=torch.zeros(2)), None)
    with pytest.raises(ConfigError, match=r"dpp_diversity\.jitter must be >= 1e-08"):
        DppDiversity.Config(pretrained=None, jitter=0.0)
    with pytest.raises(ConfigError, match=r"dpp_diversity\.relevance_weight must be >= 0"):
        DppDiversity.Config(pretrained=None, relevance_weight=-1.0)
    with pytest.raises(ConfigError, match=r"dpp_diversity\.frame_stride / frame_reduce apply to videos"):
        DppDiversity.Config(pretrained=None, modality="image", frame_stride=2)
