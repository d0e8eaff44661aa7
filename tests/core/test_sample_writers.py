"""Sample writers chosen by output modality: the table, the video writer (MP4s that decode back to their frames, frame
strips, an HTML page), mask overlays, segmentation overlays from a reward's declared artifacts, and an unknown modality
refused by the writer table and by preflight."""

import json

import av
import numpy as np
import pytest
import torch
from PIL import Image

from mmgrpo import config as config_mod, registry
from mmgrpo.preflight import check_modalities
from mmgrpo.sample_writers import WRITERS, SampleWriter, overlay, writers_for
from mmgrpo.types import PromptBatch
from mmgrpo.validation import ConfigError


def decoded_frames(path) -> list[np.ndarray]:
    with av.open(str(path)) as container:
        return [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]  # [H, W, 3] each


def test_table_has_one_writer_per_modality_and_refuses_an_unknown_one():
    assert sorted(WRITERS) == ["image", "mask", "text", "video"]
    assert [w.modality for w in writers_for({"video", "text"}, 4)] == ["text", "video"]
    with pytest.raises(ValueError, match=r"no sample writer for output modality \['hologram'\].*WRITERS"):
        writers_for({"image", "hologram"}, 4)


def test_a_declared_modality_missing_from_the_outputs_is_an_error():
    (writer,) = writers_for({"image"}, 4)
    with pytest.raises(ValueError, match=r"declares modality 'image'.*outputs\['images'\]"):
        writer.add({"texts": ["a"]}, PromptBatch(["p"]))


def test_video_writer_writes_mp4s_that_decode_to_their_frames_strips_and_a_page(tmp_path):
    n, f, h, w = 3, 5, 16, 21  # an odd width: padded to an even one for yuv420p
    videos = torch.zeros(n, f, 3, h, w)  # [N, F, C, H, W]
    for i in range(n):
        for t in range(f):
            videos[i, t, i % 3] = t / (f - 1)  # sample i brightens one channel over time
    writer = SampleWriter("video", limit=2)
    writer.add({"videos": videos[:1]}, PromptBatch(["a red fade"]))
    writer.add({"videos": videos[1:]}, PromptBatch(["a green fade", "a blue fade"]))  # only one more is kept
    written = writer.write(tmp_path, 12, [0.25, -1.5])
    clips = sorted((tmp_path / "step_00012_video").glob("*.mp4"))
    assert [p.name for p in clips] == ["sample_00.mp4", "sample_01.mp4"]
    for i, clip in enumerate(clips):
        frames = decoded_frames(clip)
        assert len(frames) == f and frames[0].shape == (h, w + 1, 3)
        brightness = [float(frame[..., i].mean()) for frame in frames]  # the channel that fades in
        assert brightness[0] < 20 and brightness[-1] > 230 and brightness == sorted(brightness)
    strips = Image.open(tmp_path / "step_00012_video.png")
    assert strips.size[0] > strips.size[1]  # two strips side by side
    page = (tmp_path / "step_00012_video.html").read_text()
    assert "step_00012_video/sample_01.mp4" in page and "a green fade" in page and "-1.500" in page
    assert "a blue fade" not in page and "step_00012_video.png" in page
    assert set(written) == {*clips, tmp_path / "step_00012_video.png", tmp_path / "step_00012_video.html"}


def test_mask_overlay_reddens_the_mask_over_its_input_image(tmp_path):
    image = Image.fromarray(np.full((20, 30, 3), 128, dtype=np.uint8))  # a grey input image
    mask = torch.zeros(10, 15, dtype=torch.bool)
    mask[:, :5] = True  # the left third, at half the image's resolution
    picture = overlay(mask, image)  # [3, 20, 30]
    assert picture.shape == (3, 20, 30)
    assert picture[0, :, :10].min() > 0.7 and picture[1, :, :10].max() < 0.3  # red where the mask is
    torch.testing.assert_close(picture[:, :, 10:], torch.full((3, 20, 20), 128 / 255))  # untouched elsewhere
    writer = SampleWriter("mask", limit=4)
    batch = PromptBatch(["the left part", "nothing"], conditions={"images": [image, [image]]})
    writer.add({"masks": [mask, None]}, batch)
    (path,) = writer.write(tmp_path, 3, [0.9, float("nan")])
    assert path.name == "step_00003_masks.png" and Image.open(path).size[0] > 100


def test_text_writer_keeps_the_jsonl_layout(tmp_path):
    (writer,) = writers_for({"text"}, 1)
    writer.add({"texts": ["<answer>3</answer>", "x"]}, PromptBatch(["how many?", "b"]))
    writer.write(tmp_path, 0, [1.0])
    lines = (tmp_path / "step_00000.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [{"prompt": "how many?", "text": "<answer>3</answer>", "reward": 1}]
    assert "&lt;answer&gt;3" in (tmp_path / "step_00000.html").read_text()


def test_a_reward_declaring_artifacts_gets_overlays_without_any_outputs_key(tmp_path):
    """The text writer draws the masks and prompts a reward declares as artifacts of its result; a ``masks`` key in
    the outputs that no reward declares is not drawn, and a declared artifact missing from a result is an error."""
    image = Image.fromarray(np.full((12, 16, 3), 100, dtype=np.uint8))
    mask = torch.zeros(12, 16, dtype=torch.bool)
    mask[2:6, 3:9] = True
    batch = PromptBatch(["find it", "b"], conditions={"images": [image, image]})
    outputs = {"texts": ["<answer>x</answer>", "y"]}
    artifacts = {"mask": [mask, None], "seg_prompts": [{"boxes": [[3, 2, 9, 6]], "points": [[[5, 4]]],
                                                        "labels": [[1]]}, None]}
    (writer,) = writers_for({"text"}, 4, artifacts=frozenset(artifacts))
    writer.add(outputs, batch, artifacts)
    written = sorted(p.name for p in writer.write(tmp_path, 2, [0.5, 0.0]))
    assert written == ["step_00002.html", "step_00002.jsonl", "step_00002_seg.html", "step_00002_seg.png"]
    assert (tmp_path / "step_00002_seg.html").read_text().count("<img") == 2
    assert writer.segmentation[0]["mask"] is mask and writer.segmentation[1]["prompt"] is None
    undeclared = SampleWriter("text", 4)  # a key in the outputs is no channel: nothing declared, nothing drawn
    undeclared.add({**outputs, "masks": [mask, None]}, batch)
    assert sorted(p.name for p in undeclared.write(tmp_path / "plain", 2, [0.5, 0.0])) == ["step_00002.html",
                                                                                            "step_00002.jsonl"]
    with pytest.raises(ValueError, match=r"declares the artifacts \['mask', 'seg_prompts'\].*artifacts\['seg_prompts'\]"):
        writer.add(outputs, batch, {"mask": [mask, None]})
    (image_writer,) = writers_for({"image"}, 4, artifacts=frozenset(artifacts))  # draws no artifacts of these kinds
    assert image_writer.artifacts == frozenset()


def test_preflight_refuses_a_pipeline_modality_without_writer(tmp_path, monkeypatch):
    (tmp_path / "prompts.txt").write_text("a red circle\n")
    config = config_mod.from_dict({
        "output_dir": str(tmp_path / "out"),
        "pipeline": {"name": "sd3", "pretrained": "org/some-model", "resolution": 32},
        "algorithm": {"name": "flow_grpo"},
        "reward": {"name": "jpeg"},
        "data": {"name": "prompt_file", "train_file": str(tmp_path / "prompts.txt")},
    })
    check_modalities(config)  # images: known
    monkeypatch.setattr(registry.get("pipeline", "sd3"), "modalities", frozenset({"image", "hologram"}))
    with pytest.raises(ConfigError, match=r"pipeline\.name: .*\['hologram'\] has no sample writer"):
        check_modalities(config)
    monkeypatch.setattr(registry.get("pipeline", "sd3"), "modalities", frozenset())
    with pytest.raises(ConfigError, match="which has none"):
        check_modalities(config)


def test_drawn_figures_do_not_pile_up(tmp_path):
    import gc

    from matplotlib.figure import Figure

    from mmgrpo.visualize import save_image_grid

    gc.collect()
    gc.disable()  # a run holding a model rarely reaches a full collection: the figures must not wait for one
    try:
        before = sum(isinstance(o, Figure) for o in gc.get_objects())
        for i in range(3):
            save_image_grid(torch.rand(4, 3, 8, 8), [f"p{j}" for j in range(4)], tmp_path / f"grid{i}.png")
        after = sum(isinstance(o, Figure) for o in gc.get_objects())
    finally:
        gc.enable()
    assert after <= before + 1  # the last one is still referenced by its drawing function while it collects


def test_grid_rows_fit_wide_frame_strips_without_blank_bands(tmp_path):
    from mmgrpo.visualize import save_image_grid

    strips = [torch.rand(3, 32, 5 * 32) for _ in range(4)]  # [3, H, 5 W]: five frames side by side
    squares = [torch.rand(3, 32, 32) for _ in range(4)]  # [3, H, W]
    save_image_grid(strips, ["a red circle moving right"] * 4, tmp_path / "strips.png", columns=2)
    save_image_grid(squares, ["a red circle"] * 4, tmp_path / "squares.png", columns=2)
    strip_size, square_size = Image.open(tmp_path / "strips.png").size, Image.open(tmp_path / "squares.png").size
    assert strip_size[0] == square_size[0]  # same cell width
    assert strip_size[1] < 0.5 * square_size[1]  # rows shrink with the images' height / width
