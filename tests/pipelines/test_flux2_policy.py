"""The FLUX.2 adapter on real diffusers classes built from tiny configs (`builders/flux2.py`, FLUX.2 [klein]): ODE
sampling equals the stock `Flux2KleinPipeline` (true CFG on the base model, none on the step-distilled one with a
4-step schedule; FLUX.2 [dev] with its guidance embedding), the noise levels are the stock ones (FLUX.2's empirical
mu of tokens and steps), replay reproduces the rollout's log-probabilities, LoRA and full exports load back in the
stock pipeline, gradient checkpointing changes nothing. (Saving and reloading the trained weights is shared code,
tested on `z_image`, `sd3` and `flux`.)"""

import pytest
import torch

from mmgrpo.algorithms.flow_grpo import FlowGRPO, FlowGRPOConfig
from mmgrpo.pipelines.flux2 import Flux2Config, Flux2Policy
from mmgrpo.plans import FlowPlan
from mmgrpo.types import PromptBatch
from algorithm_options import algo_config
from builders._weights import perturb
from builders.flux2 import OUT_LAYERS

PROMPTS = ["a red circle", "two blue squares", "a green triangle left of a yellow circle"]


def make_policy(path, **overrides):
    options = dict(pretrained=path, resolution=32, num_steps=3, guidance_scale=2.0, lora_rank=4, lora_alpha=8,
                   max_sequence_length=32, text_encoder_out_layers=OUT_LAYERS, weights_dtype="float32")
    return Flux2Policy(Flux2Config(**{**options, **overrides}))


def stock(path, lora=None, dev=False):
    from diffusers import Flux2KleinPipeline, Flux2Pipeline

    pipe = (Flux2Pipeline if dev else Flux2KleinPipeline).from_pretrained(str(path))
    pipe.set_progress_bar_config(disable=True)
    if lora is not None:
        pipe.load_lora_weights(str(lora))
    return pipe


def stock_images(pipe, policy, steps, prompts=PROMPTS[:2], seed=2):
    return pipe(prompt=list(prompts), guidance_scale=policy.config.guidance_scale, num_inference_steps=steps, height=32,
                width=32, output_type="pt", generator=torch.Generator().manual_seed(seed),
                max_sequence_length=policy.config.max_sequence_length,
                text_encoder_out_layers=tuple(OUT_LAYERS)).images.float()


def ours(policy, steps, prompts=PROMPTS[:2], seed=2):
    plan = FlowPlan.deterministic(steps)
    return policy.sample(PromptBatch(prompts), plan, generator=torch.Generator().manual_seed(seed)).outputs["images"]


CASES = {"cfg": ("tiny_flux2_dir", 2.0, 3), "no-cfg": ("tiny_flux2_dir", 1.0, 3),
         "distilled-4-steps": ("tiny_flux2_distilled_dir", 4.0, 4)}


@pytest.mark.parametrize("case", CASES)
def test_ode_sampling_equals_stock_pipeline(request, tmp_path, case):
    fixture, guidance, steps = CASES[case]
    path = request.getfixturevalue(fixture)
    policy = make_policy(path, guidance_scale=guidance)
    assert policy.do_cfg == (case == "cfg")
    perturb(policy, seed=1)
    policy.save_pretrained(str(tmp_path / "lora"))
    pipe = stock(path, tmp_path / "lora")
    torch.testing.assert_close(ours(policy, steps), stock_images(pipe, policy, steps), rtol=0, atol=1e-4)
    torch.testing.assert_close(pipe.scheduler.sigmas, policy.sigmas(steps), rtol=0, atol=0)


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
    policy = make_policy(tiny_flux2_distilled_dir, num_steps=4, guidance_scale=4.0)
    plan = FlowGRPO(algo_config(FlowGRPOConfig, noise_level=0.9)).schedule(4)
    rollout = policy.sample(PromptBatch(PROMPTS).repeat(2), plan, generator=torch.Generator().manual_seed(1))
    assert rollout.trajectory["latents"].shape == (6, 5, 64, 16)
    with torch.no_grad():
        full = policy.log_prob(rollout, [0, 3]).log_prob
        sub = policy.log_prob(rollout.select(torch.tensor([4, 1])), [0, 3]).log_prob
    torch.testing.assert_close(full, rollout.old_log_probs[:, [0, 3]], rtol=0, atol=1e-5)
    torch.testing.assert_close(sub, rollout.old_log_probs[[4, 1]][:, [0, 3]], rtol=0, atol=1e-5)


@pytest.mark.parametrize("lora_rank, merge", [(4, True), (0, False)], ids=["lora-merged", "full"])
def test_export_loads_in_stock_pipeline_with_identical_outputs(tiny_flux2_dir, tmp_path, lora_rank, merge):
    from mmgrpo.export import LORA_FOLDER

    policy = make_policy(tiny_flux2_dir, lora_rank=lora_rank)
    perturb(policy, seed=4)
    policy.export_pretrained(str(tmp_path / "out"), merge_lora=merge)
    pipe = stock(tmp_path / "out", tmp_path / "out" / LORA_FOLDER if lora_rank and not merge else None)
    expected = ours(policy, 3)
    torch.testing.assert_close(stock_images(pipe, policy, 3), expected, rtol=0, atol=1e-4)
    assert not torch.allclose(stock_images(stock(tiny_flux2_dir), policy, 3), expected, atol=1e-3)


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
    from pathlib import Path

    from mmgrpo import config as config_mod

    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(root)
    cfg = config_mod.load(root / "configs" / "flux2_klein_base_flow_grpo.yaml")
    pipe, algo = cfg.pipeline.options, cfg.algorithm.options
    assert cfg.pipeline.name == "flux2" and pipe.pretrained == "black-forest-labs/FLUX.2-klein-base-9B"
    assert (pipe.resolution, pipe.num_steps, pipe.eval_num_steps, pipe.guidance_scale) == (384, 8, 28, 4.0)
    assert pipe.pipeline_class == "Flux2KleinPipeline" and (pipe.lora_rank, pipe.lora_alpha) == (64, 128)
    assert (algo.sde.noise_level, algo.clip.clip_low, algo.kl.kl_beta) == (0.7, 1e-4, 0.0)
    assert (algo.sde_window_size, algo.sde_window_range) == (1, [1, 4])  # one SDE step drawn from steps 1-3
    assert (cfg.train.prompts_per_step, cfg.train.group_size, cfg.train.learning_rate) == (48, 16, 3e-4)


def test_gradient_checkpointing_gives_the_same_replay_and_gradient(tiny_flux2_dir):
    """``gradient_checkpointing`` recomputes the transformer's blocks in the backward pass: same log-probs, same
    gradients (same LoRA initialisation and perturbation for both policies)."""
    plan = FlowGRPO(FlowGRPOConfig()).schedule(3)
    results = []
    for checkpointing in (False, True):
        torch.manual_seed(0)  # the LoRA initialisation
        policy = make_policy(tiny_flux2_dir, gradient_checkpointing=checkpointing)
        perturb(policy, seed=5)
        rollout = policy.sample(PromptBatch(PROMPTS[:2]), plan, generator=torch.Generator().manual_seed(0))
        score = policy.log_prob(rollout, [0, 2]).log_prob
        score.sum().backward()
        # (the last block's text-stream layers do not reach the image: no gradient)
        results.append((score.detach(), [p.grad for p in policy.trainable_parameters()]))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=1e-6)
    assert any(g is not None for g in results[0][1])
    for plain, checkpointed in zip(results[0][1], results[1][1]):
        assert (plain is None) == (checkpointed is None)
        if plain is not None:
            torch.testing.assert_close(plain, checkpointed, rtol=1e-4, atol=1e-6)
