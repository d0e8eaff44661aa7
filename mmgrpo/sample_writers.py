"""Evaluation samples a person looks at, one writer per output modality, chosen by the pipeline's ``modalities``.

A pipeline declares what its ``outputs`` hold with the same names the rewards use (``"image"``, ``"text"``,
``"video"``, ``"mask"``); [`writers_for`] gives one [`SampleWriter`] per declared modality, which keeps the first
``limit`` samples it is given (``add``, per evaluation batch) and writes them under ``samples/`` (``write``, with the
final rewards, after any group stage of the reward) with its modality's function in [`WRITERS`]. A modality without
one is refused there and by ``mmgrpo check``, before any model loads:

- ``image``, ``outputs["images"]`` `[N, 3, H, W]`: ``step_XXXXX.png``, a grid, each image with its prompt and reward
  (``step_XXXXX`` is the evaluated step).
- ``text``, ``outputs["texts"]`` (`N` strings): ``step_XXXXX.jsonl`` (prompt, text, reward) and ``step_XXXXX.html``
  (the same rows with the prompt's input images); with a reward that declares the artifacts ``mask`` (and
  ``seg_prompts``), a segmenter such as `sam_mask`, also the overlays ``step_XXXXX_seg.png`` and ``step_XXXXX_seg.html``
  (see `mmgrpo._mask_overlays`).
- ``video``, ``outputs["videos"]`` `[N, F, 3, H, W]`: ``step_XXXXX_video/sample_NN.mp4`` (H.264), the frame strips
  with prompt and reward in ``step_XXXXX_video.png``, and ``step_XXXXX_video.html``, which plays and links them.
- ``mask``, ``outputs["masks"]`` `[N, H, W]` or `N` tensors `[H_i, W_i]` (`None`: no mask): ``step_XXXXX_masks.png``,
  each mask in red over the prompt's first input image, with prompt and reward.

Pixel values are in [0, 1]. A writer whose key is missing from the outputs raises: a pipeline that declares a
modality must produce it.

What a reward adds for the writers is a declared artifact of its result (``RewardResult.artifacts``, kinds declared by
the reward class's ``artifacts_for``; see [`mmgrpo.protocols.RewardFn`]), never a key written into the outputs: each
modality's writer draws the kinds of [`ARTIFACT_WRITERS`] that the reward declares, and refuses a result lacking one;
``mmgrpo check`` refuses a reward declaring a kind no writer of the pipeline's modalities draws.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

import torch

from . import _mask_overlays
from .types import PromptBatch, as_list
from .visualize import as_pil, save_image_grid, save_sample_table

OUTPUT_KEYS = {"image": "images", "text": "texts", "video": "videos", "mask": "masks"}  # modality -> outputs key
# modality -> the reward artifacts its writer draws (``RewardResult.artifacts`` kinds): the text writer's segmentation
# overlays, the predicted ``mask`` (bool [H, W] or None per sample) with the VLM's ``seg_prompts`` (boxes and points)
ARTIFACT_WRITERS = {"text": frozenset({"mask", "seg_prompts"})}
VIDEO_FPS = 16  # frame rate of the MP4 files


class SampleWriter:
    """Keeps the first `limit` samples of one output `modality` (prompts, input images, outputs) and writes them.

    Args:
        modality (`str`): a key of [`WRITERS`].
        limit (`int`): samples kept.
        artifacts (`frozenset[str]`, *optional*): the artifact kinds the reward declares (its ``artifacts``); the
            writer keeps those it draws ([`ARTIFACT_WRITERS`]) from each batch's reward result.
    """

    def __init__(self, modality: str, limit: int, artifacts: frozenset[str] = frozenset()):
        if modality not in WRITERS:
            raise ValueError(
                f"no sample writer for output modality {[modality]}; known: {sorted(WRITERS)}. Declare one of those in "
                "the pipeline's `modalities`, or add a writer to mmgrpo.sample_writers.WRITERS."
            )
        self.modality, self.limit, self.prompts, self.items, self.inputs = modality, limit, [], [], []
        self.artifacts = frozenset(artifacts) & ARTIFACT_WRITERS.get(modality, frozenset())  # the kinds it draws
        self.segmentation = []  # text samples with a segmenter reward's masks (mmgrpo._mask_overlays)

    def add(self, outputs: dict[str, Any], batch: PromptBatch, artifacts: dict[str, list] | None = None) -> None:
        """Keeps the first samples of `batch` while fewer than `limit` are kept; `outputs` must hold the modality's
        key ([`OUTPUT_KEYS`]), `artifacts` (the reward result's) every declared kind this writer draws."""
        key = OUTPUT_KEYS[self.modality]
        if key not in outputs:
            raise ValueError(
                f"the pipeline declares modality {self.modality!r} but its outputs hold only {sorted(outputs)}: return "
                f"outputs[{key!r}] from sample(), or declare the modalities it produces."
            )
        given = artifacts or {}
        missing = sorted(self.artifacts - given.keys())
        if missing:
            raise ValueError(f"the reward declares the artifacts {sorted(self.artifacts)} but its result holds only "
                             f"{sorted(given)}: return RewardResult.artifacts[{missing[0]!r}] from __call__, or declare "
                             "the artifacts it adds (artifacts_for).")
        k = min(self.limit - len(self.items), len(batch))
        if k <= 0:
            return
        pictures = batch.conditions.get("images", [None] * len(batch))  # the inputs of a VLM, if any
        self.items.extend(outputs[key][i] for i in range(k))
        self.prompts.extend(batch.prompts[:k])
        self.inputs.extend(as_list(pictures[i]) for i in range(k))
        if self.artifacts:  # the text writer's segmentation overlays (mmgrpo._mask_overlays)
            none = [None] * len(batch)
            masks = given["mask"] if "mask" in self.artifacts else none
            prompts = given["seg_prompts"] if "seg_prompts" in self.artifacts else none
            self.segmentation.extend(_mask_overlays.keep(outputs[key], masks, prompts, batch, k))

    def write(self, folder: str | Path, step: int, rewards: list[float]) -> list[Path]:
        """Writes the kept samples, with their `rewards`, in `folder` for `step`; returns the files written."""
        return WRITERS[self.modality](self, Path(folder), step, rewards) if self.items else []

    def captions(self, rewards: list[float]) -> list[str]:
        return [f"{p}\nr={s:.2f}" for p, s in zip(self.prompts, rewards)]


def write_image_grid(kept: SampleWriter, folder: Path, step: int, rewards: list[float]) -> list[Path]:
    """``step_XXXXX.png``: the kept images `[3, H, W]`, each captioned with its prompt and reward."""
    path = folder / f"step_{step:05d}.png"
    save_image_grid(torch.stack(kept.items), kept.captions(rewards), path)
    return [path]


def write_text_table(kept: SampleWriter, folder: Path, step: int, rewards: list[float]) -> list[Path]:
    """``step_XXXXX.jsonl`` (prompt, text, reward per line) and ``step_XXXXX.html`` (the same rows with the input
    images of each prompt)."""
    rows = [{"prompt": p, "text": t, "reward": s, "images": im}
            for p, t, s, im in zip(kept.prompts, kept.items, rewards, kept.inputs)]
    folder.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({k: v for k, v in row.items() if k != "images"}) for row in rows]
    table, page = folder / f"step_{step:05d}.jsonl", folder / f"step_{step:05d}.html"
    table.write_text("\n".join(lines) + "\n", encoding="utf-8")
    save_sample_table(rows, page, f"step {step}")
    return [table, page, *_mask_overlays.write(kept.segmentation, kept.prompts, folder, step, rewards)]


def write_mp4(video: torch.Tensor, path: str | Path, fps: int = VIDEO_FPS) -> None:
    """Writes frames `[F, 3, H, W]` in [0, 1] as an H.264 MP4 (yuv420p; an odd height or width is padded by one
    edge row or column, as the format needs even sizes)."""
    import av

    frames = (video.detach().float().cpu().clamp(0, 1) * 255).round().to(torch.uint8)  # [F, 3, H, W]
    frames = torch.nn.functional.pad(frames, (0, frames.shape[-1] % 2, 0, frames.shape[-2] % 2), mode="replicate")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = frames.shape[-1], frames.shape[-2], "yuv420p"
        for frame in frames.permute(0, 2, 3, 1).numpy():  # [H, W, 3] each
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())  # flush the encoder


def frame_strip(video: torch.Tensor, max_frames: int = 8) -> torch.Tensor:
    """Up to `max_frames` evenly spaced frames of `video` `[F, 3, H, W]`, side by side: `[3, H, k * W]`."""
    count = video.shape[0]
    index = torch.linspace(0, count - 1, min(max_frames, count)).round().long()  # [k]
    return torch.cat(list(video[index].float().cpu()), dim=-1)


def write_videos(kept: SampleWriter, folder: Path, step: int, rewards: list[float]) -> list[Path]:
    """One MP4 per kept video `[F, 3, H, W]` (``step_XXXXX_video/sample_NN.mp4``, [`VIDEO_FPS`]), their frame strips
    as a PNG grid with prompts and rewards (``step_XXXXX_video.png``) and an HTML page that plays and links them
    (``step_XXXXX_video.html``)."""
    if any(not isinstance(v, torch.Tensor) or v.dim() != 4 for v in kept.items):
        raise ValueError("outputs['videos'] must be a tensor [N, F, 3, H, W] in [0, 1].")
    name = f"step_{step:05d}_video"
    clips = [folder / name / f"sample_{i:02d}.mp4" for i in range(len(kept.items))]
    for video, clip in zip(kept.items, clips):
        write_mp4(video, clip)
    strips = folder / f"{name}.png"
    save_image_grid([frame_strip(v) for v in kept.items], kept.captions(rewards), strips, columns=2)
    rows = "".join(
        f"<tr><td><video src='{name}/{clip.name}' controls loop muted></video><br><a href='{name}/{clip.name}'>"
        f"{clip.name}</a></td><td><pre>{html.escape(p)}</pre></td><td>{s:.3f}</td></tr>"
        for clip, p, s in zip(clips, kept.prompts, rewards)
    )
    page = folder / f"{name}.html"
    page.write_text(
        "<!doctype html><meta charset='utf-8'><style>body{font-family:sans-serif}td{vertical-align:top;"
        "border-bottom:1px solid #ddd;padding:4px}pre{white-space:pre-wrap;margin:0;max-width:40em}</style>"
        f"<h3>step {step}</h3><p><a href='{strips.name}'><img src='{strips.name}' alt='frame strips' "
        "style='max-width:100%'></a></p><table><tr><th>video</th><th>prompt</th><th>reward</th></tr>"
        f"{rows}</table>\n", encoding="utf-8")
    return [*clips, strips, page]


def overlay(mask, image) -> torch.Tensor:
    """`mask` (`[H, W]`, bool or probabilities, or `None`) in red over `image` (see [`mmgrpo.visualize.as_pil`]; grey
    when `None`) at the image's size: `[3, H', W']` in [0, 1]."""
    import numpy as np

    picture = as_pil(image)
    if picture is not None:
        base = torch.from_numpy(np.asarray(picture, dtype=np.float32) / 255).permute(2, 0, 1)  # [3, H', W']
    else:
        shape = mask.shape[-2:] if mask is not None else (32, 32)
        base = torch.full((3, *shape), 0.5)
    if mask is None:
        return base
    m = mask.detach().float().cpu()[None, None]  # [1, 1, H, W]
    m = torch.nn.functional.interpolate(m, size=base.shape[-2:], mode="nearest")[0, 0].clamp(0, 1)  # [H', W']
    red = torch.tensor([1.0, 0.0, 0.0])[:, None, None]
    return base * (1 - 0.5 * m) + red * 0.5 * m


def write_mask_overlays(kept: SampleWriter, folder: Path, step: int, rewards: list[float]) -> list[Path]:
    """``step_XXXXX_masks.png``: each kept mask in red over its prompt's first input image, with prompt and reward."""
    pictures = [overlay(m, inputs[0] if inputs else None) for m, inputs in zip(kept.items, kept.inputs)]
    path = folder / f"step_{step:05d}_masks.png"
    save_image_grid(pictures, kept.captions(rewards), path)
    return [path]


WRITERS = {"image": write_image_grid, "text": write_text_table, "video": write_videos, "mask": write_mask_overlays}


def writers_for(modalities, limit: int, artifacts: frozenset[str] = frozenset()) -> list[SampleWriter]:
    """One [`SampleWriter`] per modality in `modalities` (sorted), each keeping `limit` samples and drawing the
    reward's declared `artifacts` it knows ([`ARTIFACT_WRITERS`]).

    Raises:
        ValueError: a modality without a write function in [`WRITERS`] (its name and the known ones).
    """
    return [SampleWriter(modality, limit, artifacts) for modality in sorted(modalities)]
