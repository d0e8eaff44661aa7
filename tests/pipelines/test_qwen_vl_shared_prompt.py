"""``pipeline.share_prompt_forward`` of the Qwen-VL adapter (`pipelines/_qwen_vl_shared_prompt.py`) on tiny real-class
models: the first update's log-probs and gradients continued from sampling's prompt forward equal those of forwarding
the prompts again; the kept forward is taken once, by a gradient-enabled call outside the reference, and only while the
weights are unchanged; evaluation keeps none; trainer steps match the option off; and the option is refused, before any
weight loads, where it cannot apply."""

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mmgrpo import config as config_mod
from mmgrpo.algorithms.grpo import GRPO, GRPOConfig
from mmgrpo.components import score_unit
from mmgrpo.pipelines._qwen_vl_forward import GroupForward
from mmgrpo.pipelines.qwen_vl import QwenVLConfig
from mmgrpo.plans import TokenPlan
from mmgrpo.trainer import Trainer
from mmgrpo.validation import ConfigError
from algorithm_options import algo_config
from builders._qwen_vl_batches import scored_grads, vision_batch, vl_policy

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny" / "vlm_count.yaml"


def sampling_plan(pol) -> TokenPlan:
    return TokenPlan(num_steps=pol.num_steps, train_units=[list(range(pol.num_steps))])


def counted_prompt_forwards(monkeypatch) -> list[int]:
    """Counts the prompt forwards (`GroupForward.prompt_states` calls) from now on."""
    calls, original = [], GroupForward.prompt_states

    def counted(module, prefix):
        calls.append(1)
        return original(module, prefix)

    monkeypatch.setattr(GroupForward, "prompt_states", counted)
    return calls


def assert_same_scores(first, second) -> None:
    (values, grads), (values_again, grads_again) = first, second
    torch.testing.assert_close(values, values_again, rtol=0, atol=1e-6)
    assert grads.keys() == grads_again.keys() and grads
    for name, grad in grads.items():
        assert (grad - grads_again[name]).abs().max() <= 1e-6 * grads_again[name].abs().max() + 1e-8, name


@pytest.mark.parametrize("fixture", ["tiny_qwen2_vl_dir", "tiny_qwen2_5_vl_dir"])
@pytest.mark.parametrize("lora", [True, False])
def test_the_first_update_continues_sampling_prompt_forward_with_the_same_values(request, fixture, lora, monkeypatch):
    """Images (one and two per prompt) and video; LoRA, or full fine-tuning with the vision tower trained."""
    options = {} if lora else {"lora_rank": 0, "freeze_vision": False}
    pol = vl_policy(request, fixture, max_new_tokens=6, share_prompt_forward=True, **options)
    rollout = pol.sample(vision_batch(2), sampling_plan(pol), generator=torch.Generator().manual_seed(0))
    steps = list(range(pol.num_steps))
    calls = counted_prompt_forwards(monkeypatch)
    shared = scored_grads(pol, rollout, steps, shared=True)
    assert not calls and pol.shared_prompt.states is None  # no prompt forward: sampling's, taken once
    again = scored_grads(pol, rollout, steps, shared=True)
    assert len(calls) == 1  # the second call forwards the prompts itself
    assert_same_scores(shared, again)
    if not lora:
        assert any(".visual." in f".{name}" for name in shared[1])  # gradients reach the vision tower through it
    # the recorded log-probs replay at ratio 1 through the kept forward too
    pol.sample(vision_batch(2), sampling_plan(pol), generator=torch.Generator().manual_seed(0))
    replayed = pol.log_prob(rollout, steps)
    torch.testing.assert_close(replayed.log_prob.detach()[replayed.mask], rollout.old_log_probs[rollout.mask],
                               rtol=0, atol=1e-5)


def test_a_minibatch_of_some_groups_takes_its_rows(request, monkeypatch):
    pol = vl_policy(request, "tiny_qwen2_vl_dir", max_new_tokens=5, share_prompt_forward=True)
    rollout = pol.sample(vision_batch(3), sampling_plan(pol), generator=torch.Generator().manual_seed(1))
    sub = rollout.select(torch.tensor([7, 1, 0, 8]))  # the video prompt's group, then the first one's, mixed
    calls = counted_prompt_forwards(monkeypatch)
    shared = scored_grads(pol, sub, list(range(pol.num_steps)), shared=True)
    assert not calls
    assert_same_scores(shared, scored_grads(pol, sub, list(range(pol.num_steps)), shared=True))
    assert len(calls) == 1


def test_any_minibatch_takes_the_kept_rows_with_the_recomputed_values(request, monkeypatch):
    """Property: whatever rows (and order) a minibatch holds, continuing from sampling's forward gives the log-probs of
    forwarding its prompts again."""
    pol = vl_policy(request, "tiny_qwen2_5_vl_dir", max_new_tokens=4, share_prompt_forward=True)
    plan, steps = sampling_plan(pol), list(range(4))
    calls = counted_prompt_forwards(monkeypatch)

    @settings(derandomize=True, max_examples=12, deadline=None, database=None)
    @given(st.lists(st.integers(0, 8), min_size=1, max_size=9, unique=True), st.integers(0, 2**31 - 1))
    def check(rows, seed):
        rollout = pol.sample(vision_batch(3), plan, generator=torch.Generator().manual_seed(seed))  # 9 samples
        sub = rollout.select(torch.tensor(rows))
        before = len(calls)
        kept = pol.log_prob(sub, steps).log_prob
        assert len(calls) == before and pol.shared_prompt.states is None  # taken: no prompt forward
        again = pol.log_prob(sub, steps).log_prob
        assert len(calls) == before + 1
        torch.testing.assert_close(kept, again, rtol=0, atol=1e-6)

    check()


def test_the_kept_forward_is_not_taken_after_the_weights_change_nor_outside_a_training_call(request, monkeypatch):
    pol = vl_policy(request, "tiny_qwen2_vl_dir", max_new_tokens=5, share_prompt_forward=True)
    plan, steps = sampling_plan(pol), list(range(5))
    calls = counted_prompt_forwards(monkeypatch)
    rollout = pol.sample(vision_batch(2), plan, generator=torch.Generator().manual_seed(2))
    assert len(calls) == 1 and pol.shared_prompt.states is not None
    with torch.no_grad():  # the recompute of old log-probs: no gradients, nothing taken
        pol.log_prob(rollout, steps)
    with torch.no_grad(), pol.reference():  # the reference pass
        pol.log_prob(rollout, steps)
    assert len(calls) == 3 and pol.shared_prompt.states is not None
    with torch.no_grad():  # an optimizer step's in-place update
        for param in pol.trainable_parameters():
            param.add_(0.01)
    updated = pol.log_prob(rollout, steps).log_prob
    assert len(calls) == 4 and pol.shared_prompt.states is None  # forwarded again, the stale forward dropped
    torch.testing.assert_close(updated, pol.log_prob(rollout, steps).log_prob, rtol=0, atol=0)
    # another rollout's prompts (other objects) are never matched with the kept ones
    pol.sample(vision_batch(2), plan, generator=torch.Generator().manual_seed(2))
    pol.log_prob(rollout, steps)
    assert len(calls) == 7 and pol.shared_prompt.states is None


def test_evaluation_and_gradient_free_sampling_keep_nothing(request):
    pol = vl_policy(request, "tiny_qwen2_vl_dir", max_new_tokens=4, share_prompt_forward=True)
    greedy = TokenPlan(num_steps=4, train_units=[[0, 1, 2, 3]], greedy=True)
    pol.sample(vision_batch(2), greedy, generator=torch.Generator().manual_seed(0))
    assert pol.shared_prompt.states is None
    with torch.no_grad():
        pol.sample(vision_batch(2), sampling_plan(pol), generator=torch.Generator().manual_seed(0))
    assert pol.shared_prompt.states is None


def test_option_off_keeps_nothing_and_samples_the_same(request):
    pol = vl_policy(request, "tiny_qwen2_vl_dir", max_new_tokens=6, lora_rank=0)
    off = pol.sample(vision_batch(2), sampling_plan(pol), generator=torch.Generator().manual_seed(4))
    assert pol.shared_prompt.states is None
    pol.config.share_prompt_forward = True
    on = pol.sample(vision_batch(2), sampling_plan(pol), generator=torch.Generator().manual_seed(4))
    assert torch.equal(on.trajectory["completion_ids"], off.trajectory["completion_ids"])
    torch.testing.assert_close(on.old_log_probs, off.old_log_probs, rtol=0, atol=1e-6)
    algorithm = GRPO(algo_config(GRPOConfig, kl_beta=0.04))
    new, old, _ = score_unit(pol, algorithm, on, list(range(6)), torch.device("cpu"))
    assert algorithm.loss(new, old, torch.ones(len(on)), None).metrics["ratio_mean"] == pytest.approx(1, abs=1e-6)


def test_trainer_steps_match_the_option_off(tmp_path):
    """The shipped VLM default (full fine-tuning, vision trained) with a KL term (the reference pass runs between):
    4 prompts x 2, two minibatches per update (the first continues sampling's forward), 3 steps."""
    records = {}
    for share in (False, True):
        overrides = [f"output_dir={tmp_path / str(share)}", f"pipeline.share_prompt_forward={str(share).lower()}",
                     "train.prompts_per_step=4", "train.group_size=2", "train.minibatch_size=4",
                     "train.updates_per_step=1", "train.max_steps=3", "train.max_seconds=0", "algorithm.kl_beta=0.04",
                     "data.n_eval=1", "eval.every=0", "checkpoint.every=0"]
        Trainer(config_mod.load(str(CONFIG), overrides)).train()
        lines = (tmp_path / str(share) / "metrics.jsonl").read_text().splitlines()
        records[share] = [json.loads(line) for line in lines if "train/grad_norm" in line]
    assert len(records[True]) == len(records[False]) == 3
    for off, on in zip(records[False], records[True]):
        assert on["reward/mean"] == off["reward/mean"]
        for key in ("train/grad_norm", "train/kl", "train/policy_loss", "train/ratio_mean"):
            assert on[key] == pytest.approx(off[key], rel=1e-5, abs=1e-6), key


def test_option_refused_where_it_cannot_apply(request, monkeypatch):
    model = request.getfixturevalue("tiny_qwen2_vl_dir")
    with pytest.raises(ConfigError, match="share_prompt_forward needs prefix_sharing: true"):
        QwenVLConfig(pretrained=model, share_prompt_forward=True, prefix_sharing=False)
    with pytest.raises(ConfigError, match="share_prompt_forward takes the families"):
        QwenVLConfig(pretrained=request.getfixturevalue("tiny_qwen3_5_dir"), share_prompt_forward=True)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="share_prompt_forward runs in one process; this launch has 2"):
        QwenVLConfig(pretrained=model, share_prompt_forward=True)
    monkeypatch.setenv("WORLD_SIZE", "1")
    QwenVLConfig(pretrained=model, share_prompt_forward=True)
