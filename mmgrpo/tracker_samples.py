"""An evaluation's sample files ([`mmgrpo.sample_writers`]) as each tracker shows them, through accelerate's tracker
objects ([`mmgrpo.tracking.Trackers.log_samples`]).

- TensorBoard: PNG pictures as images (``samples/grid``, ``samples/video`` for the frame strips...); the text table of
  a token policy's completions (``step_XXXXX.jsonl``) as a markdown table (prompt, completion, reward) in the Text
  tab (``samples/table``); each MP4 clip as a video (``samples/video.sample_00``...): an animated GIF image summary,
  the summary ``SummaryWriter.add_video`` writes (which cannot encode without moviepy 1.x), shown in the Images tab.
  The clips are read back from the MP4 files the video writer wrote, at their frame rate, scaled down to at most
  [`VIDEO_SIDE`] pixels on their longer side.
- MLflow: every sample file as an artifact of the run (``mlflow.log_artifact`` through accelerate's tracker), under
  ``samples/step_XXXXX/`` (a video's clips under ``samples/step_XXXXX/step_XXXXX_video/``), so the UI shows the
  pictures, plays the clips and offers the pages for download.
- Other trackers: PNG pictures as images where accelerate's tracker takes images (W&B, Aim, ClearML, SwanLab), text
  tables as tables where it takes tables (W&B, ClearML).

A tag leaves out the step (``step_00020_grid.png`` -> ``samples/grid``), so each tracker shows one series per kind.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

from .tracker_names import tracker_name

VIDEO_SIDE = 256  # the longer side of a clip sent to TensorBoard, in pixels


def tag(path: Path, step: int) -> str:
    """A sample file's tracker tag without its step (``step_00020_grid.png`` -> ``samples/grid``; a clip
    ``step_00020_video/sample_00.mp4`` -> ``samples/video.sample_00``)."""
    if path.suffix == ".mp4":
        return tracker_name(f"samples/{_stem(path.parent, step)}/{path.stem}")
    return tracker_name(f"samples/{_stem(path, step)}")


def _stem(path: Path, step: int) -> str:
    stem = path.stem.removeprefix(f"step_{step:05d}").removeprefix(f"step_{step:07d}").strip("_")
    return stem or {".png": "grid", ".jsonl": "table"}.get(path.suffix, "samples")


def read_table(path: Path) -> tuple[list[str], list[list[str]]]:
    """The columns (in the order the rows first name them) and the rows, as text, of a JSONL sample table."""
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]
    columns = list(dict.fromkeys(key for row in rows for key in row))
    return columns, [[_cell(row.get(column, "")) for column in columns] for row in rows]


def _cell(value) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def markdown_table(columns: list[str], rows: list[list[str]]) -> str:
    """A markdown table (TensorBoard's Text tab renders it): ``|`` escaped, line breaks as ``<br>``."""
    def line(cells):
        return "| " + " | ".join(c.replace("\\", "\\\\").replace("|", "\\|").replace("\r", "").replace("\n", "<br>")
                                 for c in cells) + " |"
    header = ["completion" if c == "text" else c for c in columns]
    return "\n".join([line(header), "|" + "---|" * len(columns), *map(line, rows)])


def read_clip(path: Path, side: int = VIDEO_SIDE):
    """The frames of an MP4 file, ``uint8`` `[F, H, W, 3]`, scaled down to at most `side` pixels on the longer side,
    and its frame rate."""
    import av
    import numpy as np
    from PIL import Image

    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        fps = float(stream.average_rate or 16)
        frames = [frame.to_image() for frame in container.decode(stream)]
    scale = min(1.0, side / max(frames[0].size))
    size = (max(1, round(frames[0].width * scale)), max(1, round(frames[0].height * scale)))
    return np.stack([np.asarray(f.resize(size, Image.BILINEAR) if scale < 1 else f) for f in frames]), fps


def gif(frames, fps: float) -> bytes:
    """Frames ``uint8`` `[F, H, W, 3]` as a looping animated GIF."""
    from PIL import Image

    pictures = [Image.fromarray(frame) for frame in frames]
    buffer = io.BytesIO()
    pictures[0].save(buffer, format="GIF", save_all=True, append_images=pictures[1:], loop=0,
                     duration=max(20, round(1000 / fps)))
    return buffer.getvalue()


def tensorboard_video(writer, name: str, path: Path, step: int) -> None:
    """The clip at `path` as the video summary ``add_video`` writes (an animated GIF image) to `writer`, a
    ``SummaryWriter``."""
    from tensorboard.compat.proto.summary_pb2 import Summary

    frames, fps = read_clip(path)  # [F, H, W, 3]
    image = Summary.Image(height=frames.shape[1], width=frames.shape[2], colorspace=3,
                          encoded_image_string=gif(frames, fps))
    writer.file_writer.add_summary(Summary(value=[Summary.Value(tag=name, image=image)]), step)
    writer.flush()


def log_tracker_samples(tracker, paths: list[Path], step: int) -> None:
    """Sends the sample files `paths` of `step` to `tracker` (an accelerate tracker) as the module docstring says."""
    import numpy as np
    from PIL import Image

    for path in map(Path, paths):
        name = tag(path, step)
        if tracker.name == "mlflow":
            folder = f"samples/step_{step:05d}" + (f"/{path.parent.name}" if path.suffix == ".mp4" else "")
            tracker.log_artifact(str(path), artifact_path=folder)
        elif path.suffix == ".png" and hasattr(tracker, "log_images"):  # accelerate's trackers with images
            with Image.open(path) as image:
                pixels = np.asarray(image.convert("RGB"))[None]  # [1, H, W, 3]
            options = {"dataformats": "NHWC"} if tracker.name == "tensorboard" else {}
            tracker.log_images({name: pixels}, step=step, **options)
        elif path.suffix == ".jsonl" and tracker.name == "tensorboard":
            tracker.log({name: markdown_table(*read_table(path))}, step=step)  # add_text
        elif path.suffix == ".jsonl" and hasattr(tracker, "log_table"):  # accelerate's trackers with tables
            columns, rows = read_table(path)
            tracker.log_table(name, columns=columns, data=rows, step=step)
        elif path.suffix == ".mp4" and tracker.name == "tensorboard":
            tensorboard_video(tracker.tracker, name, path, step)
