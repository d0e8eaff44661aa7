"""Run by `test_async_training.py` under torchrun with 2 processes: the tiny SD3 Flow-GRPO run synchronously, with
``train.async.max_staleness`` 0 and 1, and the latter resumed from its step-2 checkpoint (rollouts in flight); each
process writes its final weights per run, rank 0 the world size."""

import json
import sys
from pathlib import Path

from safetensors.torch import save_file

from mmgrpo import config as config_mod
from mmgrpo.trainer import Trainer
from test_async_training import flow_run


def run(out: Path, tiny_sd3_dir: str, name: str, staleness, steps: int = 3, every: int = 0, resume=None) -> Trainer:
    raw = flow_run(out / name, tiny_sd3_dir, steps=steps, staleness=staleness, every=every)
    if resume:
        raw["checkpoint"]["resume_from"] = resume
    trainer = Trainer(config_mod.from_dict(raw))
    trainer.train()
    weights = {str(i): p.detach().contiguous() for i, p in enumerate(trainer.policy.trainable_parameters())}
    save_file(weights, str(out / f"{name}_rank{trainer.rank}.safetensors"))
    return trainer


def main(tiny_sd3_dir: str, out_dir: str) -> None:
    out = Path(out_dir)
    trainer = run(out, tiny_sd3_dir, "sync", None)
    run(out, tiny_sd3_dir, "async0", 0)
    run(out, tiny_sd3_dir, "full", 1, steps=4, every=2)
    run(out, tiny_sd3_dir, "resumed", 1, steps=4, resume=str(out / "full" / "run" / "checkpoints" / "step_0000002"))
    if trainer.rank == 0:
        (out / "result.json").write_text(json.dumps({"world_size": trainer.world}))


if __name__ == "__main__":
    main(*sys.argv[1:])
