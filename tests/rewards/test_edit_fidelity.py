"""`edit_fidelity` on hand-made images: a perfect edit scores 1, an unedited output scores the preserved share, a
wrong colour in the edited region or a change elsewhere costs exactly its share of pixels; masks, sizes, paths."""

import pytest
import torch
from PIL import Image

from mmgrpo.rewards.edit_fidelity import EditFidelityConfig, EditFidelityReward
from mmgrpo.types import PromptBatch

RED, BLUE = torch.tensor([0.9, 0.1, 0.1]), torch.tensor([0.1, 0.1, 0.9])


def scene(colour=None, size=8):
    """A black `[3, size, size]` image with a 2 x 2 square of `colour` at rows / columns 2-3 (none without)."""
    image = torch.zeros(3, size, size)
    if colour is not None:
        image[:, 2:4, 2:4] = colour[:, None, None]
    return image


def score(outputs, metadata, **options):
    reward = EditFidelityReward(EditFidelityConfig(dilation=0, **options))
    return reward({"images": torch.stack(outputs)}, PromptBatch(["edit"] * len(outputs), metadata=metadata))


def test_perfect_edit_scores_one_and_the_unedited_input_scores_the_preserved_half():
    source, target = scene(RED), scene(BLUE)  # "make the red square blue"
    truth = {"source_image": source, "target_image": target}
    result = score([target, source], [truth, truth])
    torch.testing.assert_close(result.scores, torch.tensor([1.0, 0.5 + 0.5 * (1 - 0.8 * 2 / 3)]))
    torch.testing.assert_close(result.components["edit_preserve"], torch.ones(2))


def test_a_change_outside_the_region_costs_its_share_of_pixels():
    source, target = scene(RED), scene(None)  # "remove the square": 4 edited pixels, 60 kept
    output = target.clone()
    output[:, 7, 7] = 1.0  # one kept pixel turned white: mean difference 1 over 1 of 60 pixels
    result = score([output], [{"source_image": source, "target_image": target}], change_weight=0.25)
    expected_preserve = 1 - 1 / 60
    torch.testing.assert_close(result.components["edit_change"], torch.ones(1))
    torch.testing.assert_close(result.scores, torch.tensor([0.25 + 0.75 * expected_preserve]))


def test_mask_dilation_and_sizes():
    source, target = scene(RED), scene(BLUE)
    mask = torch.zeros(8, 8, dtype=torch.bool)  # a mask over the whole left half: the region is the mask
    mask[:, :4] = True
    result = score([source], [{"source_image": source, "target_image": target, "edit_mask": mask}])
    torch.testing.assert_close(result.components["edit_change"], torch.tensor([1 - 4 * 0.8 * 2 / 3 / 32]))
    grown = EditFidelityReward(EditFidelityConfig(dilation=1))  # 4 x 4 region: output 16 x 16 of a 8 x 8 truth
    big = torch.nn.functional.interpolate(target[None], size=(16, 16), mode="nearest")
    out = grown({"images": big}, PromptBatch(["e"], metadata=[{"source_image": source, "target_image": target}]))
    assert 0.9 < float(out.scores[0]) <= 1.0


def test_paths_and_missing_truth(tmp_path):
    source, target = scene(RED), scene(BLUE)
    for name, image in {"a.png": source, "b.png": target}.items():
        Image.fromarray((image.permute(1, 2, 0) * 255).round().byte().numpy()).save(tmp_path / name)
    truth = {"source_image": str(tmp_path / "a.png"), "target_image": str(tmp_path / "b.png")}
    result = score([target, target], [truth, {}])
    assert float(result.scores[0]) == pytest.approx(1.0, abs=2e-3) and torch.isnan(result.scores[1])
    whole = torch.ones(8, 8, dtype=torch.bool)  # nothing to preserve: the change term alone
    only = score([target], [{"source_image": source, "target_image": target, "edit_mask": whole}])
    assert torch.isnan(only.components["edit_preserve"][0]) and float(only.scores[0]) == pytest.approx(1.0)


def test_strict_counts_right_pixels_in_each_region():
    """Strict is 1 when >= 80% of the edited pixels are within 0.25 of the target and >= 98% of the others within
    0.25 of the source. On 10 x 10 images with a 5 x 5 recoloured square (25 edited pixels; with dilation 0, 75 kept):
    5 wrong edited pixels (80% right) pass, 6 fail; 1 changed kept pixel (98.7% right) passes, 2 (97.3%) fail."""
    source, target = torch.zeros(3, 10, 10), torch.zeros(3, 10, 10)
    source[:, :5, :5], target[:, :5, :5] = RED[:, None, None], BLUE[:, None, None]
    truth = {"source_image": source, "target_image": target}

    def with_errors(region_wrong, kept_wrong):
        out = target.clone()
        out.view(3, -1)[:, [r * 10 + c for r in range(5) for c in range(5)][:region_wrong]] = RED[:, None]
        out[:, 9, :kept_wrong] = 1.0  # white: 1 away from the black source
        return out

    outputs = [with_errors(0, 0), with_errors(5, 0), with_errors(6, 0), with_errors(0, 1), with_errors(0, 2), source]
    result = score(outputs, [truth] * len(outputs))
    torch.testing.assert_close(result.components["strict"], torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0]))
    near = target + 0.24  # every pixel within the tolerance: strict, although the graded score is below 1
    result = score([near, near], [truth, truth])
    assert result.components["strict"].tolist() == [1.0, 1.0] and float(result.scores[0]) < 0.8
    assert score([near], [truth], strict_tolerance=0.2).components["strict"].tolist() == [0.0]
    assert torch.isnan(score([target], [{}]).components["strict"][0])
    strict = score(outputs, [truth] * len(outputs), score="strict")
    torch.testing.assert_close(strict.scores, strict.components["strict"])


def test_config_errors_name_the_option():
    with pytest.raises(ValueError, match="change_weight"):
        EditFidelityConfig(change_weight=1.5)
    with pytest.raises(ValueError, match="threshold"):
        EditFidelityConfig(threshold=0.0)
    with pytest.raises(ValueError, match="strict_tolerance"):
        EditFidelityConfig(strict_tolerance=0.0)
    with pytest.raises(ValueError, match="strict_preserve_share"):
        EditFidelityConfig(strict_preserve_share=1.5)
    with pytest.raises(ValueError, match="reward.score"):
        EditFidelityConfig(score="partial")
