"""A tiny random VideoScore-Qwen2-VL folder written as the authors' model class saves it (Mantis'
``Qwen2VLForSequenceClassification``: keys ``visual.*``, ``model.*`` and ``score.*``, no ``lm_head``; its config and
processor). Import ``tiny_videoscore_dir`` (the fixture) or call [`write_tiny_videoscore`]."""

import pytest
import torch
from builders.qwen_vl import tiny_qwen_vl
from hpsv3_checkpoint import authors_key

# videoscore options for the tiny model: small frames
TINY_OPTIONS = {"min_pixels": 28 * 28, "max_pixels": 56 * 56, "dtype": "float32", "device": "cpu"}


def write_tiny_videoscore(folder, seed: int = 0):
    """Writes the folder; returns the model (stock class, `eval()`), the score layer and the processor."""
    from safetensors.torch import save_file

    model, processor = tiny_qwen_vl("qwen2_vl", seed=seed, min_pixels=28 * 28, max_pixels=112 * 112)
    score = torch.nn.Linear(64, 5).eval()
    torch.manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.model.language_model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                param.mul_(8)  # sharp attention, so that positions (1-D vs M-RoPE) change the score
        score.weight.normal_(0, 2 / 64 ** 0.5)
    state = {authors_key(k, "old"): v.clone().contiguous() for k, v in model.state_dict().items()
             if not k.startswith("lm_head.")}
    state.update({f"score.{k}": v.clone() for k, v in score.state_dict().items()})
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    model.config.architectures = ["Qwen2VLForSequenceClassification"]
    model.config.num_labels = 5
    model.config.save_pretrained(folder)
    processor.save_pretrained(folder)
    return model.eval(), score, processor


@pytest.fixture(scope="session")
def tiny_videoscore_dir(tmp_path_factory):
    """A folder holding a tiny VideoScore-Qwen2-VL (the authors' key layout), its config and processor."""
    folder = tmp_path_factory.mktemp("tiny_videoscore")
    write_tiny_videoscore(folder)
    return folder
