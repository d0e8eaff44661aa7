"""Masked-diffusion LM policy (`mdlm`), its decoding math, CJ-GRPO's exact replay and diffu-GRPO's estimator."""

import dataclasses
import json
import math

import pytest
import torch

from mmgrpo.algorithms.cj_grpo import CJGRPO, CJGRPOConfig
from mmgrpo.algorithms.diffu_grpo import DiffuGRPO, DiffuGRPOConfig
from mmgrpo.samplers.masked_diffusion import ass_sizes, eoser_gamma, linear_sizes, make_schedule, unmask_step
from mmgrpo.components import score_unit
from mmgrpo.types import PromptBatch
from algorithm_options import algo_config

PROMPTS = ["12+34=", "7+8=", "305+9="]  # different lengths: left padding and an attention mask are exercised


def _policy(path, **overrides):
    from mmgrpo.pipelines.mdlm import MDLMConfig, MDLMPolicy

    options = dict(pretrained=path, gen_length=8, block_length=4, steps_per_block=2, lora_rank=4, lora_alpha=8)
    return MDLMPolicy(MDLMConfig(**{**options, **overrides}))


def _rollout(policy, algorithm, seed=1):
    plan = algorithm.schedule(policy.num_steps, torch.Generator().manual_seed(0))
    batch = PromptBatch(PROMPTS).repeat(2)
    return plan, policy.sample(batch, plan, generator=torch.Generator().manual_seed(seed))


def test_tiny_model_is_bidirectional(tiny_mdlm_dir):
    policy = _policy(tiny_mdlm_dir)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    changed = ids.clone()
    changed[0, -1] = 11  # a later token ...
    with torch.no_grad():
        first, second = policy.logits(ids, None), policy.logits(changed, None)
    finite = torch.isfinite(first[0, 0])  # the mask token's logit is -inf by design
    assert (first[0, 0] - second[0, 0])[finite].abs().max() > 1e-4  # ... changes the first position's logits


def test_dream_shift_aligns_logits(tiny_mdlm_dir):
    plain, shifted = _policy(tiny_mdlm_dir), _policy(tiny_mdlm_dir, shift_logits=True)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        a, b = plain.logits(ids, None), shifted.logits(ids, None)
    torch.testing.assert_close(b[:, 1:], a[:, :-1], rtol=0, atol=0)  # logit j - 1 predicts token j
    torch.testing.assert_close(b[:, 0], a[:, 0], rtol=0, atol=0)


@pytest.mark.parametrize("length", [1, 2, 3, 7, 8, 9, 31, 32, 64, 100, 256])
def test_ass_commits_powers_of_two_in_log_steps(length):
    sizes = ass_sizes(length)
    assert len(sizes) == math.ceil(math.log2(length + 1)) and sum(sizes) == length
    assert sizes[:-1] == [2**i for i in range(len(sizes) - 1)] and 1 <= sizes[-1] <= 2 ** (len(sizes) - 1)


def test_fixed_and_block_schedules():
    assert linear_sizes(10, 4) == [3, 3, 2, 2]
    schedule = make_schedule(8, 4, 2, "fixed")
    assert schedule.block_of_step == [0, 0, 1, 1] and schedule.tokens_per_step == [2, 2, 2, 2]
    assert make_schedule(8, 4, 2, "ass").tokens_per_step == [1, 2, 1, 1, 2, 1]
    with pytest.raises(ValueError, match="multiple of block_length"):
        make_schedule(10, 4, 2, "fixed")
    assert eoser_gamma(0, 5, 0.4, 1.0, "linear") == pytest.approx(0.4) and eoser_gamma(4, 5, 0.4, 1.0, "linear") == 1.0
    assert eoser_gamma(2, 3, 0.0 + 1e-9, 1.0, "power") == pytest.approx(7 / 8)


def test_pipeline_ass_rollout_commits_1_2_4(tiny_mdlm_dir):
    policy = _policy(tiny_mdlm_dir, gen_length=15, block_length=None, schedule="ass")
    assert policy.num_steps == 4
    _, rollout = _rollout(policy, CJGRPO(CJGRPOConfig()))
    per_step = torch.stack([(rollout.trajectory["commit_step"] == s).sum(1) for s in range(4)], 1)  # [N, S]
    assert (per_step == torch.tensor([1, 2, 4, 8])).all()


def test_eoser_rejects_early_eos_without_changing_log_probs():
    eos = 2
    logits = torch.full((1, 4, 6), -4.0)  # [n, T, V]
    logits[0, :3, 4] = 1.0  # three ordinary positions, moderately confident
    logits[0, 3, eos] = 3.0  # the last position is a confident EOS
    state = torch.full((1, 4), 5)
    candidates = torch.ones(1, 4, dtype=torch.bool)
    kwargs = dict(temperature=0.0, remasking="low_confidence", eos_ids=[eos])
    plain = unmask_step(logits, state, candidates, 1, **kwargs)
    damped = unmask_step(logits, state, candidates, 1, eos_gamma=eoser_gamma(0, 4, 0.01, 1.0, "linear"), **kwargs)
    assert plain.committed[0, 3] and plain.state[0, 3] == eos  # the EOS trap without EOSER
    assert not damped.committed[0, 3] and damped.committed.sum() == 1  # EOSER commits a non-EOS token first
    torch.testing.assert_close(plain.log_prob, damped.log_prob, rtol=0, atol=0)


class _EOSTrap(torch.nn.Module):
    """Wraps a model so that EOS is the confident prediction at the last `tail` positions (LLaDA's "EOS trap")."""

    def __init__(self, inner, eos: int, tail: int):
        super().__init__()
        self.inner, self.eos, self.tail = inner, eos, tail

    def forward(self, input_ids, **kwargs):
        logits = self.inner(input_ids=input_ids, **kwargs).logits.clone()
        logits[:, -self.tail:, self.eos] += 8.0
        return (logits,)


def test_eoser_in_rollout_delays_eos(tiny_mdlm_dir):
    """With EOS the most confident token at the tail, step 0 commits an EOS without EOSER and a non-EOS with it,
    for as long as EOS's scaled confidence stays below the others'."""
    def first_steps(eoser):
        policy = _policy(tiny_mdlm_dir, gen_length=8, block_length=None, steps_per_block=8, eoser=eoser,
                         eoser_gamma_min=0.01, temperature=0.0, eos_token_ids=[9])
        policy.forward = _EOSTrap(policy.model, eos=9, tail=4)  # 9: never the random model's own top prediction
        r = policy.sample(PromptBatch(PROMPTS).repeat(2), CJGRPO(CJGRPOConfig()).schedule(8),
                          generator=torch.Generator().manual_seed(0))
        completion, commit = r.trajectory["completion"], r.trajectory["commit_step"]
        return [int(((completion == 9) & (commit == s)).sum()) for s in range(2)]

    assert first_steps(False) == [6, 6]  # every row commits EOS first
    # EOSER: at step 0 EOS's scaled confidence (0.01 * 0.99) is below the other tokens' (~0.055): a non-EOS token is
    # committed; at step 1 the factor is 0.15 and EOS (0.15) beats them again, so it is committed
    assert first_steps(True) == [0, 6]


@pytest.mark.parametrize("block", ["semi_ar", "full"])
@pytest.mark.parametrize("eoser", [False, True])
@pytest.mark.parametrize("schedule", ["fixed", "ass"])
@pytest.mark.parametrize("remasking", ["low_confidence", "random"])
def test_cj_replay_is_exact(tiny_mdlm_dir, block, eoser, schedule, remasking):
    policy = _policy(tiny_mdlm_dir, block_length=4 if block == "semi_ar" else None, eoser=eoser, schedule=schedule,
                     remasking=remasking, steps_per_block=2 if block == "semi_ar" else 4, temperature=1.0)
    plan, rollout = _rollout(policy, CJGRPO(CJGRPOConfig()))
    commit = rollout.trajectory["commit_step"]
    assert (commit >= 0).all() and (commit < policy.num_steps).all()  # every token committed exactly once
    sizes = torch.tensor(policy.config.decoding.tokens_per_step)
    assert (torch.stack([(commit == s).sum(1) for s in range(policy.num_steps)], 1) == sizes).all()
    replay = policy.log_prob(rollout, list(range(policy.num_steps)))
    assert torch.equal(replay.log_prob.detach(), rollout.old_log_probs)  # difference 0, CPU fp32
    per_token = (replay.token_log_prob.detach() * replay.token_mask).sum(1)  # [N, L]: each token at its step
    assert torch.equal(per_token, rollout.trajectory["token_log_probs"])


def test_replay_of_a_minibatch_and_reference(tiny_mdlm_dir):
    policy = _policy(tiny_mdlm_dir)
    algorithm = CJGRPO(algo_config(CJGRPOConfig, kl_beta=0.04))
    plan, rollout = _rollout(policy, algorithm)
    sub = rollout.select(torch.tensor([4, 1]))
    new, old, ref = score_unit(policy, algorithm, sub, [1], torch.device("cpu"))
    torch.testing.assert_close(new.log_prob.detach(), old, rtol=0, atol=1e-5)
    torch.testing.assert_close(ref.token_log_prob, new.token_log_prob.detach(), rtol=0, atol=1e-6)  # LoRA B = 0
    for p in policy.trainable_parameters():  # move the policy: the reference must not move with it
        p.data.add_(0.05)
    new2, _, ref2 = score_unit(policy, algorithm, sub, [1], torch.device("cpu"))
    torch.testing.assert_close(ref2.token_log_prob, ref.token_log_prob, rtol=0, atol=0)
    assert (new2.log_prob - old).abs().max() > 1e-4
    out = algorithm.loss(new2, old, torch.tensor([1.0, -1.0]), ref2)
    assert out.metrics["kl"] > 0 and out.metrics["ratio_mean"] != 1.0


def test_diffu_grpo_one_step_estimator(tiny_mdlm_dir):
    policy = _policy(tiny_mdlm_dir, prompt_mask_prob=0.5)
    algorithm = DiffuGRPO(algo_config(DiffuGRPOConfig, draws=2))
    plan, rollout = _rollout(policy, algorithm)
    masks = rollout.trajectory["prompt_masked"]  # [N, S, P]
    assert masks[:, 0].any() and not torch.equal(masks[:, 0], masks[:, 1])  # a fresh prompt mask per draw
    assert not (masks & ~rollout.trajectory["prompt_attention"][:, None]).any()  # padding is never "masked"
    for unit in plan.train_units:
        new, old, ref = score_unit(policy, algorithm, rollout, unit, torch.device("cpu"))
        torch.testing.assert_close(new.log_prob.detach(), old, rtol=0, atol=1e-5)
        keep = policy.completion_mask(rollout.trajectory["completion"])
        assert torch.equal(new.token_mask[:, 0], keep)
    # the one-step estimate is not the trajectory's log-prob
    one_step = policy.likelihood(rollout, [0]).token_log_prob[:, 0].detach()
    assert (one_step - rollout.trajectory["token_log_probs"]).abs().max() > 1e-3


def _saved_bytes(policy, algorithm, rollout, units, per_unit: bool) -> int:
    """Peak bytes saved for backward: one unit's graph at a time (the trainer) or every unit's graph at once."""
    alive, peak = [0], [0]

    def pack(tensor):
        alive[0] += tensor.numel() * tensor.element_size()
        peak[0] = max(peak[0], alive[0])
        return tensor

    total = 0
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for unit in units:
            new, old, ref = score_unit(policy, algorithm, rollout, unit, torch.device("cpu"))
            loss = algorithm.loss(new, old, torch.ones(len(rollout)), ref).loss / len(units)
            if per_unit:
                loss.backward()
                alive[0] = 0  # the unit's graph is freed by backward
            else:
                total = total + loss
    if not per_unit:
        total.backward()
    return peak[0]


def test_cj_update_memory_does_not_grow_with_steps(tiny_mdlm_dir):
    measured = {}
    for steps in (2, 8):
        policy = _policy(tiny_mdlm_dir, gen_length=8, block_length=None, steps_per_block=steps)
        algorithm = CJGRPO(algo_config(CJGRPOConfig, kl_beta=0.0))
        plan, rollout = _rollout(policy, algorithm)
        measured[steps] = (_saved_bytes(policy, algorithm, rollout, plan.train_units, True),
                           _saved_bytes(policy, algorithm, rollout, plan.train_units, False))
    (step2, all2), (step8, all8) = measured[2], measured[8]
    assert step8 == step2  # step-by-step back-propagation: flat in the number of decoding steps
    assert all8 > 3 * all2  # summing every step first (the authors' loop) grows with it


class _LLaDALikeBlock(torch.nn.Module):
    """A block with LLaDA's projection names (it has no o_proj, gate_proj or down_proj)."""

    def __init__(self):
        super().__init__()
        for name in ("q_proj", "k_proj", "v_proj", "attn_out", "ff_proj", "up_proj", "ff_out"):
            self.add_module(name, torch.nn.Linear(4, 4))


def test_lora_targets_are_checked_against_the_model():
    from mmgrpo.pipelines.mdlm import FAMILIES, MDLMPolicy

    model = torch.nn.Sequential(_LLaDALikeBlock(), _LLaDALikeBlock())
    assert MDLMPolicy._lora_targets(model, FAMILIES["llada"][0], defaults=False) == FAMILIES["llada"][0]
    # the usual Llama names: only those that exist are kept by default, and asking for a missing one is an error
    assert MDLMPolicy._lora_targets(model, FAMILIES["dream"][0], defaults=True) == ["q_proj", "k_proj", "v_proj", "up_proj"]
    with pytest.raises(ValueError, match="o_proj"):
        MDLMPolicy._lora_targets(model, ["q_proj", "o_proj"], defaults=False)


def test_real_llada_config_carries_cj_grpo_hyperparameters(monkeypatch):
    from pathlib import Path

    from mmgrpo import config as config_mod
    from mmgrpo.pipelines.mdlm import FAMILIES

    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(root)
    cfg = config_mod.load(root / "configs" / "llada_8b_cj_grpo.yaml")
    p, a = cfg.pipeline.options, cfg.algorithm.options
    assert p.family == "llada" and p.trust_remote_code and p.lora_targets == FAMILIES["llada"][0]
    assert (p.lora_rank, p.lora_alpha, p.temperature, p.eoser_gamma_min) == (128, 64, 1.0, 0.01)
    assert p.num_steps == 9 and p.decoding.tokens_per_step[:4] == [1, 2, 4, 8]  # ASS: 256 tokens in 9 steps
    assert (a.clip.clip_low, a.kl.kl_beta) == (0.5, 0.04)
    assert (cfg.train.learning_rate, cfg.train.group_size, cfg.train.inner_epochs, cfg.train.max_grad_norm) == (3e-6, 6, 12, 0.2)


def test_grpo_runs_on_the_mdlm_pipeline(tiny_mdlm_dir):
    """The token-level algorithms treat each decoding step as a decision (one unit: every step at once)."""
    from mmgrpo import registry

    cls = registry.get("algorithm", "grpo")
    algorithm = cls(cls.Config())
    policy = _policy(tiny_mdlm_dir)
    plan, rollout = _rollout(policy, algorithm)
    new, old, ref = score_unit(policy, algorithm, rollout, plan.train_units[0], torch.device("cpu"))
    assert new.log_prob.shape == (6, policy.num_steps)
    torch.testing.assert_close(new.log_prob.detach(), old, rtol=0, atol=0)
    out = algorithm.loss(new, old, torch.tensor([1.0, -1.0] * 3), ref)
    out.loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in policy.trainable_parameters())


@pytest.mark.parametrize("algorithm", ["cj_grpo", "diffu_grpo"])
def test_trainer_runs_mdlm_and_resumes_weights(tiny_mdlm_dir, tmp_path, algorithm):
    """Two trainer steps on addition prompts, evaluation, a checkpoint whose weights load back into a fresh policy."""
    from mmgrpo import config as config_mod
    from mmgrpo.trainer import Trainer

    cfg = config_mod.from_dict({
        "output_dir": str(tmp_path / "out"), "seed": 0,
        "pipeline": {"name": "mdlm", "pretrained": tiny_mdlm_dir, "gen_length": 4, "steps_per_block": 4, "lora_rank": 0},
        "algorithm": {"name": algorithm, "kl_beta": 0.04},
        "reward": {"name": "accuracy", "mode": "numeric"},
        "data": {"name": "arith", "digits": 2, "n_train": 32, "n_eval": 8},
        "train": {"max_steps": 2, "prompts_per_step": 2, "group_size": 4, "minibatch_size": 4, "learning_rate": 1e-2},
        "eval": {"every": 2, "num_prompts": 8},
    })
    trainer = Trainer(cfg)
    before = [p.detach().clone() for p in trainer.policy.trainable_parameters()]
    summary = trainer.train()
    assert summary["steps"] == 2 and "eval_score_last" in summary
    samples = (tmp_path / "out" / "samples" / "step_00002.jsonl").read_text().splitlines()
    assert samples and {"prompt", "text", "reward"} <= set(json.loads(samples[0]))
    weights = sorted((tmp_path / "out" / "checkpoints").glob("step_*"))[-1] / "weights"
    fresh = _policy(tiny_mdlm_dir, gen_length=4, steps_per_block=4, lora_rank=0)
    fresh.load_trainable(str(weights))
    for a, b in zip(fresh.trainable_parameters(), trainer.policy.trainable_parameters()):
        torch.testing.assert_close(a, b.detach(), rtol=0, atol=0)
    # the reference (frozen initial model) did not move
    for a, b in zip(trainer.policy.frozen.parameters(), before):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_shipped_base_model_is_clearly_imperfect():
    """The embedded default's base model: held-out greedy accuracy between 30% and 60% (room for RL)."""
    from mmgrpo import registry
    from mmgrpo.hub import shipped_weights_dir
    from mmgrpo.prompt_stream import items_to_batch
    from mmgrpo.plans import MaskedPlan

    metrics = json.loads((shipped_weights_dir() / "mdlm_arith" / "metrics.json").read_text())
    assert 0.3 <= metrics["held_out_accuracy"] <= 0.6
    policy = _policy("mmgrpo:mdlm_arith", gen_length=4, block_length=None, steps_per_block=4, lora_rank=0)
    data = registry.get("data", "arith")(registry.get("data", "arith").Config(digits=2, n_train=100, n_eval=200))
    batch = items_to_batch(data.eval_items())
    rollout = policy.sample(batch, MaskedPlan.deterministic(4), generator=torch.Generator().manual_seed(0))
    reward = registry.get("reward", "accuracy")(registry.get("reward", "accuracy").Config(mode="numeric"))
    assert float(reward(rollout.outputs, batch).scores.mean()) == pytest.approx(metrics["held_out_accuracy"], abs=1e-6)


def test_lora_adapter_saves_and_loads(tiny_mdlm_dir, tmp_path):
    policy = _policy(tiny_mdlm_dir)
    with torch.no_grad():
        for p in policy.trainable_parameters():
            p.add_(0.01 * torch.randn_like(p))
    policy.save_pretrained(str(tmp_path / "adapter"))
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    fresh = _policy(tiny_mdlm_dir)
    fresh.load_trainable(str(tmp_path / "adapter"))
    for a, b in zip(fresh.trainable_parameters(), policy.trainable_parameters()):
        torch.testing.assert_close(a, b.detach(), rtol=0, atol=0)


def test_a_bert_style_masked_lm_works_too(tmp_path):
    """Any bidirectional model mapping input_ids -> logits: a tiny BertForMaskedLM, replayed exactly."""
    from transformers import BertConfig, BertForMaskedLM

    from builders._tokenizers import char_tokenizer

    tokenizer = char_tokenizer()
    torch.manual_seed(0)
    model = BertForMaskedLM(BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                       intermediate_size=64, pad_token_id=0, hidden_dropout_prob=0.0))
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    policy = _policy(str(tmp_path))
    assert policy.family == "generic" and policy.mask_id == tokenizer.mask_token_id
    plan, rollout = _rollout(policy, CJGRPO(CJGRPOConfig()))
    replay = policy.log_prob(rollout, list(range(policy.num_steps)))
    assert torch.equal(replay.log_prob.detach(), rollout.old_log_probs)


def test_arith_prompts_are_checkable_and_held_out():
    from mmgrpo.data.arith import ArithConfig, ArithPrompts

    data = ArithPrompts(ArithConfig(digits=2, n_train=300, n_eval=50))
    train, held_out = data.train_items(), data.eval_items()
    assert len(train) == 300 and len(held_out) == 50
    assert not {i["prompt"] for i in train} & {i["prompt"] for i in held_out}
    for item in train[:20]:
        a, b = item["prompt"].rstrip("=").split("+")
        assert len(a) == len(b) == 2 and item["metadata"]["answer"] == str(int(a) + int(b))
    templated = ArithPrompts(ArithConfig(digits=2, n_train=5, n_eval=5, template="What is {a} + {b}?"))
    assert templated.eval_items()[0]["prompt"].startswith("What is ")
    with pytest.raises(ValueError, match="template"):
        ArithConfig(template="{c}")


def test_step_level_ratio_is_on_policy_and_clipped(tiny_mdlm_dir):
    policy = _policy(tiny_mdlm_dir)
    algorithm = CJGRPO(algo_config(CJGRPOConfig, ratio_level="step", kl_beta=0.0, clip_low=0.1))
    plan, rollout = _rollout(policy, algorithm)
    new, old, _ = score_unit(policy, algorithm, rollout, [0], torch.device("cpu"))
    out = algorithm.loss(new, old, torch.zeros(6), None)
    assert out.metrics["ratio_mean"] == pytest.approx(1.0) and out.metrics["clip_frac"] == 0.0
    out.loss.backward()
    assert all(p.grad is None or torch.count_nonzero(p.grad) == 0 for p in policy.trainable_parameters())
    shifted = dataclasses.replace(new, log_prob=new.log_prob.detach() + 0.5)  # a transition 1.65x likelier: clipped at 1.1
    assert algorithm.loss(shifted, old, torch.ones(6), None).metrics["clip_frac"] == 1.0
