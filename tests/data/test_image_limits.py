"""Prompt sources refuse an image (or mask) over `max_image_pixels` from its header, before decoding it, with one line
naming the file, its size and the option: `vlm_jsonl`, `referring_jsonl`, `hf_dataset`, and the shared
`mmgrpo.image_files.open_image`."""

import io
import json
import struct
import zlib

import pytest
from PIL import Image

from mmgrpo.data.referring_jsonl import ReferringJsonl, ReferringJsonlConfig
from mmgrpo.data.vlm_jsonl import VLMJsonl, VLMJsonlConfig
from mmgrpo.image_files import DEFAULT_MAX_IMAGE_PIXELS, open_image
from mmgrpo.validation import ConfigError


def header_only_png(width: int, height: int) -> bytes:
    """A PNG that claims `width` x `height` and holds no pixels: reading it is fine, decoding it fails."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


ONE_LINE = r"^[^\n]*{}[^\n]*$"


def test_open_image_reads_the_header_and_refuses_before_decoding(tmp_path):
    (tmp_path / "big.png").write_bytes(header_only_png(9000, 9000))  # 81 million pixels, a few bytes
    with pytest.raises(ValueError, match=r"big\.png is 9000x9000 \(81000000 pixels\), over the limit of 67108864 .*"
                                         r"raise data\.max_image_pixels"):
        open_image(tmp_path / "big.png", DEFAULT_MAX_IMAGE_PIXELS)
    with open_image(tmp_path / "big.png", 10**8) as image:  # within a higher limit: opened, nothing decoded yet
        assert image.size == (9000, 9000)
    (tmp_path / "huge.png").write_bytes(header_only_png(20000, 20000))  # past PIL's own bound: still one line
    with pytest.raises(ValueError, match=r"huge\.png is too large to decode"):
        open_image(tmp_path / "huge.png", DEFAULT_MAX_IMAGE_PIXELS)


@pytest.mark.parametrize("row", [{"image": "big.png", "problem": "?"}, {"image": ["ok.png", "big.png"], "problem": "?"},
                                 {"image": "ok.png", "video": ["ok.png", "big.png"], "problem": "?"}])
def test_vlm_jsonl_refuses_an_oversized_image_or_frame(tmp_path, row):
    Image.new("RGB", (40, 30)).save(tmp_path / "ok.png")
    (tmp_path / "big.png").write_bytes(header_only_png(9000, 9000))
    (tmp_path / "rows.jsonl").write_text(json.dumps(row) + "\n")
    source = VLMJsonl(VLMJsonlConfig(train_file=str(tmp_path / "rows.jsonl")))
    with pytest.raises(ValueError, match=ONE_LINE.format(r"rows\.jsonl:1: image .*big\.png is 9000x9000 .*"
                                                         r"data\.max_image_pixels")):
        source.train_items()
    small = VLMJsonl(VLMJsonlConfig(train_file=str(tmp_path / "rows.jsonl"), max_image_pixels=1000))
    (tmp_path / "rows.jsonl").write_text(json.dumps({"image": "ok.png", "problem": "?"}) + "\n")
    with pytest.raises(ValueError, match=r"ok\.png is 40x30 \(1200 pixels\), over the limit of 1000"):
        small.train_items()


def test_referring_jsonl_refuses_an_oversized_image_or_mask(tmp_path):
    Image.new("RGB", (8, 6)).save(tmp_path / "im.png")
    (tmp_path / "big.png").write_bytes(header_only_png(9000, 9000))
    rows = {"image": "big.png", "problem": "it", "mask": {"size": [6, 8], "counts": [48]}}
    (tmp_path / "a.jsonl").write_text(json.dumps(rows) + "\n")
    with pytest.raises(ValueError, match=ONE_LINE.format(r"a\.jsonl:1: image .*big\.png is 9000x9000")):
        ReferringJsonl(ReferringJsonlConfig(train_file=str(tmp_path / "a.jsonl"))).train_items()
    Image.new("L", (80, 60)).save(tmp_path / "mask.png")  # a mask over a 100-pixel limit, on a 48-pixel image
    (tmp_path / "b.jsonl").write_text(json.dumps({"image": "im.png", "problem": "it", "mask": "mask.png"}) + "\n")
    source = ReferringJsonl(ReferringJsonlConfig(train_file=str(tmp_path / "b.jsonl"), max_image_pixels=100))
    with pytest.raises(ValueError, match=r"b\.jsonl:1: image .*mask\.png is 80x60 \(4800 pixels\)"):
        source.train_items()


def test_hf_dataset_refuses_an_oversized_image_before_datasets_decodes_it(tmp_path):
    datasets = pytest.importorskip("datasets", reason="the optional `datasets` extra (installed by .[test])")
    from mmgrpo import registry

    small = io.BytesIO()
    Image.new("RGB", (20, 10), (10, 0, 0)).save(small, format="PNG")
    features = datasets.Features({"problem": datasets.Value("string"), "image": datasets.Image(),
                                  "images": datasets.List(datasets.Image())})
    rows = {"problem": ["a", "b"], "image": [{"bytes": small.getvalue(), "path": "small.png"},
                                             {"bytes": header_only_png(9000, 9000), "path": "big.png"}],
            "images": [[{"bytes": small.getvalue(), "path": None}]] * 2}
    datasets.Dataset.from_dict(rows, features=features).save_to_disk(str(tmp_path / "set"))
    cls = registry.get("data", "hf_dataset")
    first = cls(cls.Config(path=str(tmp_path / "set"), image_column="image", max_train_rows=1)).train_items()[0]
    assert first["images"][0].mode == "RGB" and first["images"][0].getpixel((0, 0)) == (10, 0, 0)
    listed = cls(cls.Config(path=str(tmp_path / "set"), image_column="images", metadata_columns=[])).train_items()
    assert [item["images"][0].size for item in listed] == [(20, 10), (20, 10)]  # the unused column is not decoded
    with pytest.raises(ValueError, match=ONE_LINE.format(r"\[train\] row 1: image big\.png is 9000x9000 .*"
                                                         r"data\.max_image_pixels")):
        cls(cls.Config(path=str(tmp_path / "set"), image_column="image")).train_items()


@pytest.mark.parametrize("value", [0, 2**28, 1.5])
def test_max_image_pixels_is_checked(tmp_path, value):
    (tmp_path / "rows.jsonl").write_text("{}\n")
    for config in (VLMJsonlConfig, ReferringJsonlConfig):
        with pytest.raises(ConfigError, match="max_image_pixels"):
            config(train_file=str(tmp_path / "rows.jsonl"), max_image_pixels=value)
