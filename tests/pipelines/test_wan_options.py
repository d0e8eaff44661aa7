"""The memory options of the `wan` adapter (text embeddings once per prompt, offloaded rollouts, gradient
checkpointing, bf16 weights) and a short training run through the unchanged trainer that writes MP4s."""

import json

import pytest
import torch

from builders.wan import WAN_TOKENS, tiny_policy as make_policy
from mmgrpo.algorithms.flow_grpo import FlowGRPO, FlowGRPOConfig
from mmgrpo.types import PromptBatch
from algorithm_options import algo_config

PROMPTS = ["a red circle", "two blue squares", "a green triangle"]


def seeded(seed):
    return torch.Generator().manual_seed(seed)


def flow_grpo_plan():
    return FlowGRPO(FlowGRPOConfig()).schedule(3)


def test_text_is_encoded_once_per_prompt_and_shared_by_its_group(tiny_wan_dir):
    """3 prompts x group 4 with CFG: two encoder calls (3 prompts, 1 negative prompt), not 24 rows; each sample's
    embedding is its prompt's, as encoding it alone gives."""
    policy = make_policy(tiny_wan_dir, guidance_scale=2.0)
    rows = []
    hook = policy.pipe.text_encoder.register_forward_pre_hook(lambda _, args: rows.append(args[0].shape[0]))
    batch = PromptBatch(PROMPTS).repeat(4)
    rollout = policy.sample(batch, flow_grpo_plan(), generator=seeded(0))
    hook.remove()
    assert rows == [3, 1]
    traj = rollout.trajectory
    assert traj["shared_prompt_embeds"].shape[0] == 3 and traj["shared_negative_prompt_embeds"].shape[0] == 1
    alone = policy._encode_text([PROMPTS[2]])
    picked = policy._pick(traj, torch.tensor([8, 11]))["prompt_embeds"]  # samples of the third prompt
    torch.testing.assert_close(picked, alone.expand(2, -1, -1), rtol=0, atol=0)
    sub = rollout.select(torch.tensor([11, 0]))  # a minibatch keeps the shared table and its own indices
    assert sub.trajectory["prompt_index"].tolist() == [2, 0] and sub.trajectory["shared_prompt_embeds"].shape[0] == 3


def test_offload_keeps_the_rollout_on_the_cpu_with_the_same_numbers(tiny_wan_dir):
    """With ``offload`` every trajectory tensor is a CPU tensor and replay gives the same log-probs and gradients as
    without (here the device is the CPU too; a GPU run moves each replayed minibatch back to the device)."""
    scores = []
    for offload in (False, True):
        torch.manual_seed(0)  # the same LoRA initialisation in both policies
        policy = make_policy(tiny_wan_dir, offload=offload)
        rollout = policy.sample(PromptBatch(PROMPTS).repeat(2), flow_grpo_plan(), generator=seeded(0))
        if offload:
            assert all(v.device.type == "cpu" for v in rollout.trajectory.values() if isinstance(v, torch.Tensor))
        score = policy.log_prob(rollout, [1])
        score.log_prob.sum().backward()
        scores.append((score.log_prob.detach(), [p.grad.clone() for p in policy.trainable_parameters()]))
    torch.testing.assert_close(scores[0][0], scores[1][0], rtol=0, atol=0)
    for a, b in zip(scores[0][1], scores[1][1]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="moves tensors between a GPU and the CPU")
def test_offload_on_a_gpu_keeps_the_rollout_on_the_cpu(tiny_wan_dir):
    from types import SimpleNamespace

    policy = make_policy(tiny_wan_dir, offload=True)
    device = torch.device("cuda")
    policy.prepare(SimpleNamespace(device=device, prepare_model=lambda m: m))
    rollout = policy.sample(PromptBatch(PROMPTS).repeat(2), flow_grpo_plan(), generator=seeded(0))
    assert rollout.trajectory["latents"].device.type == "cpu"
    score = policy.log_prob(rollout, [1])
    assert score.log_prob.device.type == "cuda"
    torch.testing.assert_close(score.log_prob.detach().cpu(), rollout.old_log_probs[:, [1]], rtol=0, atol=1e-4)


@pytest.mark.parametrize("lora_rank", [4, 0])
def test_gradient_checkpointing_recomputes_blocks_with_the_same_loss_and_gradient(tiny_wan_dir, lora_rank):
    algorithm = FlowGRPO(algo_config(FlowGRPOConfig, clip_low=0.2))
    results = []
    for checkpointing in (False, True):
        torch.manual_seed(0)  # the same LoRA initialisation in both policies
        policy = make_policy(tiny_wan_dir, gradient_checkpointing=checkpointing, lora_rank=lora_rank)
        rollout = policy.sample(PromptBatch(PROMPTS).repeat(2), algorithm.schedule(3), generator=seeded(0))
        forwards = []
        hook = policy.transformer.blocks[0].register_forward_pre_hook(lambda *args: forwards.append(1))
        out = algorithm.loss(policy.log_prob(rollout, [2]), rollout.old_log_probs[:, [2]],
                             torch.linspace(-1, 1, 6), None)
        out.loss.backward()
        hook.remove()
        assert len(forwards) == (2 if checkpointing else 1)  # the block started again in the backward pass
        results.append((out.loss.detach(), [p.grad.clone() for p in policy.trainable_parameters()]))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=1e-6)
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


def test_decode_batch_size_changes_the_calls_not_the_videos(tiny_wan_dir):
    policy = make_policy(tiny_wan_dir, decode_batch_size=4)
    latents = torch.randn(6, 16, 2, 4, 4, generator=seeded(0))
    calls = []
    hook = policy.pipe.vae.post_quant_conv.register_forward_pre_hook(lambda _, args: calls.append(args[0].shape[0]))
    together = policy.decode(latents)
    policy.config.decode_batch_size = 1
    alone = policy.decode(latents)
    hook.remove()
    assert calls == [4, 2] + [1] * 6
    torch.testing.assert_close(together, alone, rtol=0, atol=1e-5)


def test_bf16_weights_keep_trainable_parameters_in_float32(tiny_wan_dir):
    policy = make_policy(tiny_wan_dir, weights_dtype="bfloat16")
    assert policy.pipe.vae.dtype == torch.bfloat16 and policy.pipe.text_encoder.dtype == torch.bfloat16
    attention = policy.transformer.blocks[0].attn1.to_q  # a LoRA layer around the frozen base weight
    assert attention.base_layer.weight.dtype == torch.bfloat16 and not attention.base_layer.weight.requires_grad
    assert all(p.dtype == torch.float32 for p in policy.trainable_parameters())
    rollout = policy.sample(PromptBatch(PROMPTS[:1]).repeat(2), flow_grpo_plan(), generator=seeded(0))
    assert torch.isfinite(rollout.old_log_probs).all() and rollout.outputs["videos"].dtype == torch.float32


def test_trainer_trains_wan_and_writes_mp4s(tmp_path, tiny_wan_dir):
    """Two Flow-GRPO steps through the unchanged trainer (KL reference, checkpoints, evaluation): ratio 1 on the first
    update, the LoRA moves, and the evaluation writes one MP4 per sample, the frame strips and the HTML page."""
    import av

    from mmgrpo import config as config_mod
    from mmgrpo.trainer import Trainer

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\na blue square\na green triangle\n")
    raw = {
        "output_dir": str(tmp_path / "run"), "seed": 3,
        "pipeline": {"name": "wan", "pretrained": tiny_wan_dir, "height": 32, "width": 32, "num_frames": 5,
                     "num_steps": 3, "guidance_scale": 1.0, "lora_rank": 4, "lora_alpha": 8,
                     "max_sequence_length": WAN_TOKENS, "offload": True},
        "algorithm": {"name": "flow_grpo", "clip_low": 0.2, "kl_beta": 0.1, "noise_level": 0.9},
        "reward": {"name": "temporal_flicker"},
        "data": {"name": "prompt_file", "train_file": str(prompts), "eval_file": str(prompts)},
        "train": {"max_steps": 2, "prompts_per_step": 2, "group_size": 2, "minibatch_size": 2, "learning_rate": 1e-3},
        "eval": {"every": 2, "num_prompts": 2, "grid_size": 2, "metric": "temporal_flicker"},
        "checkpoint": {"every": 2, "keep_last": 1},
    }
    trainer = Trainer(config_mod.from_dict(raw))
    before = [p.detach().clone() for p in trainer.policy.trainable_parameters()]
    trainer.train()
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.policy.trainable_parameters()))
    run = tmp_path / "run"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    ratios = [r["train/ratio_mean"] for r in records if "train/ratio_mean" in r]
    assert ratios and ratios[0] == pytest.approx(1.0, abs=1e-4)
    clips = sorted(run.rglob("step_*_video/sample_*.mp4"))
    assert len(clips) >= 2
    with av.open(str(clips[0])) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert len(frames) == 5 and frames[0].shape == (32, 32, 3)
    assert list(run.rglob("step_*_video.png")) and list(run.rglob("step_*_video.html"))
