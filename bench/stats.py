"""Pairwise interleaving and medians: how every ratio in the bench is formed.

On a shared, noisy machine a contender measured for a minute and then its rival for the next
minute see different neighbours. So each round runs every contender once, back to back, in an
order that goes forward and then backward (A B C, C B A, B C A, A C B ...), so that in every
two rounds each contender runs once before and once after each other one; a ratio is formed
*within* a round (both sides saw the same noise) and the median over the rounds is quoted,
with the spread.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from .progress import note


def rounds(names: Sequence[str], count: int, label: str = "") -> Iterator[tuple[int, list[str]]]:
    """Yield ``(round, order)``: every name once per round, in an order balanced over each pair
    of rounds: a rotation, then the same rotation backwards, then the next rotation.

    A rotation alone (A B C, B C A, C A B) runs B after A in two rounds of three; a drift across
    a round (a neighbour waking up) would then favour one side of the A/B ratio.

    With a ``label``, each round is announced on stderr (``[bench] ... <label>: round 2 of 7``).
    """
    for number in range(count):
        if label:
            note(f"{label}: round {number + 1} of {count}")
        shift = (number // 2) % len(names) if names else 0
        order = [*names[shift:], *names[:shift]]
        yield number, order if number % 2 == 0 else order[::-1]


@dataclass(frozen=True)
class Summary:
    """The median of some samples and their spread."""

    median: float
    low: float
    high: float
    count: int

    @classmethod
    def of(cls, samples: Sequence[float]) -> Summary:
        """Summarize ``samples`` (at least one that is a number; NaN marks a lost reading)."""
        numbers = [sample for sample in samples if not math.isnan(sample)]
        return cls(statistics.median(numbers), min(numbers), max(numbers), len(numbers))

    def as_dict(self) -> dict[str, float]:
        """For the JSON results."""
        return {"median": self.median, "low": self.low, "high": self.high, "n": self.count}


def paired_ratios(numerators: Sequence[float], denominators: Sequence[float]) -> list[float]:
    """Round-by-round ratios of two contenders measured in the same rounds; a round where
    either reading was lost (NaN) or the denominator is 0 gives none."""
    if len(numerators) != len(denominators):
        raise ValueError("paired samples must come from the same rounds")
    return [
        n / d
        for n, d in zip(numerators, denominators, strict=True)
        if d and not (math.isnan(n) or math.isnan(d))
    ]
