"""Property tests over every shipped config (configs/*.yaml, configs/tiny/*.yaml): a field set to a wrong type, a
boundary, an out-of-range, non-finite or extreme value (2**63, 1e308, a subnormal, -0.0), a key dropped or an unknown
key added, and the command line either accepts the config or refuses it at once, with exit code 2 and one line that
names the mutated key. Accepted mutations of the tiny configs then train one step. Every numeric key of every shipped
config set to 2**63, 1e30 or 1e308 is refused, naming the key; so are the absurd values found by earlier sweeps.

Real-model configs cannot load their weights here; `mmgrpo check` needs none of them (their hub ids are not looked
up), so for them "accepted" is what `check` says.
"""

import contextlib
import copy
import io
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
EXTREMES = [2**63, -(2**63), 1e30, 1e308, 5e-324, -0.0]  # huge and tiny magnitudes, of either type
HUGE = [2**63, 1e30, 1e308]  # no numeric option of a real run takes any of them


def key_paths(node: dict, prefix: tuple = ()):
    """Every key path of a config mapping, sections included (lists are values)."""
    for key, value in node.items():
        yield prefix + (key,)
        if isinstance(value, dict):
            yield from key_paths(value, prefix + (key,))


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def numeric_paths(node: dict, prefix: tuple = ()):
    """``(key path, list index or None)`` of every number of a config mapping (a list of numbers: its first one)."""
    for key, value in node.items():
        path = prefix + (key,)
        if is_number(value):
            yield path, None
        elif isinstance(value, list) and value and all(is_number(v) for v in value):
            yield path, 0
        elif isinstance(value, dict):
            yield from numeric_paths(value, path)


def replacements(value, small: bool) -> list:
    """Values to put in place of `value`: its type's boundaries, out-of-range and non-finite values, other types.
    `small` keeps integers small enough to train with (the one-step test)."""
    if isinstance(value, bool):
        typed = [not value, 1, "yes"]
    elif isinstance(value, int):
        typed = ([-1, 0, 1, 2, 3] if small else [value - 1, value + 1, -1, 0, 1, 2**32]) + EXTREMES
    elif isinstance(value, float):
        typed = [0.0, -value, value / 2, 1.0, math.nan, math.inf, -math.inf] + EXTREMES
    elif isinstance(value, str):
        typed = ["", " ", "no", "3", value + "x"]
    elif isinstance(value, list):
        typed = [[], value + value[:1], [None], value[:1]]
        if value and all(is_number(v) for v in value):  # an extreme first element
            typed += [[extreme, *value[1:]] for extreme in EXTREMES]
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
    assert elapsed < (10 if code else 30), f"{key}: {elapsed:.1f} s"


def _check(tmp_path, raw: dict, *overrides: str) -> tuple[int, str]:
    """``mmgrpo check`` of mapping `raw` (written to a file, output_dir under `tmp_path`): exit code and stderr."""
    file = tmp_path / "config.yaml"
    file.write_text(dump_yaml({**raw, "output_dir": str(tmp_path / "run")}), encoding="utf-8")
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["check", str(file), "--trust-remote-code", *overrides])
    return code, err.getvalue()


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.relative_to(ROOT / "configs").as_posix())
def test_every_numeric_key_refuses_huge_values_naming_the_key(path, tmp_path, monkeypatch):
    """Each number of the config (every key path, the first number of a list) set to 2**63, 1e30 and 1e308 in turn:
    `mmgrpo check` refuses each at once, in one line naming the key."""
    monkeypatch.chdir(ROOT)  # the configs' relative paths (prompt files) are relative to the repository
    paths = list(numeric_paths(RAW[path]))
    assert paths
    for keys, index in paths:
        for value in HUGE:
            raw = copy.deepcopy(RAW[path])
            parent = raw
            for part in keys[:-1]:
                parent = parent[part]
            if index is None:
                parent[keys[-1]] = value
            else:
                parent[keys[-1]][index] = value
            start = time.perf_counter()
            code, err = _check(tmp_path, raw)
            where = f"{'.'.join(keys)}{'' if index is None else f'[{index}]'}={value!r}"
            assert code == 2, f"{where} was accepted"
            assert err.startswith("mmgrpo: config error: ") and err.count("\n") == 1, err
            assert str(keys[-1]) in err, f"{where} was refused without naming {keys[-1]}: {err}"
            assert time.perf_counter() - start < 5, where


TINY_DIR = ROOT / "configs" / "tiny"
ABSURD = [  # (config, overrides, the key the refusal names): values that `check` accepted, then failed, hung or crashed
    ("vlm_count", ["pipeline.lora_rank=9223372036854775808"], "pipeline.lora_rank"),
    ("vlm_count", ["pipeline.lora_rank=1000"], "pipeline.lora_rank"),  # above the model's hidden size (128)
    ("t2v_shapes", ["pipeline.width=9223372036854775808"], "pipeline.width"),
    ("t2v_shapes", ["pipeline.width=1000000000000000000000000000000"], "pipeline.width"),
    ("t2v_shapes", ["pipeline.width=4096"], "pipeline.width"),  # beyond the transformer's rotary positions
    ("t2i_shapes", ["pipeline.resolution=64"], "pipeline.resolution"),  # beyond SD3's pos_embed_max_size
    ("t2i_shapes", ["pipeline.max_sequence_length=9223372036854775808"], "pipeline.max_sequence_length"),
    ("t2i_shapes", ["train.minibatch_size=9223372036854775808"], "train.minibatch_size"),
    ("t2i_shapes", ["train.max_steps=9223372036854775808", "train.lr_schedule=cosine"], "train.max_steps"),
    ("t2i_shapes", ["train.learning_rate=1e308"], "train.learning_rate"),
    ("t2i_shapes", ["train.learning_rate=10.0"], "train.learning_rate"),
    ("t2i_shapes", ["train.prompts_per_step=9223372036854775808"], "train.prompts_per_step"),
    ("t2i_shapes", ["train.prompts_per_step=1000000"], "train.prompts_per_step"),
    ("vlm_count", ["pipeline.max_new_tokens=1000000000000000000000000000000"], "pipeline.max_new_tokens"),
    ("vlm_count", ["pipeline.max_new_tokens=100000"], "pipeline.max_new_tokens"),  # the model has 2048 positions
    ("mdlm_arith", ["pipeline.gen_length=1000"], "pipeline.gen_length"),  # the model has 256 positions
    ("mdlm_arith", ["pipeline.temperature=5e-324"], "pipeline.temperature"),
    ("temporal_shapes", ["data.num_frames=1000"], "data.num_frames"),  # was refused as data.speed
    ("temporal_shapes", ["data.num_frames=1000000"], "data.num_frames"),
    ("t2i_shapes_flow_grpo", ["algorithm.noise_level=5e-324"], "algorithm.noise_level"),
    ("t2i_shapes", ["train.adam_eps=5e-324"], "train.adam_eps"),
    # a real-model config whose first batch of clips cannot fit in any machine's memory
    ("../wan2_1_t2v_1_3b_flow_grpo", ["train.prompts_per_step=65536", "train.group_size=16", "pipeline.height=720",
                                      "pipeline.width=1280", "pipeline.num_frames=81"], "train.prompts_per_step"),
]


@pytest.mark.parametrize("name, overrides, named", ABSURD, ids=[" ".join(o) for _, o, _ in ABSURD])
def test_absurd_values_are_refused_naming_the_key(name, overrides, named, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    raw = copy.deepcopy(RAW[(TINY_DIR / f"{name}.yaml").resolve()])
    start = time.perf_counter()
    code, err = _check(tmp_path, raw, *overrides)
    assert code == 2, f"{overrides} accepted"
    assert err.startswith("mmgrpo: config error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert named in err, err
    assert time.perf_counter() - start < 5


def test_a_first_batch_larger_than_memory_is_refused_before_it_starts():
    """The memory check compares one step's outputs (samples x the pipeline's output size) with the memory given."""
    from mmgrpo.memory_check import check_memory

    raw = copy.deepcopy(RAW[TINY_DIR / "t2v_shapes.yaml"])  # 5 frames of 32 x 32: 61,440 bytes per clip
    raw["train"].update(prompts_per_step=16, group_size=16)  # 256 clips: 15 MiB
    config = config_mod.from_dict(raw)
    check_memory(config, available=2**30)
    with pytest.raises(ConfigError, match=r"^train\.prompts_per_step x train\.group_size = 256 samples .* lower "
                                          r"train\.prompts_per_step, train\.group_size or pipeline\.num_frames"):
        check_memory(config, available=2**20)


SMALL_RUN = {"train": {"max_steps": 1, "prompts_per_step": 2, "group_size": 4, "minibatch_size": 8},
             "eval": {"every": 0, "every_seconds": 0.0}, "data": {"n_train": 8, "n_eval": 2}}


def shrink(raw: dict, key: str, output_dir: Path) -> dict:
    """`raw` with one-step sizes and `output_dir`, except where the mutation is (the mutated key and its section)."""
    if not key.startswith("output_dir"):
        raw["output_dir"] = str(output_dir)
    tree = raw.get("algorithm", {}).get("name") == "branch_grpo"  # its tree fixes the group size (8 leaves)
    for section, values in SMALL_RUN.items():
        if not isinstance(raw.get(section, {}), dict) or key == section:
            continue
        for name, value in values.items():
            if tree and section == "train" and name in ("group_size", "minibatch_size"):
                continue
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
