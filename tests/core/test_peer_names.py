"""Names people already know: another toolkit's key for one of our options, written anywhere in a config, fails with
a hint naming our key (which exists) and the difference of convention; `mmgrpo list` describes each plugin in whole
sentences."""

import copy
import re

import pytest

from mmgrpo import registry
from mmgrpo.cli import main
from mmgrpo.config import SECTIONS, from_dict
from mmgrpo.config_yaml import read_yaml
from mmgrpo.peer_names import PEER_NAMES
from mmgrpo.validation import RENAMED, ConfigError, flat_hints

BASE = read_yaml("configs/tiny/t2i_shapes.yaml")


def our_keys(kind: str) -> set[str]:
    """Every key a config may hold under section `kind` (for a plugin kind: of any registered plugin)."""
    if kind in SECTIONS:
        return set(flat_hints(SECTIONS[kind]))
    return {"name"} | {key for name in registry.available(kind) for key in flat_hints(registry.get(kind, name).Config)}


@pytest.mark.parametrize("peer", sorted(PEER_NAMES))
def test_each_hint_names_keys_that_exist(peer):
    for ours in PEER_NAMES[peer].ours:
        section, key = ours.split(".")
        assert key in our_keys(section), f"{peer} -> {ours}, which no {section} has"


def test_loss_types_name_registered_algorithms():
    note = PEER_NAMES["loss_type"].note + PEER_NAMES["importance_sampling_level"].note
    for algorithm in ("grpo", "dr_grpo", "dapo", "sapo", "gspo"):
        assert re.search(rf"(is|algorithm.name:) {algorithm}\b", note) and algorithm in registry.available("algorithm")


@pytest.mark.parametrize("peer", sorted(PEER_NAMES))
@pytest.mark.parametrize("where", ["top", "train", "algorithm"])
def test_a_peer_key_anywhere_gets_the_hint(peer, where):
    raw = copy.deepcopy(BASE)
    node = raw if where == "top" else raw[where]
    if where == "train" and peer in our_keys("train") or where == "algorithm" and peer in flat_hints(
            registry.get("algorithm", raw["algorithm"]["name"]).Config):
        pytest.skip(f"{peer} is an option of {where}")
    node[peer] = 1
    with pytest.raises(ConfigError) as caught:
        from_dict(raw)
    message = str(caught.value)
    if where == "algorithm" and peer in RENAMED:  # our own former name there: the rename message says the new one
        assert f"algorithm.{peer} was renamed: use algorithm." in message
        return
    assert f"{peer} is {PEER_NAMES[peer].toolkits} name: use {' or '.join(PEER_NAMES[peer].ours)}." in message, message
    assert PEER_NAMES[peer].note in message


def test_trl_conventions_are_spelled_out(capsys, tmp_path):
    assert main(["check", "configs/tiny/t2i_shapes.yaml", "train.epsilon=0.2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Unknown config key train.epsilon" in err
    assert "use algorithm.clip_low. The same lower clip: the ratio is clipped at 1 - clip_low" in err


def test_list_lines_are_whole_sentences(capsys):
    assert main(["list"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  ")]
    assert len(lines) == sum(len(registry.available(kind)) for kind in registry.KINDS)
    cut = [line for line in lines if not re.search(r"[.!?][)\"'`]*$", line)]
    assert not cut, cut
