"""image_reward on a tiny random BLIP (stock `BlipVisionModel` / `BlipTextModel`) and LAION-layout head, saved as
the authors save ``ImageReward.pt`` (their BLIP code's key names, written out below) beside a ``med_config.json``,
and reloaded: the score equals the authors' pipeline on PIL images (their torchvision transform, BERT tokens padded
to 35, the [CLS] state of the cross-attending text encoder through the head, normalised by their constants)."""

import json

import pytest
import torch
from PIL import Image
from torchvision import transforms as T

from mmgrpo.rewards.image_reward import ImageReward
from mmgrpo.types import PromptBatch
from mmgrpo.validation import ConfigError
from reward_fixtures import IMAGE_REWARD_MED_CONFIG as MED_CONFIG, tiny_image_reward  # noqa: F401 (fixture)

PROMPTS = ["a photo of a red circle", "a blue square", "a green triangle on a red square"]


def authors_scores(folder, vision, text, head, pil):
    preprocess = T.Compose([T.Resize(32, interpolation=T.InterpolationMode.BICUBIC), T.CenterCrop(32), T.ToTensor(),
                            T.Normalize((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))])
    from transformers import BertTokenizer

    tokens = BertTokenizer.from_pretrained(folder / "tokenizer")(PROMPTS, padding="max_length", truncation=True,
                                                                 max_length=35, return_tensors="pt")
    with torch.no_grad():
        embeds = vision(pixel_values=torch.stack([preprocess(im) for im in pil])).last_hidden_state
        hidden = text(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask, encoder_hidden_states=embeds,
                      encoder_attention_mask=torch.ones(embeds.shape[:-1], dtype=torch.long)).last_hidden_state
        return (head(hidden[:, 0]).squeeze(-1) - 0.16717362830052426) / 1.0333394966054072


@pytest.mark.parametrize("size, tolerance", [((32, 32), 1e-5), ((48, 40), 0.01)])
def test_image_reward_equals_the_authors_pipeline(tiny_image_reward, size, tolerance):
    folder, vision, text, head = tiny_image_reward
    reward = ImageReward(ImageReward.Config(model=str(folder), tokenizer=str(folder / "tokenizer"), device="cpu"))
    pixels = (torch.rand(3, 3, *size, generator=torch.Generator().manual_seed(0)) * 255).round() / 255
    pil = [Image.fromarray((p.permute(1, 2, 0) * 255).round().byte().numpy()) for p in pixels]
    expected = authors_scores(folder, vision, text, head, pil)
    result = reward({"images": pixels}, PromptBatch(PROMPTS))
    torch.testing.assert_close(result.scores, expected, rtol=0, atol=tolerance)  # PIL and torch resampling differ
    torch.testing.assert_close(result.components["raw"], expected * 1.0333394966054072 + 0.16717362830052426,
                               rtol=0, atol=tolerance * 1.04)


def test_a_checkpoint_that_does_not_fit_is_refused(tiny_image_reward, tmp_path):
    folder, *_ = tiny_image_reward
    state = torch.load(folder / "ImageReward.pt", weights_only=True)
    (tmp_path / "med_config.json").write_text(json.dumps(MED_CONFIG))
    for broken, match in [({k: v for k, v in state.items() if "blocks.1.attn.qkv.weight" not in k}, "unset"),
                          ({**state, "blip.visual_encoder.blocks.0.ls1.gamma": torch.ones(64)}, "no counterpart"),
                          ({**state, "blip.text_encoder.encoder.layer.0.extra.weight": torch.ones(2)}, "unused")]:
        torch.save(broken, tmp_path / "ImageReward.pt")
        with pytest.raises(ValueError, match=match):
            ImageReward(ImageReward.Config(model=str(tmp_path), tokenizer=str(folder / "tokenizer"), device="cpu"))


def test_options_are_checked(tmp_path, tiny_image_reward):
    folder, *_ = tiny_image_reward
    with pytest.raises(ConfigError, match="lacks"):
        ImageReward.Config(model=str(tmp_path), tokenizer=str(folder / "tokenizer"))
    with pytest.raises(ConfigError, match="image_reward.batch_size"):
        ImageReward.Config(model=str(folder), tokenizer=str(folder / "tokenizer"), batch_size=0)
    with pytest.raises(RuntimeError, match="image_reward.model"):  # the hub is offline in tests
        ImageReward(ImageReward.Config(model="nobody-here/no-image-reward", tokenizer=str(folder / "tokenizer")))
