"""FSDP2 (``train.sharding: fsdp``) on two CPU processes under torchrun and gloo against one process, on the same
rollouts and advantages (see `fsdp_worker.py`): the same losses and, within fp32 tolerance, the same weights after
several updates, for the flow pipelines (sd3, flux, wan, and fully trained with checkpointed blocks z_image,
qwen_image, flux2, hunyuan_video15, ltx2, flux_kontext and qwen_image_edit), `qwen_vl` and `mdlm`, LoRA and full
fine-tuning (the full ones with gradient checkpointing: diffusers' checkpointed blocks rerun FSDP2's hooks,
transformers' do not); with the reference policy (adapter off / frozen copy, through a KL term), DGPO's fast-EMA old
model, global gradient clipping (an active clip: a per-process norm would scale differently) and the NaN-skip rule;
evaluation and sample writing on rank 0; checkpoints resumed at the other world size (2 -> 1 and 1 -> 2) whose
weights load in stock diffusers; a launch as two nodes of one process (two torchrun invocations, localhost
rendezvous), ``train.sharding: hybrid`` on them (a 2 x 1 replicate x shard mesh), and a process of it dying; and,
marked slow, hybrid on two nodes of two processes (a 2 x 2 mesh).
Four launches shared by the tests (one process, two, one, two nodes) and the slow test's launch of four processes:
measured: 14 tests in 70 s on two otherwise idle cores.

fp32 tolerance: the sharded run reduces gradients in another order (reduce-scatter of per-process sums), so
weights agree to ``atol=5e-5`` after the updates (measured: at most 1.9e-5, while Adam moved them by 4e-3 to
4e-2), not bitwise; losses and metrics to ``rel=1e-4`` (``abs=1e-6`` for the small KL terms).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

WORKER = Path(__file__).with_name("fsdp_worker.py")
ENV = {"ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
WEIGHT_ATOL, LOSS_REL, LOSS_ABS = 5e-5, 1e-4, 1e-6


def sd3_config(root: Path, pretrained: str, world: int, *, lora: bool, algorithm: dict,
               checkpointing: bool = False) -> dict:
    root.mkdir(parents=True, exist_ok=True)
    prompts = root / "prompts.txt"
    prompts.write_text("a red circle\na blue square\na green triangle\n")
    return {
        "output_dir": str(root / "run"), "seed": 0,
        "pipeline": {"name": "sd3", "pretrained": pretrained, "resolution": 32, "num_steps": 3, "guidance_scale": 1.0,
                     "lora_rank": 4 if lora else 0, "max_sequence_length": 16, "gradient_checkpointing": checkpointing},
        "algorithm": algorithm,
        "reward": {"name": "jpeg"},
        "data": {"name": "prompt_file", "train_file": str(prompts), "eval_file": str(prompts)},
        "train": {"max_steps": 3, "prompts_per_step": 2, "group_size": 2, "minibatch_size": 4 // world,
                  "learning_rate": 1e-2 if lora else 1e-3, "max_grad_norm": 0.05, "sharding": "fsdp"},
        "eval": {"every": 0, "num_prompts": 2, "metric": "jpeg_kb"},
        "checkpoint": {"every": 0},
    }


def flux_config(root: Path, pretrained: str, world: int, *, lora: bool, checkpointing: bool = False) -> dict:
    config = sd3_config(root, pretrained, world, lora=lora, algorithm=flow_grpo(), checkpointing=checkpointing)
    config["pipeline"].update(name="flux")
    config["pipeline"].pop("guidance_scale")
    return config


def wan_config(root: Path, pretrained: str, world: int, *, lora: bool, checkpointing: bool = False) -> dict:
    config = sd3_config(root, pretrained, world, lora=lora, algorithm=flow_grpo(), checkpointing=checkpointing)
    config["pipeline"] = {"name": "wan", "pretrained": pretrained, "height": 32, "width": 32, "num_frames": 5,
                          "num_steps": 3, "guidance_scale": 1.0, "lora_rank": 4 if lora else 0, "lora_alpha": 8,
                          "max_sequence_length": 16, "gradient_checkpointing": checkpointing}
    config["reward"], config["eval"]["metric"] = {"name": "temporal_flicker"}, "temporal_flicker"
    return config


FLOW_OPTIONS = {  # the 2026 flow pipelines: tiny sizes of their builders, one forward per step (no CFG), fp32 weights
    "z_image": {"resolution": 32, "guidance_scale": 0.0, "max_sequence_length": 16},
    "qwen_image": {"resolution": 32, "true_cfg_scale": 1.0, "max_sequence_length": 16},
    "flux2": {"resolution": 32, "guidance_scale": 1.0, "max_sequence_length": 16,
              "text_encoder_out_layers": [1, 2, 2]},
    "hunyuan_video15": {"height": 16, "width": 16, "num_frames": 3, "guidance_scale": 1.0, "max_sequence_length": 16,
                        "glyph_max_length": 16},
    "ltx2": {"height": 32, "width": 32, "num_frames": 5, "frame_rate": 25.0, "guidance_scale": 1.0,
             "audio_guidance_scale": 1.0, "max_sequence_length": 16},
    "flux_kontext": {"resolution": 32, "max_sequence_length": 16},
    "qwen_image_edit": {"resolution": 32, "true_cfg_scale": 1.0, "max_sequence_length": 16,
                        "condition_area": 32 * 32, "pipeline_class": "QwenImageEditPipeline"},
}
EDITS = Path(__file__).resolve().parents[2] / "data" / "examples" / "edit" / "edits.jsonl"


def flow_config(root: Path, pretrained: str, world: int, *, name: str, lora: bool, checkpointing: bool) -> dict:
    """Flow-GRPO with a KL term on pipeline `name` (options in `FLOW_OPTIONS`); videos are rewarded by flicker, edits
    read the example edit rows (an instruction and an input image each)."""
    config = sd3_config(root, pretrained, world, lora=lora, algorithm=flow_grpo(), checkpointing=checkpointing)
    config["pipeline"] = {"name": name, "pretrained": pretrained, "num_steps": 3, "lora_rank": 4 if lora else 0,
                          "lora_alpha": 8, "weights_dtype": "float32", "gradient_checkpointing": checkpointing,
                          **FLOW_OPTIONS[name]}
    if "num_frames" in FLOW_OPTIONS[name]:
        config["reward"], config["eval"]["metric"] = {"name": "temporal_flicker"}, "temporal_flicker"
    if name in ("flux_kontext", "qwen_image_edit"):
        config["data"] = {"name": "edit_jsonl", "train_file": str(EDITS), "eval_file": str(EDITS)}
    return config


def qwen_vl_config(root: Path, pretrained: str, world: int, *, lora: bool, optim: str = "adamw_torch") -> dict:
    return {
        "output_dir": str(root / "run"), "seed": 0,
        "pipeline": {"name": "qwen_vl", "pretrained": pretrained, "max_new_tokens": 6, "lora_rank": 4 if lora else 0,
                     "lora_alpha": 8},
        "algorithm": {"name": "grpo", "kl_beta": 0.04},
        "reward": {"name": "format"},
        "data": {"name": "vlm_shapes", "tasks": ["count"], "n_train": 8, "n_eval": 2},
        "train": {"max_steps": 3, "prompts_per_step": 2, "group_size": 2, "minibatch_size": 4 // world,
                  "learning_rate": 1e-2 if lora else 1e-3, "max_grad_norm": 0.05, "sharding": "fsdp",
                  "optim": optim},
        "eval": {"every": 0, "num_prompts": 2, "metric": "score"},
        "checkpoint": {"every": 0},
    }


def mdlm_config(root: Path, pretrained: str, world: int, *, lora: bool, checkpointing: bool = False) -> dict:
    return {
        "output_dir": str(root / "run"), "seed": 0,
        "pipeline": {"name": "mdlm", "pretrained": pretrained, "gen_length": 8, "block_length": 4,
                     "steps_per_block": 2, "lora_rank": 4 if lora else 0, "lora_alpha": 8,
                     "gradient_checkpointing": checkpointing},
        "algorithm": {"name": "cj_grpo", "kl_beta": 0.04},
        "reward": {"name": "accuracy", "mode": "numeric"},
        "data": {"name": "arith", "digits": 1, "n_train": 8, "n_eval": 2},
        "train": {"max_steps": 3, "prompts_per_step": 2, "group_size": 2, "minibatch_size": 4 // world,
                  "learning_rate": 1e-2 if lora else 1e-3, "max_grad_norm": 0.05, "sharding": "fsdp"},
        "eval": {"every": 0, "num_prompts": 2, "metric": "score"},
        "checkpoint": {"every": 0},
    }


def run_worker(tmp_path: Path, tag: str, world: int, cases: dict) -> dict:
    """Runs `cases` in `world` processes (torchrun for 2) and returns the rank-0 result per case."""
    spec = tmp_path / f"spec_{tag}.json"
    spec.write_text(json.dumps({"tag": tag, "cases": cases}))
    launch = [sys.executable]
    if world > 1:
        launch += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world)]
    proc = subprocess.run(launch + [str(WORKER), str(spec), str(tmp_path)], capture_output=True, text=True,
                          timeout=900, env=dict(os.environ, **ENV))
    first = proc.stderr.find("Traceback")  # the worker's own error, before torchrun's summary
    assert proc.returncode == 0, proc.stderr[first : first + 5000] if first >= 0 else proc.stderr[-5000:]
    return json.loads((tmp_path / f"result_{tag}.json").read_text())


def weights(tmp_path: Path, name: str, tag: str) -> torch.Tensor:
    return load_file(str(tmp_path / f"{name}_{tag}.safetensors"))["weights"]


def flow_grpo(kl_beta: float = 0.01) -> dict:
    return {"name": "flow_grpo", "kl_beta": kl_beta}


def assert_same_run(one: dict, two: dict, w_one: torch.Tensor, w_two: torch.Tensor) -> None:
    """Same update metrics step by step (losses, KL, global gradient norm) and weights within fp32 tolerance."""
    assert one["steps"].keys() == two["steps"].keys() and one["steps"]
    for step, metrics in one["steps"].items():
        assert metrics.keys() == two["steps"][step].keys()
        for key, value in metrics.items():
            assert two["steps"][step][key] == pytest.approx(value, rel=LOSS_REL, abs=LOSS_ABS, nan_ok=True), (step, key)
    torch.testing.assert_close(w_two, w_one, rtol=0, atol=WEIGHT_ATOL)
    # not vacuous: training moved the weights far beyond the tolerance
    assert one["max_move"] > 50 * WEIGHT_ATOL and two["max_move"] > 50 * WEIGHT_ATOL


DGPO = {"name": "dgpo", "trunc_steps": 1, "num_train_timesteps": 2, "ema_decay_rate": 0.1}
CASES = {  # name -> (builder, its fixture, options): each trains 2 steps of 2 inner epochs
    # reference: the frozen copy; blocks checkpointed (diffusers checkpoints the block's __call__, FSDP2 hooks included)
    "sd3_full": (sd3_config, "tiny_sd3_dir", {"lora": False, "algorithm": flow_grpo(), "checkpointing": True}),
    "sd3_dgpo": (sd3_config, "tiny_sd3_dir", {"lora": True, "algorithm": DGPO}),  # the fast-EMA old model
    "flux_lora": (flux_config, "tiny_flux_dir", {"lora": True}),  # reference: the adapter off
    "wan_full": (wan_config, "tiny_wan_dir", {"lora": False, "checkpointing": True}),  # video latents, blocks checkpointed
    "qwen_vl_lora": (qwen_vl_config, "tiny_qwen2_vl_dir", {"lora": True}),  # prefix-shared group forward, KL
    "qwen_vl_full": (qwen_vl_config, "tiny_qwen2_vl_dir", {"lora": False, "optim": "adamw_torch_fused"}),  # one kernel
    "mdlm_lora": (mdlm_config, "tiny_mdlm_dir", {"lora": True}),  # step-by-step masked-diffusion backward, KL
    "mdlm_full": (mdlm_config, "tiny_mdlm_dir", {"lora": False, "checkpointing": True}),  # layers checkpointed
    # the 2026 flow pipelines, full fine-tuning with checkpointed blocks (a sharded frozen reference copy)
    **{f"{name}_full": (flow_config, f"tiny_{name}_dir", {"name": name, "lora": False, "checkpointing": True})
       for name in FLOW_OPTIONS},
}


def pipeline_cases(request, root: Path, world: int, names) -> dict:
    """The worker cases `names` of `CASES` for `world` processes, under `root`."""
    cases = {}
    for name in names:
        builder, fixture, options = CASES[name]
        config = builder(root / f"{name}_w{world}", request.getfixturevalue(fixture), world, **options)
        config["train"]["inner_epochs"] = 2  # the second epoch's losses depend on the updated weights
        cases[name] = {"config": config, "steps": 2}
    return cases


def sd3_case(root: Path, tiny_sd3_dir: str, world: int, resume_from: str | None = None, **extra) -> dict:
    """sd3 LoRA, Flow-GRPO with a KL term (reference = adapter off), 3 steps of 2 inner epochs; a NaN advantage on
    the last sample (the last process's) at step 2, then a checkpoint. ``train.ema`` averages the sharded weights: the
    checkpoint's weights/ hold the average and its trained weights resume at the other world size."""
    config = sd3_config(root, tiny_sd3_dir, world, lora=True, algorithm=flow_grpo())
    config["train"]["inner_epochs"] = 2
    config["train"]["ema"] = {"decay": 0.9}
    config["checkpoint"]["resume_from"] = resume_from
    return {"config": config, "steps": 3, "save_at": 2, "nan_step": 2, **extra}


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory, tiny_sd3_dir):
    """One launch of one process and one of two FSDP processes train every case (sd3 LoRA and `CASES`); the two
    processes also resume the one process's sd3 checkpoint, and a third launch (one process) resumes theirs."""
    root = tmp_path_factory.mktemp("fsdp_runs")
    one = run_worker(root, "w1", 1, {"sd3": sd3_case(root / "w1", tiny_sd3_dir, 1),
                                     **pipeline_cases(request, root, 1, CASES)})
    two = run_worker(root, "w2", 2, {"sd3": sd3_case(root / "w2", tiny_sd3_dir, 2, evaluate=True),
                                     "from1": sd3_case(root / "w2r", tiny_sd3_dir, 2, one["sd3"]["checkpoint"]),
                                     **pipeline_cases(request, root, 2, CASES)})
    back = run_worker(root, "w1r", 1, {"from2": sd3_case(root / "w1r", tiny_sd3_dir, 1, two["sd3"]["checkpoint"])})
    return root, one, {**two, **back}


@pytest.mark.parametrize("name", list(CASES))
def test_fsdp_matches_one_process(runs, name):
    """Two FSDP processes give the same update metrics (losses, KL to the reference, global gradient norm) and,
    within fp32 tolerance, the same weights as one process, for each pipeline, LoRA and full fine-tuning."""
    root, ones, twos = runs
    one, two = ones[name], twos[name]
    assert two["sharded"] and two["world"] == 2 and two["sharding"] == "fsdp" and not one["sharded"]
    if name.endswith("_full"):  # the frozen reference copy is sharded too: each process holds its share
        assert two["reference_sharded"] and not one["reference_sharded"]
    assert_same_run(one, two, weights(root, name, "w1"), weights(root, name, "w2"))
    assert one["steps"]["2"]["train/kl"] > 0  # the reference was read, and the trained policy has left it


def test_fsdp_sd3_lora_clips_globally_and_skips_nan_updates_everywhere(runs):
    """sd3 LoRA over 3 steps: the same metrics and weights as one process, with clipping active (a per-process norm
    would scale each shard differently) and step 2's NaN advantage, on the last process only, skipped by both."""
    root, ones, twos = runs
    one, two = ones["sd3"], twos["sd3"]
    assert two["sharded"] and not one["sharded"]
    assert two["nan_step_unchanged"] and one["nan_step_unchanged"]  # the skipped step left the weights as they were
    assert two["skipped_updates"] == one["skipped_updates"] == 2  # 2 inner epochs, 1 update each
    assert "train/grad_norm" not in two["steps"]["2"]
    assert max(two["steps"][s]["train/grad_norm"] for s in ("1", "3")) > 0.05  # above max_grad_norm: clipped
    assert_same_run(one, two, weights(root, "sd3", "w1"), weights(root, "sd3", "w2"))


def test_fsdp_checkpoints_resume_at_another_world_size(runs, tiny_sd3_dir):
    """The checkpoint written after step 2 by one process resumes in two and the other way round, to the same third
    step; it holds no pickle, its consolidated LoRA file loads in stock diffusers, and loading weights into the
    sharded model afterwards is refused with a clear message."""
    root, ones, twos = runs
    one, two = ones["sd3"], twos["sd3"]
    assert twos["from1"]["start"] == twos["from2"]["start"] == 2 and list(twos["from2"]["steps"]) == ["3"]
    third = {**one, "steps": {"3": one["steps"]["3"]}}
    assert_same_run(third, twos["from1"], weights(root, "sd3", "w1"), weights(root, "from1", "w2"))
    assert_same_run(third, twos["from2"], weights(root, "sd3", "w1"), weights(root, "from2", "w1r"))
    # the checkpoint holds no pickle, and the LoRA file rank 0 consolidated loads in stock diffusers
    ckpt = Path(two["checkpoint"])
    assert not [p for p in ckpt.rglob("*") if p.suffix in (".pt", ".bin", ".pkl", ".metadata")]
    from diffusers import SD3Transformer2DModel

    mine = load_file(str(ckpt / "weights" / "pytorch_lora_weights.safetensors"))
    other = load_file(str(Path(one["checkpoint"]) / "weights" / "pytorch_lora_weights.safetensors"))
    assert mine.keys() == other.keys() and len(mine) > 0
    for key in mine:
        torch.testing.assert_close(mine[key], other[key], rtol=0, atol=WEIGHT_ATOL)
    model = SD3Transformer2DModel.from_pretrained(tiny_sd3_dir, subfolder="transformer")
    model.load_lora_adapter(str(ckpt / "weights"), prefix="transformer", weight_name="pytorch_lora_weights.safetensors")
    loaded = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    assert len(loaded) == len(mine)
    for key, value in mine.items():
        name = key.removeprefix("transformer.").replace(".weight", ".default_0.weight")
        torch.testing.assert_close(loaded[name], value, rtol=0, atol=0)
    # loading weights into the sharded model (what `mmgrpo eval --checkpoint` does after building it) is refused
    assert "cannot load weights into a sharded model" in two["load_weights_error"]
    assert "load_weights_error" not in one


def test_fsdp_evaluates_on_every_process_and_writes_on_rank_0(runs):
    """Evaluation runs sharded (each process samples its held-out prompt) and rank 0 writes the per-prompt scores
    and the samples."""
    root, _, twos = runs
    rows = json.loads((root / "w2" / "run" / "eval" / "step_00099.json").read_text())
    assert sorted(r["prompt"] for r in rows) == ["a blue square", "a red circle"]
    assert list((root / "w2" / "run" / "samples").glob("*.png"))
    assert twos["sd3"]["eval"]["eval/jpeg_kb"] == pytest.approx(sum(r["jpeg_kb"] for r in rows) / 2, rel=1e-6)


def launch_two_nodes(tmp_path: Path, tag: str, cases: dict, timeout: float = 600,
                     per_node: int = 1) -> list[subprocess.CompletedProcess]:
    """Runs `cases` as two nodes of `per_node` processes each: two torchrun invocations meeting at a localhost
    rendezvous."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spec = tmp_path / f"spec_{tag}.json"
    spec.write_text(json.dumps({"tag": tag, "cases": cases}))
    nodes = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", str(per_node),
             "--node_rank",
             str(rank), "--master_addr", "127.0.0.1", "--master_port", str(port), str(WORKER), str(spec),
             str(tmp_path)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ, **ENV),
        )
        for rank in (0, 1)
    ]
    done = []
    for node in nodes:
        out, err = node.communicate(timeout=timeout)
        done.append(subprocess.CompletedProcess(node.args, node.returncode, out, err))
    return done


def hybrid(case: dict) -> dict:
    """`case` with ``train.sharding: hybrid`` (HSDP: shard within a node, replicate across nodes)."""
    case["config"]["train"]["sharding"] = "hybrid"
    return case


@pytest.fixture(scope="module")
def two_nodes(request, tmp_path_factory, tiny_sd3_dir):
    """One launch of two nodes of one process: `mdlm` LoRA under fsdp, then under hybrid `mdlm` LoRA and the sd3
    LoRA case (clipping, NaN skip, checkpoint), then a case in which the second node's process dies."""
    root = tmp_path_factory.mktemp("fsdp_nodes")
    cases = pipeline_cases(request, root / "nodes", 2, ["mdlm_lora"])
    cases["hybrid_mdlm"] = hybrid(pipeline_cases(request, root / "hybrid", 2, ["mdlm_lora"])["mdlm_lora"])
    cases["hybrid_sd3"] = hybrid(sd3_case(root / "hybrid_sd3", tiny_sd3_dir, 2))
    cases["dies"] = {**pipeline_cases(request, root / "dies", 2, ["mdlm_lora"])["mdlm_lora"],
                     "die": {"rank": 1, "step": 2}}
    first, second = launch_two_nodes(root, "nodes", cases, timeout=600)  # a hang would raise TimeoutExpired
    return root, first, second, json.loads((root / "result_nodes.json").read_text())  # written after each case


def test_fsdp_two_nodes_of_one_process(runs, two_nodes):
    """Two torchrun invocations (`--nnodes 2 --node_rank 0/1`, localhost rendezvous) shard `mdlm` LoRA over both
    "nodes" and give one process's update. Then, in the last case, the second node's process exits abruptly during
    step 2 while the first gathers parameters from it: both launches end (no wait for a collective timeout) with a
    non-zero status, and the first node's error names the lost peer."""
    root, ones, _ = runs
    nodes, first, second, two = two_nodes
    assert list(two) == ["mdlm_lora", "hybrid_mdlm", "hybrid_sd3"]  # "dies" never finished
    assert two["mdlm_lora"]["world"] == 2 and two["mdlm_lora"]["sharded"]
    assert two["mdlm_lora"]["mesh"] == {"shape": [2], "names": []}
    assert_same_run(ones["mdlm_lora"], two["mdlm_lora"], weights(root, "mdlm_lora", "w1"),
                    weights(nodes, "mdlm_lora", "nodes"))
    assert second.returncode != 0 and "exitcode  : 3" in second.stderr
    assert first.returncode != 0
    lost = ("Connection closed by peer", "Connection reset by peer")  # gloo's words, as the peer's socket closes
    assert any(words in first.stderr for words in lost), first.stderr[-3000:]


def test_hybrid_two_nodes_match_one_process(runs, two_nodes):
    """``train.sharding: hybrid`` on two nodes of one process: a 2-D mesh of 2 replicas x 1 shard, and the same
    update metrics and weights as one process for `mdlm` LoRA and for sd3 LoRA with an active global clip (a norm
    that counted each replica's copy of a shard would be sqrt(2) too large and clip differently), step 2's NaN
    advantage skipped, and a checkpoint written."""
    root, ones, _ = runs
    nodes, _, _, two = two_nodes
    for name, one_name in (("hybrid_mdlm", "mdlm_lora"), ("hybrid_sd3", "sd3")):
        run = two[name]
        assert run["sharding"] == "hybrid" and run["world"] == 2 and run["sharded"]
        assert run["mesh"] == {"shape": [2, 1], "names": ["replicate", "shard"]}
        assert_same_run(ones[one_name], run, weights(root, one_name, "w1"), weights(nodes, name, "nodes"))
    sd3 = two["hybrid_sd3"]
    assert sd3["nan_step_unchanged"] and sd3["skipped_updates"] == ones["sd3"]["skipped_updates"] == 2
    assert max(sd3["steps"][s]["train/grad_norm"] for s in ("1", "3")) > 0.05  # above max_grad_norm: clipped
    assert Path(sd3["checkpoint"], "weights", "pytorch_lora_weights.safetensors").is_file()


@pytest.mark.slow  # four processes on two cores (about 40 s)
def test_hybrid_two_nodes_of_two_processes_match_one_process(request, runs, tmp_path, tiny_sd3_dir):
    """``train.sharding: hybrid`` on two nodes of two processes: a 2 x 2 mesh (each node shards over its two
    processes, the nodes replicate), and one process's update metrics and weights for `mdlm` LoRA and for sd3 LoRA
    with an active global clip and step 2's NaN advantage skipped."""
    root, ones, _ = runs
    cases = {"hybrid_mdlm": hybrid(pipeline_cases(request, tmp_path / "mdlm", 4, ["mdlm_lora"])["mdlm_lora"]),
             "hybrid_sd3": hybrid(sd3_case(tmp_path / "sd3", tiny_sd3_dir, 4))}
    launches = launch_two_nodes(tmp_path, "h22", cases, timeout=900, per_node=2)
    for launch in launches:
        first = launch.stderr.find("Traceback")
        assert launch.returncode == 0, launch.stderr[first : first + 5000] if first >= 0 else launch.stderr[-5000:]
    four = json.loads((tmp_path / "result_h22.json").read_text())
    for name, one_name in (("hybrid_mdlm", "mdlm_lora"), ("hybrid_sd3", "sd3")):
        run = four[name]
        assert run["world"] == 4 and run["sharding"] == "hybrid"
        assert run["mesh"] == {"shape": [2, 2], "names": ["replicate", "shard"]}
        assert_same_run(ones[one_name], run, weights(root, one_name, "w1"), weights(tmp_path, name, "h22"))
    assert four["hybrid_sd3"]["nan_step_unchanged"] and four["hybrid_sd3"]["skipped_updates"] == 2
