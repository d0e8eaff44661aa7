"""The synthetic shapes task: prompts, metadata, rendering, train/eval split and determinism."""

import json

import numpy as np
import pytest

from mmgrpo.data import shapes
from mmgrpo.data.shapes import (
    BACKGROUND,
    KINDS,
    PALETTE,
    VOCABULARY,
    ShapesPrompts,
    all_metadata,
    prompt_from_metadata,
    render,
    sample_prompt,
    stable_fraction,
)


def test_plugin_and_docstring():
    assert shapes.PLUGIN is ShapesPrompts
    assert shapes.__doc__.splitlines()[0].strip()


def test_prompts_of_each_kind():
    examples = {
        "single": ({"kind": "single", "objects": [{"color": "red", "shape": "circle", "count": 1}]}, "a red circle"),
        "counting": ({"kind": "counting", "objects": [{"color": "blue", "shape": "square", "count": 2}]},
                     "two blue squares"),
        "two_objects": ({"kind": "two_objects", "objects": [{"color": "red", "shape": "circle", "count": 1},
                                                           {"color": "green", "shape": "triangle", "count": 1}]},
                        "a red circle and a green triangle"),
        "position": ({"kind": "position", "relation": "left_of",
                      "objects": [{"color": "red", "shape": "circle", "count": 1},
                                  {"color": "blue", "shape": "square", "count": 1}]},
                     "a red circle left of a blue square"),
    }
    for metadata, prompt in examples.values():
        assert prompt_from_metadata(metadata) == prompt


def test_enumeration_is_distinct_json_and_uses_vocabulary():
    metadata = all_metadata()
    prompts = [prompt_from_metadata(m) for m in metadata]
    assert len(set(prompts)) == len(prompts) == 18 + 54 + 306 + 1224
    assert json.loads(json.dumps(metadata)) == metadata
    assert {w for p in prompts for w in p.split()} <= set(VOCABULARY)


def test_sample_prompt_is_deterministic():
    a = [sample_prompt(np.random.default_rng(3)) for _ in range(5)]
    b = [sample_prompt(np.random.default_rng(3)) for _ in range(5)]
    assert a == b
    prompt, metadata = a[0]
    assert prompt == prompt_from_metadata(metadata) and metadata["kind"] in KINDS


def test_stable_fraction_is_fixed():
    assert stable_fraction("a red circle") == stable_fraction("a red circle")
    assert 0 <= stable_fraction("x") < 1
    # a fixed value: sha256 does not depend on the process (unlike hash())
    assert abs(stable_fraction("a red circle") - 0.632395) < 1e-6


def test_train_eval_disjoint_and_deterministic():
    source = ShapesPrompts(ShapesPrompts.Config(seed=0, n_train=500, n_eval=200))
    train, held_out = source.train_items(), source.eval_items()
    assert len(train) == 500 and len(held_out) == 200
    assert not {it["prompt"] for it in train} & {it["prompt"] for it in held_out}
    for kind in KINDS:
        pool_train = {prompt_from_metadata(m) for m in source.train_pools[kind]}
        pool_eval = {prompt_from_metadata(m) for m in source.eval_pools[kind]}
        assert pool_train and pool_eval and not pool_train & pool_eval
    # the split depends on the prompt only, not on the seed; the draws depend on the seed
    other = ShapesPrompts(ShapesPrompts.Config(seed=5, n_train=500, n_eval=200))
    assert other.eval_pools == source.eval_pools
    assert other.eval_items() != held_out
    assert ShapesPrompts(ShapesPrompts.Config(seed=0, n_train=500, n_eval=200)).train_items() == train
    # kinds are balanced and items are consistent
    assert [it["metadata"]["kind"] for it in held_out[:4]] == list(KINDS)
    assert all(it["prompt"] == prompt_from_metadata(it["metadata"]) for it in train + held_out)


def test_train_kinds_narrow_training_but_not_the_held_out_set():
    kinds = ("single", "counting", "two_objects")
    full = ShapesPrompts(ShapesPrompts.Config(kinds=kinds, n_train=300, n_eval=60))
    narrow = ShapesPrompts(ShapesPrompts.Config(kinds=kinds, train_kinds=("counting", "two_objects"), n_train=300,
                                                n_eval=60))
    assert {it["metadata"]["kind"] for it in narrow.train_items()} == {"counting", "two_objects"}
    assert [it["metadata"]["kind"] for it in narrow.train_items()[:4]] == ["counting", "two_objects"] * 2
    assert narrow.eval_items() == full.eval_items()  # every kind is still measured, on the same prompts
    assert full.config.train_kinds == kinds
    with pytest.raises(ValueError, match=r"train_kinds .* subset of kinds.*add \['position'\]"):
        ShapesPrompts.Config(kinds=kinds, train_kinds=("counting", "position"))


def test_config_validation_messages():
    with pytest.raises(ValueError, match="kinds"):
        ShapesPrompts.Config(kinds=("single", "colour"))
    with pytest.raises(ValueError, match="eval_fraction"):
        ShapesPrompts.Config(eval_fraction=1.5)
    with pytest.raises(ValueError, match="counts"):
        ShapesPrompts.Config(counts=(0, 7))
    with pytest.raises(ValueError, match="image_size"):
        ShapesPrompts.Config(image_size=8)
    assert ShapesPrompts.Config(kinds=["single"]).kinds == ("single",)


def _pixels(image, color):
    return (np.asarray(image) == np.array(color)).all(-1)


def test_render_draws_the_right_objects():
    rng = np.random.default_rng(0)
    metadata = {"kind": "counting", "objects": [{"color": "yellow", "shape": "square", "count": 3}]}
    image = render(metadata, rng)
    assert image.size == (32, 32) and image.mode == "RGB"
    colors = {tuple(c) for c in np.asarray(image).reshape(-1, 3)}
    assert colors == {BACKGROUND, PALETTE["yellow"]}  # hard edges, no other colour
    assert _pixels(image, PALETTE["yellow"]).sum() >= 3 * 8 * 8


def test_render_position_is_on_the_stated_side():
    rng = np.random.default_rng(1)
    for relation in ("left_of", "right_of", "above", "below"):
        metadata = {"kind": "position", "relation": relation,
                    "objects": [{"color": "red", "shape": "square", "count": 1},
                                {"color": "blue", "shape": "square", "count": 1}]}
        for _ in range(20):
            image = render(metadata, rng)
            ay, ax = np.argwhere(_pixels(image, PALETTE["red"])).mean(0)
            by, bx = np.argwhere(_pixels(image, PALETTE["blue"])).mean(0)
            offset = {"left_of": bx - ax, "right_of": ax - bx, "above": by - ay, "below": ay - by}[relation]
            assert offset >= 4


def test_render_is_deterministic():
    metadata = all_metadata(("position",))[17]
    a = np.asarray(render(metadata, np.random.default_rng(9)))
    b = np.asarray(render(metadata, np.random.default_rng(9)))
    assert np.array_equal(a, b)
    assert not np.array_equal(a, np.asarray(render(metadata, np.random.default_rng(10))))
    assert render(metadata, np.random.default_rng(0), size=64).size == (64, 64)


def test_rl_only_held_out_prompts_were_in_base_training_but_not_in_rl():
    unseen = ShapesPrompts(ShapesPrompts.Config())  # the split the shipped base model was trained with
    rl_only = ShapesPrompts(ShapesPrompts.Config(held_out="rl_only"))
    for kind in unseen.train_pools:
        base_train = {prompt_from_metadata(m) for m in unseen.train_pools[kind]}
        base_unseen = {prompt_from_metadata(m) for m in unseen.eval_pools[kind]}
        rl_train = {prompt_from_metadata(m) for m in rl_only.train_pools[kind]}
        rl_eval = {prompt_from_metadata(m) for m in rl_only.eval_pools[kind]}
        assert rl_eval and rl_train
        assert rl_eval <= base_train and rl_train <= base_train  # the base model saw both
        assert not rl_eval & rl_train  # RL never trains on a held-out prompt
        assert not (rl_eval | rl_train) & base_unseen  # the zero-shot prompts stay out of both
    with pytest.raises(ValueError, match="held_out"):
        ShapesPrompts.Config(held_out="seen")
    with pytest.raises(ValueError, match="below 0.5"):
        ShapesPrompts.Config(held_out="rl_only", eval_fraction=0.6)
