"""The FLUX.2 adapter on real diffusers classes built from tiny configs (`builders/flux2.py`, FLUX.2 [klein]): ODE
sampling equals the stock `Flux2KleinPipeline` (true CFG on the base model, none on the step-distilled one with a
4-step schedule; FLUX.2 [dev] with its guidance embedding), the noise levels are the stock ones (FLUX.2's empirical
mu of tokens and steps), replay reproduces the rollout's log-probabilities, LoRA and full exports load back in the
stock pipeline, gradient checkpointing changes nothing. (Saving and reloading the trained weights is shared code,
tested on `z_image`, `sd3` and `flux`.)"""

import pytest
import torch

from mmgrpo.pipelines.flux2 import Flux2Config, Flux2Policy
from builders._stock_equality import (
    PROMPTS, StockAdapter, check_export, check_gradient_checkpointing, check_ode_sampling, check_replay,
    load_flow_factory_config, load_stock, ours,
)
from builders._weights import perturb
from builders.flux2 import OUT_LAYERS


def make_policy(path, **overrides):
    options = dict(pretrained=path, resolution=32, num_steps=3, guidance_scale=2.0, lora_rank=4, lora_alpha=8,
                   max_sequence_length=32, text_encoder_out_layers=OUT_LAYERS, weights_dtype="float32")
    return Flux2Policy(Flux2Config(**{**options, **overrides}))


def stock(path, lora=None, dev=False):
    from diffusers import Flux2KleinPipeline, Flux2Pipeline

    return load_stock(Flux2Pipeline if dev else Flux2KleinPipeline, path, lora)


def stock_images(pipe, policy, steps, prompts=PROMPTS[:2], seed=2):
    return pipe(prompt=list(prompts), guidance_scale=policy.config.guidance_scale, num_inference_steps=steps, height=32,
                width=32, output_type="pt", generator=torch.Generator().manual_seed(seed),
                max_sequence_length=policy.config.max_sequence_length,
                text_encoder_out_layers=tuple(OUT_LAYERS)).images.float()


ADAPTER = StockAdapter(make_policy, stock, stock_images)
CASES = {"cfg": ("tiny_flux2_dir", 2.0, 3), "no-cfg": ("tiny_flux2_dir", 1.0, 3),
         "distilled-4-steps": ("tiny_flux2_distilled_dir", 4.0, 4)}


@pytest.mark.parametrize("case", CASES)
def test_ode_sampling_equals_stock_pipeline(request, tmp_path, case):
    fixture, guidance, steps = CASES[case]
    path = request.getfixturevalue(fixture)
    policy = make_policy(path, guidance_scale=guidance)
    assert policy.do_cfg == (case == "cfg")
    check_ode_sampling(ADAPTER, policy, path, steps, tmp_path)


def test_dev_ode_sampling_and_export_equal_stock_pipeline(tiny_flux2_dev_dir, tmp_path):
    """FLUX.2 [dev]: the Mistral-3 text encoder and the distilled guidance embedding (no CFG batch)."""
    policy = make_policy(tiny_flux2_dev_dir, guidance_scale=4.0, max_sequence_length=64)
    assert not policy.klein and not policy.do_cfg
    perturb(policy, seed=1)
    policy.export_pretrained(str(tmp_path / "out"), merge_lora=True)
    pipe = stock(tmp_path / "out", dev=True)
    expected = ours(policy, 3)
    torch.testing.assert_close(expected, stock_images(pipe, policy, 3), rtol=0, atol=1e-4)
    low = make_policy(tiny_flux2_dev_dir, guidance_scale=1.0, max_sequence_length=64)
    perturb(low, seed=1)
    assert not torch.allclose(ours(low, 3), expected, atol=1e-3), "the guidance embedding must be fed"


def test_sigmas_follow_the_empirical_mu_of_tokens_and_steps(tiny_flux2_dir):
    import math

    from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

    policy = make_policy(tiny_flux2_dir)
    for steps in (4, 8):
        base = torch.linspace(1.0, 1 / steps, steps, dtype=torch.float64)
        mu = compute_empirical_mu(64, steps)  # 8 x 8 latent tokens
        shifted = math.exp(mu) / (math.exp(mu) + (1 / base - 1))
        sigmas = policy.sigmas(steps)
        torch.testing.assert_close(sigmas[:-1].double(), shifted, rtol=0, atol=1e-6)
        assert sigmas[-1] == 0 and sigmas.shape == (steps + 1,)


def test_replay_matches_rollout_on_a_few_step_schedule(tiny_flux2_distilled_dir):
    check_replay(make_policy(tiny_flux2_distilled_dir, num_steps=4, guidance_scale=4.0), (6, 5, 64, 16))


@pytest.mark.parametrize("lora_rank, merge", [(4, True), (0, False)], ids=["lora-merged", "full"])
def test_export_loads_in_stock_pipeline_with_identical_outputs(tiny_flux2_dir, tmp_path, lora_rank, merge):
    check_export(ADAPTER, tiny_flux2_dir, tmp_path, lora_rank, merge)


def test_config_errors_name_the_fix(tiny_flux2_dir, tmp_path):
    with pytest.raises(ValueError, match="multiple of 16"):
        Flux2Config(pretrained=tiny_flux2_dir, resolution=40)
    with pytest.raises(ValueError, match="max_sequence_length"):
        Flux2Config(pretrained=tiny_flux2_dir, max_sequence_length=1024)
    (tmp_path / "model_index.json").write_text('{"_class_name": "FluxPipeline"}')
    with pytest.raises(ValueError, match="set pipeline_class"):
        Flux2Config(pretrained=str(tmp_path))
    assert Flux2Config(pretrained=str(tmp_path), pipeline_class="Flux2Pipeline").pipeline_name() == "Flux2Pipeline"


def test_real_config_carries_flow_factorys_recipe(monkeypatch):
    cfg = load_flow_factory_config(monkeypatch, "flux2_klein_base_flow_grpo", noise_level=0.7)
    pipe = cfg.pipeline.options
    assert cfg.pipeline.name == "flux2" and pipe.pretrained == "black-forest-labs/FLUX.2-klein-base-9B"
    assert (pipe.resolution, pipe.num_steps, pipe.eval_num_steps, pipe.guidance_scale) == (384, 8, 28, 4.0)
    assert pipe.pipeline_class == "Flux2KleinPipeline" and (pipe.lora_rank, pipe.lora_alpha) == (64, 128)


def test_gradient_checkpointing_gives_the_same_replay_and_gradient(tiny_flux2_dir):
    check_gradient_checkpointing(make_policy, tiny_flux2_dir)
