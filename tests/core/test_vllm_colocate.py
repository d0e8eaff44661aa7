"""The colocated vLLM engine (`mmgrpo.engines_vllm`) on the tiny Qwen2-VL: the prompt tokens vLLM sees for an image
prompt are the trainer's, its greedy output is the trainer's before and after a weight sync, and it sleeps between
rollouts. Needs the vllm package (the ``vllm`` extra) and a CUDA GPU; skipped where vllm is not installed."""

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="the vllm extra is not installed")

from mmgrpo.plans import TokenPlan  # noqa: E402
from mmgrpo.sections import RolloutConfig  # noqa: E402
from builders._qwen_vl_batches import vl_policy  # noqa: E402
from test_rollout_engines import image_batch, perturb  # noqa: E402

STEPS = 6
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="vLLM runs on a CUDA GPU")


@pytest.fixture(scope="module")
def engine_and_policy(request):
    from mmgrpo.engines_vllm import VLLMColocateEngine

    policy = vl_policy(request, "tiny_qwen2_vl_dir", STEPS)
    policy.model.to("cuda")
    policy.device = torch.device("cuda")
    engine = VLLMColocateEngine(policy, RolloutConfig(engine="vllm", gpu_memory_utilization=0.2, enforce_eager=True,
                                                      max_model_len=1024))
    return engine, policy


def test_vllm_sees_the_trainers_prompt_tokens(engine_and_policy):
    engine, policy = engine_and_policy
    batch = image_batch()
    rollout = engine.sample(batch, TokenPlan(num_steps=STEPS, train_units=[list(range(STEPS))]),
                            generator=torch.Generator().manual_seed(0))
    assert engine.seen == [p["input_ids"].tolist() for p in policy._encode_batch(image_batch())]
    assert rollout.engine_log_probs is not None and rollout.mask.any()


def test_greedy_output_follows_the_synced_weights(engine_and_policy):
    engine, policy = engine_and_policy
    batch = image_batch(1)
    plan = TokenPlan(num_steps=STEPS, train_units=[list(range(STEPS))], greedy=True)
    before = policy.sample(batch, plan).outputs["texts"]
    assert engine.sample(batch, plan).outputs["texts"] == before
    perturb(policy)
    after = policy.sample(batch, plan).outputs["texts"]
    assert after != before
    engine.sync_weights(policy)
    assert engine.sample(batch, plan).outputs["texts"] == after
