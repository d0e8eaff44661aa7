"""``mmgrpo export``: a self-contained folder that the stock libraries load alone (diffusers / transformers
`from_pretrained`, with a LoRA merged or in ``lora/``) and that gives mmgrpo's own outputs; a model card; nothing
half-written; the hub push is refused clearly when the hub cannot be reached."""

import json
import re
import subprocess
import sys

import pytest
from huggingface_hub import ModelCard
import torch

from mmgrpo import cli, config as config_mod
from mmgrpo.export import LORA_FOLDER, export_checkpoint, hub_files
from mmgrpo.metrics_log import read_records
from mmgrpo.model_card import loading_call, model_card
from mmgrpo.trainer import Trainer
from mmgrpo.types import PromptBatch
from mmgrpo.plans import FlowPlan

from builders._runs import dgpo_config
from builders._weights import perturb

PROMPTS = ["a red circle", "two blue squares"]


def _stock_sd3(folder):
    from diffusers import StableDiffusion3Pipeline

    # the tiny model, like the shipped ones, has no third (T5) text encoder: stock diffusers needs it named as None
    pipe = StableDiffusion3Pipeline.from_pretrained(str(folder), text_encoder_3=None, tokenizer_3=None)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _samples(pipe):
    return pipe(prompt=PROMPTS, num_inference_steps=4, guidance_scale=1.0, height=32, width=32, output_type="pt",
                generator=torch.Generator().manual_seed(2), max_sequence_length=16).images.float()


def _run_example(card: str, folder) -> str:
    """Runs the model card's Python example in a fresh interpreter in `folder`; returns what it printed."""
    code = re.search(r"```python\n(.*?)```", card, re.S).group(1)
    proc = subprocess.run([sys.executable, "-c", code], cwd=folder, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _sd3_policy(path, lora_rank):
    from mmgrpo.pipelines.sd3 import SD3Config, SD3Policy

    return SD3Policy(SD3Config(pretrained=path, resolution=32, num_steps=4, guidance_scale=1.0, lora_rank=lora_rank,
                               max_sequence_length=16))


@pytest.mark.parametrize("lora_rank, merge", [(4, True), (4, False), (0, False)], ids=["lora-merged", "lora", "full"])
def test_sd3_export_loads_in_stock_diffusers_and_samples_like_mmgrpo(tiny_sd3_dir, tmp_path, lora_rank, merge):
    policy = _sd3_policy(tiny_sd3_dir, lora_rank)
    perturb(policy, seed=4)
    policy.export_pretrained(str(tmp_path / "out"), merge_lora=merge)
    ours = policy.sample(PromptBatch(PROMPTS), FlowPlan.deterministic(4), generator=torch.Generator().manual_seed(2))
    pipe = _stock_sd3(tmp_path / "out")
    assert (tmp_path / "out" / LORA_FOLDER).is_dir() == (lora_rank > 0 and not merge)
    if lora_rank and not merge:
        pipe.load_lora_weights(str(tmp_path / "out" / LORA_FOLDER))
    assert not any("lora" in name for name, _ in pipe.transformer.named_parameters()) or not merge
    torch.testing.assert_close(_samples(pipe), ours.outputs["images"], rtol=0, atol=1e-4)
    base = _samples(_stock_sd3(tiny_sd3_dir))
    assert not torch.allclose(base, ours.outputs["images"], atol=1e-3), "the export must carry the trained weights"


@pytest.mark.parametrize("merge", [True, False], ids=["merged", "lora"])
def test_qwen_vl_export_loads_in_stock_transformers(tiny_qwen2_vl_dir, tmp_path, merge):
    from peft import PeftModel
    from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

    from mmgrpo.pipelines.qwen_vl import QwenVLConfig, QwenVLPolicy

    policy = QwenVLPolicy(QwenVLConfig(pretrained=tiny_qwen2_vl_dir, max_new_tokens=4, lora_rank=4, lora_alpha=8))
    perturb(policy, seed=4)
    policy.export_pretrained(str(tmp_path / "out"), merge_lora=merge)
    model = Qwen2VLForConditionalGeneration.from_pretrained(str(tmp_path / "out")).eval()
    if not merge:
        model = PeftModel.from_pretrained(model, str(tmp_path / "out" / LORA_FOLDER)).eval()
    processor = AutoProcessor.from_pretrained(str(tmp_path / "out"))
    ids = processor.tokenizer("how many circles ?", return_tensors="pt").input_ids
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, policy.model.eval()(input_ids=ids).logits,
                                   rtol=0, atol=1e-5)


def test_vlm_lora_export_of_a_shipped_base_loads_with_auto_peft_model_and_its_card_example_runs(tmp_path):
    """The VLM default's base is shipped (``mmgrpo:vlm_shapes``): the export bundles it and its adapter names it, with
    the base class, so peft's ``AutoPeftModel`` loads ``lora/`` alone and computes what the policy does; the card's
    example loads and generates; pushed, the adapter and the example name the repository instead."""
    from peft import AutoPeftModel

    from mmgrpo.pipelines.qwen_vl import QwenVLConfig, QwenVLPolicy

    policy = QwenVLPolicy(QwenVLConfig(pretrained="mmgrpo:vlm_shapes", max_new_tokens=4, lora_rank=4, lora_alpha=8))
    perturb(policy, seed=4)
    out = tmp_path / "out"
    policy.export_pretrained(str(out), merge_lora=False)
    model = AutoPeftModel.from_pretrained(str(out / LORA_FOLDER)).eval()
    ids = torch.tensor([[3, 5, 7, 9, 11, 4]])
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, policy.model.eval()(input_ids=ids).logits,
                                   rtol=0, atol=1e-5)
    config = {"pipeline": {"name": "qwen_vl", "pretrained": "mmgrpo:vlm_shapes", "max_new_tokens": 4},
              "algorithm": {"name": "grpo"}, "reward": {"name": "accuracy"}, "data": {"name": "vlm_shapes"}}
    card = model_card(config, 3, {"eval/accuracy": 2 / 3}, lora=True, merged=False, loading=loading_call(out),
                      folder=str(out.resolve()), prompt="How many circles?")
    data = ModelCard(card).data
    assert (data.library_name, data.pipeline_tag, data.base_model) == ("transformers", "image-text-to-text", None)
    assert "| `eval/accuracy` | 0.6667 |" in card and "AutoPeftModel.from_pretrained" in card
    assert _run_example(card, tmp_path).strip()  # a generated answer
    (out / "README.md").write_text(card)
    pushed = hub_files(out, "someone/tiny-vlm")
    assert json.loads(pushed[f"{LORA_FOLDER}/adapter_config.json"])["base_model_name_or_path"] == "someone/tiny-vlm"
    assert 'folder = snapshot_download("someone/tiny-vlm")' in pushed["README.md"].decode()


def test_an_adapter_on_a_hub_base_names_its_id_revision_and_class(tmp_path):
    from transformers import Qwen2VLForConditionalGeneration

    from mmgrpo.export import name_base

    (tmp_path / LORA_FOLDER).mkdir()
    (tmp_path / LORA_FOLDER / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "/x",
                                                                            "task_type": None, "r": 4}))
    name_base(tmp_path, Qwen2VLForConditionalGeneration, "Qwen/Qwen2-VL-2B-Instruct", "abc123")
    record = json.loads((tmp_path / LORA_FOLDER / "adapter_config.json").read_text())
    assert record["base_model_name_or_path"] == "Qwen/Qwen2-VL-2B-Instruct"
    assert (record["revision"], record["r"]) == ("abc123", 4)
    assert record["auto_mapping"] == {"base_model_class": "Qwen2VLForConditionalGeneration",
                                      "parent_library": "transformers.models.qwen2_vl.modeling_qwen2_vl"}


def test_a_hub_base_is_the_cards_base_model():
    config = {"pipeline": {"name": "sd3", "pretrained": "stabilityai/stable-diffusion-3.5-medium"},
              "algorithm": {"name": "flow_grpo"}, "reward": {"name": "pickscore"}, "data": {"name": "prompt_file"}}
    card = ModelCard(model_card(config, 1, {}, lora=True, merged=False, loading=("StableDiffusion3Pipeline", "")))
    assert card.data.base_model == "stabilityai/stable-diffusion-3.5-medium"
    assert card.data.pipeline_tag == "text-to-image"


def test_mdlm_export_merged_loads_in_stock_transformers(tiny_mdlm_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mmgrpo.pipelines.mdlm import MDLMConfig, MDLMPolicy

    policy = MDLMPolicy(MDLMConfig(pretrained=tiny_mdlm_dir, gen_length=8, block_length=4, steps_per_block=2,
                                   lora_rank=4, lora_alpha=8))
    perturb(policy, seed=4)
    policy.export_pretrained(str(tmp_path / "out"), merge_lora=True)
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    assert not any("lora" in name for name, _ in model.named_parameters())
    assert AutoTokenizer.from_pretrained(str(tmp_path / "out")) is not None
    ids = torch.tensor([[3, 5, 7, 9, 11, 4]])
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, policy.model.eval()(input_ids=ids).logits,
                                   rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def sd3_run(tmp_path_factory, tiny_sd3_dir):
    """A 2-step DGPO run on the tiny SD3 (LoRA) with a checkpoint at step 2 and an evaluation at the end."""
    raw = dgpo_config(tmp_path_factory.mktemp("run"), tiny_sd3_dir, 2)
    raw["eval"] = {"every": 2, "num_prompts": 2, "metric": "jpeg_kb"}
    trainer = Trainer(config_mod.from_dict(raw))
    trainer.train()
    return trainer.output_dir


def test_export_command_writes_a_model_card_and_the_checkpoints_weights(sd3_run, tmp_path, capsys):
    assert cli.main(["export", str(sd3_run), str(tmp_path / "model"), "--merge-lora"]) == 0
    card = (tmp_path / "model" / "README.md").read_text()
    config = json.loads((sd3_run / "config.json").read_text())
    data = ModelCard.load(tmp_path / "model" / "README.md").data  # the hub's own reader of the front matter
    assert (data.library_name, data.pipeline_tag, data.base_model) == ("diffusers", "text-to-image", None)
    assert "dgpo" in data.tags
    for text in ("trained with dgpo", "Training steps: 2 (LoRA merged into the weights)", "reward: `jpeg`",
                 "## Training config", f"pretrained: {config['pipeline']['pretrained']}",
                 'StableDiffusion3Pipeline.from_pretrained(folder, text_encoder_3=None, tokenizer_3=None)'):
        assert text in card, text
    evaluation = [r for r in read_records(sd3_run / "metrics.jsonl") if "eval/jpeg_kb" in r][-1]["eval/jpeg_kb"]
    assert f"| `eval/jpeg_kb` | {evaluation:.4g} |" in card  # rounded to 4 significant digits
    _run_example(card, tmp_path)
    assert (tmp_path / "sample.png").is_file()
    exported = _samples(_stock_sd3(tmp_path / "model"))
    policy = _sd3_policy(config["pipeline"]["pretrained"], 4)
    policy.load_trainable(str(sorted((sd3_run / "checkpoints").glob("step_*"))[-1] / "weights"))
    ours = policy.sample(PromptBatch(PROMPTS), FlowPlan.deterministic(4), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(exported, ours.outputs["images"], rtol=0, atol=1e-4)


def test_export_never_overwrites_and_leaves_nothing_half_written(sd3_run, tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    assert cli.main(["export", str(sd3_run), str(tmp_path / "taken")]) == 2
    assert [p.name for p in (tmp_path / "taken").iterdir()] == ["keep.txt"]
    with pytest.raises(FileNotFoundError, match="no complete checkpoint|not a complete checkpoint"):
        export_checkpoint(tmp_path / "taken", tmp_path / "new")
    assert not (tmp_path / "new").exists() and not (tmp_path / "new.tmp").exists()


def test_push_to_hub_offline_exports_first_then_says_how_to_upload(sd3_run, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code = cli.main(["export", str(sd3_run), str(tmp_path / "model"), "--push-to-hub", "someone/tiny-sd3"])
    assert code == 1
    assert (tmp_path / "model" / "README.md").is_file() and (tmp_path / "model" / "model_index.json").is_file()
    err = capsys.readouterr().err
    assert "HF_HUB_OFFLINE is set" in err and "hf upload someone/tiny-sd3" in err


def _closed_port() -> int:
    import socket

    with socket.socket() as sock:  # a port nothing listens on: connections are refused at once
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("token", ["hf_not_a_real_token", None], ids=["unreachable", "no-token"])
def test_push_to_hub_without_network_fails_fast_with_one_line(sd3_run, tmp_path, monkeypatch, capsys, token):
    """Online mode, but the hub cannot be reached (here an endpoint on a closed loopback port) or no token: a one-line
    error naming the fix, within seconds, after the export is written; no traceback."""
    import time

    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))  # no stored token
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "hf_home" / "token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(tmp_path / "hf_home" / "stored_tokens"))
    if token:
        monkeypatch.setenv("HF_TOKEN", token)
    else:
        monkeypatch.delenv("HF_TOKEN", raising=False)
    capsys.readouterr()
    begin = time.monotonic()
    code = cli.main(["export", str(sd3_run), str(tmp_path / "model"), "--push-to-hub", "someone/tiny-sd3"])
    err = capsys.readouterr().err
    assert code == 1 and (tmp_path / "model" / "README.md").is_file()
    lines = [line for line in err.splitlines() if line.startswith("mmgrpo: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert ("cannot be reached" if token else "hf auth login") in lines[0], lines[0]
    assert "hf upload someone/tiny-sd3" in lines[0]
    assert time.monotonic() - begin < 60  # the export itself; no retries with back-off


@pytest.mark.parametrize("lora_rank, merge", [(4, True), (4, False), (0, False)], ids=["lora-merged", "lora", "full"])
def test_wan_two_expert_export_loads_in_stock_diffusers(tiny_wan_experts_dir, tmp_path, lora_rank, merge):
    """Both experts' trained weights reach the exported pipeline: each exported transformer computes what the
    policy's does."""
    from diffusers import WanPipeline

    from mmgrpo.pipelines.wan import WanConfig, WanPolicy

    policy = WanPolicy(WanConfig(pretrained=tiny_wan_experts_dir, num_frames=5, height=32, width=32, num_steps=3,
                                 lora_rank=lora_rank, lora_alpha=8, max_sequence_length=16))
    perturb(policy, seed=4)
    policy.export_pretrained(str(tmp_path / "out"), merge_lora=merge)
    pipe = WanPipeline.from_pretrained(str(tmp_path / "out"))
    if lora_rank and not merge:
        pipe.load_lora_weights(str(tmp_path / "out" / LORA_FOLDER))
        pipe.load_lora_weights(str(tmp_path / "out" / LORA_FOLDER / "transformer_2"), load_into_transformer_2=True)
    generator = torch.Generator().manual_seed(0)
    latents = torch.randn(1, 16, 2, 4, 4, generator=generator)  # [1, 16, (5 - 1) / 4 + 1, 32 / 8, 32 / 8]
    text = torch.randn(1, 16, pipe.transformer.config.text_dim, generator=generator)
    step = torch.tensor([700.0])
    for name, expert in zip(("transformer", "transformer_2"), policy.experts):
        with torch.no_grad():
            ours = expert.module.eval()(latents, step, text, return_dict=False)[0]
            theirs = getattr(pipe, name).eval()(latents, step, text, return_dict=False)[0]
        torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)


def test_flux_full_fine_tuning_export_samples_like_mmgrpo_in_stock_diffusers(tiny_flux_dir, tmp_path):
    from diffusers import FluxPipeline

    from mmgrpo.pipelines.flux import FluxConfig, FluxPolicy

    policy = FluxPolicy(FluxConfig(pretrained=tiny_flux_dir, resolution=32, num_steps=4, lora_rank=0,
                                   max_sequence_length=16))
    perturb(policy, seed=4)
    policy.export_pretrained(str(tmp_path / "out"))
    ours = policy.sample(PromptBatch(PROMPTS), FlowPlan.deterministic(4), generator=torch.Generator().manual_seed(2))
    pipe = FluxPipeline.from_pretrained(str(tmp_path / "out"))
    pipe.set_progress_bar_config(disable=True)
    theirs = pipe(prompt=PROMPTS, num_inference_steps=4, guidance_scale=3.5, height=32, width=32, output_type="pt",
                  generator=torch.Generator().manual_seed(2), max_sequence_length=16).images.float()
    torch.testing.assert_close(theirs, ours.outputs["images"], rtol=0, atol=1e-4)
