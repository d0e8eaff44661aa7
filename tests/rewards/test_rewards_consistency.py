"""temporal_consistency (VBench's subject-consistency rule) against a hand computation on frame embeddings from
open_clip's own PIL preprocessing, frame pair by frame pair."""

import numpy as np
import pytest
import torch
from PIL import Image

from mmgrpo.config import ConfigError
from mmgrpo.rewards.temporal_consistency import TemporalConsistency
from mmgrpo.types import PromptBatch
from reward_fixtures import clip_of, random_levels, tiny_clip_dir  # noqa: F401 (fixture)

PROMPTS = ["a red circle moving right", "a green triangle growing"]


@pytest.fixture(scope="module")
def consistency(tiny_clip_dir):
    return lambda **o: TemporalConsistency(TemporalConsistency.Config(
        model_name=f"local-dir:{tiny_clip_dir}", device="cpu", **o))


def frame_features(tiny_clip_dir, levels: np.ndarray) -> np.ndarray:
    """`[N, F, D]` L2-normalised embeddings of every frame through open_clip's own PIL transforms (float64)."""
    import open_clip

    model, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{tiny_clip_dir}")
    with torch.no_grad():
        out = [[model.eval().encode_image(preprocess(Image.fromarray(frame))[None])[0].double().numpy()
                for frame in video] for video in levels]
    features = np.array(out)
    return features / np.linalg.norm(features, axis=-1, keepdims=True)


@pytest.mark.parametrize("stride", [1, 2])
def test_consistency_equals_vbench_rule_by_hand(consistency, tiny_clip_dir, stride):
    levels = random_levels(seed=1)
    result = consistency(frame_stride=stride)({"videos": clip_of(levels)}, PromptBatch(PROMPTS))
    expected, previous_terms = [], []
    for video in frame_features(tiny_clip_dir, levels):  # [F, D]
        f = video[::stride]
        terms = [(max(0.0, f[i - 1] @ f[i]) + max(0.0, f[0] @ f[i])) / 2 for i in range(1, len(f))]
        expected.append(sum(terms) / len(terms))
        previous_terms.append(sum(max(0.0, f[i - 1] @ f[i]) for i in range(1, len(f))) / (len(f) - 1))
    assert result.scores.tolist() == pytest.approx(expected, abs=1e-5)
    assert result.components["previous"].tolist() == pytest.approx(previous_terms, abs=1e-5)
    assert max(expected) < 1 - 1e-3  # frames that differ in feature space (by far more than the tolerance)


def test_consistency_of_a_still_video_is_one_and_of_one_frame_nan(consistency):
    still = np.repeat(random_levels(seed=2, f=1), 4, axis=1)  # [2, 4, H, W, 3]: the same frame four times
    reward = consistency()
    scores = reward({"videos": clip_of(still)}, PromptBatch(PROMPTS)).scores
    assert scores.tolist() == pytest.approx([1.0, 1.0], abs=1e-5)
    assert torch.isnan(reward({"videos": clip_of(still[:, :1])}, PromptBatch(PROMPTS)).scores).all()


def test_consistency_clamps_negative_cosines_at_zero():
    from mmgrpo.rewards.temporal_consistency import consistency_terms

    e0, e1 = torch.eye(2)
    features = torch.stack([e0, -e0, e1])[None]  # [1, 3, 2]: cos(f0, f1) = -1, cos(f1, f2) = 0, cos(f0, f2) = 0
    previous, first = consistency_terms(features)
    assert previous.tolist() == [0.0] and first.tolist() == [0.0]  # max(0, -1) = 0, not -1


def test_consistency_config_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"temporal_consistency\.frame_stride must be >= 1"):
        TemporalConsistency.Config(frame_stride=0, pretrained=None)
    with pytest.raises(ValueError, match=r"temporal_consistency\.pretrained.*no such file"):
        TemporalConsistency.Config(pretrained=str(tmp_path / "open_clip_pytorch_model.bin"))
