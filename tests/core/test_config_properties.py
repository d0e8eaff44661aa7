"""Property tests over every shipped config (configs/*.yaml, configs/tiny/*.yaml): a field set to a wrong type, a
boundary, an out-of-range or non-finite value, a key dropped or an unknown key added, and the command line either
accepts the config or refuses it at once, with exit code 2 and one line that names the mutated key. Accepted
mutations of the tiny configs then train one step.

Real-model configs cannot load their weights here; `mmgrpo check` needs none of them (their hub ids are not looked
up), so for them "accepted" is what `check` says.
"""

import copy
import math
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from mmgrpo import config as config_mod
from mmgrpo.cli import main
from mmgrpo.config_yaml import dump_yaml, read_yaml
from mmgrpo.preflight import preflight
from mmgrpo.validation import ConfigError

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml")) + sorted((ROOT / "configs" / "tiny").glob("*.yaml"))
TINY = [p for p in CONFIGS if p.parent.name == "tiny"]
RAW = {p: read_yaml(p) for p in CONFIGS}
SETTINGS = dict(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                         HealthCheck.too_slow])
WRONG_TYPES = [None, "text", [1, 2], {"bogus": 1}, True]
BOGUS = "bogus_option"


def key_paths(node: dict, prefix: tuple = ()):
    """Every key path of a config mapping, sections included (lists are values)."""
    for key, value in node.items():
        yield prefix + (key,)
        if isinstance(value, dict):
            yield from key_paths(value, prefix + (key,))


def replacements(value, small: bool) -> list:
    """Values to put in place of `value`: its type's boundaries, out-of-range and non-finite values, other types.
    `small` keeps integers small enough to train with (the one-step test)."""
    if isinstance(value, bool):
        typed = [not value, 1, "yes"]
    elif isinstance(value, int):
        typed = [-1, 0, 1, 2, 3] if small else [value - 1, value + 1, -1, 0, 1, 2**32, 2**63, -(2**63)]
    elif isinstance(value, float):
        typed = [0.0, -value, value / 2, 1.0, math.nan, math.inf, -math.inf] + ([] if small else [1e308])
    elif isinstance(value, str):
        typed = ["", " ", "no", "3", value + "x"]
    elif isinstance(value, list):
        typed = [[], value + value[:1], [None], value[:1]]
    else:
        typed = [{}, []]
    return typed + WRONG_TYPES


@st.composite
def mutations(draw, configs: list[Path], small: bool = False):
    """``(config path, mutated mapping, mutated key path, the key name an error must mention)``."""
    path = draw(st.sampled_from(configs))
    raw = copy.deepcopy(RAW[path])
    key = draw(st.sampled_from(list(key_paths(raw))))
    parent = raw
    for part in key[:-1]:
        parent = parent[part]
    kind = draw(st.sampled_from(["set", "set", "set", "drop", "add"]))
    if kind == "set":
        parent[key[-1]] = draw(st.sampled_from(replacements(parent[key[-1]], small)))
    elif kind == "drop":
        del parent[key[-1]]
    else:
        parent[BOGUS] = 1
        return path, raw, ".".join(key[:-1] + (BOGUS,)), BOGUS
    return path, raw, ".".join(map(str, key)), str(key[-1])


@settings(max_examples=45, **SETTINGS)
@given(case=mutations(CONFIGS))
def test_check_accepts_or_refuses_at_once_naming_the_key(case, tmp_path, monkeypatch, capsys):
    path, raw, key, named = case
    monkeypatch.chdir(ROOT)  # the configs' relative paths (prompt files) are relative to the repository
    file = tmp_path / path.name
    file.write_text(dump_yaml(raw), encoding="utf-8")
    start = time.perf_counter()
    code = main(["check", str(file), "--trust-remote-code"])  # value checks only (LLaDA's config asks for its code)
    elapsed = time.perf_counter() - start
    out, err = capsys.readouterr()
    assert code in (0, 2), (key, code)
    event("refused" if code else "accepted")
    if code == 2:
        assert err.startswith("mmgrpo: config error: ") and err.count("\n") == 1, err
        assert named in err, f"mutating {key} was refused without naming it: {err}"
    else:
        assert out.endswith("ok\n") and not err
    assert elapsed < 30, f"{key}: {elapsed:.1f} s"


SMALL_RUN = {"train": {"max_steps": 1, "prompts_per_step": 2, "group_size": 4, "minibatch_size": 8},
             "eval": {"every": 0, "every_seconds": 0.0}, "data": {"n_train": 8, "n_eval": 2}}


def shrink(raw: dict, key: str, output_dir: Path) -> dict:
    """`raw` with one-step sizes and `output_dir`, except where the mutation is (the mutated key and its section)."""
    if not key.startswith("output_dir"):
        raw["output_dir"] = str(output_dir)
    for section, values in SMALL_RUN.items():
        if not isinstance(raw.get(section, {}), dict) or key == section:
            continue
        for name, value in values.items():
            if f"{section}.{name}" != key and (section != "data" or name in raw.get(section, {})):
                raw.setdefault(section, {})[name] = value
    return raw


@pytest.fixture(scope="module")
def trainer_cls():
    from mmgrpo.trainer import Trainer

    return Trainer


@settings(max_examples=12, **SETTINGS)
@given(case=mutations(TINY, small=True))
def test_accepted_mutations_of_tiny_configs_train_one_step(case, tmp_path, monkeypatch, trainer_cls):
    path, raw, key, named = case
    monkeypatch.chdir(tmp_path)  # a mutated, relative output_dir lands here
    raw = shrink(raw, key, tmp_path / "run")
    try:
        config = config_mod.from_dict(raw)
        preflight(config)
    except ConfigError as err:
        assert named in str(err), f"mutating {key} was refused without naming it: {err}"
        event("refused")
        return
    event(f"trained one step: {path.name}")
    trainer = trainer_cls(config)
    trainer.step = 1  # what Trainer.train does before each step
    metrics = trainer.timed_train_step()
    assert metrics["samples_seen"] == config.train.prompts_per_step * config.train.group_size


LINE_TEXT = st.text(st.characters(blacklist_categories=("Cs", "Cc")), max_size=12)  # what one shell word can hold


@settings(max_examples=60, **SETTINGS)
@given(field=st.sampled_from(["eval.metric", "data.template", "train.mixed_precision", "checkpoint.resume_from"]),
       text=st.one_of(LINE_TEXT, st.sampled_from(["no", "yes", "off", "3", "1e-4", "null", "~", "[a]", "{a: 1}"])))
def test_a_string_override_is_the_text_as_typed(field, text):
    """``key=TEXT`` on a field that takes strings gives TEXT itself (``no`` is not false, ``3`` is not 3), or a
    refusal naming the key; ``null`` / ``~`` are None where the field is optional; quoted text is read as YAML."""
    raw = copy.deepcopy(RAW[ROOT / "configs" / "tiny" / "mdlm_arith.yaml"])
    plain = not text.strip().startswith(("'", '"'))
    must_accept = plain and (text in ("no", "bf16", "fp16") if field == "train.mixed_precision" else
                             field == "eval.metric" and text.strip() and text not in ("prompt", "n", "reward"))
    try:
        config = config_mod.from_dict(config_mod.apply_overrides(raw, [f"{field}={text}"]))
    except ConfigError as err:
        assert field in str(err) and not must_accept, err
        event(f"{field} refused")
        return
    event(f"{field} accepted")
    section, name = field.split(".")
    value = getattr(getattr(config, section), name, None)
    if section == "data":
        value = config.data.options.template
    if text.strip() in ("null", "~", "Null", "NULL") and field in ("data.template", "checkpoint.resume_from"):
        assert value is None
    elif plain:
        assert value == text
