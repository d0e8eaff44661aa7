"""Hub ids are validated by the hub client's own rules (``huggingface_hub.utils.validate_repo_id``), before anything
loads or is exported: a config's model location and ``mmgrpo export --push-to-hub``."""

import pytest
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id

from mmgrpo import cli
from mmgrpo.hub import is_hub_id, resolve_pretrained

# well-formed by a plain `namespace/name` pattern, refused by the hub
REFUSED_BY_THE_HUB = ["org/na--me", "org/na..me", "org/name.git", "org/" + "a" * 100, "org/-name", "org/name."]
VALID = ["Qwen/Qwen2.5-VL-3B-Instruct", "stabilityai/stable-diffusion-3.5-medium", "org_1/name_2"]


@pytest.mark.parametrize("location", REFUSED_BY_THE_HUB + VALID)
def test_a_hub_id_is_what_the_hub_client_accepts_as_namespace_and_name(location):
    try:
        validate_repo_id(location)
        accepted = True
    except HFValidationError:
        accepted = False
    assert is_hub_id(location) == accepted == (location in VALID)


@pytest.mark.parametrize("location", REFUSED_BY_THE_HUB)
def test_a_model_location_the_hub_would_refuse_is_refused_before_loading(location):
    with pytest.raises(ValueError, match="does not exist. Point pipeline.pretrained at"):
        resolve_pretrained(location, "pipeline.pretrained")


@pytest.mark.parametrize("location", ["gpt2", "mmgrpo:vlm_shapes", "a/b/c"])
def test_a_name_without_namespace_a_shipped_model_or_a_path_is_no_hub_id(location):
    assert not is_hub_id(location)


def test_push_to_hub_refuses_an_invalid_repository_id_before_exporting(tmp_path, capsys):
    code = cli.main(["export", str(tmp_path / "no_run"), str(tmp_path / "out"), "--push-to-hub", "me/model--v1"])
    err = capsys.readouterr().err
    assert code == 2 and "--push-to-hub 'me/model--v1' is not a hub repository id" in err, err
    assert not (tmp_path / "out").exists()
