"""Rollout engines: the ``rollout`` config section and its preflight, and the server engine against a real HTTP server
on loopback serving a real tiny Qwen2-VL (tests/engine_server.py): the prompt tokens the engine sends reach the model
as the trainer's (an image prompt), the rollout replays under the trainer's policy, a weight push changes the served
output and then matches the trainer's greedy output, and a stalled or dropped server gives a clear error."""

import pytest
import torch
from PIL import Image

from engine_server import engine_server  # noqa: F401
from mmgrpo.config import load
from mmgrpo.engine_builders import build_engine, check_engine
from mmgrpo.engine_server import EngineServerError, ServerEngine
from mmgrpo.engines import LocalEngine, RolloutEngine
from mmgrpo.plans import TokenPlan
from mmgrpo.sections import RolloutConfig
from mmgrpo.types import PromptBatch
from mmgrpo.validation import ConfigError
from builders._qwen_vl_batches import vl_policy

STEPS = 6


def vlm_config(tmp_path, *overrides):
    return load("configs/tiny/vlm_count.yaml", [f"output_dir={tmp_path}", *overrides])


# ------------------------------------------------------------------------------------------------------ the config
@pytest.mark.parametrize("overrides, message", [
    (["rollout.gpu_memory_utilization=0"], "rollout.gpu_memory_utilization"),
    (["rollout.gpu_memory_utilization=1.5"], "rollout.gpu_memory_utilization"),
    (["rollout.tensor_parallel_size=0"], "rollout.tensor_parallel_size"),
    (["rollout.tensor_parallel_size=100000"], "rollout.tensor_parallel_size"),
    (["rollout.max_model_len=-1"], "rollout.max_model_len"),
    (["rollout.timeout_s=0"], "rollout.timeout_s"),
    (["rollout.engine=trtllm"], "rollout.engine"),
    (["rollout.engine=sglang"], "rollout.mode: server"),
    (["rollout.engine=vllm", "rollout.mode=server"], "rollout.server_url"),
    (["rollout.engine=sglang", "rollout.mode=server", "rollout.server_url=localhost:30000"], "http://"),
    (["rollout.server_url=http://localhost:30000"], "rollout.mode: server"),
    (["rollout.gpu_memory_fraction=0.5"], "gpu_memory_fraction"),
])
def test_bad_rollout_options_are_refused_naming_the_key(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        vlm_config(tmp_path, *overrides)


def test_rollout_section_defaults_to_the_local_engine_and_round_trips(tmp_path):
    config = vlm_config(tmp_path, "rollout.engine=sglang", "rollout.mode=server",
                        "rollout.server_url=http://127.0.0.1:30000", "rollout.timeout_s=30")
    assert vlm_config(tmp_path).rollout == RolloutConfig()
    assert config.to_dict()["rollout"]["server_url"] == "http://127.0.0.1:30000"
    check_engine(config)  # a token pipeline and a server: nothing to install here


def test_an_engine_on_a_flow_pipeline_is_refused_before_any_model_loads(tmp_path):
    config = load("configs/tiny/t2i_shapes.yaml", [f"output_dir={tmp_path}", "rollout.engine=sglang",
                                                   "rollout.mode=server", "rollout.server_url=http://127.0.0.1:1"])
    with pytest.raises(ConfigError, match=r"samples token policies only .* set rollout.engine: local"):
        check_engine(config)


def test_a_colocated_engine_without_its_package_names_the_extra(tmp_path, monkeypatch):
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here: the refusal of a missing package cannot happen")
    with pytest.raises(ConfigError, match=r"pip install mmgrpo\[vllm\]"):
        check_engine(vlm_config(tmp_path, "rollout.engine=vllm"))


def test_build_engine_gives_the_local_engine_by_default(tmp_path, request):
    policy = vl_policy(request, "tiny_qwen2_vl_dir", STEPS)
    engine = build_engine(vlm_config(tmp_path), policy)
    assert isinstance(engine, LocalEngine) and isinstance(engine, RolloutEngine) and not engine.holds_weights


# ------------------------------------------------------------------------------------------- the server engine
def image_batch(group_size=2) -> PromptBatch:
    images = [Image.new("RGB", (100, 80), (255, 0, 0)), Image.new("RGB", (60, 70), (0, 200, 0))]
    return PromptBatch(["how many circles?", "which colour?"], metadata=[{}, {}],
                       conditions={"images": images}).repeat(group_size)


def server_engine(policy, server, engine="sglang", tmp_path=None, timeout_s=60.0):
    return ServerEngine(policy, engine, server.url, timeout_s, str(tmp_path / "weights"))


def test_the_engines_prompt_tokens_are_the_trainers_with_an_image(request, engine_server, tmp_path):
    policy = vl_policy(request, "tiny_qwen2_vl_dir", STEPS)
    engine = server_engine(policy, engine_server, tmp_path=tmp_path)
    batch = image_batch()
    rollout = engine.sample(batch, TokenPlan(num_steps=STEPS, train_units=[list(range(STEPS))]))
    trainer_ids = [p["input_ids"].tolist() for p in policy._encode_batch(image_batch())]
    assert engine_server.prompts_seen == trainer_ids  # what the served model saw, placeholders expanded
    image_pad = policy.processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert all(ids.count(image_pad) == 1 for ids in engine.sent)  # one placeholder per image went out
    assert all(ids.count(image_pad) > 1 for ids in trainer_ids)
    assert isinstance(engine, RolloutEngine) and engine.holds_weights
    # the rollout replays under the trainer's policy; the engine's log-probs are the server's
    assert rollout.engine_log_probs is not None and rollout.mask.shape == (len(batch), STEPS)
    score = policy.log_prob(rollout, list(range(STEPS)))
    torch.testing.assert_close(score.log_prob[rollout.mask], rollout.engine_log_probs[rollout.mask],
                               atol=1e-4, rtol=1e-4)  # float32 on both sides, vision tokens biased away
    vision = [policy.processor.tokenizer.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|vision_start|>")]
    assert not torch.isin(rollout.trajectory["completion_ids"], torch.tensor(vision)).any()


def greedy_texts(policy, batch):
    plan = TokenPlan(num_steps=STEPS, train_units=[list(range(STEPS))], greedy=True)
    return policy.sample(batch, plan).outputs["texts"], plan


def perturb(policy, seed=3):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in policy.trainable_parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.5)


@pytest.mark.parametrize("engine_name", ["sglang", "vllm"])
def test_a_weight_push_changes_the_served_output_and_matches_the_trainers_greedy(request, engine_server, tmp_path,
                                                                                 engine_name):
    policy = vl_policy(request, "tiny_qwen2_vl_dir", STEPS)
    engine = server_engine(policy, engine_server, engine_name, tmp_path)
    batch = PromptBatch(["count the circles", "name a colour"], metadata=[{}, {}]).repeat(1)
    before, plan = greedy_texts(policy, batch)
    assert engine.sample(batch, plan).outputs["texts"] == before  # the served base is the trainer's initial model
    perturb(policy)
    after, _ = greedy_texts(policy, batch)
    assert after != before
    assert engine.sample(batch, plan).outputs["texts"] == before  # not pushed yet
    engine.sync_weights(policy)
    served = engine.sample(batch, plan)
    assert served.outputs["texts"] == after
    local = policy.sample(batch, plan)
    assert torch.equal(served.trajectory["completion_ids"], local.trajectory["completion_ids"])
    assert not (tmp_path / "weights" / "v0").exists() and (tmp_path / "weights" / "v1").exists()


def test_a_fully_fine_tuned_policy_cannot_push_an_adapter_to_vllm(request, engine_server, tmp_path):
    policy = vl_policy(request, "tiny_qwen2_vl_dir", STEPS, lora_rank=0)
    with pytest.raises(ValueError, match="loads LoRA adapters only"):
        server_engine(policy, engine_server, "vllm", tmp_path).sync_weights(policy)


def test_vllm_server_refuses_image_prompts_with_the_fix(request, engine_server, tmp_path):
    policy = vl_policy(request, "tiny_qwen2_vl_dir", STEPS)
    with pytest.raises(EngineServerError, match="rollout.mode: colocate"):
        server_engine(policy, engine_server, "vllm", tmp_path).sample(image_batch(1), TokenPlan(num_steps=STEPS, train_units=[list(range(STEPS))]))


@pytest.mark.parametrize("fault, message", [("stall", "no answer within rollout.timeout_s"),
                                            ("drop", "connection was dropped")])
def test_a_stalled_or_dropped_server_gives_a_clear_error(request, engine_server, tmp_path, fault, message):
    policy = vl_policy(request, "tiny_qwen2_vl_dir", STEPS)
    engine_server.fault = fault
    engine = server_engine(policy, engine_server, tmp_path=tmp_path, timeout_s=0.5)
    with pytest.raises(EngineServerError, match=message):
        engine.sample(image_batch(1), TokenPlan(num_steps=STEPS, train_units=[list(range(STEPS))]))


def test_a_server_that_is_not_running_gives_a_clear_error(request, tmp_path):
    import socket

    with socket.socket() as probe:  # a free port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    policy = vl_policy(request, "tiny_qwen2_vl_dir", STEPS)
    engine = ServerEngine(policy, "sglang", f"http://127.0.0.1:{port}", 5.0, str(tmp_path))
    with pytest.raises(EngineServerError, match="is the server running"):
        engine.sample(image_batch(1), TokenPlan(num_steps=STEPS, train_units=[list(range(STEPS))]))


@pytest.mark.parametrize("overrides, world, message", [
    (["rollout.engine=sglang", "rollout.mode=server", "rollout.server_url=http://127.0.0.1:1"], 2, "one-process run"),
    (["rollout.engine=vllm", "train.sharding=fsdp"], 2, "use train.sharding: ddp"),
])
def test_engines_that_cannot_take_a_multi_process_runs_weights_are_refused(tmp_path, overrides, world, message):
    from mmgrpo.engine_builders import check_world

    config = vlm_config(tmp_path, *overrides)
    check_world(config, 1)
    with pytest.raises(ConfigError, match=message):
        check_world(config, world)
    check_world(vlm_config(tmp_path, "rollout.engine=vllm", "train.sharding=ddp"), world)


def test_a_trainer_step_samples_on_the_server_and_pushes_its_weights(engine_server, tiny_qwen2_vl_dir, tmp_path):
    from mmgrpo.trainer import Trainer

    config = vlm_config(
        tmp_path, f"pipeline.pretrained={tiny_qwen2_vl_dir}", f"pipeline.max_new_tokens={STEPS}",
        "pipeline.min_pixels=3136", "pipeline.max_pixels=3136", "pipeline.lora_rank=4", "pipeline.lora_alpha=8",
        "train.prompts_per_step=2", "train.group_size=2", "train.minibatch_size=4", "train.max_steps=1",
        "train.max_seconds=0", "eval.every=0", "checkpoint.every=0", "data.n_train=4", "data.n_eval=1",
        "rollout.engine=sglang", "rollout.mode=server", f"rollout.server_url={engine_server.url}",
    )
    trainer = Trainer(config)
    assert isinstance(trainer.engine, ServerEngine) and trainer.engine.holds_weights
    trainer.step = 1
    initial = engine_server.model
    metrics = trainer.train_step()
    assert engine_server.model is not initial  # reloaded from the pushed folder
    assert len(engine_server.prompts_seen) == 4  # the step's rollouts came from the server
    assert "rollout_corr/kl" in metrics  # the engine's log-probs were corrected (recomputed by the trainer)
    assert trainer.engine.version == 1 and (tmp_path / "engine_weights" / "v1" / "config.json").is_file()
    served = {name: p for name, p in engine_server.model.named_parameters()}
    merged = trainer.policy.engine_weights()
    torch.testing.assert_close(served["model.language_model.layers.0.self_attn.q_proj.weight"],
                               merged["model.language_model.layers.0.self_attn.q_proj.weight"].float())
