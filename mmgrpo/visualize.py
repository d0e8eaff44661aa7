"""Pictures and tables a person looks at: sample grids, the reward curve, and the evaluation per prompt."""

from __future__ import annotations

import base64
import gc
import html
import io
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from .metrics_log import read_records  # noqa: E402


def _close(fig) -> None:
    """Closes `fig` and frees it now: a closed figure is a web of reference cycles that Python's full collection,
    rare in a process that holds a model, would free only much later (a few MiB per sample grid, seen as RSS growth
    over a long run)."""
    plt.close(fig)
    gc.collect()


def save_image_grid(images, captions: list[str], path: str | Path, columns: int = 4) -> None:
    """Saves images in [0, 1] as a PNG grid, each with its caption: a tensor `[N, 3, H, W]` or a list of `N` tensors
    `[3, H_i, W_i]` (sizes may differ, e.g. frame strips or overlays on their input images). Rows are as tall as the
    tallest image at the common cell width, so wide frame strips leave no blank bands."""
    n = len(images)
    rows = max(1, (n + columns - 1) // columns)
    aspect = max((float(image.shape[-2]) / image.shape[-1] for image in images), default=1.0)  # tallest H / W
    fig, axes = plt.subplots(rows, columns, figsize=(columns * 2.4, rows * (2.4 * aspect + 0.35)), squeeze=False)
    for i, ax in enumerate(axes.flat):
        ax.axis("off")
        if i < n:
            ax.imshow(images[i].permute(1, 2, 0).clamp(0, 1).cpu().numpy(), interpolation="nearest")
            ax.set_title(captions[i], fontsize=6.5, wrap=True)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    _close(fig)


KIND_COLORS = ("tab:green", "tab:purple", "tab:brown", "tab:orange", "tab:pink", "tab:olive", "tab:cyan", "tab:gray")


def reward_curves(records: list[dict], eval_metric: str) -> dict[str, list[tuple[int, float]]]:
    """The curves of [`plot_reward_curve`] from ``metrics.jsonl`` records, by label: the training reward per step, the
    held-out `eval_metric` per evaluation and, where the evaluations report kinds (``eval/kind/<kind>/<metric>``), the
    metric of each kind; a logged null is NaN (a gap in the curve). Curves without a point are left out."""
    nan = float("nan")
    keys = {"train reward (mean)": "reward/mean", f"held-out {eval_metric}": f"eval/{eval_metric}"}
    prefix, suffix = "eval/kind/", f"/{eval_metric}"
    kinds = sorted({key for r in records for key in r if key.startswith(prefix) and key.endswith(suffix)})
    keys.update({f"held-out {eval_metric}, {key[len(prefix) : -len(suffix)]}": key for key in kinds})
    curves = {label: [(r["step"], nan if r[key] is None else r[key]) for r in records if key in r]
              for label, key in keys.items()}
    return {label: points for label, points in curves.items() if points}


def plot_reward_curve(metrics_file: str | Path, path: str | Path, eval_metric: str) -> None:
    """Plots training reward per step, held-out `eval_metric` per evaluation and, thinner, the metric of each kind of
    held-out item ([`reward_curves`]) from ``metrics.jsonl``."""
    curves = reward_curves(read_records(metrics_file), eval_metric)  # a torn last line (a crash mid-write) is skipped
    fig, ax = plt.subplots(figsize=(6, 3.6))
    kinds = 0
    for label, points in curves.items():
        if label == "train reward (mean)":
            ax.plot(*zip(*points), color="tab:blue", alpha=0.5, label=label)
        elif label == f"held-out {eval_metric}":
            ax.plot(*zip(*points), "o-", color="tab:red", label=label)
        else:  # the kinds' curves: thinner, in colours other than the two above
            ax.plot(*zip(*points), ".--", linewidth=1, alpha=0.8, color=KIND_COLORS[kinds % len(KIND_COLORS)],
                    label=label)
            kinds += 1
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _close(fig)


def as_pil(image):
    """`image` (a PIL image, a file path, or an array / tensor `[H, W, 3]` or `[3, H, W]`, floats in [0, 1]) as an RGB
    PIL image; `None` for anything else or a missing file."""
    import numpy as np
    from PIL import Image

    if isinstance(image, (str, Path)):
        if not Path(image).is_file():
            return None
        image = Image.open(image)
    elif isinstance(image, torch.Tensor):
        array = image.detach().float().cpu()
        array = array.permute(1, 2, 0) if array.shape[0] in (1, 3) and array.dim() == 3 else array
        image = Image.fromarray((array.clamp(0, 1).numpy() * 255).round().astype(np.uint8).squeeze())
    elif isinstance(image, np.ndarray):
        image = Image.fromarray(image if image.dtype == np.uint8 else (np.clip(image, 0, 1) * 255).astype(np.uint8))
    if not isinstance(image, Image.Image):
        return None
    return image.convert("RGB")


def _thumbnail_src(image, size: int = 128) -> str | None:
    """A data-URI PNG of `image` (a PIL image, a file path, or an array / tensor `[H, W, 3]` or `[3, H, W]`)."""
    from PIL import Image

    image = as_pil(image)
    if image is None:
        return None
    scale = size / max(image.size)
    image = image.resize((max(1, round(image.width * scale)), max(1, round(image.height * scale))), Image.NEAREST)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def save_sample_table(rows: list[dict], path: str | Path, title: str = "") -> None:
    """Writes a self-contained HTML table of text samples: input images (if any), prompt, completion and reward.

    Args:
        rows (`list[dict]`): ``{"prompt": str, "text": str, "reward": float, "images": list (optional)}``.
        path (`str` or `Path`): the ``.html`` file to write.
        title (`str`, *optional*): a heading.
    """
    cells = []
    for row in rows:
        pictures = "".join(
            f'<img src="{src}" alt="input image">' for src in map(_thumbnail_src, row.get("images") or []) if src
        )
        cells.append(
            f"<tr><td>{pictures}</td><td><pre>{html.escape(row['prompt'])}</pre></td>"
            f"<td><pre>{html.escape(row['text'])}</pre></td><td>{row['reward']:.3f}</td></tr>"
        )
    page = (
        "<!doctype html><meta charset='utf-8'><style>body{font-family:sans-serif}td{vertical-align:top;"
        "border-bottom:1px solid #ddd;padding:4px}pre{white-space:pre-wrap;margin:0;max-width:40em}"
        "img{image-rendering:pixelated;margin-right:4px}</style>"
        f"<h3>{html.escape(title)}</h3><table><tr><th>input</th><th>prompt</th><th>completion</th><th>reward</th></tr>"
        + "".join(cells) + "</table>\n"
    )
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(page, encoding="utf-8")


def write_per_prompt_scores(items: list[tuple[str, float, float, int]], path: str | Path, metric: str) -> None:
    """Writes the held-out evaluation per distinct prompt, worst first, as JSON: what RL still gets wrong.

    Args:
        items (`list[tuple[str, float, float, int]]`): one ``(prompt, reward, metric, index)`` per evaluated item, its
            index in the held-out split (a prompt may appear several times, each with its own noise, or, for a
            prompt with images, each with other images: the row's ``items`` lists their indices, ``values`` their
            metric values in the same order, ``null`` where unscorable).
        path (`str` or `Path`): the JSON file to write (its folder is created).
        metric (`str`): the name of the third value (the config's ``eval.metric``).
    """
    grouped: dict[str, list[tuple[float, float, int]]] = {}
    for prompt, reward, value, index in items:
        grouped.setdefault(prompt, []).append((reward, value, index))

    def mean(values: list[float]) -> float | None:
        finite = [v for v in values if v == v]  # NaN (unscorable) items are left out
        return sum(finite) / len(finite) if finite else None

    rows = []
    for prompt, values in grouped.items():
        values.sort(key=lambda entry: entry[2])  # by held-out index
        rows.append({"prompt": prompt, "n": len(values), "reward": mean([r for r, _, _ in values]),
                     metric: mean([m for _, m, _ in values]), "items": [i for _, _, i in values],
                     "values": [m if m == m else None for _, m, _ in values]})
    rows.sort(key=lambda row: (row[metric] is None, row[metric] if row[metric] is not None else 0.0, row["prompt"]))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
