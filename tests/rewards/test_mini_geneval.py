"""MiniGenEval: correct renders pass, wrong images fail with the expected partial score, weird images score 0."""

import numpy as np
import pytest
import torch

from mmgrpo.data.shapes import KINDS, PALETTE, all_metadata, prompt_from_metadata, render
from mmgrpo.protocols import RewardFn
from mmgrpo.rewards import mini_geneval
from mmgrpo.rewards.mini_geneval import CHECK_NAMES, MiniGenEval
from mmgrpo.types import PromptBatch, RewardResult


def _tensor(images) -> torch.Tensor:
    return torch.stack([torch.from_numpy(np.asarray(im).copy()).permute(2, 0, 1).float() / 255 for im in images])


def _score(metadata: list[dict], images: torch.Tensor, score: str = "partial") -> RewardResult:
    batch = PromptBatch([prompt_from_metadata(m) for m in metadata], metadata)
    return MiniGenEval(MiniGenEval.Config(score=score))({"images": images}, batch)


def _meta(kind, *objects, relation=None):
    out = {"kind": kind, "objects": [{"color": c, "shape": s, "count": n} for c, s, n in objects]}
    if relation:
        out["relation"] = relation
    return out


def test_plugin_contract():
    reward = mini_geneval.PLUGIN(mini_geneval.PLUGIN.Config())
    assert isinstance(reward, RewardFn)
    assert reward.modalities == frozenset({"image"})


@pytest.mark.parametrize("exact_scene", [False, True])
def test_correct_renders_pass_for_every_kind(exact_scene):
    rng = np.random.default_rng(0)
    pool = all_metadata()
    metadata = [pool[i] for i in rng.choice(len(pool), 300)]
    metadata += [m for kind in KINDS for m in all_metadata((kind,))[:25]]  # every kind surely present
    batch = PromptBatch([prompt_from_metadata(m) for m in metadata], metadata)
    reward = MiniGenEval(MiniGenEval.Config(exact_scene=exact_scene))
    result = reward({"images": _tensor([render(m, rng) for m in metadata])}, batch)
    strict = result.components["strict"]
    kinds = np.array([m["kind"] for m in metadata])
    rates = {kind: strict[torch.from_numpy(kinds == kind)].mean().item() for kind in KINDS}
    print(f"strict rate of correct renders over {len(metadata)} prompts (exact_scene={exact_scene}): "
          f"{strict.mean().item():.4f} {rates}")
    assert strict.mean().item() == 1.0, rates
    assert torch.equal(result.scores, result.components["partial"])
    assert result.scores.dtype == torch.float32 and result.scores.shape == (len(metadata),)


def test_correct_renders_pass_at_64_pixels():
    rng = np.random.default_rng(1)
    metadata = [all_metadata()[i] for i in rng.choice(1602, 40)]
    assert _score(metadata, _tensor([render(m, rng, 64) for m in metadata])).components["strict"].min() == 1.0


RED_CIRCLE_LEFT_OF_BLUE_SQUARE = _meta("position", ("red", "circle", 1), ("blue", "square", 1), relation="left_of")
RED_CIRCLE_AND_GREEN_TRIANGLE = _meta("two_objects", ("red", "circle", 1), ("green", "triangle", 1))
WRONG_IMAGES = [  # (prompt metadata, metadata of the image actually drawn, partial, partial with exact_scene)
    # wrong colour: shape ok, colour no (exact: + count no, total ok)
    (_meta("single", ("red", "circle", 1)), _meta("single", ("blue", "circle", 1)), 1 / 2, 2 / 4),
    # wrong shape: nothing (exact: total ok)
    (_meta("single", ("red", "circle", 1)), _meta("single", ("red", "square", 1)), 0.0, 1 / 4),
    # wrong count: shape, colour ok, count no (exact: + total no)
    (_meta("counting", ("green", "triangle", 3)), _meta("counting", ("green", "triangle", 2)), 2 / 3, 2 / 4),
    # swapped position: everything but the relation
    (RED_CIRCLE_LEFT_OF_BLUE_SQUARE, dict(RED_CIRCLE_LEFT_OF_BLUE_SQUARE, relation="right_of"), 4 / 5, 7 / 8),
    (_meta("position", ("cyan", "triangle", 1), ("yellow", "circle", 1), relation="above"),
     _meta("position", ("cyan", "triangle", 1), ("yellow", "circle", 1), relation="below"), 4 / 5, 7 / 8),
    # colours swapped between the two objects: both shapes found, both colours wrong (exact: + total ok)
    (RED_CIRCLE_AND_GREEN_TRIANGLE, _meta("two_objects", ("green", "circle", 1), ("red", "triangle", 1)), 2 / 4, 3 / 7),
    # second object missing: first fully right (exact: + its count; total wrong)
    (RED_CIRCLE_AND_GREEN_TRIANGLE, _meta("single", ("red", "circle", 1)), 2 / 4, 3 / 7),
]


@pytest.mark.parametrize("exact_scene", [False, True])
def test_wrong_images_fail_with_expected_partial(exact_scene):
    rng = np.random.default_rng(2)
    reward = MiniGenEval(MiniGenEval.Config(exact_scene=exact_scene))
    for prompt_meta, drawn_meta, partial, partial_exact in WRONG_IMAGES:
        images = _tensor([render(drawn_meta, rng) for _ in range(5)])
        result = reward({"images": images}, PromptBatch([prompt_from_metadata(prompt_meta)] * 5, [prompt_meta] * 5))
        expected = partial_exact if exact_scene else partial
        assert torch.all(result.components["strict"] == 0), prompt_from_metadata(prompt_meta)
        assert torch.allclose(result.components["partial"], torch.full((5,), expected)), (
            prompt_from_metadata(prompt_meta), result.components["partial"], expected)


def test_extra_objects_are_ignored_unless_exact_scene():
    rng = np.random.default_rng(5)
    prompt = _meta("single", ("red", "circle", 1))
    drawn = _meta("two_objects", ("red", "circle", 1), ("blue", "square", 1))  # the object plus another one
    images = _tensor([render(drawn, rng) for _ in range(4)])
    assert _score([prompt] * 4, images).components["strict"].tolist() == [1.0] * 4  # as in GenEval
    exact = MiniGenEval(MiniGenEval.Config(exact_scene=True))
    result = exact({"images": images}, PromptBatch(["a red circle"] * 4, [prompt] * 4))
    assert result.components["strict"].tolist() == [0.0] * 4
    assert result.components["partial"].tolist() == [0.75] * 4  # shape, colour, count ok; total wrong


def test_weird_images_score_zero_and_never_raise():
    metadata = [_meta("single", ("red", "circle", 1)), _meta("position", ("red", "circle", 1), ("blue", "square", 1),
                                                             relation="below")] * 2
    gen = torch.Generator().manual_seed(0)
    weird = {
        "black": torch.zeros(4, 3, 32, 32),
        "white": torch.ones(4, 3, 32, 32),
        "noise": torch.rand(4, 3, 32, 32, generator=gen),
        "nan": torch.full((4, 3, 32, 32), float("nan")),
        "out_of_range": torch.randn(4, 3, 32, 32, generator=gen) * 5,
        "flat_red": torch.tensor(PALETTE["red"]).float().div(255).view(1, 3, 1, 1).expand(4, 3, 32, 32),
    }
    for name, images in weird.items():
        result = _score(metadata, images)
        assert torch.all(result.components["strict"] == 0), name
        assert torch.all(result.components["partial"] == 0), (name, result.components["partial"])
    wrong_shape = _score(metadata, torch.zeros(4, 1, 32, 32))
    assert torch.all(wrong_shape.scores == 0)


def test_strict_score_and_components():
    rng = np.random.default_rng(3)
    metadata = [_meta("counting", ("magenta", "circle", 2)), _meta("single", ("red", "square", 1))]
    images = _tensor([render(metadata[0], rng), render(_meta("single", ("red", "circle", 1)), rng)])
    result = _score(metadata, images, score="strict")
    assert result.scores.tolist() == [1.0, 0.0]
    assert set(result.components) == {"strict", "partial"} | {f"check_{n}" for n in CHECK_NAMES}
    assert torch.isnan(result.components["check_relation"]).all()
    assert torch.isnan(result.components["check_total"]).all()
    assert result.components["check_count_0"][0] == 1.0 and torch.isnan(result.components["check_count_0"][1])


def test_non_shapes_metadata_is_nan():
    result = MiniGenEval()({"images": torch.zeros(2, 3, 32, 32)},
                           PromptBatch(["a cat", "a red circle"], [{}, _meta("single", ("red", "circle", 1))]))
    assert torch.isnan(result.scores[0]) and result.scores[1] == 0


def test_config_validation():
    with pytest.raises(ValueError, match="partial"):
        MiniGenEval.Config(score="best")
    with pytest.raises(ValueError, match="color_threshold"):
        MiniGenEval.Config(color_threshold=2.0)


def test_detector_finds_objects():
    rng = np.random.default_rng(4)
    meta = _meta("position", ("yellow", "triangle", 1), ("cyan", "circle", 1), relation="left_of")
    objects = MiniGenEval().detect(_tensor([render(meta, rng)]))[0]
    assert sorted((o["color"], o["shape"]) for o in objects) == [("cyan", "circle"), ("yellow", "triangle")]
    left = min(objects, key=lambda o: o["cx"])
    assert left["color"] == "yellow"
