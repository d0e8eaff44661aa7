"""`train.sharding` and the parts of `mmgrpo.sharding` that need no process group: the option's validation, the
world-size rules, the blocks found in each pipeline's trained module (real tiny diffusers / transformers / peft
models), the module FSDP's root forward is attached to, and the global-norm clipping against a hand computation."""

import math

import pytest
import torch

from mmgrpo import sharding
from mmgrpo.sections import TrainConfig
from mmgrpo.validation import ConfigError


def test_sharding_option_is_validated_before_any_model_loads():
    assert TrainConfig().sharding == "ddp"  # what a multi-process launch did before the option existed
    assert TrainConfig(sharding="fsdp", mixed_precision="bf16").mixed_precision == "bf16"  # FSDP2 bf16 / fp32 reduce
    with pytest.raises(ConfigError, match="sharding must be 'none', 'ddp', 'fsdp' or 'hybrid', got 'zero3'"):
        TrainConfig(sharding="zero3")
    for mode in ("fsdp", "hybrid"):
        with pytest.raises(ConfigError, match=f"fp16 does not combine with train.sharding: {mode}.*use bf16"):
            TrainConfig(sharding=mode, mixed_precision="fp16")


def test_world_size_rules(monkeypatch):
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    assert sharding.check_world("fsdp", 2) == "fsdp" and sharding.check_world("ddp", 8) == "ddp"
    assert sharding.check_world("ddp", 1) == "none" and sharding.check_world("none", 1) == "none"
    with pytest.warns(UserWarning, match="fsdp with a single process: the model is not sharded"):
        assert sharding.check_world("fsdp", 1) == "none"
    with pytest.raises(ValueError, match="sharding is none but the run was launched with 2 processes: set ddp"):
        sharding.check_world("none", 2)
    # hybrid shards within a node: the world must be a whole number of nodes of LOCAL_WORLD_SIZE processes
    assert sharding.check_world("hybrid", 4, 2) == "hybrid" and sharding.check_world("hybrid", 2, 1) == "hybrid"
    with pytest.raises(ValueError, match="hybrid shards within a node of 2 processes, but the run has 3 processes"):
        sharding.check_world("hybrid", 3, 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="node of 4 processes, but the run has 6"):
        sharding.check_world("hybrid", 6)
    with pytest.warns(UserWarning, match="hybrid with a single process: the model is not sharded"):
        assert sharding.check_world("hybrid", 1) == "none"
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(ValueError, match="accelerate was launched with its FSDP plugin.*train.sharding: fsdp"):
        sharding.check_world("fsdp", 2)


def test_blocks_and_root_of_sd3_transformer(tiny_sd3_dir):
    from diffusers import SD3Transformer2DModel
    from peft import LoraConfig

    model = SD3Transformer2DModel.from_pretrained(tiny_sd3_dir, subfolder="transformer")
    model.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["attn.to_q"]))
    blocks = sharding.find_blocks(model)
    assert blocks == list(model.transformer_blocks) and len(blocks) == model.config.num_layers
    assert sharding.shard_root(model) is model  # it holds parameters of its own (embedders, final norm)


def test_blocks_and_root_of_qwen_vl_policy(tiny_qwen2_vl_dir):
    from mmgrpo.pipelines.qwen_vl import QwenVLConfig, QwenVLPolicy

    policy = QwenVLPolicy(QwenVLConfig(pretrained=tiny_qwen2_vl_dir, max_new_tokens=2, lora_rank=4, lora_alpha=8))
    group_forward = policy.switch.module
    # through the parameterless group forward to the model its prefix / step / forward methods call
    assert sharding.shard_root(group_forward) is policy.model
    blocks = sharding.find_blocks(policy.model)
    layers, vision = list(policy.model.model.language_model.layers), list(policy.model.model.visual.blocks)
    assert blocks == vision + layers or blocks == layers + vision
    assert all(type(b).__name__ in ("Qwen2VLDecoderLayer", "Qwen2VLVisionBlock") for b in blocks)


def test_blocks_and_root_of_mdlm_peft_model(tiny_mdlm_dir):
    from mmgrpo.pipelines.mdlm import MDLMConfig, MDLMPolicy

    policy = MDLMPolicy(MDLMConfig(pretrained=tiny_mdlm_dir, gen_length=4, block_length=4, steps_per_block=2,
                                   lora_rank=4, lora_alpha=8))
    root = sharding.shard_root(policy.model)
    assert type(root).__name__ == "LlamaForCausalLM"  # under the peft wrappers, which hold no parameters of their own
    blocks = sharding.find_blocks(root)
    assert [type(b).__name__ for b in blocks] == ["LlamaDecoderLayer"] * root.config.num_hidden_layers


FLOW_BLOCK_LISTS = {  # pipeline -> the transformer's block lists (LTX-2 names no _no_split_modules: found by name)
    "z_image": ("noise_refiner", "context_refiner", "layers"),
    "qwen_image": ("transformer_blocks",),
    "flux2": ("transformer_blocks", "single_transformer_blocks"),
    "hunyuan_video15": ("transformer_blocks",),
    "ltx2": ("transformer_blocks",),
    "flux_kontext": ("transformer_blocks", "single_transformer_blocks"),
    "qwen_image_edit": ("transformer_blocks",),
}


@pytest.mark.parametrize("name", list(FLOW_BLOCK_LISTS))
def test_blocks_of_the_2026_flow_transformers(request, name):
    """FSDP2 shards every block of each list of the trained transformer (with its LoRA), each once, none inside
    another, and the transformer itself is the root."""
    import importlib

    policy = importlib.import_module(f"builders.{name}").build_policy(request)
    model = next(iter(policy.trainable_modules().values()))
    assert sharding.shard_root(model) is model
    blocks = sharding.find_blocks(model)
    expected = [block for attribute in FLOW_BLOCK_LISTS[name] for block in model.get_submodule(attribute)]
    assert {id(b) for b in expected} <= {id(b) for b in blocks} and len({id(b) for b in blocks}) == len(blocks)
    inner = {id(m) for b in blocks for m in b.modules() if m is not b}
    assert not any(id(b) in inner for b in blocks)  # never nested


def test_block_lists_are_found_by_name_without_no_split_modules():
    class Toy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Linear(2, 4)
            self.blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(3)])
            self.other = torch.nn.ModuleList([torch.nn.Linear(4, 4)])

    toy = Toy()
    assert sharding.find_blocks(toy) == list(toy.blocks)


def test_unsharded_clipping_is_the_global_l2_norm():
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    a.grad, b.grad = torch.tensor([3.0, 0.0]), torch.tensor([0.0, 4.0, 12.0])  # norm sqrt(9 + 16 + 144) = 13
    norm = sharding.clip_grad_norm_([a, b], max_norm=6.5)
    assert norm.item() == pytest.approx(13.0)
    scale = 6.5 / (13.0 + 1e-6)
    torch.testing.assert_close(a.grad, torch.tensor([3.0 * scale, 0.0]))
    torch.testing.assert_close(b.grad, torch.tensor([0.0, 4.0 * scale, 12.0 * scale]))
    b.grad[0] = float("nan")
    before = a.grad.clone()
    assert math.isnan(sharding.clip_grad_norm_([a, b], max_norm=1.0).item())
    assert torch.equal(a.grad, before)  # not scaled: the trainer discards the update


def test_accelerate_autocast_is_off_only_for_a_sharded_multi_process_run(monkeypatch):
    bf16 = TrainConfig(sharding="fsdp", mixed_precision="bf16")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert sharding.autocast_precision(bf16) == "no"  # FSDP2's MixedPrecisionPolicy computes in bf16 instead
    assert sharding.autocast_precision(TrainConfig(sharding="ddp", mixed_precision="bf16")) == "bf16"
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert sharding.autocast_precision(bf16) == "bf16"  # one process is not sharded: accelerate's autocast
