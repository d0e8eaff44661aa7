"""Helpers shared by the rewards (not a plugin: no ``PLUGIN``): media frames (an image reward scores a video frame by
frame: [`frames`] picks the frames, [`reduce_frames`] reduces their scores), answer extraction, the length cap of
model texts, NaN vectors.

Every parser here reads its input in one pass (O(length)); the text rewards also cut each completion to
``max_completion_chars`` characters before parsing ([`cut_texts`]), so a runaway generation costs a bounded time.
"""

from __future__ import annotations

import os
import re
from typing import Any, Iterator

import torch

from mmgrpo.validation import ConfigError, check_range, check_text

NAN = float("nan")
MEDIA_KEYS = {"image": "images", "video": "videos"}  # modality -> key in `outputs`
MAX_COMPLETION_CHARS = 16384  # default `max_completion_chars` of the text rewards (~4K tokens)
# ceilings of the rewards' options: far above what a real run uses
COMPLETION_CHARS_LIMIT = 2**24  # characters of a completion a text reward reads (~4M tokens)
FRAME_STRIDE_LIMIT = 1024  # a video's frame stride
BATCH_LIMIT = 4096  # images (frames) per forward of a reward model
WEIGHT_LIMIT = 1e3  # a term's weight, scale or divisor (papers: ~0.1 to 100)
PIXEL_DISTANCE_LIMIT = 1e5  # a distance in pixels
_BRACE = re.compile(r"[{}]")

# A reward's declarations (see mmgrpo.protocols.RewardFn), taken into its class by name:
# ``modalities_for = classmethod(fixed_modalities)``, ``artifacts_for = classmethod(fixed_artifacts)``.


def resolve_device(device: str) -> str:
    """`device` as configured, with ``"auto"`` meaning CUDA when it is available, else the CPU."""
    return ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device


def weights_path(location: str, filename: str, *, reward: str, option: str, hub_repo: str) -> str:
    """The local path of a reward model's weights: `location` itself when it is a file, ``location/filename`` for a
    folder, else `filename` from the hub repository `location` (from the local cache when offline). A failed download
    raises one line naming `reward`'s `option` and where the file comes from (`hub_repo`)."""
    path = os.path.expanduser(location)
    if os.path.isfile(path):
        return path
    if os.path.isdir(path):
        return os.path.join(path, filename)
    from huggingface_hub import hf_hub_download

    try:
        return hf_hub_download(location, filename)
    except Exception as err:  # offline, missing file, no such repository
        raise RuntimeError(
            f"{reward}: could not get {filename} from the hub repository {location!r} ({err}). Download it from "
            f"https://huggingface.co/{hub_repo} and set {reward}.{option} to the file or its folder."
        ) from err


def fixed_modalities(cls, config) -> frozenset[str]:
    """``modalities_for`` of a reward that scores its class's `modalities` whatever its options."""
    return cls.modalities


def modality_option(cls, config) -> frozenset[str]:
    """``modalities_for`` of a reward whose ``modality`` option says what it scores (``"image"`` or ``"video"``)."""
    return frozenset({config.modality})


def fixed_artifacts(cls, config) -> frozenset[str]:
    """``artifacts_for`` of a reward whose results carry its class's `artifacts` (none) whatever its options."""
    return cls.artifacts


def nans(n: int) -> torch.Tensor:
    """A `[n]` float32 vector of NaN ("not applicable")."""
    return torch.full((n,), NAN, dtype=torch.float32)


def frames(
    outputs: dict[str, Any], modality: str, reward: str, stride: int = 1, reduce: str = "mean"
) -> tuple[torch.Tensor, int]:
    """The images to score and the number of frames per sample.

    Args:
        outputs (`dict`): ``"images"`` `[N, 3, H, W]` or ``"videos"`` `[N, F, 3, H, W]`, values in [0, 1].
        modality (`str`): ``"image"`` or ``"video"``.
        reward (`str`): the reward's name, for errors.
        stride (`int`, defaults to 1): videos keep frames ``0, stride, 2 * stride, ...`` (``F' = ceil(F / stride)``).
        reduce (`str`, defaults to `"mean"`): the reduction [`reduce_frames`] will apply; ``"first"`` keeps frame 0
            only (``F' = 1``), so the other frames are not scored at all.

    Returns:
        `tuple`: the frames `[N * F', 3, H, W]` (float32, detached, non-finite values set to 0) and `F'` (1 for images).

    Raises:
        ValueError: when the key is missing or the tensor has the wrong shape (a wiring error, not a bad sample).
    """
    key = MEDIA_KEYS[modality]
    value = outputs.get(key)
    ndim = 4 if modality == "image" else 5
    if not isinstance(value, torch.Tensor) or value.dim() != ndim or value.shape[-3] != 3 or value.shape[-4] == 0:
        shape = "[N, 3, H, W]" if modality == "image" else "[N, F >= 1, 3, H, W]"
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(
            f"{reward}: expected outputs[{key!r}] as a tensor {shape} in [0, 1], got {got}; "
            f"set the reward's `modality` to what the pipeline produces."
        )
    value = value.detach().float()
    if modality == "video":
        value = value[:, :1] if reduce == "first" else value[:, ::stride]  # [N, F', 3, H, W]
    per_sample = 1 if modality == "image" else value.shape[1]
    flat = value.reshape(-1, *value.shape[-3:])  # [N * F', 3, H, W]
    return torch.nan_to_num(flat, nan=0.0, posinf=1.0, neginf=0.0), per_sample


def reduce_frames(values: torch.Tensor, per_sample: int, reduce: str) -> torch.Tensor:
    """One value per sample from per-frame values `[N * F']` (in [`frames`]' order): their ``"mean"`` or ``"min"``,
    or the ``"first"`` frame's value. Returns `[N]` float32 (an image is its own single frame)."""
    values = values.float().reshape(-1, per_sample)  # [N, F']
    if reduce == "mean":
        return values.mean(dim=1)
    if reduce == "min":
        return values.min(dim=1).values
    return values[:, 0]


def check_frame_options(reward: str, modality: str, stride: int, reduce: str) -> None:
    """Config-time checks of the per-frame options of an image reward applied to videos (`frame_stride`,
    `frame_reduce`): a stride >= 1, and either option away from its default only with ``modality: video``."""
    check_range(f"{reward}.frame_stride", stride, 1, FRAME_STRIDE_LIMIT,
                fix="1 scores every frame, k every k-th frame from the first")
    if modality != "video" and (stride != 1 or reduce != "mean"):
        raise ConfigError(
            f"{reward}.frame_stride / frame_reduce apply to videos, but modality is {modality!r}; set "
            f"{reward}.modality to 'video' (outputs['videos'] [N, F, 3, H, W]) or leave the frame options out."
        )


def non_finite_samples(outputs: dict[str, Any], modality: str) -> torch.Tensor:
    """`[N]` float 0/1: 1 where a sample's pixels hold NaN or infinity (counted as ``malformed``)."""
    value = outputs[MEDIA_KEYS[modality]].detach()
    return (~torch.isfinite(value)).flatten(1).any(dim=1).float().cpu()


def tag_spans(text: str, opening: str, closing: str) -> Iterator[tuple[int, int]]:
    """``(begin, end)`` of the contents of each ``opening...closing`` block of `text`, left to right.

    The blocks are those of ``re.findall(re.escape(opening) + "(.*?)" + re.escape(closing), text, re.DOTALL)``: each
    ends at the first `closing` after its `opening`, and the next one starts after it. One pass of `str.find`, so
    O(len(text)) even with thousands of unclosed openings (the lazy regex rescans the rest of the text from each).
    """
    if not opening or not closing:
        raise ValueError("tag_spans: opening and closing must be non-empty strings.")
    position = 0
    while True:
        start = text.find(opening, position)
        if start < 0:
            return
        begin = start + len(opening)
        end = text.find(closing, begin)
        if end < 0:  # no closing after this opening, hence none after any later one
            return
        yield begin, end
        position = end + len(closing)


def last_tag_block(text: str, tag: str) -> str | None:
    """Contents of the last ``<tag>...</tag>`` block of `text` (across lines), or None if there is none (linear)."""
    last = None
    for last in tag_spans(text, f"<{tag}>", f"</{tag}>"):
        pass
    return None if last is None else text[last[0] : last[1]]


def last_boxed(text: str) -> str | None:
    """Contents of the last ``\\boxed{...}`` of `text`, with nested braces, or None (linear: one scan of its braces)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for match in _BRACE.finditer(text, begin):
        if match.group() == "{":
            depth += 1
        elif depth == 0:
            return text[begin : match.start()]
        else:
            depth -= 1
    return None


def texts(outputs: dict[str, Any], n: int, reward: str) -> list[str | None]:
    """``outputs["texts"]`` as a list of `n` entries; an entry that is not a string becomes None (malformed)."""
    value = outputs.get("texts")
    if not isinstance(value, (list, tuple)) or len(value) != n:
        got = f"{type(value).__name__} of length {len(value)}" if isinstance(value, (list, tuple)) else type(value).__name__
        raise ValueError(f"{reward}: expected outputs['texts'] as a list of {n} strings, got {got}.")
    return [item if isinstance(item, str) else None for item in value]


def check_max_completion_chars(value: int | None) -> None:
    """Validates a text reward's `max_completion_chars`: None or an integer >= 0 (None and 0: no cut)."""
    fix = "give the cap in characters, or 0 / null for no cut"
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"max_completion_chars must be an integer or null, got {value!r}; {fix}.")
    if value is not None:
        check_range("max_completion_chars", value, 0, COMPLETION_CHARS_LIMIT, fix=fix)


def check_tag(key: str, value: str | None) -> None:
    """Validates a tag name option (``"answer"`` for ``<answer>...</answer>``): None, or a non-empty name without
    angle brackets."""
    check_text(key, value)
    if value is not None and ("<" in value or ">" in value):
        name = value.strip("<>/")
        raise ConfigError(f"{key}={value!r}: give the tag's name without angle brackets, e.g. {name!r}.")


def cut_texts(entries: list[str | None], max_chars: int | None) -> tuple[list[str | None], torch.Tensor]:
    """Cuts each text to its first `max_chars` characters, before any parsing: the one length cap of the text rewards.

    The head is kept, as a generation that ran out of tokens keeps it, so a cut answer usually loses its closing tag
    and fails the format.

    Args:
        entries (`list`): texts (None for a malformed entry, left as is).
        max_chars (`int`, *optional*): the cap; None or 0 cuts nothing.

    Returns:
        `tuple`: the texts, and `truncated` `[N]` float 0/1, 1 where a text was cut (reported as a reward component,
        so the share of cut completions shows in the metrics).
    """
    truncated = torch.zeros(len(entries), dtype=torch.float32)
    if not max_chars:
        return list(entries), truncated
    out = []
    for i, text in enumerate(entries):
        if text is not None and len(text) > max_chars:
            text, truncated[i] = text[:max_chars], 1.0
        out.append(text)
    return out, truncated
