"""rewards._common.weights_path: where a reward model's weights file is read from (a file, a folder, the hub)."""

import pytest

from mmgrpo.rewards._common import weights_path

ARGS = dict(reward="hpsv2", option="checkpoint", hub_repo="xswu/HPSv2")


def test_a_file_is_itself_and_a_folder_holds_the_file(tmp_path):
    weights = tmp_path / "other_name.pt"
    weights.write_bytes(b"0")
    assert weights_path(str(weights), "HPS_v2.1_compressed.pt", **ARGS) == str(weights)
    assert weights_path(str(tmp_path), "HPS_v2.1_compressed.pt", **ARGS) == str(tmp_path / "HPS_v2.1_compressed.pt")


def test_a_hub_id_that_cannot_be_fetched_names_the_option_and_the_source(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    expected = r"(?s)hpsv2: could not get x\.pt .*huggingface\.co/xswu/HPSv2 and set hpsv2\.checkpoint"
    with pytest.raises(RuntimeError, match=expected):
        weights_path("nobody/no-such-repo", "x.pt", **ARGS)
