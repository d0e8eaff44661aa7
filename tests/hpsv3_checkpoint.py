"""A tiny random HPSv3 checkpoint written as the authors write ``HPSv3.safetensors``: a stock Qwen2-VL with
``<|Reward|>`` added to its tokenizer and embeddings and the authors' head, in one safetensors file with the head's
``rm_head.*`` keys, beside a ``base`` folder holding the base model's processor and config (as
Qwen/Qwen2-VL-7B-Instruct: before the token is added). Import ``tiny_hpsv3_dir`` (the fixture) or call
[`write_tiny_hpsv3`]."""

import pytest
import torch
from builders.qwen_vl import tiny_qwen_vl

BUDGET = 56 * 56  # hpsv3.pixels for the tiny model (min_pixels = max_pixels, as the authors' 256 * 28 * 28)


def authors_key(key: str, layout: str) -> str:
    """A stock (transformers 5) key as the authors' checkpoint names it: ``old`` is transformers < 4.52 (``visual.*``,
    ``model.layers.*``, as the hpsv3 1.0.0 package's model class), ``new`` the current layout (their repository)."""
    if layout == "old":
        return key.replace("model.visual.", "visual.", 1).replace("model.language_model.", "model.", 1)
    return key


def write_tiny_hpsv3(folder, layout: str = "old", seed: int = 0):
    """Writes ``folder/HPSv3.safetensors`` and ``folder/base``; returns the model, the head (both `eval()`) and the
    processor with ``<|Reward|>`` added and right padding, as the authors' inference builds them."""
    from safetensors.torch import save_file

    model, processor = tiny_qwen_vl("qwen2_vl", seed=seed, min_pixels=28 * 28, max_pixels=112 * 112)
    processor.save_pretrained(folder / "base")  # the base's processor, before the authors add their token
    model.config.save_pretrained(folder / "base")  # the base's config: its vocabulary is one token short
    processor.tokenizer.add_special_tokens({"additional_special_tokens": ["<|Reward|>"]})
    processor.tokenizer.padding_side = "right"
    model.resize_token_embeddings(len(processor.tokenizer), mean_resizing=False)
    head = torch.nn.Sequential(torch.nn.Linear(64, 1024), torch.nn.ReLU(), torch.nn.Dropout(0.05),
                               torch.nn.Linear(1024, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)).eval()
    torch.manual_seed(seed + 1)
    with torch.no_grad():
        model.get_input_embeddings().weight[-1].normal_()  # the trained <|Reward|> embedding
        for name, param in model.model.language_model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                param.mul_(8)  # sharp attention, so that positions (1-D vs M-RoPE) change the score
        for layer in head[0], head[3], head[5]:  # wider than PyTorch's init, so the scores spread
            layer.weight.normal_(0, 2 / layer.in_features ** 0.5)
    state = {authors_key(k, layout): v.clone().contiguous() for k, v in model.state_dict().items()}
    state.update({f"rm_head.{k}": v.clone() for k, v in head.state_dict().items()})
    save_file(state, folder / "HPSv3.safetensors")
    return model.eval(), head, processor


@pytest.fixture(scope="session")
def tiny_hpsv3_dir(tmp_path_factory):
    """A folder holding a tiny ``HPSv3.safetensors`` (the authors' transformers < 4.52 key layout) and ``base``."""
    folder = tmp_path_factory.mktemp("tiny_hpsv3")
    write_tiny_hpsv3(folder)
    return folder
