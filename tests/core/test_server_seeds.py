"""Server rollouts follow the run's seed: against the loopback server of tests/engine_server.py (a real tiny Qwen2-VL
that honours ``seed`` / ``n`` as vLLM does and ``sampling_seed`` as SGLang does), the same generator state gives the
same requests and the same rollout, another seed another rollout, the members of a group different samples, and each
returned sample is the server's draw for its own seed, in the batch's order."""

import pytest
import torch

from engine_server import engine_server  # noqa: F401
from mmgrpo.engine_server import ServerEngine
from mmgrpo.plans import TokenPlan
from mmgrpo.types import PromptBatch
from builders._qwen_vl_batches import vl_policy

STEPS, G = 4, 3
PROMPTS = ["count the circles", "name a colour"]


def text_batch() -> PromptBatch:
    return PromptBatch(list(PROMPTS), metadata=[{}, {}]).repeat(G)


def plan() -> TokenPlan:
    return TokenPlan(num_steps=STEPS, train_units=[list(range(STEPS))])


def engine_for(request, server, engine_name, tmp_path) -> ServerEngine:
    policy = vl_policy(request, "tiny_qwen2_vl_dir", STEPS)
    return ServerEngine(policy, engine_name, server.url, 60.0, str(tmp_path / "weights"))


def sampled(engine, seed):
    rollout = engine.sample(text_batch(), plan(), generator=torch.Generator().manual_seed(seed))
    return rollout.trajectory["completion_ids"], rollout.engine_log_probs, rollout.mask  # [N, S] each


def posted(server, route):
    return [body for path, body in server.requests if path == route]


@pytest.mark.parametrize("engine_name", ["sglang", "vllm"])
def test_the_same_run_seed_gives_the_same_server_rollout_and_another_seed_another(request, engine_server, tmp_path,
                                                                                   engine_name):
    engine = engine_for(request, engine_server, engine_name, tmp_path)
    ids, log_probs, mask = sampled(engine, 7)
    ids_again, log_probs_again, _ = sampled(engine, 7)
    ids_other, _, _ = sampled(engine, 8)
    assert torch.equal(ids, ids_again)
    assert torch.equal(log_probs, log_probs_again)
    assert not torch.equal(ids, ids_other)
    for group in ids.view(len(PROMPTS), G, STEPS):  # no two members of a group share their draws
        assert len({tuple(member.tolist()) for member in group}) == G
    assert mask[:, 0].all()


def test_vllm_sends_one_request_per_group_with_n_the_group_size_and_the_groups_seed(request, engine_server, tmp_path):
    engine = engine_for(request, engine_server, "vllm", tmp_path)
    ids, _, mask = sampled(engine, 7)
    bodies = posted(engine_server, "/v1/completions")
    assert len(bodies) == len(PROMPTS)
    assert all(body["n"] == G and len(body["prompt"]) == 1 for body in bodies)
    seeds = {tuple(body["prompt"][0]): body["seed"] for body in bodies}  # arrival order is free: key by prompt
    assert set(seeds) == {tuple(engine.sent[g * G]) for g in range(len(PROMPTS))}
    assert len(set(seeds.values())) == len(PROMPTS)
    engine_server.requests.clear()
    sampled(engine, 7)
    assert {tuple(b["prompt"][0]): b["seed"] for b in posted(engine_server, "/v1/completions")} == seeds
    # member i of a group is the server's draw with the group's seed + i (vLLM's children), in the batch's order
    template = {key: value for key, value in bodies[0].items() if key not in ("prompt", "n", "seed")}
    for j, prompt in enumerate(engine.sent):
        alone = engine.post("/v1/completions", {**template, "prompt": [prompt], "n": 1,
                                                "seed": seeds[tuple(prompt)] + j % G})
        assert ids[j][mask[j]].tolist() == alone["choices"][0]["token_ids"]


def test_sglang_sends_one_sampling_seed_per_sample_and_each_sample_is_its_seeds_draw(request, engine_server, tmp_path):
    engine = engine_for(request, engine_server, "sglang", tmp_path)
    ids, _, mask = sampled(engine, 7)
    (body,) = posted(engine_server, "/generate")
    params = body["sampling_params"]
    assert isinstance(params, list) and len(params) == len(PROMPTS) * G
    seeds = [p["sampling_seed"] for p in params]
    assert len(set(seeds)) == len(seeds) and all(isinstance(s, int) for s in seeds)
    engine_server.requests.clear()
    sampled(engine, 7)
    assert [p["sampling_seed"] for p in posted(engine_server, "/generate")[0]["sampling_params"]] == seeds
    for j, prompt in enumerate(engine.sent):
        (alone,) = engine.post("/generate", {"input_ids": [prompt], "return_logprob": True,
                                             "sampling_params": [params[j]]})
        assert ids[j][mask[j]].tolist() == alone["output_ids"]


@pytest.mark.parametrize("engine_name", ["sglang", "vllm"])
def test_without_a_generator_the_requests_carry_no_seed(request, engine_server, tmp_path, engine_name):
    engine = engine_for(request, engine_server, engine_name, tmp_path)
    engine.sample(text_batch(), plan())
    (body,) = [b for _, b in engine_server.requests]
    if engine_name == "vllm":
        assert "seed" not in body and body["n"] == 1 and len(body["prompt"]) == len(PROMPTS) * G
    else:
        assert isinstance(body["sampling_params"], dict) and "sampling_seed" not in body["sampling_params"]
