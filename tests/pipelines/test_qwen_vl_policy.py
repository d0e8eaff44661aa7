"""The Qwen2-VL / Qwen2.5-VL adapter on tiny real-class models saved and reloaded with `from_pretrained`: the
prefix-shared group forward equals the naive one (log-probs and gradients; several images, video), replay, vision
tokens never sampled, LoRA reference unchanged by training, checkpoints, greedy evaluation."""

from functools import partial

import pytest
import torch

from mmgrpo.algorithms.grpo import GRPO, GRPOConfig
from mmgrpo.pipelines.qwen_vl import QwenVLConfig, QwenVLPolicy
from mmgrpo.components import score_unit
from mmgrpo.plans import TokenPlan
from algorithm_options import algo_config
from builders._qwen_vl_batches import scored_grads, vision_batch, vl_policy

KINDS = ["tiny_qwen2_vl_dir", "tiny_qwen2_5_vl_dir"]


policy = partial(vl_policy, max_new_tokens=8)


def token_plan(policy):
    return GRPO(GRPOConfig()).schedule(policy.num_steps)


@pytest.mark.parametrize("fixture", KINDS)
@pytest.mark.parametrize("lora", [True, False])
def test_prefix_shared_forward_equals_naive(request, fixture, lora):
    """Images (one and two per prompt) and video; LoRA, or full fine-tuning with the vision tower trained."""
    options = {} if lora else {"lora_rank": 0, "freeze_vision": False}
    pol = policy(request, fixture, **options)
    rollout = pol.sample(vision_batch(3), token_plan(pol), generator=torch.Generator().manual_seed(0))
    steps = list(range(pol.num_steps))
    shared, shared_grads = scored_grads(pol, rollout, steps, shared=True)
    naive, naive_grads = scored_grads(pol, rollout, steps, shared=False)
    torch.testing.assert_close(shared, naive, rtol=0, atol=1e-5)
    assert shared_grads.keys() == naive_grads.keys() and shared_grads
    if not lora:
        assert any(".visual." in f".{name}" for name in shared_grads)  # gradients reach the (shared) vision tower
    for name, grad in shared_grads.items():  # equal up to float32 summation order, relative to the tensor's scale
        assert (grad - naive_grads[name]).abs().max() <= 1e-5 * naive_grads[name].abs().max() + 1e-7, name


@pytest.mark.parametrize("fixture", KINDS)
def test_replay_ratio_one_and_zero_advantage_zero_gradient(request, fixture):
    pol = policy(request, fixture)
    algorithm = GRPO(algo_config(GRPOConfig, kl_beta=0.04))
    plan = token_plan(pol)
    rollout = pol.sample(vision_batch(2), plan, generator=torch.Generator().manual_seed(1))
    assert rollout.old_log_probs.shape == rollout.mask.shape == (6, pol.num_steps)
    assert len(rollout.outputs["texts"]) == 6 and all(isinstance(t, str) for t in rollout.outputs["texts"])
    assert (rollout.old_log_probs[~rollout.mask] == 0).all() and (rollout.old_log_probs[rollout.mask] < 0).all()
    new, old, ref = score_unit(pol, algorithm, rollout, plan.train_units[0], torch.device("cpu"))
    mask = new.mask
    torch.testing.assert_close(new.log_prob.detach()[mask], old[mask], rtol=0, atol=1e-5)
    torch.testing.assert_close(ref.log_prob[mask], old[mask], rtol=0, atol=1e-5)  # LoRA B starts at 0
    out = algorithm.loss(new, old, torch.zeros(6), ref)
    assert out.metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    out.loss.backward()
    assert all(p.grad is None or torch.count_nonzero(p.grad) == 0 for p in pol.trainable_parameters())


@pytest.mark.parametrize("fixture", KINDS)
def test_vision_tokens_are_never_sampled(request, fixture):
    pol = policy(request, fixture, max_new_tokens=6)
    vocab = pol.processor.tokenizer.get_vocab()
    banned = [vocab[t] for t in ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")]
    with torch.no_grad():
        pol.model.lm_head.weight[banned] = pol.model.lm_head.weight[banned].sign() * 50  # make them very likely
    rollout = pol.sample(vision_batch(2), token_plan(pol), generator=torch.Generator().manual_seed(2))
    assert not torch.isin(rollout.trajectory["completion_ids"], torch.tensor(banned)).any()
    # and replay still works (a sampled vision token would break the next forward)
    out = pol.log_prob(rollout, list(range(pol.num_steps)))
    torch.testing.assert_close(out.log_prob.detach()[out.mask], rollout.old_log_probs[rollout.mask], rtol=0, atol=1e-5)


@pytest.mark.parametrize("fixture", KINDS)
def test_lora_reference_unchanged_after_a_step(request, fixture, tmp_path):
    pol = policy(request, fixture)
    plan = token_plan(pol)
    rollout = pol.sample(vision_batch(2), plan, generator=torch.Generator().manual_seed(3))
    steps = plan.train_units[0]
    base = {n: p.detach().clone() for n, p in pol.model.named_parameters() if not p.requires_grad}
    with torch.no_grad(), pol.reference():
        ref_before = pol.log_prob(rollout, steps).log_prob
    optimizer = torch.optim.Adam(pol.trainable_parameters(), lr=1e-2)
    algorithm = GRPO(algo_config(GRPOConfig, kl_beta=0.0))
    new = pol.log_prob(rollout, steps)
    algorithm.loss(new, rollout.old_log_probs, torch.tensor([1.0, -1.0] * 3), None).loss.backward()
    optimizer.step()
    with torch.no_grad():
        after = pol.log_prob(rollout, steps).log_prob
        with pol.reference():
            ref_after = pol.log_prob(rollout, steps).log_prob
    assert (after - rollout.old_log_probs).abs().max() > 1e-4  # the policy moved
    torch.testing.assert_close(ref_after, ref_before, rtol=0, atol=0)  # the reference did not
    assert all(torch.equal(p, base[n]) for n, p in pol.model.named_parameters() if n in base)
    assert pol.trainable_parameters()  # still trainable after leaving the reference context
    # checkpoint round trip: a fresh policy with the saved adapter scores the same
    pol.save_pretrained(str(tmp_path / "ckpt"))
    fresh = policy(request, fixture)
    fresh.load_trainable(str(tmp_path / "ckpt"))
    with torch.no_grad():
        torch.testing.assert_close(fresh.log_prob(rollout, steps).log_prob, after, rtol=0, atol=1e-6)


def test_greedy_evaluation_and_input_size(request):
    pol = policy(request, "tiny_qwen2_5_vl_dir", max_new_tokens=5)
    batch = vision_batch(1)
    batch.group_ids = torch.arange(len(batch))
    plan = TokenPlan.deterministic(pol.eval_num_steps)
    first = pol.sample(batch, plan)
    second = pol.sample(batch, plan, generator=torch.Generator().manual_seed(9))
    assert first.outputs["texts"] == second.outputs["texts"]
    assert batch.metadata[0]["input_size"] == [112, 84]  # 100 x 80 resized to the 28-pixel grid within max_pixels
    # a mask stops after the end-of-turn token
    for row, ids in zip(first.mask, first.trajectory["completion_ids"]):
        ended = torch.isin(ids[row], torch.tensor(pol.stop_ids))
        assert not ended[:-1].any()


def test_wrong_model_type_is_a_clear_error(request):
    with pytest.raises(ValueError, match="qwen_vl pipeline takes"):
        QwenVLPolicy(QwenVLConfig(pretrained=request.getfixturevalue("tiny_mdlm_dir")))
