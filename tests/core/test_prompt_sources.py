"""Contract test over every registered prompt source: it is a `PromptSource` (runtime-checkable protocol), its training
and held-out items are non-empty and well formed, its held-out splits start with ``eval`` (its held-out items), and
no held-out split shares an item with training when the source declares disjoint splits.

Each source is built from the data section of every shipped config that names it (paths relative to the repository
root) and from its default `Config()` where every option has a default, so a new source is tested by adding it and a
config, without a table here."""

import dataclasses
import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from mmgrpo import registry
from mmgrpo.config_yaml import read_yaml
from mmgrpo.protocols import PromptSource
from mmgrpo.validation import build_dataclass

ROOT = Path(__file__).resolve().parents[2]
PROTOCOL_MEMBERS = set(PromptSource.__annotations__) | {
    key for key, value in vars(PromptSource).items() if callable(value) and not key.startswith("_")
}


def _cases() -> list[tuple[str, str, dict]]:
    """``(source, where the options come from, options)`` for every registered source."""
    shipped = {name: [] for name in registry.available("data")}
    for path in sorted((ROOT / "configs").rglob("*.yaml")):
        data = dict(read_yaml(path).get("data") or {})
        name = data.pop("name", None)
        if name in shipped:
            shipped[name].append((path.relative_to(ROOT).as_posix(), data))
    cases = []
    for name, found in shipped.items():
        config_cls = registry.get("data", name).Config
        if all(f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
               for f in dataclasses.fields(config_cls) if f.init):
            found.append(("Config()", {}))
        cases += [(name, where, options) for where, options in found]
    return cases


CASES = _cases()


def item_key(value):
    """A hashable key equal for equal items: prompt, metadata and every condition (images compared by pixels)."""
    if isinstance(value, Image.Image):
        return ("image", value.mode, value.size, hashlib.sha256(value.tobytes()).hexdigest())
    if isinstance(value, (torch.Tensor, np.ndarray)):
        array = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else value
        return ("array", array.shape, str(array.dtype), hashlib.sha256(array.tobytes()).hexdigest())
    if isinstance(value, dict):
        return tuple(sorted((str(k), item_key(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(item_key(v) for v in value)
    return repr(value)


@pytest.fixture
def build(monkeypatch):
    """Builds a source from its options as the trainer does (config paths are relative to the repository root)."""
    monkeypatch.chdir(ROOT)

    def make(name: str, options: dict):
        plugin = registry.get("data", name)
        return plugin(build_dataclass(plugin.Config, dict(options), "data"))

    return make


def test_every_registered_source_is_built_by_a_config_or_its_defaults():
    covered = {name for name, _, _ in CASES}
    missing = sorted(set(registry.available("data")) - covered)
    assert not missing, f"give these prompt sources a shipped config (or defaults for every option): {missing}"


@pytest.mark.parametrize("name, where, options", CASES, ids=[f"{n}-{w}" for n, w, _ in CASES])
def test_source_satisfies_the_prompt_source_contract(build, name, where, options):
    source = build(name, options)
    missing = sorted(m for m in PROTOCOL_MEMBERS if not hasattr(source, m))
    assert isinstance(source, PromptSource) and not missing, (
        f"{name} lacks {missing} of mmgrpo.protocols.PromptSource: declare them on the class (disjoint_splits: True "
        "when no held-out item is ever a training item, False when the user's files decide)"
    )
    assert type(source.disjoint_splits) is bool and dataclasses.is_dataclass(source.Config)
    train, held_out = source.train_items(), source.eval_items()
    assert train and held_out, f"{name} ({where}): {len(train)} training and {len(held_out)} held-out items"
    for item in train + held_out:
        assert isinstance(item["prompt"], str) and item["prompt"].strip(), item
        assert isinstance(item.get("metadata", {}), dict), item
    splits = source.eval_splits()
    assert list(splits)[0] == "eval" and [item_key(i) for i in splits["eval"]] == [item_key(i) for i in held_out]
    assert all(items and isinstance(split, str) and "/" not in split for split, items in splits.items()), list(splits)
    if source.disjoint_splits:
        trained = {item_key(i) for i in train}
        for split, items in splits.items():
            shared = trained & {item_key(i) for i in items}
            assert not shared, f"{name} ({where}) declares disjoint splits but its {split} shares {len(shared)} items"


def test_an_incomplete_source_is_not_a_prompt_source():
    class NoDeclaration:  # train_items / eval_items / eval_splits but no disjoint_splits
        Config = dict

        def train_items(self):
            return [{"prompt": "a", "metadata": {}}]

        def eval_items(self):
            return []

        def eval_splits(self):
            return {"eval": []}

    assert not isinstance(NoDeclaration(), PromptSource)
    NoDeclaration.disjoint_splits = False
    assert isinstance(NoDeclaration(), PromptSource)


def test_item_key_tells_items_apart_by_prompt_metadata_and_pixels():
    black, white = Image.new("RGB", (4, 4)), Image.new("RGB", (4, 4), (255, 255, 255))
    item = {"prompt": "How many?", "metadata": {"answer": "2"}, "images": [black]}
    same = {"images": [Image.new("RGB", (4, 4))], "metadata": {"answer": "2"}, "prompt": "How many?"}
    assert item_key(item) == item_key(same)
    assert item_key(item) != item_key({**item, "images": [white]})
    assert item_key(item) != item_key({**item, "metadata": {"answer": "3"}})
    assert item_key(item) != item_key({**item, "prompt": "How many."})


def test_a_source_whose_files_overlap_is_caught_by_the_disjointness_check(build, tmp_path):
    """The check the contract applies to declared-disjoint sources finds a shared item (prompt files may share)."""
    (tmp_path / "train.txt").write_text("a red circle\ntwo blue squares\n", encoding="utf-8")
    (tmp_path / "eval.txt").write_text("a green triangle\ntwo blue squares\n", encoding="utf-8")
    source = build("prompt_file", {"train_file": str(tmp_path / "train.txt"), "eval_file": str(tmp_path / "eval.txt")})
    shared = {item_key(i) for i in source.train_items()} & {item_key(i) for i in source.eval_items()}
    assert shared == {item_key({"prompt": "two blue squares", "metadata": {}})}
    assert source.disjoint_splits is False
