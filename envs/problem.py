"""The problem every policy source solves: a workload, a hardware profile, a memory budget and options.

:class:`Problem` holds what to solve and what follows from it (the simulator, built once, the candidates'
features), and scores policies (:meth:`Problem.evaluate`: counted, and answered from a cache for a policy seen
before). The environment (envs/memory_env.py) is built on it; the searchers (agents/) solve
:class:`agents.base.Problem`, which adds their settings (time limit, trials, storage) and what a search
leaves on it as it runs (seeds, progress, the best policy seen).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from envs.simulator import SimResult, Simulator, compiled_twin
from runtime.hardware import HardwareProfile, get_profile
from runtime.policy import PolicyOptions
from runtime.vocab import KEEP, SWAP
from runtime.workload import Workload

CACHED_RESULTS = 50_000  # simulations ``Problem.evaluate`` remembers (about 1 KiB each on ResNet-101)
_OPTION_FIELDS = tuple(f.name for f in dataclasses.fields(PolicyOptions))


@dataclass
class Problem:
    """What to solve. The simulator is built once per problem and shared by everything that solves it."""

    workload: Workload
    hardware: HardwareProfile
    budget_bytes: int
    options: PolicyOptions = field(default_factory=PolicyOptions)
    allow_compress: bool = False
    # False for a search whose policy runs under torch.compile (runtime/compiled.py C5: keep and recompute
    # only), and on a profile without copy engines (the CPU: simulator Rule 4, the copy is the same memory, so a
    # swap never lowers the peak and adds a copy): a swap is simulated as the keep it would become, and
    # Searcher.search answers keep for it.
    allow_swap: bool = True
    # The torch.compile backend the policy will run under (``search --compile``), else None: the problem's
    # workload and profile are then the simulator's twin of the compiled step (envs/simulator.py Rule 16), and
    # it swaps nothing.
    compiled: str | None = None
    evaluations: int = field(default=0, repr=False, kw_only=True)  # ``evaluate`` calls
    cached: int = field(default=0, repr=False, kw_only=True)  # evaluations answered from the cache
    _sim: Simulator | None = field(default=None, repr=False, kw_only=True)
    _results: dict[tuple[object, ...], SimResult] = field(default_factory=dict, repr=False, kw_only=True)

    def __post_init__(self) -> None:
        if isinstance(self.hardware, str):  # a profile's name, as the CLI's --gpu takes it
            self.hardware = get_profile(self.hardware)
        if isinstance(self.budget_bytes, bool) or not isinstance(self.budget_bytes, (int, np.integer)):
            raise TypeError(
                f"budget_bytes={self.budget_bytes!r}: expected a whole number of bytes (autotune.budget.parse_budget "
                "reads '6GB')"
            )
        # A workload traced with partitions (runtime/partition.py) was traced so with the user's consent:
        # every policy for it carries allow_partition, whoever makes it.
        if self.workload.meta.get("partitions") and not self.options.allow_partition:
            self.options = dataclasses.replace(self.options, allow_partition=True)
        # Compression allowed is lossy compression allowed: the policies its searchers export say so (a
        # compressing policy without ``lossy`` is refused when it is made).
        if self.allow_compress and not self.options.lossy:
            self.options = dataclasses.replace(self.options, lossy=True)
        if not self.hardware.is_gpu:
            self.allow_swap = False
        if self.compiled is not None:
            self.allow_swap = False
            self.workload, self.hardware = compiled_twin(self.workload, self.hardware, self.compiled)

    @property
    def simulator(self) -> Simulator:
        if self._sim is None:
            self._sim = Simulator(self.workload, self.hardware)
        return self._sim

    @property
    def n(self) -> int:
        """Number of candidates."""
        return len(self.workload.candidates)

    def evaluate(self, actions: Sequence[int] | np.ndarray, options: PolicyOptions | None = None) -> SimResult:
        """Simulate one policy under the problem's budget (counts toward ``evaluations``). A policy evaluated
        before, with the same options and budget, is answered from a cache (``cached`` counts those): local
        search and perturbation come back to the same policies (a fifth of a portfolio's evaluations on
        ResNet-101). The result is shared: do not modify it."""
        self.evaluations += 1
        options = options or self.options
        vec = self.allowed(actions)
        key = (vec.tobytes(), self.budget_bytes, *(getattr(options, f) for f in _OPTION_FIELDS))
        result = self._results.get(key)
        if result is None:
            result = self.simulator.run(vec, budget_bytes=self.budget_bytes, options=options)
            if len(self._results) >= CACHED_RESULTS:
                self._results.clear()
            self._results[key] = result
        else:
            self.cached += 1
        self._evaluated(vec, options, result)
        return result

    def allowed(self, actions: Sequence[int] | np.ndarray) -> np.ndarray:
        """``actions`` as int8 codes, a swap as the keep it becomes where swaps are not allowed; a vector of
        another length or with codes outside 0..3 is refused (the simulator would score them as a drop)."""
        codes = np.asarray(actions)
        if codes.shape != (self.n,):
            raise ValueError(f"action vector of shape {codes.shape}: expected one code per candidate, ({self.n},)")
        if codes.dtype == np.int8:  # the searchers' own: one pass (a negative code is 128 or more as uint8)
            valid = not self.n or int(codes.view(np.uint8).max()) < 4
        else:
            whole = np.issubdtype(codes.dtype, np.integer) or (  # an exact solver's 2.0 is a whole code
                np.issubdtype(codes.dtype, np.floating) and bool(np.all(codes == np.floor(codes)))
            )
            valid = not self.n or (whole and 0 <= codes.min() <= codes.max() < 4)
        if not valid:
            raise ValueError(f"action codes {np.unique(codes).tolist()} are not all integers in 0..3 (keep..compress)")
        vec = codes.astype(np.int8, copy=False)
        if not self.allow_swap and np.any(vec == SWAP):
            vec = np.where(vec == SWAP, KEEP, vec).astype(np.int8)
        return vec

    def _evaluated(self, actions: np.ndarray, options: PolicyOptions, result: SimResult) -> None:
        """Called with every evaluation (a search's problem keeps the best one it saw)."""

    def keep_all(self) -> np.ndarray:
        return np.zeros(self.n, dtype=np.int8)


__all__ = ["CACHED_RESULTS", "Problem"]
