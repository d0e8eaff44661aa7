"""Pictures a person looks at: sample grids with prompts and rewards, and the reward curve."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402


def save_image_grid(images: torch.Tensor, captions: list[str], path: str | Path, columns: int = 4) -> None:
    """Saves images `[N, 3, H, W]` in [0, 1] as a PNG grid, each with its caption."""
    n = images.shape[0]
    rows = max(1, (n + columns - 1) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(columns * 2.4, rows * 2.7), squeeze=False)
    for i, ax in enumerate(axes.flat):
        ax.axis("off")
        if i < n:
            ax.imshow(images[i].permute(1, 2, 0).clamp(0, 1).cpu().numpy(), interpolation="nearest")
            ax.set_title(captions[i], fontsize=6.5, wrap=True)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_reward_curve(metrics_file: str | Path, path: str | Path, eval_metric: str) -> None:
    """Plots training reward per step and held-out `eval_metric` per evaluation from ``metrics.jsonl``."""
    records = [json.loads(line) for line in Path(metrics_file).read_text(encoding="utf-8").splitlines() if line.strip()]
    train = [(r["step"], r["reward/mean"]) for r in records if "reward/mean" in r]
    evals = [(r["step"], r[f"eval/{eval_metric}"]) for r in records if f"eval/{eval_metric}" in r]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    if train:
        ax.plot(*zip(*train), color="tab:blue", alpha=0.5, label="train reward (mean)")
    if evals:
        ax.plot(*zip(*evals), "o-", color="tab:red", label=f"held-out {eval_metric}")
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
