"""The flow adapters (`sd3`, `flux`, `wan`) share their model-independent members once, from
`pipelines/_flow_policy.py`, and supply what those members read of them (`FlowModel`)."""

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
