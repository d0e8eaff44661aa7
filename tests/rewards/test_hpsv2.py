"""hpsv2 on a tiny random open_clip model whose state dict is saved in the authors' checkpoint layout
(``{"state_dict": ...}`` in a torch file) and reloaded: the score equals the authors' pipeline (PIL image, their
validation transform of torchvision ops, the model's forward with normalised features, the diagonal of
``image_features @ text_features.T``), written out here with torchvision and open_clip."""

import open_clip
import pytest
import torch
from PIL import Image
from torchvision import transforms as T

from mmgrpo.rewards.hpsv2 import HPSv2, load_state_dict
from mmgrpo.types import PromptBatch
from mmgrpo.validation import ConfigError
from reward_fixtures import tiny_hps_checkpoint  # noqa: F401 (fixture)

PROMPTS = ["a red circle", "a blue square", "a green triangle"]


def pil_images(size, seed=0):
    pixels = torch.rand(3, 3, *size, generator=torch.Generator().manual_seed(seed))
    pixels = (pixels * 255).round() / 255  # exactly representable as 8-bit images
    return pixels, [Image.fromarray((p.permute(1, 2, 0) * 255).round().byte().numpy()) for p in pixels]


def authors_scores(folder, checkpoint, pil):
    """HPS as ``hpsv2/img_score.py`` computes it (model and preprocess_val of their open_clip fork, fp32 here)."""
    model = open_clip.create_model(f"local-dir:{folder}", output_dict=True)
    model.load_state_dict(torch.load(checkpoint, weights_only=True)["state_dict"])
    size = model.visual.image_size[0]
    preprocess_val = T.Compose([  # image_transform(is_train=False): ToTensor, Resize, CenterCrop, Normalize
        T.ToTensor(), T.Resize(size, interpolation=T.InterpolationMode.BICUBIC), T.CenterCrop(size),
        T.Normalize(open_clip.OPENAI_DATASET_MEAN, open_clip.OPENAI_DATASET_STD),
    ])
    tokenizer = open_clip.get_tokenizer(f"local-dir:{folder}")
    with torch.no_grad():
        out = model.eval()(torch.stack([preprocess_val(im) for im in pil]), tokenizer(PROMPTS))
        return torch.diagonal(out["image_features"] @ out["text_features"].T)


@pytest.mark.parametrize("size", [(32, 32), (48, 40), (20, 57)])
def test_hpsv2_equals_the_authors_pipeline(tiny_hps_checkpoint, size):
    folder, checkpoint = tiny_hps_checkpoint
    reward = HPSv2(HPSv2.Config(checkpoint=checkpoint, model_name=f"local-dir:{folder}", device="cpu", scale=100.0))
    pixels, pil = pil_images(size)
    expected = authors_scores(folder, checkpoint, pil)
    result = reward({"images": pixels}, PromptBatch(PROMPTS))
    torch.testing.assert_close(result.components["cosine"], expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(result.scores, 100 * expected, rtol=0, atol=1e-3)


def test_hpsv2_loads_the_weights_not_random_ones(tiny_hps_checkpoint, tmp_path):
    folder, checkpoint = tiny_hps_checkpoint
    state = load_state_dict(checkpoint)
    reward = HPSv2(HPSv2.Config(checkpoint=checkpoint, model_name=f"local-dir:{folder}", device="cpu"))
    assert all(torch.equal(reward.model.state_dict()[k], v) for k, v in state.items())
    # a folder holding the file, and a DDP-prefixed safetensors export, load the same weights
    from safetensors.torch import save_file

    save_file({f"module.{k}": v.contiguous() for k, v in state.items()}, str(tmp_path / "hps.safetensors"))
    again = HPSv2(HPSv2.Config(checkpoint=str(tmp_path), filename="hps.safetensors",
                               model_name=f"local-dir:{folder}", device="cpu"))
    pixels, _ = pil_images((32, 32))
    torch.testing.assert_close(again({"images": pixels}, PromptBatch(PROMPTS)).scores,
                               reward({"images": pixels}, PromptBatch(PROMPTS)).scores, rtol=0, atol=0)


def test_hpsv2_refuses_pickled_code_and_bad_options(tiny_hps_checkpoint, tmp_path):
    folder, _ = tiny_hps_checkpoint
    unsafe = tmp_path / "unsafe.pt"
    torch.save({"state_dict": {"x": torch.zeros(1)}, "args": object()}, unsafe)  # needs unpickling of a class
    with pytest.raises(ValueError, match="plain tensors"):
        HPSv2(HPSv2.Config(checkpoint=str(unsafe), model_name=f"local-dir:{folder}", device="cpu"))
    wrong = tmp_path / "wrong.pt"
    torch.save({"state_dict": {"x": torch.zeros(1)}}, wrong)
    with pytest.raises(ValueError, match="does not fit open_clip"):
        HPSv2(HPSv2.Config(checkpoint=str(wrong), model_name=f"local-dir:{folder}", device="cpu"))
    with pytest.raises(ConfigError, match="hpsv2.scale"):
        HPSv2.Config(checkpoint=str(wrong), scale=0.0)
    with pytest.raises(ConfigError, match="has no HPS_v2.1_compressed.pt"):
        HPSv2.Config(checkpoint=str(tmp_path))
    with pytest.raises(ConfigError, match="does not exist"):
        HPSv2.Config(checkpoint=str(tmp_path / "missing" / "x.pt"))
    with pytest.raises(RuntimeError, match="hpsv2.checkpoint to the file"):  # the hub is offline in tests
        HPSv2(HPSv2.Config(checkpoint="nobody-here/no-such-hps", model_name=f"local-dir:{folder}", device="cpu"))
