"""Test set-up: offline hub, CPU threads, and tiny real-class models saved to local folders."""

import os

for _key, _value in {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "ACCELERATE_USE_CPU": "true",
    "TOKENIZERS_PARALLELISM": "false",
    "DIFFUSERS_VERBOSITY": "error",
    "TRANSFORMERS_VERBOSITY": "error",
}.items():
    os.environ.setdefault(_key, _value)

import pytest  # noqa: E402
import torch  # noqa: E402

# 2 threads by default; OMP_NUM_THREADS wins when set: on a shared 2-core machine, two torch threads competing with
# another job for one free core make tiny-model forwards ~50x slower (measured: 4.3 s instead of 0.07 s per rollout)
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 2))


@pytest.fixture(scope="session")
def load_bench():
    """Imports a script of `bench/` by name (the folder is not a package), e.g. ``load_bench("vlm_vs_trl")``."""
    import importlib.util
    from pathlib import Path

    def load(name: str):
        path = Path(__file__).resolve().parent.parent / "bench" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load


@pytest.fixture(scope="session")
def tiny_sd3_dir(tmp_path_factory):
    """A tiny random SD3 pipeline (real diffusers/transformers classes) written with `save_pretrained`."""
    from mmgrpo.data.tiny_components import tiny_sd3_pipeline

    path = tmp_path_factory.mktemp("tiny_sd3")
    tiny_sd3_pipeline(seed=0).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_flux_dir(tmp_path_factory):
    """A tiny random FLUX pipeline (real diffusers/transformers classes, offline tokenizers) written with
    `save_pretrained`."""
    from mmgrpo.data.tiny_components import tiny_flux_pipeline

    path = tmp_path_factory.mktemp("tiny_flux")
    tiny_flux_pipeline(seed=0).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_mdlm_dir(tmp_path_factory):
    """A tiny random bidirectional Llama (masked-diffusion LM) and its character tokenizer, `save_pretrained`."""
    from mmgrpo.data.tiny_mdlm import save_tiny_mdlm

    return save_tiny_mdlm(tmp_path_factory.mktemp("tiny_mdlm"))


@pytest.fixture(scope="session")
def tiny_qwen2_vl_dir(tmp_path_factory):
    """A tiny random Qwen2-VL (real transformers classes, offline tokenizer) and its processor, `save_pretrained`."""
    from mmgrpo.data.tiny_vlm import save_tiny_qwen_vl

    return save_tiny_qwen_vl(tmp_path_factory.mktemp("tiny_qwen2_vl"), "qwen2_vl")


@pytest.fixture(scope="session")
def tiny_qwen2_5_vl_dir(tmp_path_factory):
    """A tiny random Qwen2.5-VL and its processor, `save_pretrained`."""
    from mmgrpo.data.tiny_vlm import save_tiny_qwen_vl

    return save_tiny_qwen_vl(tmp_path_factory.mktemp("tiny_qwen2_5_vl"), "qwen2_5_vl")
