"""How an update's loss is normalised and batched where a peer's option is named: TRL's ``loss_type="dapo"`` (every
update of a rollout batch divides its token sum by the token count of the whole rollout batch) and Flow-GRPO's filter
of zero-advantage samples before batching. Each against the peer's rule written out (/ the worked examples of the
notes they come from), through the real trainer on tiny real models."""

from pathlib import Path

import pytest
import torch

from mmgrpo import config as config_mod, updates
from mmgrpo.advantages import kept_samples
from mmgrpo.trainer import Trainer


def make_trainer(tmp_path, pipeline, algorithm, reward, data, **train):
    """A trainer whose optimizer leaves the weights as they are (lr 1e-30, no clipping), so every update of a step
    sees the same weights and its gradient can be compared with one computed by hand."""
    return Trainer(config_mod.from_dict({
        "output_dir": str(tmp_path / "run"), "seed": 0, "pipeline": pipeline, "algorithm": algorithm,
        "reward": reward, "data": data, "checkpoint": {"every": 0},
        "train": {"learning_rate": 1e-30, "weight_decay": 0.0, "max_grad_norm": 1e6, **train},
    }))


def record_updates(trainer, monkeypatch):
    """Records the gradient of every optimizer update the trainer takes and the minibatches it was made of."""
    grads, groups = [], []
    step, accumulate = trainer.optimizer.step, updates.accumulate

    def recording_step(*args, **kwargs):
        grads.append([p.grad.clone() for p in trainer.policy.trainable_parameters()])
        return step(*args, **kwargs)

    def recording_accumulate(run, rollout, units, group, *args):
        groups.append([index.clone() for index in group])
        return accumulate(run, rollout, units, group, *args)

    trainer.optimizer.step = recording_step
    monkeypatch.setattr(updates, "accumulate", recording_accumulate)
    return grads, groups


def gradient_of(trainer, loss):
    trainer.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grads = [p.grad.clone() for p in trainer.policy.trainable_parameters()]
    trainer.optimizer.zero_grad(set_to_none=True)
    return grads


def assert_close(ours, expected):
    scale = max(float(b.abs().max()) for b in expected)
    assert scale > 0
    for a, b in zip(ours, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * scale)


def rollout_of(trainer, prompts, group_size):
    batch = trainer.stream.next_batch(prompts).repeat(group_size, first_group_id=0)
    plan = trainer.algorithm.schedule(trainer.policy.num_steps, torch.Generator().manual_seed(0))
    return trainer.policy.sample(batch, plan, generator=torch.Generator().manual_seed(1)), plan


# --------------------------------------------------------------------------------- TRL's loss_type="dapo"
# the notes' worked example, token counts divided by 10: 2 updates x 2 minibatches of 2 samples, [[3, 5], [4, 8]]
# tokens per minibatch (N_gen = 20): TRL scales every minibatch's token sum by 1 / 20, the update's own count by 1 / 8
# and 1 / 12
LENGTHS = [1, 2, 2, 3, 2, 2, 4, 4]
MINIBATCHES = [[torch.tensor([0, 1]), torch.tensor([2, 3])], [torch.tensor([4, 5]), torch.tensor([6, 7])]]


def dapo_trainer(tmp_path, tiny_qwen2_vl_dir, **algorithm):
    examples = Path(__file__).resolve().parents[2] / "data" / "examples" / "vlm" / "count.jsonl"
    return make_trainer(tmp_path, {"name": "qwen_vl", "pretrained": tiny_qwen2_vl_dir, "max_new_tokens": 6},
                        {"name": "dapo", **algorithm}, {"name": "accuracy", "mode": "numeric"},
                        {"name": "vlm_jsonl", "train_file": str(examples), "eval_file": str(examples)},
                        prompts_per_step=2, group_size=4, minibatch_size=2, updates_per_step=2)


def token_sums(trainer, rollout, unit, adv):
    """TRL's per-token loss ``-min(r A, clip(r, 0.8, 1.28) A)`` summed over each sample's tokens `[n]`."""
    new = trainer.policy.log_prob(rollout, unit)
    ratio = torch.exp(new.log_prob - rollout.old_log_probs[:, unit])
    per_token = -torch.min(ratio * adv[:, None], torch.clamp(ratio, 0.8, 1.28) * adv[:, None])
    return (per_token * new.mask.float()).sum(1)


def test_dapo_divides_every_update_by_the_rollout_batchs_token_count(tmp_path, tiny_qwen2_vl_dir):
    """TRL's rule: update u's loss is ``S_u / N_gen`` (S_u its token sum, N_gen the rollout batch's token count, zero
    advantages included), not ``S_u / N_u``; ``token_mean: update`` is the latter."""
    trainer = dapo_trainer(tmp_path, tiny_qwen2_vl_dir)
    assert trainer.algorithm.traits.update_mean == "rollout_entries"
    rollout, plan = rollout_of(trainer, 2, 4)
    rollout.mask[:] = False
    for row, length in enumerate(LENGTHS):
        rollout.mask[row, :length] = True
    unit = plan.train_units[0]
    adv = torch.tensor([1.0, -0.5, 0.0, 0.8, -1.2, 0.4, 0.3, -0.9])  # a zero advantage: counted all the same
    everyone = torch.ones(8, dtype=torch.bool)
    n_gen = updates.count_rollout_entries(trainer, rollout, plan.train_units)
    assert n_gen == 20.0
    for update, own in zip(MINIBATCHES, [8, 12]):
        trainer.optimizer.zero_grad(set_to_none=True)
        updates.accumulate(trainer, rollout, plan.train_units, update, everyone, adv, n_gen)
        ours = [p.grad.clone() for p in trainer.policy.trainable_parameters()]
        members = torch.cat(update)
        assert int(rollout.mask[members].sum()) == own
        assert_close(ours, gradient_of(trainer, token_sums(trainer, rollout, unit, adv)[members].sum() / 20))
        own_count = gradient_of(trainer, token_sums(trainer, rollout, unit, adv)[members].sum() / own)
        assert max(float((a - b).abs().max()) for a, b in zip(ours, own_count)) > 0.1 * max(
            float(b.abs().max()) for b in own_count)


def test_dapo_step_takes_trls_updates(tmp_path, tiny_qwen2_vl_dir, monkeypatch):
    """Through the trainer's own step: the sum of the two updates' gradients is the gradient of the rollout batch's
    token sum over its token count (TRL), whatever the minibatches; with ``token_mean: update`` each update is its own
    token mean instead."""
    results = {}
    for token_mean in ("rollout", "update"):
        trainer = dapo_trainer(tmp_path / token_mean, tiny_qwen2_vl_dir, token_mean=token_mean)
        rollout, plan = rollout_of(trainer, 2, 4)
        rollout.mask[:] = False
        for row, length in enumerate(LENGTHS):
            rollout.mask[row, :length] = True
        adv = torch.tensor([1.0, -0.5, 0.0, 0.8, -1.2, 0.4, 0.3, -0.9])
        grads, groups = record_updates(trainer, monkeypatch)
        trainer.update(rollout, plan, adv, torch.ones(8, dtype=torch.bool), torch.Generator().manual_seed(2))
        assert len(grads) == 2 and [len(g) for g in groups] == [2, 2]
        sums = token_sums(trainer, rollout, plan.train_units[0], adv)  # [8]
        if token_mean == "rollout":
            expected = gradient_of(trainer, sums.sum() / 20)
        else:
            members = [torch.cat(g) for g in groups]
            expected = gradient_of(trainer, sum(sums[m].sum() / rollout.mask[m].sum() for m in members))
        assert_close([a + b for a, b in zip(*grads)], expected)
        results[token_mean] = grads
    gap = max(float((a - b).abs().max()) for a, b in zip(results["rollout"][0], results["update"][0]))
    assert gap > 0.1 * max(float(b.abs().max()) for b in results["update"][0])  # the two rules differ


# ------------------------------------------------------------------------ Flow-GRPO's zero-advantage filter
# the notes' worked example: one process, 8 samples in 2 minibatches (2 updates); group A's rewards 0.2 .. 0.8,
# group B's all 0.5; with the batch std (global_std) A's advantages are +-1.896167, +-0.632056 and B's 0
REWARDS = torch.tensor([0.2, 0.4, 0.6, 0.8, 0.5, 0.5, 0.5, 0.5])
GROUPS = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])


def test_kept_samples_follow_flow_grpos_rule():
    adv = torch.tensor([-1.9, -0.6, 0.6, 1.9, 0.0, 0.0, 0.0, 0.0])
    assert kept_samples(adv, 2).tolist() == [0, 1, 2, 3]  # 4 kept split into 2: nothing put back
    three = torch.tensor([-1.9, 0.0, 0.6, 1.9, 0.0, 0.0, 0.0, 0.0])
    kept = kept_samples(three, 2, torch.Generator().manual_seed(0))  # 3 kept: one dropped sample put back
    assert len(kept) == 4 and {0, 2, 3} <= set(kept.tolist())
    drawn = {tuple(kept_samples(three, 2, torch.Generator().manual_seed(s)).tolist()) for s in range(20)}
    assert len(drawn) > 1  # the one put back is drawn at random
    assert kept_samples(torch.zeros(8), 2).tolist() == list(range(8))  # none kept: all (the authors' Wan rule)


def flow_trainer(tmp_path, tiny_sd3_dir, drop):
    prompts = tmp_path / "prompts.txt"
    prompts.parent.mkdir(parents=True, exist_ok=True)
    prompts.write_text("a red circle\na blue square\n")
    return make_trainer(tmp_path, {"name": "sd3", "pretrained": tiny_sd3_dir, "resolution": 32, "num_steps": 3,
                                   "guidance_scale": 1.0, "lora_rank": 4, "max_sequence_length": 16},
                        {"name": "flow_grpo", "clip_low": 0.2, "scale_rewards": "batch", "drop_zero_advantage": drop},
                        {"name": "jpeg"}, {"name": "prompt_file", "train_file": str(prompts)},
                        prompts_per_step=2, group_size=4, minibatch_size=4, updates_per_step=2)


def test_flow_grpo_drops_zero_advantages_before_batching(tmp_path, tiny_sd3_dir, monkeypatch):
    """The authors' filter: the kept samples of group A fill both minibatches (2 each) and each update averages over
    them, so the step's gradient is twice the one of keeping group B's samples at advantage 0 (4 per minibatch)."""
    adv_expected = [-1.896167, -0.632056, 0.632056, 1.896167, 0.0, 0.0, 0.0, 0.0]
    steps = {}
    for drop in (True, False):
        trainer = flow_trainer(tmp_path / str(drop), tiny_sd3_dir, drop)
        assert trainer.algorithm.traits.drop_zero_advantage == drop
        adv = trainer.algorithm.advantages(REWARDS, GROUPS)
        torch.testing.assert_close(adv, torch.tensor(adv_expected), rtol=0, atol=2e-6)
        rollout, plan = rollout_of(trainer, 2, 4)
        grads, groups = record_updates(trainer, monkeypatch)
        with_signal = torch.ones(8, dtype=torch.bool)
        trainer.update(rollout, plan, adv, with_signal, torch.Generator().manual_seed(3))
        assert len(grads) == 2
        assert all(len(g) == 1 for g in groups)  # one minibatch per update
        sizes = [len(g[0]) for g in groups]
        assert sizes == ([2, 2] if drop else [4, 4])
        if drop:
            assert sorted(torch.cat([g[0] for g in groups]).tolist()) == [0, 1, 2, 3]  # group B left out
        steps[drop] = [a + b for a, b in zip(*grads)]
        if drop:  # by hand: each kept sample's mean loss over the trained steps, weighed 1 / 2 (its minibatch's size)
            def kept_loss():
                total = 0.0
                for unit in plan.train_units:
                    new = trainer.policy.log_prob(rollout.select(torch.arange(4)), unit)
                    ratio = torch.exp(new.log_prob - rollout.old_log_probs[:4, unit])
                    a = adv[:4, None]
                    per = torch.maximum(-a * ratio, -a * torch.clamp(ratio, 0.8, 1.2))  # [4, 1]
                    total = total + per.sum() / 2 / len(plan.train_units)
                return total

            assert_close(steps[drop], gradient_of(trainer, kept_loss()))
    assert_close(steps[True], [2 * g for g in steps[False]])


@pytest.mark.parametrize("scale, expected", [
    ("group", [-1.341041, -0.447014, 0.447014, 1.341041]),  # the group's population std (the authors' Wan config)
    ("batch", [-1.896167, -0.632056, 0.632056, 1.896167]),  # np.std of all 8 + 1e-4 = 0.158213883 (SD3.5 configs)
])
def test_flow_grpo_advantages_match_the_authors_global_std(scale, expected):
    from algorithm_options import algo_config
    from mmgrpo.algorithms.flow_grpo import FlowGRPO, FlowGRPOConfig

    adv = FlowGRPO(algo_config(FlowGRPOConfig, scale_rewards=scale)).advantages(REWARDS, GROUPS)
    torch.testing.assert_close(adv, torch.tensor(expected + [0.0] * 4), rtol=0, atol=2e-6)
