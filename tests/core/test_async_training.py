"""Asynchronous training (``train.async``, [`mmgrpo.async_rollouts`]): ``max_staleness: 0`` gives synchronous
training's metrics and weights bit for bit on flow, token and masked-diffusion pipelines; with ``max_staleness: 1``
each rollout is the one the weights of two steps before sample (and not the previous step's); a run stopped with
rollouts in flight (a checkpoint, or ``kill -9`` after one) resumes exactly; the options are checked when read."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mmgrpo import config as config_mod, registry
from mmgrpo.async_rollouts import WEIGHTS_FILE, frozen_parameters, check_schedule, snapshot
from mmgrpo.errors import RunError
from mmgrpo.seeding import mix_seed
from mmgrpo.trainer import Trainer
from mmgrpo.validation import ConfigError

EXAMPLES = Path(__file__).resolve().parents[2] / "data" / "examples" / "vlm"


def flow_run(tmp_path, tiny_sd3_dir, steps=3, staleness=None, every=0):
    """Flow-GRPO on the tiny SD3 (the rollout's log-probs are the loss's old policy), 2 prompts x 2 per step."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\na blue square\na green triangle\n")
    train = {"max_steps": steps, "prompts_per_step": 2, "group_size": 2, "minibatch_size": 4, "learning_rate": 2e-2}
    if staleness is not None:
        train["async"] = {"max_staleness": staleness}
    return {
        "output_dir": str(tmp_path / "run"), "seed": 3,
        "pipeline": {"name": "sd3", "pretrained": tiny_sd3_dir, "resolution": 32, "num_steps": 3,
                     "guidance_scale": 1.0, "lora_rank": 4, "max_sequence_length": 16},
        "algorithm": {"name": "flow_grpo"},
        "reward": {"name": "jpeg"},
        "data": {"name": "prompt_file", "train_file": str(prompts), "eval_file": str(prompts)},
        "train": train, "eval": {"every": 0}, "checkpoint": {"every": every, "keep_last": 5},
    }


def token_run(tmp_path, model_dir, staleness=None):
    """GRPO (with its rollout correction) on the tiny Qwen2-VL counting examples."""
    train = {"max_steps": 3, "prompts_per_step": 2, "group_size": 2, "minibatch_size": 2, "learning_rate": 1e-2}
    if staleness is not None:
        train["async"] = {"max_staleness": staleness}
    return {
        "output_dir": str(tmp_path / "run"), "seed": 0,
        "pipeline": {"name": "qwen_vl", "pretrained": model_dir, "max_new_tokens": 6, "lora_rank": 4, "lora_alpha": 8},
        "algorithm": {"name": "grpo"},
        "reward": {"name": "composite", "rewards": {"format": {"weight": 0.5}, "accuracy": {"mode": "numeric"}}},
        "data": {"name": "vlm_jsonl", "train_file": str(EXAMPLES / "count.jsonl"),
                 "eval_file": str(EXAMPLES / "count.jsonl")},
        "train": train, "eval": {"every": 0}, "checkpoint": {"every": 0},
    }


def masked_run(tmp_path, model_dir, staleness=None):
    """CJ-GRPO on the tiny masked-diffusion model, addition prompts."""
    train = {"max_steps": 3, "prompts_per_step": 2, "group_size": 4, "minibatch_size": 4, "learning_rate": 1e-2}
    if staleness is not None:
        train["async"] = {"max_staleness": staleness}
    return {
        "output_dir": str(tmp_path / "run"), "seed": 0,
        "pipeline": {"name": "mdlm", "pretrained": model_dir, "gen_length": 4, "steps_per_block": 4, "lora_rank": 0},
        "algorithm": {"name": "cj_grpo"},
        "reward": {"name": "accuracy", "mode": "numeric"},
        "data": {"name": "arith", "digits": 2, "n_train": 32, "n_eval": 8},
        "train": train, "eval": {"every": 0}, "checkpoint": {"every": 0},
    }


def metrics(run: Path) -> list[dict]:
    """Each logged step's metrics, without the wall-clock times."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in records]


def weights(trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.policy.trainable_parameters()]


def assert_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["flow", "token", "masked"])
def test_staleness_0_is_synchronous_training_bit_for_bit(tmp_path, kind, request):
    make, model = {"flow": (flow_run, "tiny_sd3_dir"), "token": (token_run, "tiny_qwen2_vl_dir"),
                   "masked": (masked_run, "tiny_mdlm_dir")}[kind]
    model_dir = request.getfixturevalue(model)
    runs = {}
    for name, staleness in (("sync", None), ("async0", 0), ("async1", 1)):
        trainer = Trainer(config_mod.from_dict(make(tmp_path / name, model_dir, staleness=staleness)))
        assert (trainer.rollouts is None) == (staleness is None)
        trainer.train()
        runs[name] = (metrics(tmp_path / name / "run"), weights(trainer))
    assert runs["async0"][0] == runs["sync"][0] and len(runs["sync"][0]) == 3  # every metric of every step
    assert_same(runs["async0"][1], runs["sync"][1])
    stale = runs["async1"][0]  # one step stale: it runs, and its rollouts differ from the second step on
    assert [r["step"] for r in stale] == [1, 2, 3]
    assert stale[0]["reward/mean"] == runs["sync"][0][0]["reward/mean"]  # step 1: the initial weights in both
    assert stale[1] != runs["sync"][0][1]  # step 2: the initial weights, not those after step 1
    if kind == "token":  # the stale log-probs reach GRPO's rollout correction (recompute: the current weights')
        assert all("rollout_corr/kl" in r for r in stale) and "rollout_corr/kl" not in runs["async0"][0][0]
        assert stale[1]["rollout_corr/logp_diff_max"] > 0  # step 2 sampled from the initial weights, updated once


def test_staleness_1_samples_from_the_weights_two_steps_before(tmp_path, tiny_sd3_dir):
    """Step t's rollout equals the trained policy's own sample, with step t's seeds, from the weights after step
    t - 2 (the initial ones for steps 1 and 2), and differs from the sample of the weights after step t - 1."""
    trainer = Trainer(config_mod.from_dict(flow_run(tmp_path, tiny_sd3_dir, steps=3, staleness=1)))
    copy = trainer.rollouts.rollout_policy  # its own LoRA weights, the base model's frozen ones shared
    assert {id(p) for p in copy.trainable_parameters()}.isdisjoint(map(id, trainer.policy.trainable_parameters()))
    assert frozen_parameters(copy).keys() == frozen_parameters(trainer.policy).keys() != set()
    taken, take = {}, trainer.rollouts.take

    def recording(step, inputs_of, stream):
        taken[step] = take(step, inputs_of, stream)
        return taken[step]

    trainer.rollouts.take = recording
    after = [snapshot(trainer.policy)]  # after[v]: the weights after step v
    for _ in range(3):
        trainer.step += 1
        trainer.train_step()
        after.append(snapshot(trainer.policy))
    trainer.rollouts.close()
    assert any(not torch.equal(a, b) for a, b in zip(after[1], after[2]))  # the updates moved the weights

    def sample(step, version):
        inputs, _, _ = taken[step]
        with torch.no_grad():
            for p, w in zip(trainer.policy.trainable_parameters(), after[version]):
                p.copy_(w)
        generator = torch.Generator().manual_seed(mix_seed(3, step, 0, 1))
        return trainer.policy.sample(inputs.local, inputs.plan, generator=generator)

    for step, (_, rollout, _) in taken.items():
        own = sample(step, max(step - 2, 0))
        assert torch.equal(own.outputs["images"], rollout.outputs["images"])
        assert torch.equal(own.old_log_probs, rollout.old_log_probs)  # the rollout copy's log-probs
    fresher = sample(3, 2)
    assert not torch.equal(fresher.outputs["images"], taken[3][1].outputs["images"])


def test_a_checkpoint_with_rollouts_in_flight_resumes_exactly(tmp_path, tiny_sd3_dir):
    full = Trainer(config_mod.from_dict(flow_run(tmp_path / "full", tiny_sd3_dir, steps=4, staleness=1, every=2)))
    full.train()
    step2 = tmp_path / "full" / "run" / "checkpoints" / "step_0000002"
    assert list(load_file(str(step2 / WEIGHTS_FILE))) and json.loads(
        (step2 / "trainer_state.json").read_text())["prompt_stream"]["position"] == 4  # before step 3's batch (2 prompts a step)
    raw = flow_run(tmp_path / "resumed", tiny_sd3_dir, steps=4, staleness=1)
    raw["checkpoint"]["resume_from"] = str(step2)
    resumed = Trainer(config_mod.from_dict(raw))
    assert set(resumed.rollouts.versions) == {1}  # step 3 samples from the weights after step 1
    resumed.train()
    assert metrics(tmp_path / "resumed" / "run") == metrics(tmp_path / "full" / "run")[2:]  # steps 3 and 4
    assert_same(weights(resumed), weights(full))
    raw["train"]["async"] = {"max_staleness": 2}  # needs the weights after step 0 as well: not in the checkpoint
    raw["output_dir"] = str(tmp_path / "other")
    with pytest.raises(RunError, match="weights after step 0"):
        Trainer(config_mod.from_dict(raw)).train()


def _launch(raw, folder: Path):
    path = folder / "config.yaml"
    path.write_text(json.dumps(raw))  # JSON is YAML
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen([sys.executable, "-m", "mmgrpo.cli", "train", str(path)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def test_kill_9_with_rollouts_in_flight_resumes_exactly(tmp_path, tiny_sd3_dir):
    """SIGKILL after the step-2 checkpoint (step 3's rollout sampled, step 4's in flight): resuming from the last
    complete checkpoint ends with the weights and metrics of a run never stopped."""
    raw = flow_run(tmp_path / "killed", tiny_sd3_dir, steps=6, staleness=1, every=2)
    run = Path(raw["output_dir"])
    proc = _launch(raw, tmp_path / "killed")
    deadline = time.monotonic() + 300
    while not (run / "metrics.jsonl").is_file() or '"step": 3' not in (run / "metrics.jsonl").read_text():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the run logged no third step in time"
        time.sleep(0.1)
    proc.kill()  # kill -9: no handler runs, nothing is saved
    proc.communicate(timeout=60)
    assert proc.returncode == -9
    raw["checkpoint"]["resume_from"] = "latest"
    resumed = Trainer(config_mod.from_dict(raw))
    assert resumed.step >= 2 and resumed.rollouts.versions  # the in-flight rollouts' weights were saved
    resumed.train()
    straight = Trainer(config_mod.from_dict(flow_run(tmp_path / "straight", tiny_sd3_dir, steps=6, staleness=1)))
    straight.train()
    assert_same(weights(resumed), weights(straight))
    assert metrics(run) == metrics(tmp_path / "straight" / "run")  # steps 1 .. 6, the resumed ones included


def test_options_are_checked_before_any_model_loads(tmp_path):
    base = config_mod.load(Path(__file__).resolve().parents[2] / "configs" / "tiny" / "t2i_shapes.yaml").to_dict()
    base["output_dir"] = str(tmp_path / "run")

    def build(train: dict, algorithm: dict | None = None):
        return config_mod.from_dict({**base, "train": {**base["train"], **train},
                                     "algorithm": algorithm or base["algorithm"]})

    assert build({"async": {"max_staleness": 2}}).train.async_.max_staleness == 2
    assert build({}).to_dict()["train"]["async"] is None and build({"async": {}}).train.async_.max_staleness == 1
    assert config_mod.from_dict(build({"async": {}}).to_dict()).train.async_.max_staleness == 1  # round trip
    raw = {**base, "train": {}}
    config_mod.apply_overrides(raw, ["train.async.max_staleness=3"])
    assert config_mod.from_dict(raw).train.async_.max_staleness == 3
    for train, message in [({"async": {"max_staleness": 17}}, "train.async.max_staleness must be <= 16"),
                           ({"async": {"max_staleness": -1}}, "train.async.max_staleness must be >= 0"),
                           ({"async": {"max_staleness": 1.5}}, "train.async.max_staleness: expected an integer"),
                           ({"async": {"lag": 1}}, "Unknown config key train.async.lag"),
                           ({"async_": {}}, "Unknown config key train.async_"),
                           ({"async": {}, "prompt_sampling": "group_variance"}, "train.async cannot run with"),
                           ({"async": {}, "sharding": "fsdp"}, "train.async needs each process")]:
        with pytest.raises(ConfigError, match=message):
            build(train)
    progressive = {"name": "mix_grpo"}
    with pytest.raises(ConfigError, match="plans each step from the steps before it"):
        check_schedule(build({"async": {"max_staleness": 1}}, progressive))
    check_schedule(build({"async": {"max_staleness": 0}}, progressive))  # nothing planned ahead
    check_schedule(build({"async": {"max_staleness": 1}}, {"name": "mix_grpo", "sample_strategy": "random"}))


def test_a_trainer_built_without_preflight_refuses_a_stale_progressive_window(tmp_path, tiny_sd3_dir):
    """The trainer checks the schedule once more with its built algorithm (the same rule and message as preflight's)."""
    raw = flow_run(tmp_path, tiny_sd3_dir, staleness=1)
    raw["algorithm"] = {"name": "mix_grpo"}
    with pytest.raises(ConfigError, match="algorithm 'mix_grpo' plans each step from the steps before it"):
        Trainer(config_mod.from_dict(raw))


def test_two_processes_each_produce_their_slice(tmp_path, tiny_sd3_dir):
    """Under torchrun with 2 CPU processes (gloo): staleness 0 equals synchronous training, both processes end with the
    same weights, and a checkpoint with rollouts in flight resumes exactly."""
    env = dict(os.environ, ACCELERATE_USE_CPU="true", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(Path(__file__).with_name("async_worker.py")), tiny_sd3_dir, str(tmp_path)],
                          capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads((tmp_path / "result.json").read_text())["world_size"] == 2

    def final(name, rank):
        found = load_file(str(tmp_path / f"{name}_rank{rank}.safetensors"))
        return [found[str(i)] for i in range(len(found))]

    assert metrics(tmp_path / "async0" / "run") == metrics(tmp_path / "sync" / "run")
    assert metrics(tmp_path / "resumed" / "run") == metrics(tmp_path / "full" / "run")[2:]
    for rank in (0, 1):
        assert_same(final("async0", rank), final("sync", 0))
        assert_same(final("resumed", rank), final("full", 0))


def test_staleness_0_with_chunks_scored_while_sampling(tmp_path, tiny_sd3_dir):
    """``train.sample_chunks`` with overlapped scoring inside the worker: the same metrics as synchronous training."""
    runs = {}
    for name, staleness in (("sync", None), ("async0", 0)):
        raw = flow_run(tmp_path / name, tiny_sd3_dir, steps=2, staleness=staleness)
        raw["train"].update({"sample_chunks": 2, "overlap_scoring": True})
        Trainer(config_mod.from_dict(raw)).train()
        runs[name] = metrics(tmp_path / name / "run")
    assert runs["async0"] == runs["sync"] and len(runs["sync"]) == 2


@pytest.mark.parametrize("name", sorted(registry.available("algorithm")))
def test_schedule_reads_state_is_declared_truthfully(name):
    """An algorithm whose plan moves with its own state (its ``after_step`` clock) declares
    ``traits.schedule_reads_state``, which ``train.async`` relies on to plan steps ahead."""
    cls = registry.get("algorithm", name)
    algorithm = cls(cls.Config())
    before = algorithm.schedule(12, torch.Generator().manual_seed(0))  # 12 steps: BranchGRPO's default splits fit
    if algorithm.traits.after_step:
        for _ in range(50):
            algorithm.after_step()
    moved = algorithm.schedule(12, torch.Generator().manual_seed(0)) != before
    assert moved == algorithm.traits.schedule_reads_state
