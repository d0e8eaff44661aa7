"""bench/gpu_rollouts.py where it runs without a GPU: it parses, refuses bad arguments in one line before anything
loads, and its experiment config is a valid colocated-vLLM config for the model it is given."""

import json

import pytest


@pytest.fixture(scope="module")
def bench(load_bench):
    return load_bench("gpu_rollouts")


def test_bad_arguments_are_refused_in_one_line(bench, tmp_path, tiny_qwen2_vl_dir):
    with pytest.raises(SystemExit, match="no config.json"):
        bench.main(["--model", str(tmp_path)])
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(SystemExit, match="'llama' model"):
        bench.main(["--model", str(tmp_path)])
    with pytest.raises(SystemExit, match="--group-size must be >= 2"):
        bench.main(["--model", tiny_qwen2_vl_dir, "--group-size", "1"])
    with pytest.raises(SystemExit, match="--steps must be >= 1"):
        bench.main(["--model", tiny_qwen2_vl_dir, "--steps", "0"])
    with pytest.raises(SystemExit, match="--gpu-memory-utilization"):
        bench.main(["--model", tiny_qwen2_vl_dir, "--gpu-memory-utilization", "1.5"])


def test_without_a_gpu_it_stops_before_loading(bench, tiny_qwen2_vl_dir):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the refusal of a machine without one cannot happen")
    with pytest.raises(SystemExit, match="No CUDA GPU"):
        bench.main(["--model", tiny_qwen2_vl_dir])


def test_its_experiments_are_valid_configs(bench, tmp_path, tiny_qwen2_vl_dir):
    args = bench.parse(["--model", tiny_qwen2_vl_dir])
    local, vllm = (bench.experiment(args, tmp_path, engine) for engine in ("local", "vllm"))
    assert local.rollout.engine == "local" and vllm.rollout.engine == "vllm" and vllm.rollout.mode == "colocate"
    assert vllm.rollout.gpu_memory_utilization == args.gpu_memory_utilization
    assert vllm.train.prompts_per_step * vllm.train.group_size == vllm.train.minibatch_size
