"""Checkpoints run no code: state files are safetensors + JSON, planted pickles are never loaded (resume, eval),
older pickle checkpoints are refused with the conversion command, and ``mmgrpo convert-checkpoint --trust-pickles``
converts a genuine one exactly. Plus: torn checkpoint metadata and ``keep_last`` below 1 lose no checkpoint."""

import json
import random
import shutil

import numpy as np
import pytest
import torch
import yaml

from mmgrpo import checkpoint, cli, config as config_mod, state_io
from mmgrpo.trainer import Trainer
from builders._runs import dgpo_config  # two DGPO steps on the tiny SD3

STATE_FILES = ("optimizer", "lr_scheduler", "algorithm", "rng_rank0")


class Payload:
    """Unpickling it creates `marker`: what a crafted checkpoint file could do instead (run any code)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_sd3_dir):
    """``(raw config, trainer, checkpoint folder)`` of a finished two-step run."""
    tmp = tmp_path_factory.mktemp("trained")
    raw = dgpo_config(tmp, tiny_sd3_dir, max_steps=2)  # DGPO keeps state of its own: the fast-EMA old model
    raw["eval"] = {"every": 0, "num_prompts": 2, "grid_size": 2, "metric": "jpeg_kb"}
    trainer = Trainer(config_mod.from_dict(raw))
    trainer.train()
    return raw, trainer, checkpoint.complete_checkpoints(tmp / "run" / "checkpoints")[-1]


def copy_run(raw, source, tmp_path):
    """A fresh output_dir holding a copy of checkpoint `source`; returns ``(raw config for it, copied folder)``."""
    raw = {**json.loads(json.dumps(raw)), "output_dir": str(tmp_path / "run")}
    folder = tmp_path / "run" / "checkpoints" / source.name
    shutil.copytree(source, folder)
    return raw, folder


def make_legacy(folder, states=None):
    """Turns a current checkpoint into the older layout: state files as torch pickles (`states` overrides what they
    hold), no format mark."""
    for name in STATE_FILES:
        state = (states or {}).get(name) or state_io.load_state(folder / f"{name}.safetensors")
        torch.save(state, folder / f"{name}.pt")
        (folder / f"{name}.safetensors").unlink()
    meta = json.loads((folder / checkpoint.STATE_FILE).read_text())
    meta.pop("format")
    (folder / checkpoint.STATE_FILE).write_text(json.dumps(meta))


def run_cli(tmp_path, raw, *args):
    config_file = tmp_path / "config.yaml"
    config_file.write_text(yaml.safe_dump(raw))
    return cli.main([args[0], str(config_file), *args[1:]]) if args[0] == "eval" else cli.main(list(args))


def is_pickle(path) -> bool:
    """Whether `path` could be a pickle: a ``.safetensors`` file that does not parse as one, or any other file that
    starts like torch.save's zip archive or a raw pickle."""
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        try:
            with safe_open(str(path), "pt"):
                return False
        except Exception:
            return True
    head = path.read_bytes()[:2]
    return head == b"PK" or head[:1] == b"\x80"


def test_checkpoint_holds_no_pickle_and_its_state_is_standard_json(trained):
    _, _, folder = trained
    files = [p for p in folder.rglob("*") if p.is_file()]
    assert not [p.name for p in files if is_pickle(p)]
    assert {f"{name}.safetensors" for name in STATE_FILES} <= {p.name for p in files}
    from safetensors import safe_open

    for name in STATE_FILES:
        with safe_open(str(folder / f"{name}.safetensors"), "pt") as f:
            json.loads(f.metadata()["state"], parse_constant=lambda c: pytest.fail(f"{name}: non-standard JSON {c}"))


@pytest.mark.parametrize("layout", ["current", "legacy"])
def test_planted_pickles_never_run_on_resume_eval_or_convert(trained, tmp_path, layout, capsys):
    raw, _, source = trained
    raw, folder = copy_run(raw, source, tmp_path)
    marker = tmp_path / "code_ran"
    if layout == "legacy":
        make_legacy(folder, {name: Payload(marker) for name in STATE_FILES})
    else:
        for name in STATE_FILES:
            torch.save(Payload(marker), folder / f"{name}.pt")
    armed = tmp_path / "armed"
    torch.save(Payload(armed), tmp_path / "probe.pt")
    torch.load(tmp_path / "probe.pt", weights_only=False)
    assert armed.exists()  # the trap works: loading such a file the old way runs its code

    resume = {**raw, "checkpoint": {**raw["checkpoint"], "resume_from": "latest"}}
    if layout == "current":
        assert Trainer(config_mod.from_dict(resume)).step == 2
    else:
        with pytest.raises(checkpoint.LegacyCheckpointError) as err:
            Trainer(config_mod.from_dict(resume))
        assert f"mmgrpo convert-checkpoint {folder} --trust-pickles" in str(err.value)
        assert "optimizer.pt" in str(err.value)
    assert run_cli(tmp_path, raw, "eval", "--checkpoint", str(folder)) == 0  # weights only: works in both layouts
    assert run_cli(tmp_path, raw, "convert-checkpoint", str(folder)) == 2  # no --trust-pickles: refused
    assert "--trust-pickles" in capsys.readouterr().err
    if layout == "legacy":  # even trusted, the restricted unpickler refuses what a checkpoint never holds
        assert run_cli(tmp_path, raw, "convert-checkpoint", str(folder), "--trust-pickles") == 2
        assert "not converted and nothing in it was run" in capsys.readouterr().err
        assert all((folder / f"{name}.pt").is_file() for name in STATE_FILES)
    assert not marker.exists()


def resumed_state(raw, folder) -> dict:
    trainer = Trainer(config_mod.from_dict({**raw, "checkpoint": {**raw["checkpoint"], "resume_from": str(folder)}}))
    rng = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    return {"step": trainer.step, "position": trainer.stream.position, "optimizer": trainer.optimizer.state_dict(),
            "scheduler": trainer.lr_scheduler.state_dict(), "algorithm": trainer.algorithm.state_dict(), "rng": rng,
            "weights": [p.detach().clone() for p in trainer.policy.trainable_parameters()]}


def test_convert_a_genuine_legacy_checkpoint_then_resume_to_the_same_state(trained, tmp_path, capsys):
    raw, _, source = trained
    raw, folder = copy_run(raw, source, tmp_path)
    make_legacy(folder)
    assert checkpoint.legacy_files(folder)
    assert run_cli(tmp_path, raw, "convert-checkpoint", str(folder), "--trust-pickles") == 0
    assert "optimizer.pt -> optimizer.safetensors" in capsys.readouterr().out
    assert not list(folder.glob("*.pt")) and checkpoint.read_metadata(folder)["format"] == checkpoint.FORMAT
    converted, original = resumed_state(raw, folder), resumed_state(raw, source)
    assert checkpoint._same(converted, original)
    assert converted["algorithm"]["ema"]["shadow"] is not None and converted["optimizer"]["state"]
    assert run_cli(tmp_path, raw, "convert-checkpoint", str(folder), "--trust-pickles") == 0  # again: nothing to do
    assert "already pickle-free" in capsys.readouterr().out


def test_eval_reads_only_the_weights_and_matches_a_full_resume(trained, tmp_path, capsys):
    raw, _, source = trained
    raw, folder = copy_run(raw, source, tmp_path)
    expected = Trainer(config_mod.from_dict({**raw, "checkpoint": {**raw["checkpoint"], "resume_from": "latest"}}))
    want = expected.evaluate(expected.step)
    want_file = (tmp_path / "run" / "eval" / "step_00002.json").read_text()
    metrics = tmp_path / "run" / "metrics.jsonl"
    metrics.write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n')
    for name in STATE_FILES:  # unreadable training state: evaluation must not need it
        (folder / f"{name}.safetensors").write_bytes(b"not a state file")
    capsys.readouterr()
    assert run_cli(tmp_path, raw, "eval", "--checkpoint", str(folder)) == 0
    assert json.loads(capsys.readouterr().out) == want
    assert (tmp_path / "run" / "eval" / "step_00002.json").read_text() == want_file
    assert metrics.read_text().count("step") == 3  # eval no longer truncates the run's log as a resume did


def test_train_resuming_a_legacy_checkpoint_ends_with_one_line_and_exit_2(trained, tmp_path, capsys):
    raw, _, source = trained
    raw, folder = copy_run(raw, source, tmp_path)
    make_legacy(folder)
    raw = {**raw, "checkpoint": {**raw["checkpoint"], "resume_from": "latest"}}
    config_file = tmp_path / "config.yaml"
    config_file.write_text(yaml.safe_dump(raw))
    capsys.readouterr()
    assert cli.main(["train", str(config_file)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert f"mmgrpo convert-checkpoint {folder} --trust-pickles" in err


def test_eval_leaves_the_runs_config_json_as_training_wrote_it(trained, tmp_path):
    raw, _, source = trained
    raw, folder = copy_run(raw, source, tmp_path)
    recorded = tmp_path / "run" / "config.json"
    recorded.write_text('{"written": "by training"}')
    assert run_cli(tmp_path, raw, "eval", "--checkpoint", str(folder)) == 0
    assert recorded.read_text() == '{"written": "by training"}'


def write_checkpoint(root, step, meta):
    folder = root / f"step_{step:07d}"
    folder.mkdir(parents=True)
    (folder / checkpoint.STATE_FILE).write_text(meta)
    return folder


def test_torn_metadata_makes_a_checkpoint_incomplete(tmp_path):
    root = tmp_path / "checkpoints"
    good = write_checkpoint(root, 2, json.dumps({"step": 2, "format": checkpoint.FORMAT}))
    torn = write_checkpoint(root, 4, '{"step": 4, "data_posi')
    write_checkpoint(root, 6, '["not", "a", "record"]')
    write_checkpoint(root, 8, json.dumps({"step": "8"}))
    (root / "step_junk").mkdir()
    assert checkpoint.complete_checkpoints(root) == [good]
    assert checkpoint.resolve("latest", root) == good
    with pytest.raises(ValueError, match="incomplete.*torn"):
        checkpoint.resolve(str(torn), root)


@pytest.mark.parametrize("keep_last", [0, -1, -5])
def test_keep_last_below_one_keeps_the_checkpoint_just_written(trained, tmp_path, keep_last):
    _, trainer, _ = trained
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        final = checkpoint.save(trainer.accelerator, root, step, trainer.policy, trainer.optimizer,
                                trainer.lr_scheduler, {"data_position": 0, "skipped_updates": 0}, keep_last,
                                algorithm=trainer.algorithm)
    assert checkpoint.complete_checkpoints(root) == [final] and final.name == "step_0000003"


def test_state_round_trip_is_exact_and_refuses_code():
    state = {
        "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(2, 3).bfloat16()}},
        "param_groups": [{"betas": (0.9, 0.999), "lr": 1e-3, "params": [0], "nan": float("nan"), "inf": -float("inf"),
                          "zero": -0.0, "big": 2**80, "flag": True, "none": None}],
        "numpy": ("MT19937", np.arange(5, dtype=np.uint32), 3, 0, 0.25, np.float32(1.5)),
        "__tensor__": "a user key that looks like a tag",
        "nested": [[1, 2], {"(1, 2)": 3, (1, 2): 4}],
    }
    skeleton, tensors = state_io.flatten(state)
    back = state_io.unflatten(json.loads(json.dumps(skeleton, allow_nan=False)), tensors)
    assert checkpoint._same(state, back)
    assert back["param_groups"][0]["betas"] == (0.9, 0.999) and list(back["state"]) == [0]
    assert isinstance(back["numpy"][5], np.float32) and back["numpy"][1].dtype == np.uint32
    assert str(back["param_groups"][0]["zero"]) == "-0.0" and back["nested"][1][(1, 2)] == 4
    with pytest.raises(TypeError, match=r"state\['hook'\]: a function cannot be stored"):
        state_io.flatten({"hook": lambda: None})


def test_rng_states_round_trip_through_a_file(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    state_io.save_state(checkpoint.rng_state(), tmp_path / "rng.safetensors")
    first = (random.random(), np.random.rand(), torch.rand(1).item())
    checkpoint.set_rng_state(state_io.load_state(tmp_path / "rng.safetensors"))
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == first


PIPELINES = {  # registry name -> (fixture with the tiny model, options)
    "sd3": ("tiny_sd3_dir", {"resolution": 32, "num_steps": 2, "max_sequence_length": 16}),
    "flux": ("tiny_flux_dir", {"resolution": 32, "num_steps": 2, "max_sequence_length": 16}),
    "mdlm": ("tiny_mdlm_dir", {"gen_length": 4, "block_length": 4, "steps_per_block": 2}),
    "qwen_vl": ("tiny_qwen2_vl_dir", {"max_new_tokens": 4}),
}


@pytest.mark.parametrize("lora_rank", [4, 0], ids=["lora", "full"])
@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_every_pipeline_saves_weights_without_pickles(request, tmp_path, name, lora_rank):
    from mmgrpo import registry

    fixture, options = PIPELINES[name]
    policy_cls = registry.get("pipeline", name)
    policy = policy_cls(policy_cls.Config(pretrained=request.getfixturevalue(fixture), lora_rank=lora_rank, **options))
    policy.save_pretrained(str(tmp_path / "weights"))
    files = [p for p in (tmp_path / "weights").rglob("*") if p.is_file()]
    assert any(p.suffix == ".safetensors" for p in files)
    assert not [p.name for p in files if is_pickle(p) or p.suffix in (".bin", ".pt", ".pth", ".pkl")]
