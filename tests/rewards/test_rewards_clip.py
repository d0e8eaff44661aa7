"""clip_score and aesthetic on a tiny random open_clip model loaded through the real path (``local-dir:`` folder with
a config and safetensors weights), the aesthetic head saved to a file and reloaded, and pickscore on a tiny
transformers `CLIPModel` folder."""

import pytest
import torch
from PIL import Image

from mmgrpo.rewards.aesthetic import HEAD_FILE, AestheticScore, laion_head, load_head
from mmgrpo.rewards.clip_score import ClipScore
from mmgrpo.rewards.pickscore import PickScore
from mmgrpo.types import PromptBatch
from reward_fixtures import tiny_aesthetic_head, tiny_clip_dir, tiny_pickscore_dir  # noqa: F401 (fixtures)

PROMPTS = ["a red circle", "a blue square", "a green triangle"]


def images(n=3, size=(32, 32), seed=0):
    pixels = torch.rand(n, 3, *size, generator=torch.Generator().manual_seed(seed))
    return (pixels * 255).round() / 255  # exactly representable as 8-bit images


@pytest.fixture(scope="module")
def clip_reward(tiny_clip_dir):
    return ClipScore(ClipScore.Config(model_name=f"local-dir:{tiny_clip_dir}", device="cpu"))


def test_clip_score_matches_open_clip_own_preprocessing(clip_reward, tiny_clip_dir):
    import open_clip

    model, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{tiny_clip_dir}")
    tokenizer = open_clip.get_tokenizer(f"local-dir:{tiny_clip_dir}")
    for size in [(32, 32), (48, 40)]:
        pixels = images(size=size)
        pil = [Image.fromarray((p.permute(1, 2, 0) * 255).round().byte().numpy()) for p in pixels]
        with torch.no_grad():
            image = torch.nn.functional.normalize(model.eval().encode_image(torch.stack([preprocess(im) for im in pil])), dim=-1)
            text = torch.nn.functional.normalize(model.encode_text(tokenizer(PROMPTS)), dim=-1)
        expected = (image * text).sum(-1)  # [3] cosine through PIL and torchvision transforms
        result = clip_reward({"images": pixels}, PromptBatch(PROMPTS))
        tolerance = 1e-5 if size == (32, 32) else 2e-3  # resampling differs slightly between PIL and torch
        torch.testing.assert_close(result.components["cosine"], expected, rtol=0, atol=tolerance)
        torch.testing.assert_close(result.scores, 2.5 * expected.clamp_min(0), rtol=0, atol=2.5 * tolerance)


def test_clip_score_video_is_the_mean_over_frames(tiny_clip_dir, clip_reward):
    frames = images(n=6).view(3, 2, 3, 32, 32)  # [N=3, F=2, 3, H, W]
    video = ClipScore(ClipScore.Config(model_name=f"local-dir:{tiny_clip_dir}", device="cpu", modality="video"))
    assert video.modalities == {"video"}
    per_frame = clip_reward({"images": frames.reshape(6, 3, 32, 32)}, PromptBatch([p for p in PROMPTS for _ in "ab"]))
    result = video({"videos": frames}, PromptBatch(PROMPTS))
    torch.testing.assert_close(result.scores, per_frame.scores.view(3, 2).mean(1))


def test_clip_score_non_finite_pixels_are_counted(clip_reward):
    pixels = images()
    pixels[1, 0, 0, 0] = float("nan")
    result = clip_reward({"images": pixels}, PromptBatch(PROMPTS))
    assert torch.isfinite(result.scores).all() and result.components["malformed"].tolist() == [0.0, 1.0, 0.0]


def test_missing_clip_weights_name_the_file_and_the_key(tmp_path):
    with pytest.raises(ValueError, match=r"clip_score\.pretrained.*no such file"):
        ClipScore.Config(pretrained=str(tmp_path / "open_clip_pytorch_model.bin"))
    with pytest.raises(ValueError, match=r"open_clip_config\.json"):
        ClipScore.Config(model_name=f"local-dir:{tmp_path}")
    with pytest.raises(RuntimeError, match=r"clip_score\.pretrained=<path"):  # hub offline in tests
        ClipScore(ClipScore.Config(model_name="ViT-B-32", pretrained="openai", device="cpu"))


def test_laion_head_has_the_published_architecture():
    head = laion_head()
    linear = [m for m in head if isinstance(m, torch.nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linear] == [(768, 1024), (1024, 128), (128, 64), (64, 16), (16, 1)]
    assert [m.p for m in head if isinstance(m, torch.nn.Dropout)] == [0.2, 0.2, 0.1]
    assert sorted(head.state_dict()) == sorted(f"{i}.{p}" for i in (0, 2, 4, 6, 7) for p in ("weight", "bias"))


def test_aesthetic_uses_the_reloaded_head_on_normalised_embeddings(tiny_clip_dir, tiny_aesthetic_head):
    reward = AestheticScore(AestheticScore.Config(
        head_path=tiny_aesthetic_head, model_name=f"local-dir:{tiny_clip_dir}", device="cpu"))
    pixels = images()
    result = reward({"images": pixels}, PromptBatch(PROMPTS))
    torch.manual_seed(0)
    original = laion_head(32)  # the head the fixture saved (same seed)
    with torch.no_grad():
        from mmgrpo.rewards._clip import preprocess

        embedding = torch.nn.functional.normalize(reward.model.encode_image(preprocess(pixels, reward.model)), dim=-1)
        expected = original(embedding).squeeze(-1)
    torch.testing.assert_close(result.scores, expected)
    assert torch.equal(load_head(tiny_aesthetic_head)[0].weight, original[0].weight)


def test_aesthetic_missing_or_mismatched_head_is_a_clear_error(tmp_path, tiny_clip_dir):
    with pytest.raises(ValueError, match=rf"head_path is not set.*{HEAD_FILE.replace('+', '.')}"):
        AestheticScore.Config()
    with pytest.raises(ValueError, match="does not exist"):
        AestheticScore.Config(head_path=str(tmp_path / "missing.pth"))
    wide = tmp_path / "wide.pth"
    torch.save({f"layers.{k}": v for k, v in laion_head(768).state_dict().items()}, wide)
    config = AestheticScore.Config(head_path=str(wide), model_name=f"local-dir:{tiny_clip_dir}", device="cpu")
    with pytest.raises(ValueError, match="768-d embeddings"):
        AestheticScore(config)


def test_pickscore_matches_the_processor_and_model_forward(tiny_pickscore_dir):
    from transformers import CLIPModel, CLIPProcessor

    reward = PickScore(PickScore.Config(model=tiny_pickscore_dir, processor=None, device="cpu", divisor=2.0))
    pixels = images()
    processor, model = CLIPProcessor.from_pretrained(tiny_pickscore_dir), CLIPModel.from_pretrained(tiny_pickscore_dir)
    pil = [Image.fromarray((p.permute(1, 2, 0) * 255).round().byte().numpy()) for p in pixels]
    inputs = processor(text=PROMPTS, images=pil, padding=True, truncation=True, max_length=77, return_tensors="pt")
    with torch.no_grad():
        out = model.eval()(**inputs)
    expected = model.logit_scale.exp() * (out.image_embeds * out.text_embeds).sum(-1) / 2.0
    torch.testing.assert_close(reward({"images": pixels}, PromptBatch(PROMPTS)).scores, expected, rtol=1e-5, atol=1e-5)


def test_pickscore_missing_folder_names_the_key(tmp_path):
    with pytest.raises(ValueError, match=r"pickscore\.model"):
        PickScore.Config(model=str(tmp_path / "missing"))
