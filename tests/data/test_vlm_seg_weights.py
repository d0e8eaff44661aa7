"""The shipped segmentation base (``mmgrpo:vlm_seg``, trained by ``scripts/train_vlm_seg.py``) answers held-out
`seg_shapes` questions in Seg-Zero's layout with boxes the shipped tiny SAM 2 turns into masks, and is clearly
imperfect (RL has room); the supervised completions it was trained on hold the true box and points inside the mask."""

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mmgrpo.data.seg_shapes import SegShapes, SegShapesConfig
from mmgrpo.hub import resolve_pretrained
from mmgrpo.prompt_stream import items_to_batch
from mmgrpo.rewards._seg_parse import parse_prompt
from mmgrpo.rewards.box_iou import BoxIoU
from builders._repo_files import load_repo_script



def _script():
    return load_repo_script("scripts", "train_vlm_seg")


def test_supervised_completions_give_the_true_box_and_points_inside_the_mask():
    script = _script()
    source = SegShapes(SegShapesConfig(n_train=0, n_eval=0, prompt_template=script.TEMPLATE, with_targets=True))
    mapper = BoxIoU(BoxIoU.Config(coords="original"))
    checked = 0
    for index in range(script.SFT_FIRST, script.SFT_FIRST + 40):
        item = source.item(index)
        if item is None:
            continue
        meta = item["metadata"]
        parsed = parse_prompt(meta["completion"], "seg_zero", mapper, meta, 0, 4, 4)
        assert parsed.boxes == [meta["boxes"]]
        for x, y in parsed.points[0]:
            assert meta["mask"][int(y), int(x)]
        checked += 1
    assert checked >= 20


def _greedy_answers(name: str, n: int):
    """The first `n` held-out items of the RL configs, their batch, and the greedy outputs of ``mmgrpo:<name>``."""
    from mmgrpo.pipelines.qwen_vl import QwenVLConfig, QwenVLPolicy
    from mmgrpo.plans import TokenPlan

    policy = QwenVLPolicy(QwenVLConfig(pretrained=f"mmgrpo:{name}", max_new_tokens=144, lora_rank=0,
                                       min_pixels=3136, max_pixels=3136))
    items = SegShapes(SegShapesConfig(n_train=0, n_eval=n, prompt_template=_script().TEMPLATE)).eval_items()
    batch = items_to_batch(items)
    batch.group_ids = torch.arange(len(batch))
    return items, batch, policy.sample(batch, TokenPlan.deterministic(144)).outputs


@pytest.mark.parametrize("name", ["vlm_seg", "vlm_seg_skewed", "vlm_seg_top_left", "vlm_seg_in_dist"])
def test_shipped_vlm_seg_base_is_imperfect_and_prompts_sam(name):
    from mmgrpo.rewards.sam_mask import SamMask, SamMaskConfig

    metrics = json.loads(Path(resolve_pretrained(f"mmgrpo:{name}"), "metrics.json").read_text(encoding="utf-8"))
    assert 0.25 <= metrics["held_out_giou"] <= 0.75  # clearly imperfect: RL has room
    _, batch, outputs = _greedy_answers(name, 12)
    result = SamMask(SamMaskConfig(model="mmgrpo:tiny_sam2", coords="original", device="cpu"))(outputs, batch)
    assert float(result.components["no_box"].mean()) <= 0.25  # answers parse into boxes
    assert float(result.components["iou"].max()) > 0.5  # some answers find their shape


def test_deepen_appends_identity_layers_that_survive_save_and_reload(tmp_path):
    from transformers import Qwen2VLForConditionalGeneration

    script = _script()
    model = Qwen2VLForConditionalGeneration.from_pretrained(resolve_pretrained("mmgrpo:vlm_seg")).eval()
    ids = torch.randint(0, model.config.text_config.vocab_size - 8, (2, 12))  # [B, L] text tokens
    with torch.no_grad():
        before = model(input_ids=ids).logits  # [B, L, V]
    script.deepen(model, 2)
    assert len(model.model.language_model.layers) == model.config.text_config.num_hidden_layers == 4
    assert len(model.config.text_config.layer_types) == 4
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, before)  # the new layers start as the identity
    model.save_pretrained(tmp_path)
    reloaded = Qwen2VLForConditionalGeneration.from_pretrained(tmp_path).eval()
    assert len(reloaded.model.language_model.layers) == 4
    new_layer = reloaded.model.language_model.layers[3]
    assert torch.count_nonzero(new_layer.self_attn.q_proj.weight) > 0  # trainable, not all zero
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, before)


@pytest.mark.parametrize("argv", [["--extra-layers", "-1"], ["--extra-layers", "1", "--init", ""]])
def test_extra_layers_are_refused_without_a_model_to_deepen(argv, capsys):
    with pytest.raises(SystemExit):
        _script().main(argv)
    assert "--extra-layers" in capsys.readouterr().err


def _item_in(quadrant: int) -> dict:
    """A seg_shapes-like item whose target box lies in `quadrant` of a 56 x 56 image (0: top left ... 3: bottom right)."""
    x, y = 28 * (quadrant % 2), 28 * (quadrant // 2)
    return {"metadata": {"boxes": [x + 4, y + 4, x + 20, y + 20], "image_size": [56, 56]}}


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.floats(0.05, 0.95), st.lists(st.integers(0, 3), min_size=1, max_size=300))
def test_quadrant_prior_keeps_the_admitted_share_within_one_item(share, quadrants):
    prior = _script().QuadrantPrior("top left", share)
    taken = inside = 0
    for quadrant in quadrants:
        if prior.admits(_item_in(quadrant)):
            taken, inside = taken + 1, inside + int(quadrant == 0)
            assert abs(inside - share * taken) <= 1 + 1e-9  # "within one item"; exactly 1 happens (share 1/3, 2 of 9)
    assert (prior.taken, prior.inside) == (taken, inside)


def test_quadrant_prior_reaches_its_share_on_a_uniform_stream_and_without_one_admits_all():
    script = _script()
    prior = script.QuadrantPrior("bottom right", 0.7)
    admitted = [q for q in [0, 1, 2, 3] * 200 if prior.admits(_item_in(q))]
    assert admitted.count(3) == round(0.7 * len(admitted)) and len(admitted) > 250
    everything = script.QuadrantPrior(None, None)
    assert all(everything.admits(_item_in(q)) for q in range(4))


def _learning_rates(ratio: float, steps: int = 100, lr: float = 1e-3, extra: int = 20) -> list[float]:
    """The learning rate of each of `steps` + `extra` updates of the script's optimizer at ``--final-lr-ratio``."""
    from argparse import Namespace

    from mmgrpo.optim import build_optimizer

    args = Namespace(steps=steps, lr=lr, final_lr_ratio=ratio)
    optimizer, schedule = build_optimizer([torch.nn.Parameter(torch.zeros(1))], _script().optimizer_config(args))
    assert optimizer.defaults["weight_decay"] == 0.0
    rates = []
    for _ in range(steps + extra):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    return rates


def test_learning_rate_runs_from_lr_to_the_final_ratio():
    rates = _learning_rates(0.1)
    assert rates[0] == 1e-3 and abs(rates[99] - 1e-4) < 1e-12 and rates[-1] == rates[99]  # the last of --steps on
    assert all(a >= b for a, b in zip(rates, rates[1:]))  # never rises
    assert set(_learning_rates(1.0)) == {1e-3}  # ratio 1: a constant rate


@pytest.mark.parametrize("argv, flag", [
    (["--prior-share", "0.7"], "--prior-quadrant"),
    (["--prior-quadrant", "top left", "--prior-share", "1.0"], "--prior-quadrant"),
    (["--prior-quadrant", "top left", "--prior-share", "0"], "--prior-quadrant"),
    (["--final-lr-ratio", "0"], "--final-lr-ratio"),
])
def test_bad_prior_or_schedule_flags_are_refused_before_training(argv, flag, capsys):
    with pytest.raises(SystemExit):
        _script().main(argv)
    assert flag in capsys.readouterr().err


def test_eval_seed_moves_the_evaluated_scenes_off_the_rl_held_out_set():
    from argparse import Namespace

    script = _script()
    args = Namespace(n_eval=30, size=56, template=script.TEMPLATE, thought="labelled", eval_seed=0, ood=False)
    held_out = script.supervised_source(args).eval_items()
    rl = SegShapes(SegShapesConfig(n_train=0, n_eval=30, prompt_template=script.TEMPLATE)).eval_items()
    assert [i["prompt"] for i in held_out] == [i["prompt"] for i in rl]
    assert all(torch.equal(a["metadata"]["mask"], b["metadata"]["mask"]) for a, b in zip(held_out, rl))
    args.eval_seed = 3
    validation = script.supervised_source(args).eval_items()
    assert not any(torch.equal(a["metadata"]["mask"], b["metadata"]["mask"]) for a, b in zip(validation, rl))
    assert all("completion" in i["metadata"] for i in validation)


def test_keep_writes_each_evaluated_model_as_a_loadable_checkpoint(tmp_path):
    from transformers import Qwen2VLForConditionalGeneration

    out = tmp_path / "base"
    metrics = _script().main(["--init", str(resolve_pretrained("mmgrpo:vlm_seg")), "--out", str(out), "--steps", "2",
                              "--batch", "2", "--eval-every", "1", "--n-eval", "2", "--stop-giou", "1.0", "--keep",
                              "--eval-seed", "3"])
    assert [h["step"] for h in metrics["history"]] == [1, 2]
    first = Qwen2VLForConditionalGeneration.from_pretrained(out / "checkpoint-1")
    last = Qwen2VLForConditionalGeneration.from_pretrained(out / "checkpoint-2")
    final = Qwen2VLForConditionalGeneration.from_pretrained(out)
    assert all(torch.equal(a, b) for a, b in zip(last.state_dict().values(), final.state_dict().values()))
    assert any(not torch.equal(a, b) for a, b in zip(first.state_dict().values(), last.state_dict().values()))


@pytest.mark.parametrize(("name", "share"), [("vlm_seg_skewed", 0.97), ("vlm_seg_top_left", 0.99)])
def test_skewed_base_was_chosen_on_validation_scenes_and_leans_on_the_top_left(name, share):
    """``mmgrpo:vlm_seg_skewed`` and ``mmgrpo:vlm_seg_top_left`` (the default's base, which continues it) end
    supervised runs whose questions named a top-left shape 97% / 99% of the time, scored on validation scenes
    (``--eval-seed``), not the RL held-out ones; greedy, they answer "top left" far more often than the held-out targets
    lie there, a prior RL has to undo."""
    import re

    from mmgrpo.data.seg_shapes import QUADRANTS, target_quadrant

    metrics = json.loads(Path(resolve_pretrained(f"mmgrpo:{name}"), "metrics.json").read_text(encoding="utf-8"))
    assert metrics["args"]["eval_seed"] != 0
    assert (metrics["args"]["prior_quadrant"], metrics["args"]["prior_share"]) == ("top left", share)
    items, _, outputs = _greedy_answers(name, 40)
    answers = outputs["texts"]
    decided = [re.search(r": (top left|top right|bottom left|bottom right)</think>", text) for text in answers]
    said_top_left = sum(m is not None and m.group(1) == "top left" for m in decided)
    truly_top_left = sum(QUADRANTS[target_quadrant(item["metadata"])] == "top left" for item in items)
    assert said_top_left >= truly_top_left + 6, (said_top_left, truly_top_left)
