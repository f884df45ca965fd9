"""The problem's data as the MILP reads it: decision units (NOTE [ MILP model ] in model.py) and the
simulator's costs per unit."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from agents.base import Problem
from runtime.vocab import RECOMPUTE

TINY_FRACTION = 1e-3  # candidates under this fraction of all activation bytes are kept, not decided
MAX_UNITS = 40  # decision units: ResNet-50 (120 binaries) is solved to optimality in 10-40 s


def decision_units(problem: Problem, max_units: int = MAX_UNITS) -> list[list[int]]:
    """Candidates decided together, in forward order: runs of one block (``Candidate.block``), adjacent runs
    merged (least bytes first) down to ``max_units``, or the largest split in two up to it. Candidates under
    ``TINY_FRACTION`` of the activation bytes are left out (kept)."""
    sim = problem.simulator
    total = float(sim.size.sum())
    decided = [c for c in range(sim.k) if sim.size[c] > TINY_FRACTION * total]
    decided.sort(key=lambda c: (int(sim.save_op[c]), c))
    blocks = [c.block for c in problem.workload.candidates]
    units: list[list[int]] = []
    for c in decided:
        if units and blocks[units[-1][-1]] == blocks[c]:
            units[-1].append(c)
        else:
            units.append([c])

    def nbytes(unit: list[int]) -> int:
        return int(sim.size[unit].sum())

    while len(units) > max_units:
        i = min(range(len(units) - 1), key=lambda i: nbytes(units[i]) + nbytes(units[i + 1]))
        units[i : i + 2] = [units[i] + units[i + 1]]
    while len(units) < max_units:
        splittable = [i for i, u in enumerate(units) if len(u) > 1]
        if not splittable:
            break
        i = max(splittable, key=lambda i: nbytes(units[i]))
        sizes = np.cumsum(sim.size[units[i]])
        cut = int(np.clip(np.searchsorted(sizes, sizes[-1] / 2), 1, len(units[i]) - 1))
        units[i : i + 1] = [units[i][:cut], units[i][cut:]]
    return units


@dataclass
class MilpData:
    """Per-candidate numbers from the simulator (its own op times, copy times, closures), per-unit relations."""

    problem: Problem
    units: list[list[int]]
    actions: tuple[int, ...]
    mem_unit: float
    unit_of: np.ndarray = field(init=False)
    regen_op: np.ndarray = field(init=False)  # op at which c is regenerated when its whole unit is recomputed
    unit_start: list[int] = field(init=False)  # first such op of each unit (n_ops: never)
    dependents: list[list[int]] = field(init=False)  # units whose recompute reads unit u
    boundary: list[set[int]] = field(init=False)  # candidates of u that another unit's closure reads
    closure: list[set[int]] = field(init=False)  # boundary and, recursively, its inputs within u

    def __post_init__(self) -> None:
        sim = self.problem.simulator
        deps = [cl[2] for cl in sim.closures]  # Rule 7: candidate inputs of each closure
        self.unit_of = np.full(sim.k, -1, dtype=np.int64)
        for u, members in enumerate(self.units):
            self.unit_of[members] = u
        self.regen_op = sim.first_use.copy()
        for members in self.units:  # in-unit pulls, to a fixed point (a unit is small)
            changed = True
            while changed:
                changed = False
                for c in members:
                    for dep in deps[c]:
                        if self.unit_of[dep] == self.unit_of[c] and self.regen_op[c] < self.regen_op[dep]:
                            self.regen_op[dep] = self.regen_op[c]
                            changed = True
        self.unit_start = [int(self.regen_op[m].min()) for m in self.units]
        dependents: list[set[int]] = [set() for _ in self.units]
        self.boundary = [set() for _ in self.units]
        for c in range(sim.k):
            v = int(self.unit_of[c])
            for dep in deps[c] if v >= 0 else ():
                u = int(self.unit_of[dep])
                if u >= 0 and u != v:
                    dependents[u].add(v)
                    self.boundary[u].add(dep)
        self.dependents = [sorted(s) for s in dependents]
        self.closure = []
        for u in range(len(self.units)):
            seen, stack = set(self.boundary[u]), list(self.boundary[u])
            while stack:
                for dep in deps[stack.pop()]:
                    if self.unit_of[dep] == u and dep not in seen:
                        seen.add(dep)
                        stack.append(dep)
            self.closure.append(seen)

    def pulled_set(self, u: int, a: int) -> set[int]:
        """Candidates of unit u that Rule 7 materializes when a recomputed dependent starts, under action a."""
        return self.closure[u] if a == RECOMPUTE else self.boundary[u]
