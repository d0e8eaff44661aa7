"""`mmgrpo sft`: the completion-only loss against a hand computation, no gradient through prompt positions, thought
dropout, a falling training loss, exact resume, refusals before loading, and SFT -> RL from the written model."""

import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch

from mmgrpo import checkpoint, config as config_mod
from mmgrpo.cli import main
from mmgrpo.pipelines.qwen_vl import VISION_TOKENS, QwenVLPolicy
from mmgrpo.sft import EMPTY_THOUGHT, SFTTrainer, check, drop_thought, thought_dropped

TARGETS = {"a": "<think>red none blue red</think><answer>2</answer>", "b": "<think>x</think><answer>13</answer>"}


def sft_raw(tmp_path, model_dir, lora_rank=0, **train):
    """An experiment whose SFT part trains a tiny Qwen2-VL on 4 `vlm_shapes` counting items with targets."""
    return {
        "output_dir": str(tmp_path / "sft"), "seed": 5,
        "pipeline": {"name": "qwen_vl", "pretrained": model_dir, "max_new_tokens": 6, "min_pixels": 3136,
                     "max_pixels": 3136, "lora_rank": lora_rank, "lora_alpha": 8},
        "algorithm": {"name": "grpo"}, "reward": {"name": "accuracy", "mode": "numeric"},
        "data": {"name": "vlm_shapes", "n_train": 4, "n_eval": 2, "with_targets": True},
        "train": {"max_steps": 2, "prompts_per_step": 4, "minibatch_size": 4, "learning_rate": 1e-3,
                  "weight_decay": 0.0, **train},
        "eval": {"every": 0}, "checkpoint": {"every": 1, "keep_last": 5}, "tracking": {"log_with": []},
    }


def hand_nll(policy, prompt, images, target) -> tuple[torch.Tensor, int]:
    """Summed NLL of `target` + <|im_end|> after `prompt`, from one forward of the transformers model on the whole
    sequence (its own positions, no padding), vision special tokens removed from the support as the policy does."""
    tok = policy.processor.tokenizer
    enc = policy.encode_prompt(prompt, images, [])
    ids = tok(target, add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")]
    prompt_len, target_ids = enc["input_ids"].shape[0], torch.tensor(ids)
    full = torch.cat([enc["input_ids"], target_ids])[None]  # [1, P + T]
    types = torch.cat([enc["mm_token_type_ids"], torch.zeros(len(ids), dtype=torch.long)])[None]
    logits = policy.model(input_ids=full, attention_mask=torch.ones_like(full), mm_token_type_ids=types,
                          pixel_values=enc["pixel_values"], image_grid_thw=enc["image_grid_thw"]).logits[0]
    logits = logits[prompt_len - 1 : -1].float()  # [T, V]: position p predicts token p + 1
    logits[:, [tok.convert_tokens_to_ids(t) for t in VISION_TOKENS]] = float("-inf")
    return -logits.log_softmax(-1)[torch.arange(len(ids)), target_ids].sum(), len(ids)


def two_items(trainer):
    batch = trainer.stream.next_batch(2)
    return batch, [TARGETS["a"], TARGETS["b"]]  # different lengths: the shorter one is padded


def test_loss_and_gradient_equal_the_hand_computed_target_nll(tmp_path, tiny_qwen2_vl_dir):
    trainer = SFTTrainer(config_mod.from_dict(sft_raw(tmp_path, tiny_qwen2_vl_dir, minibatch_size=1)))
    policy = trainer.policy
    batch, targets = two_items(trainer)
    rollout = policy.teacher_rollout(batch, targets)
    tokens = int(rollout.mask.sum())
    nll = trainer.backward(rollout, scale=1.0 / tokens)  # two minibatches of one item, accumulated
    grads = [p.grad.clone() for p in policy.trainable_parameters()]
    policy.model.zero_grad(set_to_none=True)
    parts = [hand_nll(policy, batch.prompts[i], batch.conditions["images"][i], targets[i]) for i in range(2)]
    hand = sum(s for s, _ in parts) / sum(n for _, n in parts)
    assert tokens == sum(n for _, n in parts)
    assert nll / tokens == pytest.approx(float(hand), rel=1e-5)
    hand.backward()
    for mine, ref in zip(grads, (p.grad for p in policy.trainable_parameters())):
        torch.testing.assert_close(mine, ref, rtol=1e-4, atol=1e-6)


def test_prompt_positions_get_no_gradient(tmp_path, tiny_qwen2_vl_dir):
    """In the naive forward (logits at every position), the loss's gradient w.r.t. the logits that predict prompt
    tokens (and padding after a short target) is exactly 0, and not 0 where they predict target tokens."""
    raw = sft_raw(tmp_path, tiny_qwen2_vl_dir)
    raw["pipeline"]["prefix_sharing"] = False
    trainer = SFTTrainer(config_mod.from_dict(raw))
    batch, targets = two_items(trainer)
    rollout = trainer.policy.teacher_rollout(batch, targets)
    seen = []

    def keep(module, inputs, out):  # returns None: the output is left as it is
        out.retain_grad()
        seen.append(out)

    hook = trainer.policy.model.lm_head.register_forward_hook(keep)
    trainer.backward(rollout, scale=1.0)
    hook.remove()
    grad = seen[0].grad.abs().sum(-1)  # [2, P + T]
    lengths = rollout.mask.sum(1).tolist()
    prompt_len = grad.shape[1] - rollout.mask.shape[1]
    assert torch.all(grad[:, : prompt_len - 1] == 0)  # positions predicting prompt tokens (or left padding)
    for row, length in enumerate(lengths):
        assert torch.all(grad[row, prompt_len - 1 : prompt_len - 1 + length] > 0)  # predicting target tokens
        assert torch.all(grad[row, prompt_len - 1 + length :] == 0)  # after the end-of-turn token
    assert lengths[0] != lengths[1]


def test_thought_dropout_draws():
    text = TARGETS["a"]
    assert drop_thought(text) == "<think>\n\n</think><answer>2</answer>" == EMPTY_THOUGHT + "<answer>2</answer>"
    assert drop_thought("<answer>2</answer>") == "<answer>2</answer>"
    assert not any(thought_dropped(0.0, 7, i) for i in range(2000))
    assert all(thought_dropped(1.0, 7, i) for i in range(2000))
    draws = [thought_dropped(0.5, 7, i) for i in range(4000)]
    assert draws == [thought_dropped(0.5, 7, i) for i in range(4000)]  # fixed per seed and item
    assert draws != [thought_dropped(0.5, 8, i) for i in range(4000)]  # another seed, other draws
    # Bernoulli(0.5) over 4000 items: std of the fraction 0.0079, so +-0.05 is more than 6 standard deviations
    assert abs(sum(draws) / 4000 - 0.5) < 0.05


def test_trainer_applies_thought_dropout_per_item(tmp_path, tiny_qwen2_vl_dir):
    raw = sft_raw(tmp_path, tiny_qwen2_vl_dir)
    for p, expect in ((0.0, False), (1.0, True)):
        raw["sft"] = {"thought_dropout": p}
        trainer = SFTTrainer(config_mod.from_dict(raw))
        items = trainer.stream.items
        targets, dropped = trainer.targets([it["metadata"] for it in items], list(range(len(items))))
        assert dropped == [expect] * len(items)
        for item, target in zip(items, targets):
            answer = f"<answer>{item['metadata']['answer']}</answer>"
            assert target == (EMPTY_THOUGHT + answer if expect else item["metadata"]["completion"])


def test_sft_lowers_the_loss_and_resumes_exactly(tmp_path, tiny_qwen2_vl_dir):
    raw = sft_raw(tmp_path, tiny_qwen2_vl_dir, max_steps=6, learning_rate=5e-3)
    summary = SFTTrainer(config_mod.from_dict(raw)).train()
    run = tmp_path / "sft"
    losses = [json.loads(line)["train/loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 6 and losses[-1] < 0.7 * losses[0]  # the same 4 items every step: memorised
    assert summary["loss_last"] == losses[-1] and (run / "model" / "model.safetensors").is_file()
    # stop after 3 steps, resume to 6: the same weights as the uninterrupted run
    raw2 = sft_raw(tmp_path / "b", tiny_qwen2_vl_dir, max_steps=3, learning_rate=5e-3)
    SFTTrainer(config_mod.from_dict(raw2)).train()
    raw2["train"]["max_steps"] = 6
    raw2["checkpoint"]["resume_from"] = "latest"
    resumed = SFTTrainer(config_mod.from_dict(raw2))
    assert resumed.step == 3
    resumed.train()
    whole, again = (checkpoint.complete_checkpoints(folder / "checkpoints")[-1] / "weights" / "model.safetensors"
                    for folder in (run, tmp_path / "b" / "sft"))
    from safetensors.torch import load_file

    a, b = load_file(str(whole)), load_file(str(again))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_held_out_loss_is_the_target_nll_of_the_held_out_items_without_thought_dropout(tmp_path, tiny_qwen2_vl_dir):
    raw = sft_raw(tmp_path, tiny_qwen2_vl_dir, minibatch_size=1)
    raw["eval"] = {"every": 2, "num_prompts": 2}
    raw["sft"] = {"thought_dropout": 1.0}  # every training target loses its thought; held-out targets keep theirs
    trainer = SFTTrainer(config_mod.from_dict(raw))
    items = trainer.eval_items
    assert len(items) == 2 and all("<think></think>" not in item["metadata"]["completion"] for item in items)
    with torch.no_grad():
        parts = [hand_nll(trainer.policy, item["prompt"], item["images"], item["metadata"]["completion"])
                 for item in items]
    held_out = trainer.evaluate(0)
    assert held_out["eval/tokens"] == sum(n for _, n in parts)
    assert held_out["eval/loss"] == pytest.approx(float(sum(s for s, _ in parts)) / held_out["eval/tokens"], rel=1e-5)


def test_held_out_loss_is_logged_at_the_start_every_n_steps_and_at_the_end(tmp_path, tiny_qwen2_vl_dir):
    raw = sft_raw(tmp_path, tiny_qwen2_vl_dir, max_steps=5, learning_rate=5e-3)
    raw["eval"] = {"every": 2, "num_prompts": 2}
    summary = SFTTrainer(config_mod.from_dict(raw)).train()
    records = [json.loads(line) for line in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()]
    held_out = [(r["step"], r["eval/loss"]) for r in records if "eval/loss" in r]
    assert [step for step, _ in held_out] == [0, 2, 4, 5]
    assert summary["eval_loss_first"] == held_out[0][1] and summary["eval_loss_last"] == held_out[-1][1]
    assert all(math.isfinite(loss) and loss > 0 for _, loss in held_out)


def test_sft_reward_evaluation_equals_mmgrpo_eval_of_the_written_model(tmp_path):
    """With ``sft.eval_reward`` the held-out evaluation also samples greedily and scores with the config's reward, as
    ``mmgrpo train`` evaluates: at the last step it gives the per-prompt scores that ``mmgrpo eval`` gives for the
    written model."""
    held_out = ["data.n_eval=12", "eval.num_prompts=12", "data.n_train=8", "tracking.log_with=[]"]
    sft_dir, eval_dir = tmp_path / "sft", tmp_path / "eval"
    assert main(["sft", "vlm_count_sft", "sft.eval_reward=true", "eval.every=2", "train.max_steps=2",
                 "train.prompts_per_step=4", "train.minibatch_size=4", "train.learning_rate=1e-3",
                 "checkpoint.every=0", f"output_dir={sft_dir}", *held_out]) == 0
    records = [json.loads(line) for line in (sft_dir / "metrics.jsonl").read_text().splitlines()]
    evaluated = [r for r in records if "eval/score" in r]
    assert [r["step"] for r in evaluated] == [0, 2] and all("eval/loss" in r and "eval/accuracy" in r for r in evaluated)
    assert sorted(p.name for p in (sft_dir / "samples").glob("step_00002*"))  # the samples of the last evaluation
    summary = json.loads((sft_dir / "summary.json").read_text())
    assert [summary["eval_accuracy_first"], summary["eval_accuracy_last"]] == [r["eval/accuracy"] for r in evaluated]
    assert main(["eval", "vlm_count", f"pipeline.pretrained={sft_dir / 'model'}", f"output_dir={eval_dir}",
                 *held_out]) == 0
    sft_scores = json.loads((sft_dir / "eval" / "step_00002.json").read_text())
    eval_scores = json.loads((eval_dir / "eval" / "step_00000.json").read_text())
    assert sft_scores == eval_scores
    assert len({round(r["reward"], 6) for r in sft_scores}) > 1  # not vacuous: the prompts score apart


def test_sft_reads_the_declared_teacher_rollout_capability(tmp_path, capsys, monkeypatch):
    """Every pipeline declares its capabilities, `teacher_rollout` exactly where it implements it; sft reads the
    declaration: a pipeline that has the method but does not declare it is refused before any model loads."""
    from mmgrpo import registry
    from mmgrpo.sft import sft_pipelines

    for name in registry.available("pipeline"):
        cls = registry.get("pipeline", name)
        assert isinstance(cls.capabilities, frozenset)
        assert ("teacher_rollout" in cls.capabilities) == ("teacher_rollout" in vars(cls)), name
    assert sft_pipelines() == ["qwen_vl"]
    monkeypatch.setattr(QwenVLPolicy, "capabilities", frozenset())  # the method stays; the declaration goes
    assert sft_pipelines() == []
    assert main(["sft", "vlm_count_sft", f"output_dir={tmp_path / 'v'}"]) == 2
    assert "does not support pipeline 'qwen_vl': it declares no teacher_rollout capability" in capsys.readouterr().err


def test_refusals_before_any_model_loads(tmp_path, capsys):
    assert main(["sft", "mdlm_arith", f"output_dir={tmp_path / 'm'}"]) == 2
    err = capsys.readouterr().err
    assert "does not support pipeline 'mdlm'" in err and "'qwen_vl'" in err
    assert main(["sft", "vlm_count_sft", "data.with_targets=false", "data.n_train=3"]) == 2
    err = capsys.readouterr().err
    assert "sft.target_key" in err and "with_targets: true" in err
    assert main(["sft", "vlm_count_sft", "sft.thought_dropout=1.5"]) == 2
    assert "sft.thought_dropout" in capsys.readouterr().err
    assert main(["sft", "vlm_count_sft", "sft.bogus=1"]) == 2
    assert "sft.bogus" in capsys.readouterr().err
    assert main(["sft", "vlm_count_sft", "train.ema={decay: 0.9}", "train.sample_chunks=2"]) == 2
    err = capsys.readouterr().err
    assert "train.ema, train.sample_chunks: mmgrpo sft does not use" in err and "remove them" in err
    assert main(["sft", "vlm_count_sft", "data.n_eval=0", "data.n_train=3"]) == 2
    err = capsys.readouterr().err
    assert "eval.every: mmgrpo sft scores the target loss of held-out items" in err and "(data.n_eval)" in err


def test_jsonl_rows_give_targets_and_a_row_without_one_is_refused(tmp_path, tiny_qwen2_vl_dir):
    from PIL import Image

    Image.new("RGB", (56, 56), (230, 25, 25)).save(tmp_path / "red.png")
    rows = [{"image": "red.png", "problem": "How many red shapes?", "answer": "1", "completion": TARGETS["a"]},
            {"image": "red.png", "problem": "How many blue shapes?", "answer": "0", "completion": TARGETS["b"]}]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    raw = sft_raw(tmp_path, tiny_qwen2_vl_dir)
    raw["data"] = {"name": "vlm_jsonl", "train_file": str(tmp_path / "rows.jsonl")}
    items = check(config_mod.from_dict(raw))
    assert [item["metadata"]["completion"] for item in items] == [TARGETS["a"], TARGETS["b"]]
    raw["sft"] = {"target_key": "solution"}
    with pytest.raises(config_mod.ConfigError, match=r"item 0 has no text target under metadata\['solution'\]"):
        check(config_mod.from_dict(raw))
    bare = [{key: value for key, value in row.items() if key != "completion"} for row in rows]
    (tmp_path / "held_out.jsonl").write_text("".join(json.dumps(r) + "\n" for r in bare))
    raw["sft"], raw["eval"] = {}, {"every": 1}
    raw["data"]["eval_file"] = str(tmp_path / "held_out.jsonl")
    with pytest.raises(config_mod.ConfigError, match=r"held-out item 0 has no text target under metadata\['completion'\]"):
        check(config_mod.from_dict(raw))
    raw["eval"] = {"every": 0}  # without the held-out loss, held-out rows need no targets
    assert len(check(config_mod.from_dict(raw))) == 2


def test_shipped_sft_config_has_r1_targets(monkeypatch):
    from mmgrpo.hub import resolve_config

    cfg = config_mod.load(resolve_config("vlm_count_sft"), ["data.n_train=50"])
    items = check(cfg)
    for item in items:
        target = item["metadata"]["completion"]
        assert re.fullmatch(r"<think>(red|green|blue|yellow|none)( (red|green|blue|yellow|none)){3}</think>"
                            r"<answer>\d</answer>", target)
        assert target.endswith(f"<answer>{item['metadata']['answer']}</answer>")
    assert cfg.sft.thought_dropout == 0.5


def test_sft_then_rl_from_the_written_model(tmp_path):
    """The two documented commands on the embedded VLM (SFT with a LoRA, merged into model/), then checks that the RL
    run's policy is the SFT model: the same log-probs as the SFT checkpoint's adapter on the base model."""
    from mmgrpo.hub import resolve_config
    from mmgrpo.prompt_stream import items_to_batch

    sft_dir, rl_dir = tmp_path / "sft", tmp_path / "rl"
    lora = ["pipeline.lora_rank=4", "pipeline.lora_alpha=8"]
    small = ["data.n_train=8", "train.max_steps=2", "train.prompts_per_step=4", "train.minibatch_size=4",
             "tracking.log_with=[]", "train.learning_rate=1e-2"]
    assert main(["sft", "vlm_count_sft", f"output_dir={sft_dir}", *lora, *small]) == 0
    rl = [f"pipeline.pretrained={sft_dir / 'model'}", f"output_dir={rl_dir}", "train.max_steps=1",
          "train.prompts_per_step=2", "train.group_size=2", "train.minibatch_size=4", "eval.every=0",
          "data.n_train=8", "checkpoint.every=0", "tracking.log_with=[]"]
    rl_policy = QwenVLPolicy(config_mod.load(resolve_config("vlm_count"), rl).pipeline.options)  # what RL loads
    sft_cfg = config_mod.load(resolve_config("vlm_count_sft"), [*lora, "data.n_train=2"])
    sft_policy, base_policy = QwenVLPolicy(sft_cfg.pipeline.options), QwenVLPolicy(sft_cfg.pipeline.options)
    sft_policy.load_trainable(str(checkpoint.complete_checkpoints(sft_dir / "checkpoints")[-1] / "weights"))
    items = check(sft_cfg)
    batch, targets = items_to_batch(items), [item["metadata"]["completion"] for item in items]
    scores = []
    with torch.no_grad():
        for policy in (sft_policy, rl_policy, base_policy):
            rollout = policy.teacher_rollout(batch, targets)
            scores.append(policy.log_prob(rollout, list(range(rollout.mask.shape[1]))).log_prob)  # [2, T]
    torch.testing.assert_close(scores[1], scores[0], rtol=0, atol=1e-4)  # RL starts from the SFT model
    assert (scores[2] - scores[0]).abs().max() > 1e-2  # and SFT changed the base model
    assert main(["train", "vlm_count", *rl]) == 0
    assert json.loads((rl_dir / "metrics.jsonl").read_text().splitlines()[0])["step"] == 1
    assert json.loads((rl_dir / "config.json").read_text())["pipeline"]["pretrained"] == str(sft_dir / "model")


def test_two_processes_match_one(tmp_path):
    """Under torchrun with 2 CPU processes (each scoring half of every batch, with different numbers of target
    tokens), the loss and gradient norm of each step and the final model equal those of one process."""
    args = ["sft", "vlm_count_sft", "data.n_train=8", "train.max_steps=2", "train.prompts_per_step=4",
            "train.minibatch_size=2", "tracking.log_with=[]", "sft.thought_dropout=0.5", "checkpoint.every=0",
            "data.n_eval=6", "eval.num_prompts=6"]
    env = dict(os.environ, ACCELERATE_USE_CPU="true", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "mmgrpo.cli", *args, f"output_dir={tmp_path / 'two'}"],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert main([*args, f"output_dir={tmp_path / 'one'}"]) == 0
    from safetensors.torch import load_file

    runs = {}
    for name in ("one", "two"):
        records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        runs[name] = (records, summary, load_file(str(tmp_path / name / "model" / "model.safetensors")))
    (one, one_summary, one_model), (two, two_summary, two_model) = runs["one"], runs["two"]
    assert one_summary["processes"] == 1 and two_summary["processes"] == 2
    assert [r["step"] for r in one] == [r["step"] for r in two] == [0, 1, 2]  # held-out loss at 0 and the last step
    for a, b in zip(one, two):
        assert set(a) - {"time/train_s"} == set(b) - {"time/train_s"}
        for key in ("train/tokens", "eval/tokens"):
            assert a.get(key) == b.get(key)
        for key, rel in (("train/loss", 1e-5), ("eval/loss", 1e-5), ("train/grad_norm", 1e-4)):  # global means
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=rel), key
    assert one[0]["eval/tokens"] > 0 and "train/loss" not in one[0] and "eval/loss" in one[2]
    for key, value in one_model.items():
        torch.testing.assert_close(two_model[key], value, rtol=1e-4, atol=1e-6)
