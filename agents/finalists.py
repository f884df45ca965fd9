"""The best distinct policies a search simulated, kept for measurement (``autotune search --measure``).

NOTE [ Finalists ]
    A simulator is a model: where it is wrong, the policy it ranks first may run slower than the second, or
    measure a little over the budget it was planned under. A measured search therefore keeps more than its
    winner. Every policy a searcher simulates goes through ``Problem.evaluate``, which offers it here; the
    pool keeps, for each *margin* m of ``MARGINS``, the ``capacity`` fastest distinct policies whose
    simulated peak is within (1 - m) x the budget. The tier of margin 0 holds the plain answer's rivals; the
    others hold answers that still fit when the real peak turns out larger than planned (a trace that does
    not see a library's workspace, an allocator's rounding). Distinct means another action vector or other
    options. :meth:`Finalists.pick` draws ``k`` of a tier, fastest first, skipping any that differs from one
    already drawn in fewer than ``min_distance`` candidates: refinement's neighbours (one tensor apart)
    measure alike, so measuring them would spend real iterations learning nothing.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from envs.simulator import SimResult
from runtime.policy import PolicyOptions

MARGINS = (0.0, 0.01, 0.03, 0.1)  # shares of the budget kept free, one tier each


@dataclass(frozen=True, eq=False)  # compared by key: its actions are an array
class Finalist:
    """One simulated policy: its actions (codes over the workload's candidates), options and result."""

    actions: np.ndarray
    options: PolicyOptions
    result: SimResult

    @property
    def key(self) -> bytes:
        return _key(self.actions, self.options)


def _key(actions: np.ndarray, options: PolicyOptions) -> bytes:
    return actions.tobytes() + repr(options).encode()


class Finalists:
    """The ``capacity`` fastest distinct fitting policies per margin tier (see NOTE [ Finalists ])."""

    def __init__(self, budget_bytes: int, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity={capacity}: expected a positive number of policies per tier")
        self.budget_bytes = budget_bytes
        self.capacity = capacity
        # Per tier: a min-heap on samples/s of (samples/s, order, key) and the policies by key.
        self._heaps: list[list[tuple[float, int, bytes]]] = [[] for _ in MARGINS]
        self._kept: list[dict[bytes, Finalist]] = [{} for _ in MARGINS]
        self._order = itertools.count()

    def offer(self, actions: np.ndarray | Sequence[int], options: PolicyOptions, result: SimResult) -> None:
        """Consider one simulated policy (``Problem.evaluate`` calls this for every policy it simulates)."""
        if not result.feasible:
            return
        speed = result.samples_per_s
        key: bytes | None = None
        made: Finalist | None = None
        for m, heap, kept in zip(MARGINS, self._heaps, self._kept, strict=True):
            if result.peak_bytes > (1 - m) * self.budget_bytes:
                continue
            if len(heap) >= self.capacity and speed <= heap[0][0]:
                continue
            if key is None:
                key = _key(np.asarray(actions, dtype=np.int8), options)
            if key in kept:
                continue
            if made is None:  # a copy: searchers go on changing their vectors in place
                made = Finalist(np.array(actions, dtype=np.int8), options, result)
            heapq.heappush(heap, (speed, next(self._order), key))
            kept[key] = made
            if len(heap) > self.capacity:
                _, _, gone = heapq.heappop(heap)
                del kept[gone]

    def ranked(self, margin: float = 0.0) -> list[Finalist]:
        """A tier's policies, fastest first (ties: the one offered first)."""
        tier = MARGINS.index(margin)
        entries = sorted(self._heaps[tier], key=lambda e: (-e[0], e[1]))
        return [self._kept[tier][key] for _, _, key in entries]

    def pick(self, k: int, margin: float = 0.0, *, min_distance: int = 1,
             exclude: set[bytes] | None = None) -> list[Finalist]:  # fmt: skip
        """Up to ``k`` of a tier's policies, fastest first, each at least ``min_distance`` candidates away
        from every one drawn before (and not in ``exclude``, keys of policies measured already)."""
        drawn: list[Finalist] = []
        for f in self.ranked(margin):
            if len(drawn) >= k:
                break
            if exclude is not None and f.key in exclude:
                continue
            if all(int(np.count_nonzero(f.actions != d.actions)) >= min_distance for d in drawn):
                drawn.append(f)
        return drawn
