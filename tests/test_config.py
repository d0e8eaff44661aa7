"""Configs are validated strictly, before any model loads, with errors that name the key."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mmgrpo import config as config_mod
from mmgrpo.config import ConfigError

ROOT = Path(__file__).resolve().parent.parent
ALL_CONFIGS = sorted(p for p in (ROOT / "configs").rglob("*.yaml") if "accelerate" not in p.parts)


def base_config(tmp_path, **changes):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\na blue square\n")
    raw = {
        "output_dir": str(tmp_path / "out"),
        "pipeline": {"name": "sd3", "pretrained": "org/some-model", "resolution": 32},
        "algorithm": {"name": "flow_grpo"},
        "reward": {"name": "jpeg"},
        "data": {"name": "prompt_file", "train_file": str(prompts)},
    }
    raw.update(changes)
    return raw


@pytest.mark.parametrize("path", ALL_CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_validate_without_weights(path, monkeypatch):
    monkeypatch.chdir(ROOT)
    cfg = config_mod.load(path)
    assert cfg.train.max_steps >= 1
    assert cfg.pipeline.name and cfg.algorithm.name and cfg.reward.name


def test_real_sd3_config_carries_flow_grpo_hyperparameters(monkeypatch):
    monkeypatch.chdir(ROOT)
    cfg = config_mod.load(ROOT / "configs" / "sd3_5_medium_flow_grpo.yaml")
    assert cfg.pipeline.options.lora_rank == 32 and cfg.pipeline.options.lora_alpha == 64
    assert cfg.algorithm.options.clip_range == 1e-4 and cfg.algorithm.options.noise_level == 0.7
    assert cfg.train.group_size == 24 and cfg.pipeline.options.num_steps == 10


def test_unknown_key_is_named(tmp_path):
    raw = base_config(tmp_path)
    raw["algorithm"]["clip_rnage"] = 0.1
    with pytest.raises(ConfigError, match=r"algorithm\.clip_rnage.*Valid keys.*clip_range"):
        config_mod.from_dict(raw)
    with pytest.raises(ConfigError, match="Unknown config key trian"):
        config_mod.from_dict(base_config(tmp_path, trian={}))
    with pytest.raises(ConfigError, match=r"train\.lr"):
        config_mod.from_dict(base_config(tmp_path, train={"lr": 1.0}))


def test_wrong_type_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"train\.group_size: expected an integer, got 'eight'"):
        config_mod.from_dict(base_config(tmp_path, train={"group_size": "eight"}))
    raw = base_config(tmp_path)
    raw["pipeline"]["guidance_scale"] = "high"
    with pytest.raises(ConfigError, match=r"pipeline\.guidance_scale: expected a number"):
        config_mod.from_dict(raw)
    with pytest.raises(ConfigError, match=r"train\.mixed_precision: expected one of"):
        config_mod.from_dict(base_config(tmp_path, train={"mixed_precision": "fp8"}))


def test_bad_values_explain_the_fix(tmp_path):
    with pytest.raises(ConfigError, match="group_size must be >= 2"):
        config_mod.from_dict(base_config(tmp_path, train={"group_size": 1}))
    raw = base_config(tmp_path)
    raw["pipeline"]["name"] = "sd4"
    with pytest.raises(ConfigError, match="Unknown pipeline 'sd4'. Registered pipelines: .*sd3"):
        config_mod.from_dict(raw)


def test_missing_model_path(tmp_path):
    raw = base_config(tmp_path)
    raw["pipeline"]["pretrained"] = str(tmp_path / "no_such_model")
    with pytest.raises(ConfigError, match="does not exist. Point pipeline.pretrained at"):
        config_mod.from_dict(raw)
    raw["pipeline"]["pretrained"] = "mmgrpo:no_such_toy"
    with pytest.raises(ConfigError, match="no shipped model"):
        config_mod.from_dict(raw)


def test_empty_or_missing_prompt_file(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    raw = base_config(tmp_path)
    raw["data"]["train_file"] = str(empty)
    with pytest.raises(ConfigError, match="holds no prompt"):
        config_mod.from_dict(raw)
    raw["data"]["train_file"] = str(tmp_path / "missing.txt")
    with pytest.raises(ConfigError, match="does not exist"):
        config_mod.from_dict(raw)


def test_overrides_apply_and_are_checked(tmp_path):
    raw = config_mod.apply_overrides(
        base_config(tmp_path), ["train.group_size=4", "algorithm.kl_beta=0.01", "train.learning_rate=3e-4"]
    )
    cfg = config_mod.from_dict(raw)
    assert cfg.train.group_size == 4 and cfg.algorithm.options.kl_beta == 0.01
    assert cfg.train.learning_rate == 3e-4  # PyYAML reads "3e-4" as a string; a float field accepts it
    with pytest.raises(ConfigError, match="must look like"):
        config_mod.apply_overrides(raw, ["train.group_size"])


def test_cli_reports_config_error_before_loading_models(tmp_path):
    """The CLI fails fast (no model load, no traceback) and names the key."""
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(base_config(tmp_path, train={"group_sise": 4})))
    proc = subprocess.run(
        [sys.executable, "-m", "mmgrpo.cli", "train", str(path)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    assert "train.group_sise" in proc.stderr and "Traceback" not in proc.stderr
    assert "Loading pipeline" not in proc.stderr
    assert not (tmp_path / "out").exists()
