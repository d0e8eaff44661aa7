"""videoscore on a tiny random Qwen2-VL saved as the authors' Mantis class saves VideoScore-Qwen2-VL (``visual.*``,
``model.*``, ``score.*``) and reloaded through ``from_pretrained``: the prompt and the five outputs equal the authors'
pipeline written out below (qwen-vl-utils 0.0.8's frame sampling and resize, the processor as they call it, the Mantis
forward: video embeddings put into the token embeddings, the decoder without position ids, the score layer at the
last token before the padding)."""

import math

import pytest
import torch
from torchvision.transforms import InterpolationMode
from torchvision.transforms import functional as TF
from videoscore_checkpoint import TINY_OPTIONS, write_tiny_videoscore

from mmgrpo.rewards.videoscore import REGRESSION_QUERY_PROMPT, VideoScore
from mmgrpo.types import PromptBatch
from mmgrpo.validation import ConfigError

PROMPTS = ["a red ball rolls left", "a blue square {spins} slowly on a green table"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("videoscore")
    return (folder, *write_tiny_videoscore(folder))


def authors_frames(video, video_fps, fps, min_pixels, max_pixels, total_pixels):
    """qwen-vl-utils 0.0.8: smart_nframes (fps), the frame indices, smart_resize of fetch_video, on uint8 frames."""
    total = video.shape[0]
    low, high = math.ceil(4 / 2) * 2, math.floor(min(768, total) / 2) * 2
    n = math.floor(min(min(max(total / video_fps * fps, low), high), total) / 2) * 2
    index = torch.linspace(0, total - 1, n).round().long()
    frames = video[index]
    most = max(min(max_pixels, total_pixels / n * 2), int(min_pixels * 1.05))
    height, width = frames.shape[-2:]
    h, w = max(28, round(height / 28) * 28), max(28, round(width / 28) * 28)
    if h * w > most:
        beta = math.sqrt(height * width / most)
        h, w = math.floor(height / beta / 28) * 28, math.floor(width / beta / 28) * 28
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / 28) * 28, math.ceil(width * beta / 28) * 28
    return TF.resize(frames, [h, w], interpolation=InterpolationMode.BICUBIC, antialias=True).float()


def authors_scores(model, score, processor, videos, prompts, **sampling):
    processor.tokenizer.padding_side = "right"
    frames = [authors_frames(v, **sampling) for v in videos]
    messages = [[{"role": "user", "content": [{"type": "video", "video": "video.mp4", "fps": sampling["fps"]},
                                              {"type": "text", "text": REGRESSION_QUERY_PROMPT.format(text_prompt=p)}]}]
                for p in prompts]
    texts = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    batch = processor(text=texts, videos=frames, padding=True, return_tensors="pt")
    ids = batch["input_ids"]
    with torch.no_grad():
        embeds = model.model.language_model.embed_tokens(ids)
        video = model.model.visual(batch["pixel_values_videos"], grid_thw=batch["video_grid_thw"]).pooler_output
        embeds[ids == model.config.video_token_id] = video
        hidden = model.model.language_model(inputs_embeds=embeds, attention_mask=batch["attention_mask"])[0]
        logits = score(hidden)  # [B, L, 5]
    last = (torch.eq(ids, processor.tokenizer.pad_token_id).int().argmax(-1) - 1) % ids.shape[-1]
    return logits[torch.arange(len(prompts)), last], texts


@pytest.mark.parametrize("frames, size, video_fps", [(8, (40, 56), 16.0), (13, (64, 48), 24.0)])
def test_videoscore_equals_the_authors_pipeline(tiny, frames, size, video_fps):
    folder, model, score, processor = tiny
    sampling = dict(video_fps=video_fps, fps=8.0, min_pixels=28 * 28, max_pixels=56 * 56, total_pixels=24576 * 784)
    reward = VideoScore(VideoScore.Config(model=str(folder), **{**TINY_OPTIONS, "video_fps": video_fps}))
    videos = torch.rand(2, frames, 3, *size, generator=torch.Generator().manual_seed(frames))
    expected, texts = authors_scores(model, score, processor, (videos * 255).round().to(torch.uint8), PROMPTS,
                                     **sampling)
    assert reward.texts(PROMPTS) == texts
    result = reward({"videos": videos}, PromptBatch(PROMPTS))
    for k, name in enumerate(("visual_quality", "temporal_consistency", "dynamic_degree", "text_alignment",
                              "factual_consistency")):
        torch.testing.assert_close(result.components[name], expected[:, k], rtol=0, atol=1e-5)
    torch.testing.assert_close(result.scores, expected.mean(dim=1), rtol=0, atol=1e-5)
    assert expected[:, 0].std() > 1e-4  # the videos and prompts are told apart


def test_one_aspect_and_a_checkpoint_that_does_not_fit(tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    folder, *_ = tiny
    reward = VideoScore(VideoScore.Config(model=str(folder), aspect="text_alignment", **TINY_OPTIONS))
    result = reward({"videos": torch.rand(1, 4, 3, 28, 28)}, PromptBatch(PROMPTS[:1]))
    assert torch.equal(result.scores, result.components["text_alignment"])
    state = load_file(folder / "model.safetensors")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "processor_config.json",
                 "preprocessor_config.json", "video_preprocessor_config.json", "chat_template.jinja"):
        if (folder / name).exists():
            (tmp_path / name).write_bytes((folder / name).read_bytes())
    for broken, match in [({k: v for k, v in state.items() if "layers.1.mlp" not in k}, "unset"),
                          ({k: v for k, v in state.items() if not k.startswith("score.")}, "score.weight")]:
        save_file(broken, tmp_path / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(ValueError, match=match):
            VideoScore(VideoScore.Config(model=str(tmp_path), **TINY_OPTIONS))


def test_options_are_checked(tiny):
    folder, *_ = tiny
    with pytest.raises(ConfigError, match="videoscore.max_pixels"):
        VideoScore.Config(model=str(folder), min_pixels=3136, max_pixels=784)
    with pytest.raises(ConfigError, match="videoscore.video_fps"):
        VideoScore.Config(model=str(folder), video_fps=0)
    with pytest.raises(ConfigError, match="aspect"):
        VideoScore.Config(model=str(folder), aspect="beauty")
