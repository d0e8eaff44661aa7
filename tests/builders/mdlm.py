"""Tiny masked-diffusion LM (a bidirectional Llama and a character tokenizer) for tests."""

import pytest


@pytest.fixture(scope="session")
def tiny_mdlm_dir(tmp_path_factory):
    """A tiny random bidirectional Llama and its character tokenizer, `save_pretrained`."""
    from mmgrpo.data.tiny_mdlm import save_tiny_mdlm

    return save_tiny_mdlm(tmp_path_factory.mktemp("tiny_mdlm"))


def build_policy(request):
    """A semi-autoregressive, EOSER LoRA policy on `tiny_mdlm_dir` (8 tokens in blocks of 4, 2 steps each)."""
    from mmgrpo.pipelines.mdlm import MDLMConfig, MDLMPolicy

    path = request.getfixturevalue("tiny_mdlm_dir")
    return MDLMPolicy(MDLMConfig(pretrained=path, gen_length=8, block_length=4, steps_per_block=2, eoser=True, lora_rank=4, lora_alpha=8))
