"""Checkpoints of the token pipelines load with the stock libraries alone (transformers `from_pretrained`, peft
`PeftModel.from_pretrained`) and give exactly the logits of mmgrpo's own model; adapters name the base model as it was
configured. (The flow pipelines' equivalents are in `test_flow_image_policies.py` and `test_wan_policy.py`.)"""

import json

import pytest
import torch

from builders._weights import perturb


def _qwen_inputs(path):
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(path)("how many red circles are there ?", return_tensors="pt").input_ids
    return {"input_ids": ids}


@pytest.mark.parametrize("lora_rank", [4, 0], ids=["lora", "full"])
def test_qwen_vl_checkpoint_loads_in_stock_transformers_and_peft(tiny_qwen2_vl_dir, tmp_path, lora_rank):
    from peft import PeftModel
    from transformers import Qwen2VLForConditionalGeneration

    from mmgrpo.pipelines.qwen_vl import QwenVLConfig, QwenVLPolicy

    policy = QwenVLPolicy(QwenVLConfig(pretrained=tiny_qwen2_vl_dir, max_new_tokens=4, lora_rank=lora_rank, lora_alpha=8))
    perturb(policy, seed=3)
    policy.save_pretrained(str(tmp_path / "ckpt"))
    inputs = _qwen_inputs(tiny_qwen2_vl_dir)
    with torch.no_grad():
        ours = policy.model.eval()(**inputs).logits  # [1, L, V]
        base = Qwen2VLForConditionalGeneration.from_pretrained(tiny_qwen2_vl_dir).eval()
        base_logits = base(**inputs).logits
        if lora_rank:
            stock = PeftModel.from_pretrained(base, str(tmp_path / "ckpt")).eval()
            config = json.loads((tmp_path / "ckpt" / "adapter_config.json").read_text())
            assert config["base_model_name_or_path"] == tiny_qwen2_vl_dir
        else:
            stock = Qwen2VLForConditionalGeneration.from_pretrained(str(tmp_path / "ckpt")).eval()
        theirs = stock(**inputs).logits
    assert not torch.allclose(ours, base_logits, atol=1e-4), "the trained weights must change the logits"
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)


def test_qwen_vl_reads_its_adapters_with_or_without_peft_prefix(tiny_qwen2_vl_dir, tmp_path):
    """Adapters written before they carried peft's key prefix still load into the policy, with the same weights."""
    from safetensors.torch import load_file, save_file

    from mmgrpo.pipelines.qwen_vl import PEFT_PREFIX, QwenVLConfig, QwenVLPolicy

    make = lambda: QwenVLPolicy(QwenVLConfig(pretrained=tiny_qwen2_vl_dir, max_new_tokens=4, lora_rank=4, lora_alpha=8))  # noqa: E731
    policy = make()
    perturb(policy, seed=3)
    policy.save_pretrained(str(tmp_path / "new"))
    state = load_file(str(tmp_path / "new" / "adapter_model.safetensors"))
    assert state and all(k.startswith(PEFT_PREFIX) for k in state)
    (tmp_path / "old").mkdir()
    save_file({k.removeprefix(PEFT_PREFIX): v for k, v in state.items()}, str(tmp_path / "old" / "adapter_model.safetensors"))
    for folder in ("new", "old"):
        fresh = make()
        fresh.load_trainable(str(tmp_path / folder))
        for a, b in zip(fresh.trainable_parameters(), policy.trainable_parameters()):
            torch.testing.assert_close(a, b.detach(), rtol=0, atol=0)


@pytest.mark.parametrize("lora_rank", [4, 0], ids=["lora", "full"])
def test_mdlm_checkpoint_loads_in_stock_transformers_and_peft(tiny_mdlm_dir, tmp_path, lora_rank):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from mmgrpo.pipelines.mdlm import MDLMConfig, MDLMPolicy

    policy = MDLMPolicy(MDLMConfig(pretrained=tiny_mdlm_dir, gen_length=8, block_length=4, steps_per_block=2,
                                   lora_rank=lora_rank, lora_alpha=8))
    perturb(policy, seed=3)
    policy.save_pretrained(str(tmp_path / "ckpt"))
    ids = torch.tensor([[3, 5, 7, 9, 11, 4]])
    with torch.no_grad():
        ours = policy.model.eval()(input_ids=ids).logits  # [1, 6, V]
        base = AutoModelForCausalLM.from_pretrained(tiny_mdlm_dir).eval()
        if lora_rank:
            stock = PeftModel.from_pretrained(base, str(tmp_path / "ckpt")).eval()
            config = json.loads((tmp_path / "ckpt" / "adapter_config.json").read_text())
            assert config["base_model_name_or_path"] == tiny_mdlm_dir
        else:
            stock = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ckpt")).eval()
        theirs = stock(input_ids=ids).logits
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)


def test_adapters_record_the_configured_location_not_a_resolved_path(tmp_path):
    """A shipped model is recorded as `mmgrpo:<name>`, the way the config names it, never as this machine's folder."""
    from mmgrpo.pipelines.mdlm import MDLMConfig, MDLMPolicy

    policy = MDLMPolicy(MDLMConfig(pretrained="mmgrpo:mdlm_arith", gen_length=8, block_length=4, steps_per_block=2,
                                   lora_rank=4, lora_alpha=8))
    policy.save_pretrained(str(tmp_path / "ckpt"))
    config = json.loads((tmp_path / "ckpt" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "mmgrpo:mdlm_arith"
