"""Side-by-side with the Flow-GRPO reference implementation (yifan123/flow_grpo), in one run, on one model.

Measures, for the same pipeline, prompts, batch and step count:
  * rollout: mmgrpo's `SD3Policy.sample` vs Flow-GRPO's `pipeline_with_logprob` (seconds, ratio);
  * replay: one training pass over all steps (forward + backward of the per-step log-prob), mmgrpo's
    `SD3Policy.log_prob` vs Flow-GRPO's transformer call + `sde_step_with_logprob` (seconds, ratio);
  * agreement: Flow-GRPO's log-prob of the transitions mmgrpo sampled, against mmgrpo's own (max |difference|).

The peer is not a dependency: clone it anywhere and pass its folder.

    git clone https://github.com/yifan123/flow_grpo ../flow_grpo
    python bench/flow_grpo_vs_peer.py --peer-dir ../flow_grpo [--model mmgrpo:t2i_shapes] [--batch 32]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import torch


def load_peer(peer_dir: Path):
    """Imports Flow-GRPO's SD3 sampling patch from a checkout (its folder has no __init__; load by path)."""
    patch = peer_dir / "flow_grpo" / "diffusers_patch"
    pkg = importlib.util.module_from_spec(importlib.machinery.ModuleSpec("flow_grpo_patch", None, is_package=True))
    pkg.__path__ = [str(patch)]
    sys.modules["flow_grpo_patch"] = pkg
    modules = {}
    for name in ("sd3_sde_with_logprob", "sd3_pipeline_with_logprob"):
        spec = importlib.util.spec_from_file_location(f"flow_grpo_patch.{name}", patch / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        modules[name] = module
    return modules["sd3_pipeline_with_logprob"].pipeline_with_logprob, modules["sd3_sde_with_logprob"].sde_step_with_logprob


def timed(fn, repeats: int) -> float:
    """Median wall time of `fn()` over `repeats` runs (after one warm-up)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peer-dir", type=Path, required=True)
    parser.add_argument("--model", default="mmgrpo:t2i_shapes")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--resolution", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    from mmgrpo.algorithms.flow_grpo import FlowGRPO, FlowGRPOConfig
    from mmgrpo.pipelines.sd3 import SD3Config, SD3Policy
    from mmgrpo.types import PromptBatch

    peer_pipeline, peer_step = load_peer(args.peer_dir)
    policy = SD3Policy(SD3Config(pretrained=args.model, resolution=args.resolution, num_steps=args.steps,
                                 guidance_scale=1.0, lora_rank=0, max_sequence_length=16))
    pipe = policy.pipe
    prompts = [f"a red circle left of a blue square" if i % 2 else "two green triangles" for i in range(args.batch)]
    plan = FlowGRPO(FlowGRPOConfig(noise_level=0.7)).schedule(args.steps)
    batch = PromptBatch(prompts)

    def ours_rollout():
        return policy.sample(batch, plan, generator=torch.Generator().manual_seed(0))

    def peer_rollout():
        with torch.no_grad():
            return peer_pipeline(pipe, prompt=prompts, height=args.resolution, width=args.resolution,
                                 num_inference_steps=args.steps, guidance_scale=1.0, output_type="pt",
                                 max_sequence_length=16, noise_level=0.7, generator=torch.Generator().manual_seed(0))

    rollout = ours_rollout()
    traj = rollout.trajectory
    timesteps = traj["shared_sigmas"][:-1] * pipe.scheduler.config.num_train_timesteps

    def ours_replay():
        for i in range(args.steps):
            policy.log_prob(rollout, [i]).log_prob.mean().backward()

    def peer_replay(keep=None):
        pipe.scheduler.set_timesteps(args.steps)
        for i in range(args.steps):
            t = timesteps[i].expand(args.batch)
            v = pipe.transformer(hidden_states=traj["latents"][:, i], timestep=t, encoder_hidden_states=traj["prompt_embeds"],
                                 pooled_projections=traj["pooled"], return_dict=False)[0]
            _, log_prob, _, _ = peer_step(pipe.scheduler, v.float(), t, traj["latents"][:, i].float(), noise_level=0.7,
                                          prev_sample=traj["latents"][:, i + 1].float())
            if keep is not None:
                keep.append(log_prob.detach())
            log_prob.mean().backward()

    peer_log_probs: list[torch.Tensor] = []
    peer_replay(peer_log_probs)
    agreement = (torch.stack(peer_log_probs, 1) - rollout.old_log_probs).abs().max().item()
    result = {"batch": args.batch, "steps": args.steps, "threads": torch.get_num_threads()}
    for name, ours, peer in (("rollout", ours_rollout, peer_rollout), ("replay_fwd_bwd", ours_replay, peer_replay)):
        t_ours, t_peer = timed(ours, args.repeats), timed(peer, args.repeats)
        result[name] = {"mmgrpo_s": round(t_ours, 4), "flow_grpo_s": round(t_peer, 4), "speedup": round(t_peer / t_ours, 3)}
    result["max_abs_log_prob_difference"] = agreement
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
