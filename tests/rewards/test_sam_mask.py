"""The segmenter reward on a tiny real SAM 2 (`Sam2Model` saved and reloaded with `from_pretrained`): one image
embedding per group, batched decoding equal to one-by-one decoding, masks at the original size scored by an
independent IoU, Seg-R1's 0.7 IoU + 0.3 S-measure, config errors before loading, and serving over HTTP."""

import numpy as np
import pytest
import torch
from PIL import Image

from builders._sam import tiny_sam2_dir  # noqa: F401
from mmgrpo.reward_server import RewardServer
from mmgrpo.rewards.remote import RemoteReward
from mmgrpo.rewards.sam_mask import SamMask, SamMaskConfig
from mmgrpo.types import PromptBatch
from mmgrpo.validation import ConfigError

ZERO = '<think>x</think><answer>{{"bbox": {box}, "points_1": {p1}, "points_2": {p2}}}</answer>'
TEXTS = [
    ZERO.format(box=[20, 10, 50, 30], p1=[30, 20], p2=[40, 25]),
    ZERO.format(box=[0, 0, 79, 59], p1=[10, 10], p2=[60, 50]),
    "junk without a box",
    ZERO.format(box=[5, 5, 25, 40], p1=[10, 10], p2=[20, 30]),
]


def _image(seed, height=60, width=80):
    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((height, width, 3)) * 255).astype(np.uint8))


def _batch(group_size=4, images=2):
    truth = torch.zeros(60, 80, dtype=torch.bool)
    truth[10:30, 20:50] = True
    base = PromptBatch([f"segment {k}" for k in range(images)], metadata=[{"mask": truth} for _ in range(images)],
                       conditions={"images": [_image(k) for k in range(images)]})
    return base.repeat(group_size)


@pytest.fixture(scope="module")
def reward(tiny_sam2_dir):
    reward = SamMask(SamMaskConfig(model=tiny_sam2_dir, coords="original", device="cpu"))
    reward.encoded = []  # images per call of SAM's vision encoder
    reward.model.vision_encoder.register_forward_hook(lambda module, args, out: reward.encoded.append(len(args[0])))
    return reward


def test_one_image_embedding_per_group(reward):
    for group_size in (1, 4, 8):
        reward.encoded.clear()
        batch = _batch(group_size, images=2)
        result = reward({"texts": [TEXTS[i % 4] for i in range(len(batch))]}, batch)
        assert reward.encoded == [2]  # one batched encoder call over the 2 distinct images, whatever G
        assert torch.isfinite(result.scores).all()


def test_prompts_on_one_image_path_share_its_embedding(reward, tmp_path):
    _image(3).save(tmp_path / "scene.png")
    truth = torch.zeros(60, 80, dtype=torch.bool)
    batch = PromptBatch(["a", "b", "c"], metadata=[{"mask": truth}] * 3,
                        conditions={"images": [[str(tmp_path / "scene.png")]] * 3}).repeat(2)
    reward.encoded.clear()
    reward({"texts": [TEXTS[0]] * 6}, batch)
    assert reward.encoded == [1]  # three groups asking about one image file: one embedding


def test_batched_decoding_equals_decoding_each_sample_alone(reward):
    batch = _batch(4, images=2)
    outputs = {"texts": [TEXTS[i % 4] for i in range(len(batch))]}
    whole = reward(outputs, batch)
    for i in range(len(batch)):
        single = reward({"texts": [outputs["texts"][i]]}, batch.select([i]))
        assert torch.equal(single.artifacts["mask"][0], whole.artifacts["mask"][i])
        torch.testing.assert_close(single.scores, whole.scores[i : i + 1], rtol=0, atol=1e-6)


def test_masks_are_at_the_original_size_and_scored_by_their_iou(reward):
    batch = _batch(4, images=1)
    outputs = {"texts": TEXTS}
    result = reward(outputs, batch)
    assert list(outputs) == ["texts"]  # the outputs are only read: masks and prompts are the result's artifacts
    assert result.artifacts.keys() == reward.artifacts == SamMask.artifacts_for(reward.config) == {"mask", "seg_prompts"}
    truth = batch.metadata[0]["mask"].numpy()
    for i, mask in enumerate(result.artifacts["mask"]):
        pred = mask.numpy()
        assert pred.shape == (60, 80) and pred.dtype == bool
        inter, union = np.logical_and(pred, truth).sum(), np.logical_or(pred, truth).sum()
        assert result.components["intersection"][i] == inter and result.components["union"][i] == union
        assert result.scores[i].item() == pytest.approx(inter / union, abs=1e-6)
    # the junk answer predicts nothing: IoU 0 against the non-empty truth, and its counters say why
    assert not result.artifacts["mask"][2].any() and result.scores[2] == 0
    assert result.components["no_answer"][2] == 1 and result.components["no_box"][2] == 1
    assert result.components["num_boxes"].tolist() == [1, 1, 0, 1]
    assert result.artifacts["seg_prompts"][0] == {"boxes": [[20, 10, 50, 30]], "points": [[[30, 20], [40, 25]]],
                                         "labels": [[1, 1]]}


def test_seg_r1_scores_0_7_iou_plus_0_3_s_measure_and_unites_boxes(tiny_sam2_dir):
    reward = SamMask(SamMaskConfig(model=tiny_sam2_dir, coords="original", device="cpu", answer_format="seg_r1",
                                   s_measure_weight=0.3))
    text = ("<think>two</think><bbox>[20,10,50,30]</bbox><bbox>[0,0,15,15]</bbox><points>[[30,20],[5,5]]</points>"
            "<labels>[1,1]</labels>")
    batch = _batch(1, images=1)
    outputs = {"texts": [text]}
    result = reward(outputs, batch)
    c = result.components
    assert c["num_boxes"][0] == 2
    assert result.scores[0].item() == pytest.approx(0.7 * c["iou"][0].item() + 0.3 * c["s_measure"][0].item(), abs=1e-6)
    alone = []  # each box with its point alone: the two-box mask is the union of theirs
    for b, p in (("[20,10,50,30]", "[30,20]"), ("[0,0,15,15]", "[5,5]")):
        single = {"texts": [f"<bbox>{b}</bbox><points>[{p}]</points><labels>[1]</labels>"]}
        alone.append(reward(single, batch).artifacts["mask"][0])
    assert torch.equal(result.artifacts["mask"][0], alone[0] | alone[1])


def test_samples_without_truth_are_not_applicable_and_need_no_image(reward):
    batch = PromptBatch(["a", "b"], metadata=[{}, {}])
    result = reward({"texts": TEXTS[:2]}, batch)
    assert torch.isnan(result.scores).all()
    with pytest.raises(ValueError, match="no readable image"):
        reward({"texts": TEXTS[:1]}, PromptBatch(["a"], metadata=[{"mask": torch.ones(4, 4)}]))


def test_config_errors_come_before_any_model_loads(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        SamMaskConfig(model=str(tmp_path / "no_sam"))
    with pytest.raises(ConfigError, match="dtype"):
        SamMaskConfig(model=str(tmp_path), dtype="float64")
    with pytest.raises(ConfigError, match="s_measure_weight"):
        SamMaskConfig(model=str(tmp_path), s_measure_weight=1.5)


def test_a_model_that_is_not_sam_2_is_refused_naming_it(tmp_path):
    from transformers import SamConfig, SamModel

    config = SamConfig(vision_config={"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                                      "image_size": 64, "patch_size": 16, "output_channels": 16,
                                      "num_pos_feats": 8, "mlp_dim": 32},
                       prompt_encoder_config={"hidden_size": 16, "image_size": 64, "patch_size": 16},
                       mask_decoder_config={"hidden_size": 16, "mlp_dim": 32, "num_attention_heads": 2,
                                            "iou_head_hidden_dim": 16})
    SamModel(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="is a SamModel; it runs SAM 2"):
        SamMask(SamMaskConfig(model=str(tmp_path), device="cpu"))


def test_served_over_http_gives_the_in_process_scores_with_one_embedding_per_group(reward):
    batch = _batch(4, images=2)
    outputs = {"texts": [TEXTS[i % 4] for i in range(len(batch))]}
    local = reward(dict(outputs), batch)
    server = RewardServer(reward, "sam_mask").start()
    try:
        reward.encoded.clear()
        remote = RemoteReward(RemoteReward.Config(url=server.url, modalities=["text"], timeout=60.0, retries=0))
        result = remote(outputs, batch)
    finally:
        server.stop()
    assert reward.encoded == [2]  # the server sees group ids: one embedding per group there too
    torch.testing.assert_close(result.scores, local.scores, rtol=0, atol=1e-6)
    torch.testing.assert_close(result.components["union"], local.components["union"], rtol=0, atol=0)
