"""The image rewards (clip_score, aesthetic, pickscore, jpeg) on videos: every `frame_stride`-th frame scored as the
image reward scores that frame on its own, reduced by `frame_reduce` (mean, min, first), against a hand computation
from the per-frame image scores."""

import pytest
import torch

from mmgrpo.config import ConfigError
from mmgrpo.rewards.aesthetic import AestheticScore
from mmgrpo.rewards.clip_score import ClipScore
from mmgrpo.rewards.jpeg import JpegReward
from mmgrpo.rewards.pickscore import PickScore
from mmgrpo.types import PromptBatch
from reward_fixtures import tiny_aesthetic_head, tiny_clip_dir, tiny_pickscore_dir  # noqa: F401 (fixtures)

PROMPTS = ["a red circle moving right", "two blue squares moving down"]
N, F = 2, 5


def video(seed=0):
    """`[N, F, 3, 32, 32]` in [0, 1], 8-bit exact, frames of different brightness so that frame scores differ."""
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.rand(N, F, 3, 32, 32, generator=generator) * torch.rand(N, F, 1, 1, 1, generator=generator)
    return (pixels * 255).round() / 255


@pytest.fixture(scope="module")
def build(tiny_clip_dir, tiny_aesthetic_head, tiny_pickscore_dir):
    """name -> a function of options building that reward on the tiny fixtures."""
    clip = {"model_name": f"local-dir:{tiny_clip_dir}", "device": "cpu"}
    return {
        "clip_score": lambda **o: ClipScore(ClipScore.Config(**clip, **o)),
        "aesthetic": lambda **o: AestheticScore(AestheticScore.Config(head_path=tiny_aesthetic_head, **clip, **o)),
        "pickscore": lambda **o: PickScore(PickScore.Config(
            model=tiny_pickscore_dir, processor=None, device="cpu", **o)),
        "jpeg": lambda **o: JpegReward(JpegReward.Config(quality=80, **o)),
    }


def frame_scores(reward, clip):
    """`[N, F]`: each frame scored by the image reward on its own, one call per frame (independent of any batching)."""
    return torch.stack([
        torch.cat([reward({"images": clip[n, f : f + 1]}, PromptBatch([PROMPTS[n]])).scores for f in range(F)])
        for n in range(N)
    ])


@pytest.mark.parametrize("name", ["clip_score", "aesthetic", "pickscore", "jpeg"])
def test_video_scores_equal_the_hand_reduced_image_scores_of_the_frames(build, name):
    clip = video()
    per_frame = frame_scores(build[name](), clip)  # [N, F]
    assert per_frame.std() > 0  # frames that score differently, so each reduction is a different number
    expected = {  # (stride, reduce) -> [N], written out frame by frame
        (1, "mean"): (per_frame[:, 0] + per_frame[:, 1] + per_frame[:, 2] + per_frame[:, 3] + per_frame[:, 4]) / 5,
        (2, "mean"): (per_frame[:, 0] + per_frame[:, 2] + per_frame[:, 4]) / 3,
        (3, "min"): torch.minimum(per_frame[:, 0], per_frame[:, 3]),
        (1, "min"): per_frame.min(dim=1).values,
        (4, "first"): per_frame[:, 0],
    }
    for (stride, reduce), want in expected.items():
        reward = build[name](modality="video", frame_stride=stride, frame_reduce=reduce)
        assert reward.modalities == {"video"}
        result = reward({"videos": clip}, PromptBatch(PROMPTS))
        torch.testing.assert_close(result.scores, want.float(), rtol=1e-5, atol=1e-5, msg=f"{name} {stride} {reduce}")
        assert result.components["malformed"].tolist() == [0.0, 0.0]


def test_first_frame_scores_only_frame_zero(build):
    """``frame_reduce: first`` never looks at the other frames: NaN there changes nothing but ``malformed``."""
    clip = video()
    reward = build["jpeg"](modality="video", frame_reduce="first")
    clean = reward({"videos": clip}, PromptBatch(PROMPTS))
    clip[:, 1:] = float("nan")
    dirty = reward({"videos": clip}, PromptBatch(PROMPTS))
    assert torch.equal(clean.scores, dirty.scores) and dirty.components["malformed"].tolist() == [1.0, 1.0]


def test_jpeg_video_component_is_the_size_behind_the_score(build):
    clip = video()
    reward = build["jpeg"](modality="video", frame_reduce="min", mode="compressibility")
    result = reward({"videos": clip}, PromptBatch(PROMPTS))
    sizes = -frame_scores(build["jpeg"](), clip)  # [N, F] kilobytes
    torch.testing.assert_close(result.components["jpeg_kb"], sizes.max(dim=1).values)  # min score = largest file


@pytest.mark.parametrize("options, match", [
    ({"modality": "video", "frame_stride": 0}, r"jpeg\.frame_stride must be >= 1"),
    ({"modality": "video", "frame_reduce": "max"}, "frame_reduce"),
    ({"frame_stride": 2}, r"jpeg\.frame_stride / frame_reduce apply to videos.*set jpeg\.modality to 'video'"),
    ({"frame_reduce": "min"}, r"apply to videos"),
])
def test_frame_options_are_checked_before_any_model_loads(options, match):
    with pytest.raises(ConfigError, match=match):
        JpegReward.Config(**options)


@pytest.mark.parametrize("cls", [ClipScore, AestheticScore, PickScore])
def test_model_rewards_check_frame_options_in_their_config(cls, tmp_path):
    options = {"head_path": str(tmp_path / "missing.pth")} if cls is AestheticScore else {}
    with pytest.raises(ConfigError, match="frame_stride must be >= 1"):
        cls.Config(modality="video", frame_stride=0, **options)


def test_a_video_without_frames_is_a_clear_error(build):
    with pytest.raises(ValueError, match=r"outputs\['videos'\] as a tensor \[N, F >= 1, 3, H, W\]"):
        build["jpeg"](modality="video")({"videos": torch.zeros(2, 0, 3, 8, 8)}, PromptBatch(PROMPTS))
