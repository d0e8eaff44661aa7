"""Run by `test_vas.py` under torchrun with 2 processes: a VAS refresh of the shipped VLM config at small sizes, its
12 prompts split over the processes in calls of 4 per process (the last call padded), then 2 training steps. Every
process writes what it holds; the test compares them.

Usage: ``vas_worker.py OUT_DIR``.
"""

import json
import sys
from pathlib import Path

from mmgrpo import config as config_mod
from mmgrpo.trainer import Trainer
from mmgrpo.vas import refresh_weights

ROOT = Path(__file__).resolve().parents[2]


def main(out_dir: str) -> None:
    overrides = [f"output_dir={out_dir}/run", "train.max_steps=2", "train.max_seconds=0", "eval.every=0",
                 "data.n_train=12", "data.n_eval=4", "train.prompts_per_step=4", "train.group_size=2",
                 "train.minibatch_size=4", "train.prompt_sampling=vas", "train.vas.rollouts=2",
                 "train.vas.batch_prompts=4", "train.vas.accuracy=accuracy", "checkpoint.every=0"]
    trainer = Trainer(config_mod.load(ROOT / "configs" / "tiny" / "vlm_count.yaml", overrides))
    metrics = refresh_weights(trainer.stream, trainer.policy, trainer.algorithm, trainer.reward, trainer.accelerator,
                              0, 1)
    weights = list(trainer.stream.weights)
    trainer.train()  # the refresh above counts as the one before the first step
    result = {"world": trainer.world, "metrics": metrics, "weights": weights, "scores": trainer.stream.scores,
              "last": trainer.stream.last, "state": trainer.stream.state_dict()}
    Path(f"{out_dir}/rank{trainer.rank}.json").write_text(json.dumps(result))
    from mmgrpo.sharding import end_processes

    end_processes()  # no process tears down its connections while another still uses them


if __name__ == "__main__":
    main(sys.argv[1])
