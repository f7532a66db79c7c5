"""Pairwise interleaving and medians: how every ratio in the bench is formed.

On a shared, noisy machine a contender measured for a minute and then its rival for the next
minute see different neighbours. So each round runs every contender once, back to back, in an
order rotated from round to round (A B C, B C A, C A B ...); a ratio is formed *within* a round
(both sides saw the same noise) and the median over the rounds is quoted, with the spread.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from .progress import note


def rounds(names: Sequence[str], count: int, label: str = "") -> Iterator[tuple[int, list[str]]]:
    """Yield ``(round, order)``: every name once per round, the order rotated each round.

    With a ``label``, each round is announced on stderr (``[bench] ... <label>: round 2 of 7``).
    """
    for number in range(count):
        if label:
            note(f"{label}: round {number + 1} of {count}")
        shift = number % len(names) if names else 0
        yield number, [*names[shift:], *names[:shift]]


@dataclass(frozen=True)
class Summary:
    """The median of some samples and their spread."""

    median: float
    low: float
    high: float
    count: int

    @classmethod
    def of(cls, samples: Sequence[float]) -> Summary:
        """Summarize ``samples`` (at least one)."""
        return cls(statistics.median(samples), min(samples), max(samples), len(samples))

    def as_dict(self) -> dict[str, float]:
        """For the JSON results."""
        return {"median": self.median, "low": self.low, "high": self.high, "n": self.count}


def paired_ratios(numerators: Sequence[float], denominators: Sequence[float]) -> list[float]:
    """Round-by-round ratios of two contenders measured in the same rounds."""
    if len(numerators) != len(denominators):
        raise ValueError("paired samples must come from the same rounds")
    return [n / d for n, d in zip(numerators, denominators, strict=True) if d]
