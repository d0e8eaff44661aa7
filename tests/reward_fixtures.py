"""Fixtures of the reward tests: a tiny open_clip model folder, an aesthetic head file, a running reward server, and
random 8-bit video clips.

Test modules import the fixtures they use (``from reward_fixtures import tiny_clip_dir``); pytest finds fixtures in a
module's namespace.
"""

import json

import numpy as np
import pytest
import torch

TINY_CLIP = {  # an open_clip model config small enough for CPU tests (1.6M parameters, most in the token table)
    "embed_dim": 32,
    "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "head_width": 16, "patch_size": 8},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
}


def write_tiny_clip(folder, seed: int = 0) -> str:
    """Writes a random tiny open_clip model as a ``local-dir:`` folder (config + safetensors); returns the folder."""
    import open_clip
    from safetensors.torch import save_file

    (folder / "open_clip_config.json").write_text(json.dumps({"model_cfg": TINY_CLIP, "preprocess_cfg": {}}))
    torch.manual_seed(seed)
    model = open_clip.create_model(f"local-dir:{folder}")  # no weights in the folder yet: random initialisation
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "open_clip_model.safetensors"))
    return str(folder)


@pytest.fixture(scope="session")
def tiny_clip_dir(tmp_path_factory):
    return write_tiny_clip(tmp_path_factory.mktemp("tiny_clip"))


@pytest.fixture(scope="session")
def tiny_aesthetic_head(tmp_path_factory):
    """A LAION-architecture head for the tiny CLIP's 32-d embeddings, saved like the original (``layers.*`` keys)."""
    from mmgrpo.rewards.aesthetic import laion_head

    torch.manual_seed(0)
    head = laion_head(TINY_CLIP["embed_dim"])
    path = tmp_path_factory.mktemp("aesthetic") / "head.pth"
    torch.save({f"layers.{k}": v for k, v in head.state_dict().items()}, path)
    return str(path)


@pytest.fixture(scope="session")
def jpeg_server():
    """A reward server scoring `jpeg` on a free loopback port, in a background thread."""
    from mmgrpo.reward_server import RewardServer
    from mmgrpo.rewards.jpeg import JpegReward

    server = RewardServer(JpegReward(), "jpeg").start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tiny_pickscore_dir(tmp_path_factory):
    """A tiny random transformers `CLIPModel` with its `CLIPProcessor` (offline CLIP tokenizer), saved to a folder."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    from builders._tokenizers import clip_tokenizer

    tokenizer = clip_tokenizer(model_max_length=77)
    text = {"vocab_size": len(tokenizer), "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
            "num_attention_heads": 2, "max_position_embeddings": 77, "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "image_size": 32, "patch_size": 8}
    torch.manual_seed(0)
    model = CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)).eval()
    image_processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    path = tmp_path_factory.mktemp("tiny_pickscore")
    model.save_pretrained(path)
    CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(path)
    return str(path)


def clip_of(levels: np.ndarray) -> torch.Tensor:
    """8-bit frames `[N, F, H, W, 3]` (uint8) -> the pipelines' video layout `[N, F, 3, H, W]` in [0, 1]."""
    return torch.from_numpy(levels).permute(0, 1, 4, 2, 3).float() / 255


def random_levels(seed: int = 0, n: int = 2, f: int = 5, size: int = 32) -> np.ndarray:
    """Random 8-bit clips `[n, f, size, size, 3]`: a base image plus per-frame noise, each frame in its own colour
    cast, so that frames differ from each other by various amounts in pixels and in feature space."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, size=(n, 1, size, size, 3))
    drift = rng.integers(-40, 41, size=(n, f, size, size, 3))
    cast = rng.uniform(0.1, 1.0, size=(n, f, 1, 1, 3))
    return np.clip((base + drift) * cast, 0, 255).round().astype(np.uint8)


@pytest.fixture(scope="session")
def tiny_hps_checkpoint(tmp_path_factory):
    """A tiny open_clip folder (architecture only) and, beside it, a random state dict of that model saved as the
    HPSv2 authors save theirs (``torch.save({"state_dict": ...})``, as ``HPS_v2.1_compressed.pt``)."""
    import open_clip

    folder = tmp_path_factory.mktemp("tiny_hps")
    (folder / "open_clip_config.json").write_text(json.dumps({"model_cfg": TINY_CLIP, "preprocess_cfg": {}}))
    torch.manual_seed(1)
    model = open_clip.create_model(f"local-dir:{folder}")  # random weights: the folder holds none
    checkpoint = tmp_path_factory.mktemp("hps_weights") / "HPS_v2.1_compressed.pt"
    torch.save({"state_dict": model.state_dict()}, checkpoint)
    return str(folder), str(checkpoint)


OCR_CHARACTERS = list("abcdefghijklmnopqrstuvwxyz0123456789 ")


@pytest.fixture(scope="session")
def tiny_trocr_dir(tmp_path_factory):
    """A tiny random TrOCR (`VisionEncoderDecoderModel`: ViT encoder, `TrOCRForCausalLM` decoder) with a
    `TrOCRProcessor` (ViT image processor, character tokenizer), saved with ``save_pretrained``."""
    from transformers import (
        TrOCRConfig, TrOCRForCausalLM, TrOCRProcessor, ViTConfig, ViTImageProcessor, ViTModel, VisionEncoderDecoderModel,
    )

    from builders._tokenizers import CHAR_SPECIALS, char_tokenizer

    tokenizer = char_tokenizer(OCR_CHARACTERS)
    torch.manual_seed(0)
    encoder = ViTModel(ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                 image_size=32, patch_size=8))
    decoder = TrOCRForCausalLM(TrOCRConfig(
        vocab_size=len(tokenizer), d_model=32, decoder_layers=1, decoder_attention_heads=2, decoder_ffn_dim=64,
        max_position_embeddings=64, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.bos_token_id, cross_attention_hidden_size=32,
    ))
    with torch.no_grad():  # predicts characters only (specials at logit 0, the others spread): greedy decoding
        decoder.output_projection.weight.mul_(100)  # reads a text that depends on the image, max_new_tokens long
        decoder.output_projection.weight[:len(CHAR_SPECIALS)] = 0
    model = VisionEncoderDecoderModel(encoder=encoder, decoder=decoder).eval()
    model.config.decoder_start_token_id = tokenizer.bos_token_id
    model.config.pad_token_id, model.config.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    model.generation_config.decoder_start_token_id = tokenizer.bos_token_id
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    image_processor = ViTImageProcessor(size={"height": 32, "width": 32}, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    path = tmp_path_factory.mktemp("tiny_trocr")
    model.save_pretrained(path)
    TrOCRProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(path)
    return str(path)


def write_tiny_owl(folder, version: int = 1) -> str:
    """Writes a tiny random OWL-ViT (`version` 1) or OWLv2 (2) zero-shot detector with its processor (offline CLIP
    tokenizer) to `folder`; returns the folder."""
    from transformers import (
        Owlv2Config, Owlv2ForObjectDetection, Owlv2ImageProcessor, Owlv2Processor, OwlViTConfig,
        OwlViTForObjectDetection, OwlViTImageProcessor, OwlViTProcessor,
    )

    from builders._tokenizers import clip_tokenizer

    config_cls, model_cls, image_cls, processor_cls = {
        1: (OwlViTConfig, OwlViTForObjectDetection, OwlViTImageProcessor, OwlViTProcessor),
        2: (Owlv2Config, Owlv2ForObjectDetection, Owlv2ImageProcessor, Owlv2Processor),
    }[version]

    tokenizer = clip_tokenizer(model_max_length=16)
    text = {"vocab_size": len(tokenizer), "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
            "num_attention_heads": 2, "max_position_embeddings": 16, "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "image_size": 32, "patch_size": 8}
    torch.manual_seed(0)
    model = model_cls(config_cls(text_config=text, vision_config=vision, projection_dim=32)).eval()
    resize = {"do_center_crop": False} if version == 1 else {}
    image_processor = image_cls(size={"height": 32, "width": 32}, **resize)
    model.save_pretrained(folder)
    processor_cls(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def tiny_owlvit_dir(tmp_path_factory):
    """A tiny random OWL-ViT zero-shot detector with its processor, saved to a folder."""
    return write_tiny_owl(tmp_path_factory.mktemp("tiny_owlvit"), version=1)


IMAGE_REWARD_WORDS = "a photo of red blue green circle square triangle on".split()
IMAGE_REWARD_MED_CONFIG = {  # the authors' med_config.json (BERT with cross-attention), tiny
    "vocab_size": 5 + len(IMAGE_REWARD_WORDS), "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
    "num_attention_heads": 2, "max_position_embeddings": 64, "hidden_act": "gelu", "layer_norm_eps": 1e-12,
    "pad_token_id": 0, "add_cross_attention": True, "encoder_width": 768, "type_vocab_size": 2,
}
# BlipVisionModel's names -> the authors' BLIP ViT names (top level; per block below)
AUTHORS_TOP = {"embeddings.class_embedding": "cls_token", "embeddings.position_embedding": "pos_embed",
               "embeddings.patch_embedding.weight": "patch_embed.proj.weight",
               "embeddings.patch_embedding.bias": "patch_embed.proj.bias",
               "post_layernorm.weight": "norm.weight", "post_layernorm.bias": "norm.bias"}
AUTHORS_BLOCK = {"layer_norm1": "norm1", "self_attn.qkv": "attn.qkv", "self_attn.projection": "attn.proj",
                 "layer_norm2": "norm2", "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2"}


def authors_vision_key(key):
    """A `BlipVisionModel` key as the authors' BLIP code names it."""
    if key in AUTHORS_TOP:
        return AUTHORS_TOP[key]
    _, _, layer, rest = key.split(".", 3)  # encoder.layers.N.<rest>
    module, param = rest.rsplit(".", 1)
    return f"blocks.{layer}.{AUTHORS_BLOCK[module]}.{param}"


@pytest.fixture(scope="module")
def tiny_image_reward(tmp_path_factory):
    """A tiny random ImageReward saved as the authors save theirs: ``ImageReward.pt`` with their BLIP code's key
    names, ``med_config.json``, and a BERT WordPiece tokenizer folder; returns the folder and the modules."""
    from transformers import BertTokenizer, BlipTextConfig, BlipTextModel, BlipVisionConfig, BlipVisionModel

    from mmgrpo.rewards.aesthetic import laion_head

    folder = tmp_path_factory.mktemp("image_reward")
    (folder / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *IMAGE_REWARD_WORDS]) + "\n")
    BertTokenizer(str(folder / "vocab.txt")).save_pretrained(folder / "tokenizer")
    torch.manual_seed(0)
    vision = BlipVisionModel(BlipVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                              num_attention_heads=1, image_size=32, patch_size=8, layer_norm_eps=1e-6))
    text = BlipTextModel(BlipTextConfig(**{k: IMAGE_REWARD_MED_CONFIG[k] for k in ("vocab_size", "hidden_size", "intermediate_size",
                                           "num_hidden_layers", "num_attention_heads", "max_position_embeddings")},
                                        encoder_hidden_size=64, is_decoder=True), add_pooling_layer=False)
    head = laion_head(32)
    state = {f"blip.visual_encoder.{authors_vision_key(k)}": v for k, v in vision.state_dict().items()}
    state.update({f"blip.text_encoder.{k}": v for k, v in text.state_dict().items()})
    state.update({f"mlp.layers.{k}": v for k, v in head.state_dict().items()})
    state.update({"blip.vision_proj.weight": torch.zeros(16, 64), "blip.text_proj.weight": torch.zeros(16, 32),
                  "blip.text_encoder.embeddings.position_ids": torch.arange(64)[None]})  # unused by the score
    torch.save(state, folder / "ImageReward.pt")
    (folder / "med_config.json").write_text(json.dumps(IMAGE_REWARD_MED_CONFIG))
    return folder, vision.eval(), text.eval(), head.eval()
