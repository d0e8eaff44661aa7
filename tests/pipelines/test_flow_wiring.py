"""The flow adapters (`sd3`, `flux`, `wan`) share their model-independent members once, from
`pipelines/_flow_policy.py`, and supply what those members read of them (`FlowModel`)."""

import re

import pytest

from mmgrpo.pipelines import _flow_policy
from mmgrpo.pipelines.flux import FluxPolicy
from mmgrpo.pipelines.sd3 import SD3Policy
from mmgrpo.pipelines.wan import WanPolicy

SHARED = ("num_steps", "eval_num_steps", "trainable_parameters", "trainable_modules", "prepare", "reference",
          "sample", "log_prob", "likelihood", "save_pretrained", "load_trainable", "export_pretrained")
OWN = ("sigmas", "_inputs", "_pick", "velocity", "_noise", "_outputs")  # FlowModel's methods
IMAGE_IO = ("_prompt_inputs", "_pick_rows", "_images")  # taken as _inputs, _pick, _outputs by sd3 and flux


def test_the_shared_tuples_hold_the_shared_members_in_order():
    members = (*_flow_policy.SETUP, *_flow_policy.SAMPLING, *_flow_policy.CHECKPOINTS)
    assert members == tuple(vars(_flow_policy)[name] for name in SHARED)
    assert _flow_policy.IMAGE_IO == tuple(vars(_flow_policy)[name] for name in IMAGE_IO)


@pytest.mark.parametrize("policy", [SD3Policy, FluxPolicy])
def test_image_adapters_share_their_inputs_and_outputs(policy):
    assert tuple(vars(policy)[name] for name in ("_inputs", "_pick", "_outputs")) == _flow_policy.IMAGE_IO


@pytest.mark.parametrize("policy", [SD3Policy, FluxPolicy, WanPolicy])
def test_flow_adapters_take_every_shared_member_under_its_own_name(policy):
    wrong = [name for name in SHARED if vars(policy).get(name) is not vars(_flow_policy)[name]]
    assert not wrong, f"{policy.__name__}: {wrong} are not the shared members of the same name"
    assert [name for name in OWN if not callable(vars(policy).get(name))] == []
    assert isinstance(policy.input_names, tuple) and policy.input_names


PACKED = {  # adapter module -> (its config class, how its errors name the 2x2 grouping of the latents, the size fix)
    "flux": ("FluxConfig", "packing", "FLUX.1 is trained up to ~2048"),
    "qwen_image": ("QwenImageConfig", "packing", "Qwen-Image is trained up to ~1664"),
    "z_image": ("ZImageConfig", "patches", "Z-Image is trained up to ~2048"),
    "flux2": ("Flux2Config", "patches", "FLUX.2 is trained up to ~2048"),
}


@pytest.mark.parametrize("name", list(PACKED))
def test_packed_image_adapters_share_their_resolution_checks(name, tiny_flux_dir):
    """The image adapters whose latents are grouped 2x2 into tokens check the resolution with the shared
    `check_resolution` (config) and `check_packing` (loaded pipeline), with their one-line errors unchanged."""
    import importlib
    from types import SimpleNamespace

    from mmgrpo.pipelines._flow_common import check_packing

    config_class, grouping, fix = PACKED[name]
    config = vars(importlib.import_module(f"mmgrpo.pipelines.{name}"))[config_class]
    with pytest.raises(ValueError, match=rf"^resolution must be a positive multiple of 16 \(8x VAE, 2x2 {grouping}\): "
                                         r"24\.$"):
        config(pretrained=tiny_flux_dir, resolution=24, lora_rank=4)
    with pytest.raises(ValueError, match=rf"^resolution.*{re.escape(fix)}"):
        config(pretrained=tiny_flux_dir, resolution=16 * 1024, lora_rank=4)
    wide = SimpleNamespace(vae_scale_factor=16)  # all check_packing reads of a pipeline: a 16x-downsampling VAE
    with pytest.raises(ValueError, match=rf"^pipeline\.resolution 48 is not a multiple of 32 \(2x2 {grouping} of the "
                                         rf"16x-downsampled latents of {re.escape(tiny_flux_dir)}\); choose a multiple "
                                         r"of 32\.$"):
        check_packing(wide, SimpleNamespace(resolution=48, pretrained=tiny_flux_dir), grouping)
