"""Configs are validated strictly, before any model loads, with errors that name the key."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from mmgrpo import config as config_mod
from mmgrpo.config import ConfigError
from mmgrpo.sections import TrainConfig
from algorithm_options import algo_config

ROOT = Path(__file__).resolve().parents[2]
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
    assert cfg.algorithm.options.clip.clip_low == 1e-4 and cfg.algorithm.options.sde.noise_level == 0.7
    assert cfg.algorithm.options.advantage.scale_rewards == "batch"  # the authors' global_std: true
    assert cfg.train.group_size == 24 and cfg.pipeline.options.num_steps == 10


def test_unknown_key_is_named(tmp_path):
    raw = base_config(tmp_path)
    raw["algorithm"]["clip_rnage"] = 0.1
    with pytest.raises(ConfigError, match=r"algorithm\.clip_rnage.*Valid keys.*clip_low"):
        config_mod.from_dict(raw)
    with pytest.raises(ConfigError, match="Unknown config key trian"):
        config_mod.from_dict(base_config(tmp_path, trian={}))
    with pytest.raises(ConfigError, match=r"train\.lr"):
        config_mod.from_dict(base_config(tmp_path, train={"lr": 1.0}))


RENAMED_CASES = [
    ("flow_grpo", "clip_range", 1e-4,
     r"^algorithm\.clip_range was renamed: use algorithm\.clip_low \(and algorithm\.clip_high\)\.$"),
    ("e_grpo", "clip_range", 1e-4, r"use algorithm\.clip_low \(and algorithm\.clip_high\)"),
    ("dgpo", "clip_range", 1e-2, r"use algorithm\.clip_low \(and algorithm\.clip_high\)"),
    ("chunk_grpo", "clip_range", 1e-3, r"use algorithm\.clip_low \(and algorithm\.clip_high\)"),
    ("chunk_grpo", "clip_range_high", 1e-3, r"algorithm\.clip_range_high was renamed: use algorithm\.clip_high\.$"),
    ("chunk_grpo", "kl_coeff", 0.0, r"algorithm\.kl_coeff was renamed: use algorithm\.kl_beta\.$"),
    ("cj_grpo", "clip_range", 0.5, r"use algorithm\.clip_low \(and algorithm\.clip_high\)"),
    ("cj_grpo", "clip_range_high", 0.5, r"use algorithm\.clip_high"),
    ("diffu_grpo", "clip_range", 0.5, r"use algorithm\.clip_low \(and algorithm\.clip_high\)"),
    ("cj_grpo", "scale_rewards", False, r"algorithm\.scale_rewards is no longer a bool: give 'group' .* or 'none'"),
    ("diffu_grpo", "scale_rewards", True, r"algorithm\.scale_rewards is no longer a bool"),
    ("flow_grpo", "global_std", True, r"^algorithm\.global_std was renamed: use algorithm\.scale_rewards: batch "),
    ("dgpo", "global_std", False, r"use algorithm\.scale_rewards: batch \(global_std: true\) or group \(false\)"),
    ("dapo", "filter_groups", True, r"algorithm\.filter_groups was renamed: use algorithm\.token_mean: update_with_"),
]


@pytest.mark.parametrize("algorithm, key, value, message", RENAMED_CASES)
def test_renamed_option_names_its_new_key(tmp_path, algorithm, key, value, message):
    """An option's old name (or old value type) is refused in one line naming the key to use, while the config is
    read (before any model loads)."""
    raw = base_config(tmp_path)
    raw["algorithm"] = {"name": algorithm, key: value}
    with pytest.raises(ConfigError, match=message) as err:
        config_mod.from_dict(raw)
    assert "\n" not in str(err.value)


def test_wrong_type_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"train\.group_size: expected an integer, got 'eight'"):
        config_mod.from_dict(base_config(tmp_path, train={"group_size": "eight"}))
    raw = base_config(tmp_path)
    raw["pipeline"]["guidance_scale"] = "high"
    with pytest.raises(ConfigError, match=r"pipeline\.guidance_scale: expected a number"):
        config_mod.from_dict(raw)
    with pytest.raises(ConfigError, match=r"train\.mixed_precision must be 'no', 'bf16' or 'fp16', got 'fp8'"):
        config_mod.from_dict(base_config(tmp_path, train={"mixed_precision": "fp8"}))


def test_bad_values_explain_the_fix(tmp_path):
    with pytest.raises(ConfigError, match="group_size must be >= 2"):
        config_mod.from_dict(base_config(tmp_path, train={"group_size": 1}))
    raw = base_config(tmp_path)
    raw["pipeline"]["name"] = "sd4"
    with pytest.raises(ConfigError, match="Unknown pipeline 'sd4'. Registered pipelines: .*sd3"):
        config_mod.from_dict(raw)
    with pytest.raises(ConfigError, match="eval.metric 'n' is a column name of eval/step_"):
        config_mod.from_dict(base_config(tmp_path, eval={"metric": "n"}))


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
    assert cfg.train.group_size == 4 and cfg.algorithm.options.kl.kl_beta == 0.01
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


def test_cosine_schedule_warms_up_then_decays_to_the_floor():
    from mmgrpo.optim import build_optimizer, learning_rate_factor

    config = TrainConfig(max_steps=10, updates_per_step=2, warmup_steps=4, lr_schedule="cosine", min_lr_ratio=0.1)
    factors = [learning_rate_factor(n, config) for n in range(20)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert factors[4] == 1.0 and abs(factors[-1] - 0.1) < 1e-12
    assert all(a >= b for a, b in zip(factors[4:], factors[5:]))  # monotone decay after warm-up
    # midpoint of the cosine is halfway between 1 and the floor
    assert abs(learning_rate_factor(4 + 15 / 2, config) - 0.55) < 1e-12
    constant = TrainConfig(max_steps=10, warmup_steps=0)
    assert {learning_rate_factor(n, constant) for n in range(10)} == {1.0}

    parameter = torch.nn.Parameter(torch.zeros(1))
    optimizer, schedule = build_optimizer([parameter], TrainConfig(learning_rate=0.5, max_steps=3, lr_schedule="cosine",
                                                                   min_lr_ratio=0.5))
    seen = []
    for _ in range(3):
        seen.append(schedule.get_last_lr()[0])
        optimizer.step()
        schedule.step()
    assert seen == [0.5, 0.375, 0.25]


def test_fused_adamw_is_one_kernel_and_the_same_update():
    """``train.optim: adamw_torch_fused`` builds torch's fused AdamW (transformers' ``adamw_torch_fused``), whose
    updates equal the default implementation's up to float rounding; an unknown name is refused."""
    from mmgrpo.optim import build_optimizer

    generator = torch.Generator().manual_seed(0)
    start = [torch.randn(33, 17, generator=generator), torch.randn(5, generator=generator)]
    grads = [[torch.randn(p.shape, generator=generator) for p in start] for _ in range(10)]
    trained = {}
    for optim in ("adamw_torch", "adamw_torch_fused"):
        parameters = [torch.nn.Parameter(p.clone()) for p in start]
        optimizer, _ = build_optimizer(parameters, TrainConfig(learning_rate=1e-2, weight_decay=0.1, optim=optim))
        assert bool(optimizer.defaults["fused"]) == (optim == "adamw_torch_fused")
        for step in grads:
            for p, g in zip(parameters, step):
                p.grad = g
            optimizer.step()
        trained[optim] = parameters
    for default, fused, first in zip(trained["adamw_torch"], trained["adamw_torch_fused"], start):
        assert (default - first).abs().max() > 0.04  # ten steps of up to lr each moved the weights
        torch.testing.assert_close(fused, default, rtol=0, atol=1e-6)
    with pytest.raises(ConfigError, match="optim must be .adamw_torch. or .adamw_torch_fused."):
        TrainConfig(optim="adamw_8bit")


def test_bad_schedule_is_named(tmp_path):
    with pytest.raises(ConfigError, match="min_lr_ratio"):
        TrainConfig(min_lr_ratio=1.5)


@pytest.mark.parametrize("path", ALL_CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_schedule_on_their_pipeline(path, monkeypatch):
    """The algorithm's plan is of a family the pipeline reads, fits its steps and asks only for features it implements
    (what the trainer checks at start-up, here without loading any weights)."""
    from mmgrpo import registry

    monkeypatch.chdir(ROOT)
    cfg = config_mod.load(path)
    algorithm = registry.get("algorithm", cfg.algorithm.name)(cfg.algorithm.options)
    plan = algorithm.schedule(cfg.pipeline.options.num_steps, torch.Generator().manual_seed(0))
    pipeline = registry.get("pipeline", cfg.pipeline.name)
    assert plan.family == algorithm.plan_family and plan.family in pipeline.plan_families  # a plan it reads
    assert plan.features() <= pipeline.plan_features
    if plan.family == "flow" and plan.branch:  # whole sub-groups of at least 2 samples per branch
        assert cfg.train.group_size % len(plan.sde_steps) == 0 and cfg.train.group_size // len(plan.sde_steps) >= 2


# ------------------------------------------------------------------ every accepted value is usable (issue classes)
@pytest.mark.parametrize("section, key, value", [
    ("train", "learning_rate", 0.0), ("train", "learning_rate", float("nan")), ("train", "learning_rate", float("inf")),
    ("train", "adam_betas", [0.9, 1.0]), ("train", "adam_betas", [-0.1, 0.999]), ("train", "adam_eps", 0.0),
    ("train", "weight_decay", -1e-4), ("train", "max_grad_norm", 0.0), ("train", "max_grad_norm", float("inf")),
    ("train", "warmup_steps", -1), ("checkpoint", "keep_last", -1), ("checkpoint", "keep_last", 0),
    ("checkpoint", "every", -1), ("eval", "num_prompts", 0), ("eval", "grid_size", -1), ("eval", "metric", " "),
    ("eval", "seed", -1), ("eval", "every_seconds", float("nan")),
])
def test_out_of_range_values_are_refused_with_the_key(tmp_path, section, key, value):
    with pytest.raises(ConfigError, match=rf"{section}\.{key}"):
        config_mod.from_dict(base_config(tmp_path, **{section: {key: value}}))


@pytest.mark.parametrize("key, value", [("seed", -1), ("seed", 2**32), ("log_every", 0), ("output_dir", "")])
def test_top_level_values_are_checked(tmp_path, key, value):
    with pytest.raises(ConfigError, match=rf"^{key}"):
        config_mod.from_dict(base_config(tmp_path, **{key: value}))
    config_mod.from_dict(base_config(tmp_path, seed=2**32 - 1))  # numpy's largest seed is usable


def test_resume_path_must_be_a_checkpoint(tmp_path):
    for resume in (str(tmp_path / "nowhere"), "latest", str(tmp_path)):
        with pytest.raises(ConfigError, match="checkpoint.resume_from"):
            config_mod.from_dict(base_config(tmp_path, checkpoint={"resume_from": resume}))


def test_plugin_values_are_finite_and_typed(tmp_path):
    raw = base_config(tmp_path)
    raw["algorithm"]["clip_low"] = float("nan")
    with pytest.raises(ConfigError, match=r"algorithm\.clip_low: must be a finite number"):
        config_mod.from_dict(raw)
    from mmgrpo.algorithms.grpo import GRPOConfig  # the Python API checks the same, without the YAML path

    with pytest.raises(ConfigError, match="adv_eps must be > 0"):
        algo_config(GRPOConfig, adv_eps=0.0)
    with pytest.raises(ConfigError, match="kl_beta: expected a number, got True"):
        algo_config(GRPOConfig, kl_beta=True)


def write(tmp_path, text, name="exp.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_yaml_errors_name_file_line_and_column(tmp_path):
    path = write(tmp_path, "output_dir: out\ntrain: {group_size: 4\n")
    with pytest.raises(ConfigError, match=r"exp\.yaml:3:1: YAML error"):
        config_mod.load(path)
    path = write(tmp_path, "output_dir: out\nseed: 1\ntrain:\n  group_size: 4\nseed: 2\n")
    with pytest.raises(ConfigError, match=r"exp\.yaml:5:1: YAML error: duplicate key 'seed' \(first at line 2\)"):
        config_mod.load(path)
    with pytest.raises(ConfigError, match="mapping at top level, got list"):
        config_mod.load(write(tmp_path, "- a\n- b\n"))


def test_yaml_12_scalars_and_string_overrides(tmp_path):
    raw = base_config(tmp_path)
    raw["train"] = {"mixed_precision": "PLACEHOLDER", "learning_rate": 1e-4}
    text = yaml.safe_dump(raw).replace("PLACEHOLDER", "no")  # a plain `no`, which YAML 1.1 reads as false
    path = write(tmp_path, text)
    assert config_mod.load(path).train.mixed_precision == "no"
    cfg = config_mod.load(path, ["train.mixed_precision=no", "eval.metric=3", "train.learning_rate=3e-4",
                                 "checkpoint.resume_from=null", "data.eval_file=~"])
    assert cfg.train.mixed_precision == "no" and cfg.eval.metric == "3" and cfg.train.learning_rate == 3e-4
    assert cfg.checkpoint.resume_from is None and cfg.data.options.eval_file is None
    assert config_mod.load(path, ["eval.metric=yes"]).eval.metric == "yes"
    assert config_mod.load(path, ["train.adam_betas=[0.8, 0.9]"]).train.adam_betas == [0.8, 0.9]


@pytest.mark.parametrize("name", [["sd3", "flux"], {"sd3": 1}, 3])
def test_plugin_name_must_be_one_string(tmp_path, name):
    raw = base_config(tmp_path)
    raw["pipeline"]["name"] = name
    with pytest.raises(ConfigError, match=r"pipeline\.name: expected one registered name"):
        config_mod.from_dict(raw)


@pytest.mark.parametrize("override, fragment", [
    ("train..learning_rate=1", "must look like key.subkey=value"), ("=3", "must look like"),
    ("output_dir.x=1", "output_dir is"), ("train.adam_betas=[0.9,", "override train.adam_betas:1:6: YAML error"),
    ("train.group_size", "must look like"),
])
def test_bad_overrides_are_named(tmp_path, override, fragment):
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        config_mod.apply_overrides(base_config(tmp_path), [override])


@pytest.mark.parametrize("text, overrides, fragment", [
    ("output_dir: [\n", [], "exp.yaml:2:1: YAML error"),
    ("output_dir: a\noutput_dir: b\n", [], "duplicate key 'output_dir'"),
    ("- a\n", [], "mapping at top level"),
    (None, ["checkpoint.keep_last=-1"], "checkpoint.keep_last must be >= 1"),
    (None, ["pipeline.name=[sd3]"], "Unknown pipeline '[sd3]'"),
    (None, ["train.learning_rate=.nan"], "train.learning_rate: must be a finite number"),
    (None, ["train.mixed_precision=fp8"], "train.mixed_precision must be 'no', 'bf16' or 'fp16'"),
])
@pytest.mark.parametrize("command", ["train", "eval", "check"])
def test_cli_refuses_with_one_line_and_exit_2(tmp_path, capsys, command, text, overrides, fragment):
    from mmgrpo.cli import main

    path = write(tmp_path, text if text is not None else yaml.safe_dump(base_config(tmp_path)))
    assert main([command, str(path), *overrides]) == 2
    err = capsys.readouterr().err
    assert fragment in err and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_check_prints_the_resolved_config_and_ok(capsys, monkeypatch):
    from mmgrpo.cli import main

    monkeypatch.chdir(ROOT)
    assert main(["check", "configs/tiny/mdlm_arith.yaml", "train.mixed_precision=no", "eval.metric=3"]) == 0
    out = capsys.readouterr().out
    assert out.endswith("ok\n")
    resolved = yaml.safe_load(out[: -len("ok\n")])  # also what PyYAML's own loader reads: 'no' stays a string
    assert resolved["train"]["mixed_precision"] == "no" and resolved["eval"]["metric"] == "3"
    assert resolved["data"]["name"] == "arith" and resolved["train"]["learning_rate"] > 0


@pytest.mark.parametrize("changes, fragment", [
    ({"reward": {"name": "accuracy"}, "eval": {"every": 0}}, "reward.name: reward 'accuracy' scores ['text']"),
    ({"algorithm": {"name": "cj_grpo"}, "eval": {"every": 0}}, "algorithm.name: algorithm 'cj_grpo' emits 'masked'"),
    ({"eval": {"every": 5}}, "eval.every: prompt source 'prompt_file' has no held-out items to evaluate: give it some "
                             "(data.eval_file)"),
])
def test_check_runs_the_compatibility_checks_before_any_model_loads(tmp_path, capsys, changes, fragment):
    from mmgrpo.cli import main

    path = write(tmp_path, yaml.safe_dump(base_config(tmp_path, **changes)))
    assert main(["check", str(path)]) == 2
    assert fragment in capsys.readouterr().err


def test_missing_held_out_items_name_the_prompt_sources_own_option(capsys, monkeypatch):
    """A Hugging Face dataset without its held-out split is refused naming ``data.eval_split``, the option to set."""
    from mmgrpo.cli import main

    monkeypatch.chdir(ROOT)
    assert main(["check", "configs/qwen2_5_vl_3b_grpo_count_hf_dataset.yaml", "data.eval_split=null"]) == 2
    err = capsys.readouterr().err
    assert "has no held-out items to evaluate: give it some (data.eval_split)" in err, err


@pytest.mark.parametrize("path", ALL_CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_passes_check(path, monkeypatch, capsys):
    """Real-model configs name hub ids, which `check` does not look up: they pass without their weights. Their memory
    check is that of the node they are written for (8 accelerators and 1 TiB of RAM); tiny configs must fit here."""
    from mmgrpo import memory_check
    from mmgrpo.cli import main

    monkeypatch.chdir(ROOT)
    if path.parent.name != "tiny":
        monkeypatch.setattr(memory_check, "machine_memory", lambda: 2**40 + 8 * memory_check.ACCELERATOR_ALLOWANCE)
    flags = ["--trust-remote-code"] if path.name == "llada_8b_cj_grpo.yaml" else []  # LLaDA's code is on the hub
    assert main(["check", str(path.relative_to(ROOT)), *flags]) == 0, capsys.readouterr().err
    assert capsys.readouterr().out.endswith("ok\n")


def test_composite_components_are_checked_like_plugins(tmp_path):
    raw = base_config(tmp_path)
    raw["reward"] = {"name": "composite", "rewards": {"jpeg": {"weight": float("nan")}}}
    with pytest.raises(ConfigError, match=r"rewards\.jpeg\.weight: must be a finite number"):
        config_mod.from_dict(raw)
    raw["reward"]["rewards"] = {"a": {"name": ["jpeg"]}}
    with pytest.raises(ConfigError, match=r"rewards\.a\.name: expected str"):
        config_mod.from_dict(raw)
