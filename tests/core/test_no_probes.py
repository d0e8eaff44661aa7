"""No probes of our own objects: a `getattr` / `hasattr` call in the package, `pipelines/`, `rewards/` or `data/` reads
another library's object (torch, transformers, diffusers, accelerate, numpy, sympy, typing, an exception...) and is
listed below with the reason. What our own plugins, records and configs have is declared (``provides``,
``capabilities``, ``traits``, ``modalities_for`` / ``artifacts_for``, dataclass fields) and read as such, so a new
probe of one of them fails here."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("mmgrpo", "pipelines", "rewards", "data")
PROBES = {"getattr", "hasattr"}

# (file, the source of the call's first argument) -> why that object is another library's
ALLOWED = {
    ("mmgrpo/reference.py", "accelerator"): "accelerate's Accelerator: prepare_frozen exists in some versions only",
    ("mmgrpo/sharding.py", "m"): "torch modules: transformers / diffusers block lists (_no_split_modules), peft's "
                                 "peft_config",
    ("mmgrpo/sharding.py", "self._accelerator"): "the accelerate Accelerator that the wrapper forwards to",
    ("mmgrpo/model_card.py", "diffusers"): "a diffusers pipeline class named in model_index.json",
    ("mmgrpo/model_card.py", "getattr(diffusers, cls, None)"): "that diffusers class's _optional_components",
    ("mmgrpo/checkpoint.py", "np"): "numpy moved numpy.core to numpy._core in 2.0",
    ("mmgrpo/tracker_samples.py", "tracker"): "accelerate's trackers: only some log images or tables",
    ("mmgrpo/validation.py", "tp"): "a type annotation: typing constructs have no __name__",
    ("mmgrpo/plugin_help.py", "tp"): "a type annotation: typing constructs have no __name__",
    ("pipelines/_checkpointing.py", "model"): "a diffusers / transformers / peft model's checkpointing support",
    ("pipelines/_checkpointing.py", "base"): "the transformers model under a peft wrapper",
    ("pipelines/_flow_policy.py", "pipe"): "a diffusers pipeline's transformers (Wan 2.2 has a second)",
    ("pipelines/_wan_geometry.py", "pipe"): "a diffusers Wan pipeline (transformer_2 in Wan 2.2 only)",
    ("pipelines/_flow_common.py", "result"): "torch's load_state_dict result",
    ("pipelines/_qwen_vl_weights.py", "result"): "torch's load_state_dict result",
    ("pipelines/qwen_vl.py", "transformers"): "a transformers model class by name",
    ("pipelines/_qwen_vl_weights.py", "transformers"): "a transformers model class by name",
    ("pipelines/_qwen_vl_inputs.py", "saved"): "a transformers processor's saved size (an object in some versions)",
    ("pipelines/_mdlm_model.py", "module"): "a transformers attention module's is_causal flag",
    ("pipelines/_mdlm_model.py", "model_config"): "a transformers config (model_type, architectures)",
    ("pipelines/_mdlm_model.py", "model.config"): "a transformers config's mask_token_id",
    ("pipelines/mdlm.py", "out"): "a transformers model output (logits, or a tuple for remote code)",
    ("rewards/_math.py", "sp"): "a sympy function by name",
    ("rewards/remote.py", "err"): "urllib's URLError (reason)",
}


def probes() -> list[tuple[str, int, str]]:
    """Every getattr / hasattr call of the sources: ``(file, line, first argument's source)``."""
    found = []
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            text = path.read_text(encoding="utf-8")
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in PROBES:
                    first = ast.get_source_segment(text, node.args[0]) if node.args else ""
                    found.append((path.relative_to(ROOT).as_posix(), node.lineno, first))
    return found


def test_only_other_libraries_objects_are_probed():
    unlisted = [f"{file}:{line} probes {first!r}" for file, line, first in probes()
                if (file, first) not in ALLOWED]
    assert not unlisted, ("a getattr / hasattr of our own object: declare the member and read it (see "
                          f"mmgrpo/protocols.py), or list another library's object in ALLOWED: {unlisted}")


def test_the_allow_list_names_only_calls_that_exist():
    used = {(file, first) for file, _, first in probes()}
    assert not sorted(set(ALLOWED) - used), "stale ALLOWED entries: remove them"


def test_a_new_probe_of_our_own_object_is_found(tmp_path, monkeypatch):
    """The scan sees a probe of one of our records (what it exists to refuse)."""
    (tmp_path / "mmgrpo").mkdir()
    (tmp_path / "mmgrpo" / "probe.py").write_text("def f(reward):\n    return hasattr(reward, 'artifacts')\n")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    assert probes() == [("mmgrpo/probe.py", 2, "reward")]
