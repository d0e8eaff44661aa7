"""Step headers of a structured solution (R1-VL's ``### Step <n>:``), shared by `step_rar` and `step_rvr` (not a
plugin: no ``PLUGIN``). Every function reads its text once, left to right (linear time).

A step header is `prefix`, one or more decimal digits (any Unicode decimal digit, as a regular expression's ``\\d``),
then ``:``.
"""

from __future__ import annotations

import unicodedata

R1_VL_STEP = "### Step "  # R1-VL's step header prefix
SECTION_END = "\n###"  # R1-VL: a step's text runs to the next line that starts with ###, or to the end
_EXACT_DIGITS = 18  # a number written with more significant digits is larger than any step count


def next_header(text: str, prefix: str, position: int) -> tuple[int, int, str] | None:
    """``(start, end, digits)`` of the first step header ``<prefix><digits>:`` of `text` at or after `position` (`end`:
    the position after its ``:``), or None. Linear: a character is read at most ``len(prefix)`` times (`prefix` is
    not empty and holds no digit)."""
    while (start := text.find(prefix, position)) >= 0:
        end = digits = start + len(prefix)
        while digits < len(text) and text[digits].isdecimal():
            digits += 1
        if digits > end and digits < len(text) and text[digits] == ":":
            return start, digits + 1, text[end:digits]
        position = digits if digits > end else start + 1  # no header can start inside a prefix followed by digits
    return None


def step_headers(text: str, prefix: str) -> list[tuple[int, int, int]]:
    """``(start, end, number)`` of each step header of `text`, left to right (`number`: [`step_number`])."""
    found, position = [], 0
    while (header := next_header(text, prefix, position)) is not None:
        start, position, digits = header
        found.append((start, position, step_number(digits)))
    return found


def step_number(digits: str) -> int:
    """The value of a run of decimal digits (leading zeros allowed, ``"01"`` is 1), or -1 when it has more than
    `_EXACT_DIGITS` significant digits (then it equals no step number; ``int`` would refuse thousands of digits)."""
    head, tail = digits[:-_EXACT_DIGITS], digits[-_EXACT_DIGITS:]
    if any(unicodedata.digit(c) for c in head):
        return -1
    return int(tail)


def step_sections(text: str, prefix: str = R1_VL_STEP) -> list[str]:
    """The text of each step, as R1-VL reads it: from each step header on (left to right, not inside an earlier
    step's text), the text after its ``:`` and the white space after it, up to the next ``\\n###`` or the end of the
    text. A header with nothing after it takes the next line's text, header and all, as R1-VL's pattern
    ``<prefix>\\d+:\\s*(.*?)(?=\\n###|\\Z)`` does."""
    sections, position = [], 0
    while (header := next_header(text, prefix, position)) is not None:
        start = header[1]
        while start < len(text) and text[start].isspace():
            start += 1
        stop = text.find(SECTION_END, start)
        position = len(text) if stop < 0 else stop
        sections.append(text[start:position])
    return sections
