"""A tiny random SAM 2 (real transformers `Sam2Model` + `Sam2Processor`, 128-pixel input, ~220k parameters) for the
segmentation tests; not a pipeline builder (``_``-prefixed: conftest does not register it), so test modules import
its fixture: ``from builders._sam import tiny_sam2_dir``."""

import pytest

IMAGE = 128  # SAM input side (pixels)


def tiny_sam2_config(image: int = IMAGE):
    """A `Sam2Config` small enough for CPU tests: input side `image` (a multiple of 16), HieraDet hidden 12, four stages
    of widths 12..96, FPN 32 with feature maps of 1/4, 1/8 and 1/16 of the side, prompt encoder and mask decoder hidden
    32 (``scripts/train_tiny_sam.py`` trains this model)."""
    from transformers import Sam2Config
    from transformers.models.sam2.configuration_sam2 import Sam2HieraDetConfig, Sam2VisionConfig

    backbone = Sam2HieraDetConfig(
        hidden_size=12, num_attention_heads=1, image_size=[image, image], blocks_per_stage=[1, 1, 2, 1],
        embed_dim_per_stage=[12, 24, 48, 96], num_attention_heads_per_stage=[1, 1, 1, 1],
        window_size_per_stage=[8, 4, 14, 7], global_attention_blocks=[3],
    )
    vision = Sam2VisionConfig(backbone_config=backbone, backbone_channel_list=[96, 48, 24, 12],
                              backbone_feature_sizes=[[image // d, image // d] for d in (4, 8, 16)],
                              fpn_hidden_size=32)
    return Sam2Config(vision_config=vision,
                      prompt_encoder_config={"hidden_size": 32, "image_size": image, "patch_size": 16},
                      mask_decoder_config={"hidden_size": 32, "mlp_dim": 64, "num_attention_heads": 4,
                                           "iou_head_hidden_dim": 32})


def save_tiny_sam2(folder, seed: int = 0) -> str:
    """Writes a random tiny `Sam2Model` and its `Sam2Processor` to `folder` with ``save_pretrained``."""
    import torch
    from transformers import Sam2ImageProcessor, Sam2Model, Sam2Processor

    torch.manual_seed(seed)
    Sam2Model(tiny_sam2_config()).eval().save_pretrained(folder)
    Sam2Processor(image_processor=Sam2ImageProcessor(size={"height": IMAGE, "width": IMAGE})).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def tiny_sam2_dir(tmp_path_factory):
    """A tiny random SAM 2 and its processor, `save_pretrained` to a temporary folder."""
    return save_tiny_sam2(tmp_path_factory.mktemp("tiny_sam2"))
