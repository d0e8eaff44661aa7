"""bench/scale.py and bench/gpu_flow_grpo_sd35.py on their smallest cases: the state bytes one process counts, the
checkpointing measurement of the tiny VLM, the table's ratios, and the GPU script's ``--tiny`` run on the CPU."""

import pytest


@pytest.fixture(scope="module")
def scale(load_bench):
    return load_bench("scale")


def test_one_process_holds_weights_gradients_and_two_adam_moments(scale, tmp_path):
    """Fully fine-tuned in float32 with AdamW: 4 bytes per parameter each for the weights and the gradients, 8 for
    the two moments (the step counter is a scalar and not counted)."""
    result = scale.worker_case(scale.vlm_config(tmp_path, "none"), steps=1)
    n = result["parameters"]
    assert n > 100_000 and result["world"] == 1 and result["local_samples"] == 8
    assert result["param_bytes"] == 4 * n and result["grad_bytes"] == 4 * n and result["optimizer_bytes"] == 8 * n
    assert result["update_s"] > 0 and result["peak_rss_mib"] > 0


def test_checkpointing_lowers_the_tracked_peak_of_the_tiny_vlm(scale, tmp_path):
    results = scale.run_checkpointing(tmp_path, ["tiny_vlm"], repeats=1)
    off, on = results["tiny_vlm"]["False"], results["tiny_vlm"]["True"]
    assert 0 < on["activations_mib"] < off["activations_mib"] and 0 < on["peak_mib"] < off["peak_mib"]
    assert "| tiny_vlm | 8 |" in scale.checkpointing_table(results)


def test_sharding_table_gives_state_and_time_ratios_to_one_process(scale):
    def rank(param, update_s, samples):
        return {"tiny_flow": {"parameters": 1_000_000, "local_samples": samples, "param_bytes": param,
                              "grad_bytes": param, "optimizer_bytes": 2 * param, "peak_rss_mib": 900.0,
                              "update_s": update_s}}

    full, half = 4 << 20, 2 << 20
    results = {"1 process": {0: rank(full, 1.0, 8)}, "2 x DDP": {0: rank(full, 0.6, 4), 1: rank(full, 0.7, 4)},
               "2 x FSDP": {0: rank(half, 1.5, 4), 1: rank(half, 1.4, 4)}}
    rows = scale.sharding_table(results).splitlines()[2:]
    assert rows[0].startswith("| tiny_flow | 1 process | 8 | 1.00M | 4.0 MiB | 4.0 MiB | 8.0 MiB | 1.00 |")
    assert "| 2 x DDP | 4 | 1.00M | 4.0 MiB | 4.0 MiB | 8.0 MiB | 1.00 |" in rows[1] and rows[1].endswith("0.60 |")
    assert "| 2 x FSDP | 4 | 1.00M | 2.0 MiB | 2.0 MiB | 4.0 MiB | 0.50 |" in rows[2] and rows[2].endswith("1.50 |")


def test_gpu_script_runs_tiny_on_the_cpu(load_bench, tmp_path):
    gpu = load_bench("gpu_flow_grpo_sd35")
    results = gpu.main(["--tiny", "--output", str(tmp_path), "--cases", "lora:1", "full:0"])
    lora, full = results["LoRA r32, checkpointing on"], results["full, checkpointing off"]
    assert 0 < lora["trained_parameters"] < lora["transformer_parameters"]
    assert full["trained_parameters"] == full["transformer_parameters"]
    assert lora["update_s"] > 0 and full["update_s"] > 0 and full["peak_gib"] is None  # no GPU here
    assert (tmp_path / "results.json").is_file()
