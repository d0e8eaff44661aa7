"""hpsv3 on a tiny random Qwen2-VL (stock `Qwen2VLForConditionalGeneration`) with ``<|Reward|>`` added and the
authors' head, saved as the authors save ``HPSv3.safetensors`` (their key layout, the head's ``rm_head.*`` keys in the
same file) and reloaded through ``from_pretrained``: the prompt and the score equal the authors' pipeline written out
below (PIL bicubic resize to smart_resize's size, their chat message, their forward: image embeddings scattered into
the token embeddings, the decoder without position ids, the head at the ``<|Reward|>`` token, mu and sigma)."""

import hashlib
import math

import pytest
import torch
from hpsv3_checkpoint import BUDGET, write_tiny_hpsv3
from PIL import Image
from safetensors.torch import save_file

from mmgrpo.rewards import hpsv3
from mmgrpo.rewards.hpsv3 import HPSv3
from mmgrpo.types import PromptBatch
from mmgrpo.validation import ConfigError

PROMPTS = ["a red circle", "two blue squares on a green {table}", "a yellow triangle above a purple square, photo"]
# The authors' INSTRUCTION (hpsv3/dataset/data_collator_qwen.py in the hpsv3 1.0.0 package): 2523 characters
INSTRUCTION_SHA256 = "0393599dad45a971903d1d62a3acf9bad3ccccdafa7f40f680523419e1f68b7a"
TAIL = "\nPlease provide the overall ratings of this image: <|Reward|>\n\nEND\n"


@pytest.fixture(scope="module", params=["old", "new"])
def tiny_hpsv3(tmp_path_factory, request):
    folder = tmp_path_factory.mktemp(f"hpsv3_{request.param}")
    return (folder, *write_tiny_hpsv3(folder, request.param))


def authors_smart_resize(height, width, factor, min_pixels, max_pixels):
    h_bar, w_bar = max(factor, round(height / factor) * factor), max(factor, round(width / factor) * factor)
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar, w_bar = math.floor(height / beta / factor) * factor, math.floor(width / beta / factor) * factor
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def authors_scores(model, head, processor, pil, prompts):
    """The authors' prepare_batch and Qwen2VLRewardModelBT.forward (reward_token "special"), written out."""
    resized = []
    for image in pil:
        h, w = authors_smart_resize(image.height, image.width, 28, BUDGET, BUDGET)
        resized.append(image.resize((w, h), Image.BICUBIC))
    messages = [[{"role": "user", "content": [
        {"type": "image", "image": image, "min_pixels": BUDGET, "max_pixels": BUDGET},
        {"type": "text", "text": hpsv3.INSTRUCTION.format(text_prompt=text) + TAIL}]}]
        for text, image in zip(prompts, resized)]
    texts = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    batch = processor(text=texts, images=resized, padding=True, return_tensors="pt")
    ids = batch["input_ids"]
    with torch.no_grad():
        embeds = model.model.language_model.embed_tokens(ids)
        image_embeds = model.model.visual(batch["pixel_values"], grid_thw=batch["image_grid_thw"]).pooler_output
        mask = (ids == model.config.image_token_id).unsqueeze(-1).expand_as(embeds)
        embeds = embeds.masked_scatter(mask, image_embeds)
        hidden = model.model.language_model(inputs_embeds=embeds, attention_mask=batch["attention_mask"])[0]
        logits = head(hidden)  # [B, L, 2]
    pooled = logits[ids == processor.tokenizer.convert_tokens_to_ids("<|Reward|>")].view(len(prompts), -1)
    return pooled, texts


def test_the_authors_instruction_is_used():
    assert hashlib.sha256(hpsv3.INSTRUCTION.encode()).hexdigest() == INSTRUCTION_SHA256
    assert hpsv3.reward_prompt("a {cat}") == hpsv3.INSTRUCTION.replace("{text_prompt}", "a {cat}") + TAIL


@pytest.mark.parametrize("size", [(56, 56), (64, 90)])
def test_hpsv3_equals_the_authors_pipeline(tiny_hpsv3, size):
    folder, model, head, processor = tiny_hpsv3
    reward = HPSv3(HPSv3.Config(model=str(folder), base=str(folder / "base"), pixels=BUDGET, dtype="float32",
                                device="cpu", batch_size=2))
    pixels = (torch.rand(3, 3, *size, generator=torch.Generator().manual_seed(0)) * 255).round() / 255
    pil = [Image.fromarray((p.permute(1, 2, 0) * 255).round().byte().numpy()) for p in pixels]
    expected, texts = authors_scores(model, head, processor, pil, PROMPTS)
    assert reward.texts(PROMPTS) == texts
    assert texts[0].count("<|Reward|>") == 1 and "<|image_pad|>" in texts[0]
    result = reward({"images": pixels}, PromptBatch(PROMPTS))
    torch.testing.assert_close(result.scores, expected[:, 0], rtol=0, atol=1e-5)
    torch.testing.assert_close(result.components["sigma"], expected[:, 1], rtol=0, atol=1e-5)
    assert expected[:, 0].std() > 1e-4  # the images and prompts are told apart


def test_video_frames_are_scored_one_by_one(tiny_hpsv3):
    folder, *_ = tiny_hpsv3
    reward = HPSv3(HPSv3.Config(model=str(folder), base=str(folder / "base"), pixels=BUDGET, dtype="float32",
                                device="cpu", modality="video", frame_reduce="min"))
    videos = torch.rand(2, 3, 3, 56, 56, generator=torch.Generator().manual_seed(1))
    result = reward({"videos": videos}, PromptBatch(PROMPTS[:2]))
    image = HPSv3(HPSv3.Config(model=str(folder), base=str(folder / "base"), pixels=BUDGET, dtype="float32",
                               device="cpu"))
    per_frame = image({"images": videos.flatten(0, 1)}, PromptBatch([p for p in PROMPTS[:2] for _ in range(3)]))
    torch.testing.assert_close(result.scores, per_frame.scores.view(2, 3).min(dim=1).values, rtol=0, atol=1e-5)


def test_a_checkpoint_that_does_not_fit_is_refused(tiny_hpsv3, tmp_path):
    from safetensors.torch import load_file

    folder, *_ = tiny_hpsv3
    state = load_file(folder / "HPSv3.safetensors")
    layer = next(k for k in state if k.endswith("layers.1.self_attn.q_proj.weight"))
    rows = next(v.shape[0] for k, v in state.items() if k.endswith("embed_tokens.weight"))
    for broken, match in [({k: v for k, v in state.items() if k != layer}, "unset"),
                          ({**state, "model.extra.weight": torch.ones(2)}, "unused"),
                          ({k: v for k, v in state.items() if k != "rm_head.5.bias"}, "rm_head keys"),
                          ({k: (v[:-1] if k.endswith(("embed_tokens.weight", "lm_head.weight")) else v)
                            for k, v in state.items()}, f"{rows - 1} rows")]:
        save_file(broken, tmp_path / "HPSv3.safetensors")
        with pytest.raises(ValueError, match=match):
            HPSv3(HPSv3.Config(model=str(tmp_path), base=str(folder / "base"), dtype="float32", device="cpu"))


def test_options_are_checked(tmp_path, tiny_hpsv3):
    folder, *_ = tiny_hpsv3
    base = str(folder / "base")
    with pytest.raises(ConfigError, match="has no HPSv3.safetensors"):
        HPSv3.Config(model=str(tmp_path), base=base)
    with pytest.raises(ConfigError, match="hpsv3.pixels"):
        HPSv3.Config(model=str(folder), base=base, pixels=100)
    with pytest.raises(ConfigError, match="hpsv3.filename"):
        HPSv3.Config(model=str(folder), base=base, filename="HPSv3.pt")
    with pytest.raises(ConfigError, match="frame_stride"):
        HPSv3.Config(model=str(folder), base=base, frame_stride=2)
    with pytest.raises(RuntimeError, match="hpsv3.model"):  # the hub is offline in tests
        HPSv3(HPSv3.Config(model="nobody-here/no-hpsv3", base=base, device="cpu"))
