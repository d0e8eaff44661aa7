"""TempSamp-R1's off-policy ground-truth member (``algorithm.ground_truth_member``) on the tiny `qwen_vl` policy:
member 0 of each group decodes the prompt's ground truth, teacher-forced, and is rewarded, normalised and trained
like the sampled members."""

import math
from types import SimpleNamespace

import pytest
import torch

from mmgrpo import registry
from mmgrpo.algorithms.grpo import GRPO, GRPOConfig
from mmgrpo.components import check_plan, score_unit
from mmgrpo.types import PromptBatch
from algorithm_options import algo_config

G = 3  # sampled members; groups have G + 1
TRUTH = [{"completion": "<answer>42</answer>", "answer": "42"}, {"completion": "<answer>7</answer>", "answer": "7"}]


def _policy(request, max_new_tokens=24):
    from mmgrpo.pipelines.qwen_vl import QwenVLConfig, QwenVLPolicy

    path = request.getfixturevalue("tiny_qwen2_vl_dir")
    return QwenVLPolicy(QwenVLConfig(pretrained=path, max_new_tokens=max_new_tokens, lora_rank=4, lora_alpha=8))


def _batch():
    return PromptBatch(["how many circles?", "how many squares?"], metadata=[dict(t) for t in TRUTH]).repeat(G + 1)


def test_member_zero_decodes_the_ground_truth_and_replays_exactly(request):
    policy = _policy(request)
    algorithm = GRPO(algo_config(GRPOConfig, ground_truth_member=True, kl_beta=0.0))
    plan = algorithm.schedule(policy.num_steps)
    assert plan.features() == {"ground_truth_member"}
    batch = _batch()
    rollout = policy.sample(batch, plan, generator=torch.Generator().manual_seed(0))
    ids = rollout.trajectory["completion_ids"]
    targets = policy._target_ids([t["completion"] for t in TRUTH])
    for group in range(2):
        members = torch.nonzero(rollout.group_ids == group).flatten()
        assert len(members) == G + 1  # G samples and the answer
        truth, sampled = members[batch.member_ids[members] == 0], members[batch.member_ids[members] != 0]
        assert len(truth) == 1 and len(sampled) == G
        row, target = int(truth[0]), targets[group]
        assert ids[row, : len(target)].tolist() == target  # the ground truth's tokens, end-of-turn included
        assert rollout.mask[row].sum() == len(target) and rollout.outputs["texts"][row] == TRUTH[group]["completion"]
        assert all(rollout.outputs["texts"][int(r)] != TRUTH[group]["completion"] for r in sampled)
    # the recorded "old" log-probs of the answer are the sampling policy's on its tokens: those of a teacher-forced
    # rollout of the same texts, scored independently
    truth_rows = torch.nonzero(batch.member_ids == 0).flatten()
    forced = policy.teacher_rollout(batch.select(truth_rows), [t["completion"] for t in TRUTH])
    (unit,) = plan.train_units
    with torch.no_grad():
        teacher = policy.log_prob(forced, list(range(forced.mask.shape[1]))).log_prob
    for i, row in enumerate(truth_rows):
        n = int(forced.mask[i].sum())
        torch.testing.assert_close(rollout.old_log_probs[row, :n], teacher[i, :n], rtol=0, atol=1e-5)
    new, old, _ = score_unit(policy, algorithm, rollout, unit, torch.device("cpu"))
    torch.testing.assert_close(new.log_prob.detach()[new.mask], old[new.mask], rtol=0, atol=1e-5)  # ratio 1
    out = algorithm.loss(new, old, torch.zeros(len(rollout)))
    out.loss.backward()
    assert out.metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert all(p.grad is None or torch.count_nonzero(p.grad) == 0 for p in policy.trainable_parameters())


def test_the_answer_is_rewarded_and_its_advantage_follows_the_transform(request):
    """Rewards of G + 1 members, the answer's 1 among them; GRPO's advantages after TempSamp-R1's soft transform,
    computed by hand: tau + a_high log(r - tau + 1) above tau = 0.8, tau - (exp(a_low (tau - r)) - 1) / (e - 1) below,
    then (x - mean) / (unbiased std + 1e-4) per group."""
    policy = _policy(request)
    algorithm = GRPO(algo_config(GRPOConfig, ground_truth_member=True, advantage_transform="tempsamp_soft"))
    batch = _batch()
    rollout = policy.sample(batch, algorithm.schedule(policy.num_steps), generator=torch.Generator().manual_seed(1))
    reward = registry.get("reward", "accuracy")(registry.get("reward", "accuracy").Config())
    scores = reward(rollout.outputs, batch).scores
    assert scores[batch.member_ids == 0].tolist() == [1.0, 1.0]
    advantages = algorithm.advantages(scores, rollout.group_ids)

    def soft(r):
        return 0.8 + 0.01 * math.log(r - 0.8 + 1) if r >= 0.8 else 0.8 - (math.exp(0.8 - r) - 1) / (math.e - 1)

    for group in range(2):
        rows = [int(r) for r in torch.nonzero(rollout.group_ids == group).flatten()]
        shaped = [soft(float(scores[r])) for r in rows]
        mean = sum(shaped) / len(shaped)
        std = math.sqrt(sum((x - mean) ** 2 for x in shaped) / (len(shaped) - 1))
        expected = [(x - mean) / (std + 1e-4) for x in shaped]
        assert advantages[rows].tolist() == pytest.approx(expected, abs=1e-5)
        if any(float(scores[r]) < 1 for r in rows):  # the answer beats the samples that missed it
            assert float(advantages[rows[0]]) > 0


def test_missing_or_too_long_ground_truth_is_refused(request):
    policy = _policy(request, max_new_tokens=4)
    plan = GRPO(algo_config(GRPOConfig, ground_truth_member=True)).schedule(policy.num_steps)
    with pytest.raises(ValueError, match=r"more than the 4 of pipeline.max_new_tokens"):
        policy.sample(_batch(), plan)
    bare = PromptBatch(["how many circles?"]).repeat(2)
    with pytest.raises(ValueError, match=r"no ground-truth text in metadata\['completion'\]"):
        policy.sample(bare, plan)
    assert not GRPO(GRPOConfig()).schedule(4).features()  # off by default: plain sampling


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "dapo", "gspo", "sapo", "reg_grpo"])
def test_every_token_algorithm_has_the_option_and_mdlm_refuses_it(name):
    cls = registry.get("algorithm", name)
    algorithm = cls(algo_config(cls.Config, ground_truth_member=True))
    assert algorithm.schedule(4).ground_truth_member
    assert algorithm.traits.ground_truth_member and not cls(cls.Config()).traits.ground_truth_member  # declared
    with pytest.raises(ValueError, match="ground_truth_member: expected bool"):
        algo_config(cls.Config, ground_truth_member="yes")
    names = SimpleNamespace(algorithm=SimpleNamespace(name=name), pipeline=SimpleNamespace(name="mdlm"))
    policy_cls = registry.get("pipeline", "mdlm")
    holder = SimpleNamespace(num_steps=4, plan_families=policy_cls.plan_families,
                             plan_features=policy_cls.plan_features, provides=policy_cls.provides)
    with pytest.raises(ValueError, match=rf"algorithm '{name}' needs \['ground_truth_member'\]"):
        check_plan(holder, algorithm, names)


def test_a_plan_and_traits_that_disagree_on_the_member_are_refused_before_loading():
    """The trainer reads the member from ``traits.ground_truth_member`` (its ``reward/sampled_mean``), so an algorithm
    whose plan teacher-forces member 0 without declaring it, or the reverse, is refused."""
    import dataclasses

    policy_cls = registry.get("pipeline", "qwen_vl")
    names = SimpleNamespace(algorithm=SimpleNamespace(name="grpo"), pipeline=SimpleNamespace(name="qwen_vl"))
    holder = SimpleNamespace(num_steps=4, plan_families=policy_cls.plan_families,
                             plan_features=policy_cls.plan_features, provides=policy_cls.provides)
    for member in (True, False):
        algorithm = GRPO(algo_config(GRPOConfig, ground_truth_member=member))
        check_plan(holder, algorithm, names)  # consistent: accepted
        algorithm.traits = dataclasses.replace(algorithm.traits, ground_truth_member=not member)
        with pytest.raises(ValueError, match=f"declares traits.ground_truth_member={not member} but its plan"):
            check_plan(holder, algorithm, names)


def test_training_step_reports_the_sampled_members_reward_apart(tmp_path, tiny_qwen2_vl_dir):
    """`reward/mean` counts the ground-truth member (it scores 1 here); `reward/sampled_mean` is the mean over the
    policy's own answers alone, so its curve compares with a plain GRPO run's."""
    from mmgrpo import config as config_mod
    from mmgrpo.trainer import Trainer

    prompts, group = 2, G + 1
    raw = {
        "output_dir": str(tmp_path / "run"), "seed": 3,
        "pipeline": {"name": "qwen_vl", "pretrained": tiny_qwen2_vl_dir, "max_new_tokens": 64, "min_pixels": 3136,
                     "max_pixels": 3136, "lora_rank": 0},
        "algorithm": {"name": "grpo", "ground_truth_member": True},
        "reward": {"name": "accuracy", "mode": "numeric"},
        "data": {"name": "vlm_shapes", "n_train": 4, "n_eval": 2, "with_targets": True},
        "train": {"max_steps": 1, "prompts_per_step": prompts, "group_size": group, "minibatch_size": 8},
        "eval": {"every": 0}, "checkpoint": {"every": 0}, "tracking": {"log_with": []},
    }
    trainer = Trainer(config_mod.from_dict(raw))
    trainer.step = 1
    metrics = trainer.train_step()
    sampled = metrics["reward/sampled_mean"]
    # prompts ground truths score 1 each; the prompts * G sampled answers average `sampled`
    assert metrics["reward/mean"] == pytest.approx((prompts * 1.0 + prompts * G * sampled) / (prompts * group))
    assert sampled < metrics["reward/mean"]
    raw["algorithm"]["ground_truth_member"] = False
    raw["output_dir"] = str(tmp_path / "plain")
    plain = Trainer(config_mod.from_dict(raw))
    plain.step = 1
    assert "reward/sampled_mean" not in plain.train_step()
