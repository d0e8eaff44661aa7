"""Checks shared by the tests of the flow adapters that are compared with their stock diffusers pipeline on tiny
real-class models (`test_flux2_policy.py`, `test_qwen_image_policy.py`, `test_z_image_policy.py`): each test file
gives its [`StockAdapter`] (how it builds its policy, loads the stock pipeline and samples images with it), the checks
are written once here."""

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from mmgrpo.algorithms.flow_grpo import FlowGRPO, FlowGRPOConfig
from mmgrpo.plans import FlowPlan
from mmgrpo.types import PromptBatch
from algorithm_options import algo_config
from builders._weights import perturb

PROMPTS = ["a red circle", "two blue squares", "a green triangle left of a yellow circle"]


@dataclass(frozen=True)
class StockAdapter:
    """One adapter's test hooks.

    Args:
        make_policy (`Callable`): ``(path, **overrides) -> policy``, the 32 x 32 test policy of a tiny model folder.
        stock (`Callable`): ``(path, lora=None) -> pipeline``, the stock diffusers pipeline of a folder, with a LoRA
            folder loaded when given (see [`load_stock`]).
        stock_images (`Callable`): ``(pipe, policy, steps, prompts=PROMPTS[:2], seed=2) -> images`` `[n, 3, 32, 32]`,
            the stock pipeline's ODE samples with the policy's sampling options.
    """

    make_policy: Callable[..., Any]
    stock: Callable[..., Any]
    stock_images: Callable[..., torch.Tensor]


def load_stock(pipeline_cls, path, lora=None):
    """The stock pipeline `pipeline_cls` from folder `path` (no progress bar), with the LoRA folder `lora` loaded."""
    pipe = pipeline_cls.from_pretrained(str(path))
    pipe.set_progress_bar_config(disable=True)
    if lora is not None:
        pipe.load_lora_weights(str(lora))
    return pipe


def ours(policy, steps, prompts=PROMPTS[:2], seed=2) -> torch.Tensor:
    """The policy's ODE samples `[n, 3, H, W]` over `steps` steps, from the initial noise of `seed`."""
    plan = FlowPlan.deterministic(steps)
    return policy.sample(PromptBatch(prompts), plan, generator=torch.Generator().manual_seed(seed)).outputs["images"]


def check_ode_sampling(adapter: StockAdapter, policy, path, steps: int, tmp_path: Path, prompts=PROMPTS[:2]) -> None:
    """After perturbing its LoRA, `policy` samples what the stock pipeline of `path` with the saved LoRA samples, on
    the stock noise levels."""
    perturb(policy, seed=1)
    policy.save_pretrained(str(tmp_path / "lora"))
    pipe = adapter.stock(path, tmp_path / "lora")
    torch.testing.assert_close(ours(policy, steps, prompts), adapter.stock_images(pipe, policy, steps, prompts),
                               rtol=0, atol=1e-4)
    torch.testing.assert_close(pipe.scheduler.sigmas, policy.sigmas(steps), rtol=0, atol=0)


def check_replay(policy, latents_shape: tuple[int, ...]) -> None:
    """Flow-GRPO on 4 steps: the rollout's latents are `latents_shape`, and replayed log-probs equal the rollout's,
    for the whole batch and for a minibatch of it."""
    plan = FlowGRPO(algo_config(FlowGRPOConfig, noise_level=0.9)).schedule(4)
    rollout = policy.sample(PromptBatch(PROMPTS).repeat(2), plan, generator=torch.Generator().manual_seed(1))
    assert rollout.trajectory["latents"].shape == latents_shape
    with torch.no_grad():
        full = policy.log_prob(rollout, [0, 3]).log_prob
        sub = policy.log_prob(rollout.select(torch.tensor([4, 1])), [0, 3]).log_prob
    torch.testing.assert_close(full, rollout.old_log_probs[:, [0, 3]], rtol=0, atol=1e-5)
    torch.testing.assert_close(sub, rollout.old_log_probs[[4, 1]][:, [0, 3]], rtol=0, atol=1e-5)


def check_export(adapter: StockAdapter, path, tmp_path: Path, lora_rank: int, merge: bool) -> None:
    """``export_pretrained`` of a perturbed policy (LoRA merged or not, or full weights) loads in the stock pipeline,
    which then samples what the policy samples (and not what the base model samples)."""
    from mmgrpo.export import LORA_FOLDER

    policy = adapter.make_policy(path, lora_rank=lora_rank)
    perturb(policy, seed=4)
    policy.export_pretrained(str(tmp_path / "out"), merge_lora=merge)
    pipe = adapter.stock(tmp_path / "out", tmp_path / "out" / LORA_FOLDER if lora_rank and not merge else None)
    expected = ours(policy, 3)
    torch.testing.assert_close(adapter.stock_images(pipe, policy, 3), expected, rtol=0, atol=1e-4)
    assert not torch.allclose(adapter.stock_images(adapter.stock(path), policy, 3), expected, atol=1e-3)


def check_gradient_checkpointing(make_policy: Callable[..., Any], path) -> None:
    """``gradient_checkpointing`` recomputes the transformer's blocks in the backward pass: same log-probs, same
    gradients (same LoRA initialisation and perturbation for both policies)."""
    plan = FlowGRPO(FlowGRPOConfig()).schedule(3)
    results = []
    for checkpointing in (False, True):
        torch.manual_seed(0)  # the LoRA initialisation
        policy = make_policy(path, gradient_checkpointing=checkpointing)
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


def load_flow_factory_config(monkeypatch, name: str, noise_level: float):
    """The repository's config `configs/<name>.yaml` (read from the repository root), after checking the Flow-GRPO
    recipe of Flow-Factory's configs it carries: one SDE step drawn from steps 1-3, clip 1e-4, no KL, 48 prompts of
    16 samples a step at learning rate 3e-4, SDE noise level `noise_level`."""
    from mmgrpo import config as config_mod

    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(root)
    cfg = config_mod.load(root / "configs" / f"{name}.yaml")
    algo = cfg.algorithm.options
    assert (algo.sde.noise_level, algo.clip.clip_low, algo.kl.kl_beta) == (noise_level, 1e-4, 0.0)
    assert (algo.sde_window_size, algo.sde_window_range) == (1, [1, 4])  # one SDE step drawn from steps 1-3
    assert (cfg.train.prompts_per_step, cfg.train.group_size, cfg.train.learning_rate) == (48, 16, 3e-4)
    return cfg
