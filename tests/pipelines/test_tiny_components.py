"""Offline CLIP / T5 tokenizers, tiny SD3 and FLUX pipelines: shapes, determinism, eval mode, save/load round-trip;
the base-model training scripts of `scripts/` parse their arguments and train and resume exactly."""

import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch

from builders._repo_files import load_repo_script
from builders._tokenizers import clip_tokenizer, t5_tokenizer
from builders.flux import tiny_flux_pipeline
from builders.sd3 import TEXT_PAD_LENGTH, load_sd3_pipeline, tiny_sd3_pipeline


def _sample(pipe, prompts, seed=0):
    return pipe(
        prompt=prompts,
        num_inference_steps=2,
        guidance_scale=1.0,
        height=32,
        width=32,
        output_type="pt",
        generator=torch.Generator().manual_seed(seed),
        max_sequence_length=TEXT_PAD_LENGTH,
    ).images  # [N, 3, 32, 32]


@pytest.fixture(scope="module")
def pipe():
    return tiny_sd3_pipeline()


@pytest.mark.slow  # building the full 49408-token vocabulary takes ~4 s
def test_full_clip_tokenizer_matches_openai_clip_ids():
    full = clip_tokenizer(n_merges=48894, model_max_length=77)
    assert full("a photo of a cat").input_ids == [49406, 320, 1125, 539, 320, 2368, 49407]


def test_small_clip_tokenizer():
    small = clip_tokenizer()
    # ids of tokens made by the first merges are CLIP's own (as open_clip's SimpleTokenizer gives them)
    assert small("a red of a").input_ids[1:-1] == [320, 736, 539, 320]
    assert len(small) == 1000
    assert small.model_max_length == 16
    ids = small(["a red circle"], padding="max_length", max_length=16).input_ids[0]
    assert len(ids) == 16 and ids[0] == small.bos_token_id and ids[-1] == small.pad_token_id


def test_clip_tokenizer_extra_words_are_kept_whole_and_deterministic():
    words = ["yellow", "triangle", "magenta", "below"]  # 3-4 tokens each with 486 merges
    tok = clip_tokenizer(extra_words=words)
    for word in words:
        assert tok.tokenize(word) == [word + "</w>"]  # as full CLIP tokenizes them
    assert tok.tokenize("cyan") == ["c", "y", "an</w>"]  # not added: split as by the first 486 merges
    assert tok.get_vocab() == clip_tokenizer(extra_words=reversed(words)).get_vocab()
    # the first 486 merges keep their ids
    assert tok("a red").input_ids[1:-1] == clip_tokenizer()("a red").input_ids[1:-1]


def test_pipeline_components(pipe):
    assert pipe.text_encoder_3 is None and pipe.tokenizer_3 is None
    for module in (pipe.text_encoder, pipe.text_encoder_2, pipe.transformer, pipe.vae):
        assert not module.training
    assert pipe.vae_scale_factor == 2
    cfg = pipe.transformer.config
    assert cfg.pooled_projection_dim == 2 * pipe.text_encoder.config.projection_dim
    assert cfg.joint_attention_dim >= 2 * pipe.text_encoder.config.hidden_size


def test_prompt_embeds_are_clip_then_zero_padding(pipe):
    embeds, _, pooled, _ = pipe.encode_prompt(
        ["a red circle", "two blue squares"], None, None, do_classifier_free_guidance=False,
        max_sequence_length=TEXT_PAD_LENGTH,
    )
    assert embeds.shape == (2, 16 + TEXT_PAD_LENGTH, pipe.transformer.config.joint_attention_dim)
    assert pooled.shape == (2, pipe.transformer.config.pooled_projection_dim)
    assert torch.all(embeds[:, 16:] == 0)  # no T5: zeros
    assert embeds[:, :16].abs().sum() > 0


def test_pipeline_call_and_determinism(pipe):
    images = _sample(pipe, ["a red circle", "two blue squares"])
    assert images.shape == (2, 3, 32, 32)
    assert images.min() >= 0 and images.max() <= 1
    assert torch.equal(images, _sample(tiny_sd3_pipeline(seed=0), ["a red circle", "two blue squares"]))
    other = tiny_sd3_pipeline(seed=1)
    assert not torch.equal(pipe.transformer.proj_out.weight, other.transformer.proj_out.weight)


def test_builder_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    tiny_sd3_pipeline()
    assert torch.equal(torch.rand(3), expected)


def test_save_load_round_trip_is_exact(pipe, tmp_path):
    images = _sample(pipe, ["a red circle", "a green triangle left of a blue square"], seed=3)
    pipe.save_pretrained(tmp_path)
    loaded = load_sd3_pipeline(str(tmp_path))
    assert loaded.text_encoder_3 is None and loaded.tokenizer_3 is None
    assert loaded.tokenizer.model_max_length == 16
    assert torch.equal(images, _sample(loaded, ["a red circle", "a green triangle left of a blue square"], seed=3))


def test_builder_rejects_bad_sizes():
    with pytest.raises(ValueError, match="power of 2"):
        tiny_sd3_pipeline(vae_downsample=3)
    with pytest.raises(ValueError, match="divisible"):
        tiny_sd3_pipeline(sample_size=30)


SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def load_script(name: str):
    """Imports a base-model training script of `scripts/` by its stem."""
    return load_repo_script("scripts", name)


@pytest.mark.parametrize("name", sorted(p.stem for p in SCRIPTS.glob("train_*.py")))
def test_training_scripts_parse_their_arguments_from_the_repository_root(name):
    """Each script runs as ``python scripts/<name>.py`` from the repository root and finds the tiny builders."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, f"scripts/{name}.py", "--help"], cwd=SCRIPTS.parent, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("usage:") and "--seed" in proc.stdout


TRAIN_ARGS = [
    "--layers", "1", "--vae-steps", "2", "--vae-batch", "4", "--steps", "4", "--batch", "4", "--eval-start", "3",
    "--eval-every", "1", "--n-select", "4", "--n-eval", "4", "--eval-steps", "2", "--warmup", "1",
    "--checkpoint-every", "2", "--target", "0.99", "1.0",
]


def test_training_script_runs_and_resumes_exactly(tmp_path, monkeypatch):
    from safetensors.torch import load_file

    train_t2i_shapes = load_script("train_t2i_shapes")

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train_t2i_shapes.main(["--output", str(straight), *TRAIN_ARGS])
    metrics = json.loads((straight / "metrics.json").read_text())
    assert set(metrics["heldout"]) >= {"strict", "partial", "strict_single"}
    assert metrics["sampling"]["max_sequence_length"] == 4
    assert [h["step"] for h in metrics["selection_history"]] == [3, 4]
    assert (straight / "samples.png").is_file() and not (straight / "resume.safetensors").exists()
    pipe = load_sd3_pipeline(str(straight))
    assert pipe.vae.config.scaling_factor != 1.0  # calibrated latents
    assert pipe.tokenizer.tokenize("magenta triangle") == ["magenta</w>", "triangle</w>"]

    # a run killed at step 3 resumes from its step-2 checkpoint and ends exactly like the straight run
    real_rate = train_t2i_shapes.learning_rate

    def crash_at_step_3(step, args):
        if step == 3:
            raise KeyboardInterrupt
        return real_rate(step, args)

    monkeypatch.setattr(train_t2i_shapes, "learning_rate", crash_at_step_3)
    with pytest.raises(KeyboardInterrupt):
        train_t2i_shapes.main(["--output", str(resumed), *TRAIN_ARGS])
    assert (resumed / "resume.safetensors").is_file()
    monkeypatch.setattr(train_t2i_shapes, "learning_rate", real_rate)
    train_t2i_shapes.main(["--output", str(resumed), *TRAIN_ARGS])
    for name in ("transformer/diffusion_pytorch_model", "text_encoder/model", "vae/diffusion_pytorch_model"):
        a, b = load_file(straight / f"{name}.safetensors"), load_file(resumed / f"{name}.safetensors")
        assert all(torch.equal(a[k], b[k]) for k in a), name


SHIPPED = Path(__file__).resolve().parents[2] / "data" / "weights" / "t2i_shapes"


def test_shipped_weights_load_and_sample():
    metrics = json.loads((SHIPPED / "metrics.json").read_text())
    pipe = load_sd3_pipeline(str(SHIPPED))
    images = pipe(
        prompt=["a red circle", "two blue squares"], num_inference_steps=2, guidance_scale=1.0, height=32, width=32,
        output_type="pt", generator=torch.Generator().manual_seed(0),
        max_sequence_length=metrics["sampling"]["max_sequence_length"],
    ).images
    assert images.shape == (2, 3, 32, 32)
    assert sum(f.stat().st_size for f in SHIPPED.rglob("*.safetensors")) < 10_000_000


def test_t5_tokenizer_is_deterministic_and_covers_any_ascii_prompt():
    tok = t5_tokenizer()
    assert tok.get_vocab() == t5_tokenizer().get_vocab()
    ids = tok("a red circle").input_ids
    assert len(ids) == 4 and ids[-1] == tok.eos_token_id  # three whole words, then </s>
    assert tok.unk_token_id not in tok("a Zebra-like shape, 3 times!").input_ids  # unknown words go letter by letter
    assert t5_tokenizer(words=["red", "a"]).get_vocab() == t5_tokenizer(words=["a", "red"]).get_vocab()


def test_tiny_flux_pipeline_round_trips_through_save_pretrained(tiny_flux_dir):
    from diffusers import FluxPipeline

    def sample(pipe):
        pipe.set_progress_bar_config(disable=True)
        return pipe(
            prompt=["a red circle", "two blue squares"], num_inference_steps=2, guidance_scale=3.5, height=32,
            width=32, output_type="pt", generator=torch.Generator().manual_seed(0), max_sequence_length=16,
        ).images  # [2, 3, 32, 32]

    fresh = tiny_flux_pipeline(seed=0)
    assert not any(m.training for m in (fresh.text_encoder, fresh.text_encoder_2, fresh.transformer, fresh.vae))
    assert fresh.transformer.config.guidance_embeds and fresh.scheduler.config.use_dynamic_shifting
    assert torch.equal(sample(fresh), sample(FluxPipeline.from_pretrained(tiny_flux_dir)))
