"""Deterministic seeds mixed from integers, identical on every process and after a resume."""

from __future__ import annotations


def mix_seed(*parts: int, offset: int = 0) -> int:
    """A 63-bit seed from integers: ``value = (value * 1_000_003 + part + offset) mod (2**63 - 1)`` over the parts.

    Args:
        parts: the integers that identify the draw (run seed, step, rank, group id, ...).
        offset: added to every part. The trainer mixes with 0; the flow samplers' group noise mixes with 7, so the
            shipped defaults keep the exact noise they were measured with. Different offsets also keep the two
            streams apart when their parts coincide.
    """
    value = 0
    for part in parts:
        value = (value * 1_000_003 + int(part) + offset) % (2**63 - 1)
    return value
