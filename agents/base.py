"""The one interface every policy source implements: heuristics, exact solvers, Optuna and RL searchers.

A :class:`Searcher` gets a :class:`Problem` (a workload, a hardware profile, a memory budget, options) and a
:class:`SearchContext` (how to search: time limit, seed, trials, storage, warm-start seeds, progress), and
returns a :class:`SearchResult`: the best policy it found, its simulated :class:`~envs.simulator.SimResult`,
a :class:`Status`, the wall time and the number of simulator evaluations it spent.

Contract (checked for every registered searcher by tests/test_searchers_contract.py):

1. ``search(problem, ctx)`` never raises for a budget it cannot meet: it returns its best policy with status
   ``INFEASIBLE`` (no feasible policy found; for an exact solver, none exists) and the policy's result.
2. A ``FEASIBLE`` or ``OPTIMAL`` result has ``result.peak_bytes <= problem.budget_bytes``, and the policy's
   actions, simulated again, give exactly ``result``.
3. ``OPTIMAL`` is claimed only by exact solvers, and only when they proved it (for the model they solve;
   ``gap`` says how far the proof goes). ``TIMEOUT``: the time limit stopped the search; the result is the
   best incumbent.
4. Compression (lossy) is proposed only when ``problem.allow_compress`` is set. Where ``problem.allow_swap``
   is not (a policy for torch.compile), a swap is simulated as keep and answered as keep.
5. Deterministic for a given ``ctx.seed``.
6. Budget-aware heuristics stop dropping memory once the budget holds (they do not trade throughput for
   memory the budget does not need): see :func:`apply_until_fits`.

Subclasses implement :meth:`Searcher._search`; the public :meth:`Searcher.search` does the bookkeeping.
When the proposal swaps, that includes when the runtime lets swapped bytes go (``PolicyOptions.
release_after``, the simulator's Rule 4): the published methods do not say, so every answer is tried at
each of ``RELEASES`` and the best kept, alike for every searcher but the exact solvers (which answer for the
options as given). An answer that recomputes is tried with its regions both ways too (``PolicyOptions.
region_nodes``, Rule 11: one node each, or checkpointed).
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import difflib
import enum
import importlib
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import numpy as np

import envs.problem
from agents.finalists import Finalists
from envs.simulator import SimResult
from runtime.errors import AutotuneError, dropped_interrupts, note_sigint, sigint_arrived
from runtime.policy import Policy, PolicyOptions, Prediction
from runtime.vocab import COMPRESS, KEEP, RECOMPUTE, SWAP


class Status(str, enum.Enum):
    OPTIMAL = "OPTIMAL"
    FEASIBLE = "FEASIBLE"
    INFEASIBLE = "INFEASIBLE"
    TIMEOUT = "TIMEOUT"


@dataclass
class Problem(envs.problem.Problem):
    """What to solve (envs/problem.py: workload, hardware, budget, options, the simulator), with the record
    of what its evaluations saw: the best fitting policy, and the finalists when asked for."""

    # autotune search --measure: the best distinct fitting policies simulated (NOTE [ Finalists ])
    finalists: Finalists | None = field(default=None, repr=False, kw_only=True)
    # The fastest fitting policy any evaluation saw, whoever made it (a heuristic's trial it did not keep,
    # an Optuna rule's prefix): the portfolio's answer is never below it.
    best_seen: tuple[np.ndarray, PolicyOptions, SimResult] | None = field(default=None, repr=False, kw_only=True)
    # The same model traced with another partition, or none (NOTE [ Choosing a partition ] C5 in
    # autotune/partitions.py): a searcher that takes them (``Searcher.chooses_partition``) decides among
    # them too, and its proposal says which (``Proposal.rival``).
    rivals: tuple[Problem, ...] = field(default=(), repr=False, kw_only=True)

    def member(self, rival: int) -> Problem:
        """This problem (``rival`` -1) or one of its rivals."""
        return self if rival < 0 else self.rivals[rival]

    @property
    def members(self) -> tuple[Problem, ...]:
        """This problem, then its rivals."""
        return (self, *self.rivals)

    @property
    def all_evaluations(self) -> int:
        return sum(p.evaluations for p in self.members)

    def _evaluated(self, actions: np.ndarray, options: PolicyOptions, result: SimResult) -> None:
        faster = self.best_seen is None or result.samples_per_s > self.best_seen[2].samples_per_s
        if result.feasible and faster and (self.allow_compress or not np.any(actions == COMPRESS)):
            self.best_seen = (actions.copy(), options, result)
        if self.finalists is not None:
            self.finalists.offer(actions, options, result)


@dataclass
class RunState:
    """What a search says as it runs, shared by a context and every context derived from it."""

    interrupted: bool = False  # Ctrl-C stopped the search early; it returns what it has
    converged_s: float | None = None  # the search stopped early, converged, after this many seconds
    # A SIGINT came (:meth:`SearchContext.noting_sigint`) and no search has taken its KeyboardInterrupt yet.
    sigint_pending: bool = False


@dataclass(frozen=True)
class SearchContext:
    """How to search, passed beside the problem (``searcher.search(problem, ctx)``); heuristics read none
    of it. A phase or a sub-search gets its own settings through :meth:`derive`, never by changing these:
    the run state (:class:`RunState`) is the one thing they share."""

    time_limit_s: float | None = None
    seed: int = 0
    trials: int | None = None  # None: the searcher's default; 0: no bound but time_limit_s (not reproducible)
    storage: str | None = None  # Optuna storage URL (None: in memory)
    study_name: str | None = None  # None: derived from the problem (see agents/optuna_search.py)
    heartbeat_s: float | None = None  # Optuna heartbeats for shared RDB storages (NOTE [ Distributed search ])
    seeds: tuple[SearchResult, ...] = ()  # warm start: other searchers' results
    progress: Callable[[str, SimResult | None], None] | None = field(default=None, repr=False)  # (phase, best)
    state: RunState = field(default_factory=RunState, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Checked here, in one line: numpy's seeding said it twelve frames into a search (a QA run).
        whole = (int, np.integer)
        if isinstance(self.seed, bool) or not isinstance(self.seed, whole) or not 0 <= self.seed < 2**32:
            raise ValueError(f"seed={self.seed!r}: expected a whole number from 0 to 2**32 - 1, e.g. seed=0")
        if self.trials is not None and (not isinstance(self.trials, whole) or self.trials < 0):
            raise ValueError(f"trials={self.trials!r}: expected a whole number, 0 or more (None: the default)")

    @property
    def interrupted(self) -> bool:
        return self.state.interrupted

    def interrupt(self) -> None:
        """Ctrl-C reached a search: every search of this run stops and returns its best."""
        self.state.interrupted = True
        self.state.sigint_pending = False

    @contextlib.contextmanager
    def noting_sigint(self) -> Iterator[None]:
        """While inside, a SIGINT is noted before its KeyboardInterrupt is raised, and :meth:`report` raises it
        again if no search took it. Python drops an exception raised inside a finalizer (a ``__del__``, a
        weakref callback such as SQLAlchemy's ``InstanceState._cleanup``) with an "Exception ignored" traceback,
        and a Ctrl-C that lands there would leave the search running to its end; inside, that traceback is not
        printed either; nor is what SQLAlchemy logs when the interrupt lands inside one of Optuna's queries (its
        cursor's cleanup then fails with a traceback, "Error closing cursor"). Only in the main thread, and only
        where SIGINT has Python's default handler or one that notes it as this one does (the command line's,
        :func:`runtime.errors.noting_sigint`: a Ctrl-C that a finalizer swallowed before the search, while the
        model was traced, is raised at the search's first report); a caller's own handler is left alone."""
        previous = signal.getsignal(signal.SIGINT)
        if threading.current_thread() is not threading.main_thread() or (
            previous is not signal.default_int_handler and not getattr(previous, "notes_sigint", False)
        ):
            yield
            return
        if sigint_arrived():
            self.state.sigint_pending = True

        sqlalchemy = logging.getLogger("sqlalchemy")
        level = sqlalchemy.level

        def noted(signum: int, frame: Any) -> None:
            self.state.sigint_pending = True
            note_sigint()
            sqlalchemy.setLevel(logging.CRITICAL)
            signal.default_int_handler(signum, frame)

        signal.signal(signal.SIGINT, noted)
        try:
            with dropped_interrupts():
                yield
        finally:
            signal.signal(signal.SIGINT, previous)
            sqlalchemy.setLevel(level)

    def derive(self, **changes: Any) -> SearchContext:
        """These settings with ``changes`` (a phase's seeds and study name, a sub-search's time limit); the
        run state is shared."""
        return dataclasses.replace(self, **changes)

    def report(self, phase: str, best: SimResult | None = None) -> None:
        if self.state.sigint_pending:  # a Ctrl-C that a finalizer swallowed (:meth:`noting_sigint`)
            raise KeyboardInterrupt
        if self.progress is not None:
            self.progress(phase, best)


@dataclass
class Proposal:
    """What ``_search`` returns: actions (codes over ``workload.candidates``), options, and how sure."""

    actions: np.ndarray
    options: PolicyOptions | None = None
    status: Status | None = None  # None: FEASIBLE or INFEASIBLE from the simulated peak
    gap: float | None = None  # exact solvers: relative optimality gap of the proof
    note: str = ""
    rival: int = -1  # the actions are for ``problem.rivals[rival]`` (-1: the problem itself)


@dataclass
class SearchResult:
    """A searcher's answer (see the module docstring for the contract)."""

    searcher: str
    policy: Policy
    result: SimResult
    status: Status
    wall_s: float
    evaluations: int
    gap: float | None = None
    note: str = ""
    rival: int = -1  # the policy is for ``problem.rivals[rival]`` (-1: the problem itself; Proposal.rival)

    @property
    def feasible(self) -> bool:
        """A policy within the budget: found, proved, or a timed-out search's incumbent that fits."""
        return self.status in (Status.FEASIBLE, Status.OPTIMAL) or (
            self.status == Status.TIMEOUT and self.result.feasible
        )


class Searcher(abc.ABC):
    """A source of policies. Set ``name`` (registry key), ``summary`` (one line, the paper it reads), and
    ``exact`` for solvers that can prove optimality (they are reported apart from heuristics), and
    ``composite`` for searchers that build on others (Optuna, refinement, the portfolio, RL): they are not
    baselines."""

    name: ClassVar[str]
    summary: ClassVar[str] = ""
    exact: ClassVar[bool] = False
    composite: ClassVar[bool] = False
    # Decides among ``problem.rivals`` too (NOTE [ Choosing a partition ] C5): the partition is one of its
    # decisions. Others solve the problem alone and leave its rivals to the caller.
    chooses_partition: ClassVar[bool] = False

    def study_names(self, name: str) -> list[str]:
        """The Optuna studies this searcher keeps under the study name ``name`` (each of a composite's phases
        may have its own; none for one that runs no Optuna study: nothing of it to resume)."""
        return []

    def search(self, problem: Problem, ctx: SearchContext | None = None) -> SearchResult:
        """Run the search (with ``ctx``'s settings; the defaults when None) and package its proposal as a
        policy with its simulated result."""
        if not isinstance(problem, Problem) or not (ctx is None or isinstance(ctx, SearchContext)):
            raise TypeError(
                f"{self.name}.search(problem, ctx) takes an agents.base.Problem and a SearchContext (or None), not "
                f"{type(problem).__name__} and {type(ctx).__name__}: e.g. search(Problem(w, hw, budget_bytes=...), "
                "SearchContext(time_limit_s=10))"
            )
        family = problem
        start_evals = family.all_evaluations
        started = time.perf_counter()
        if problem.budget_bytes <= 0:  # no policy meets it: answered, not raised (the RL agents' env refused it)
            proposal = Proposal(problem.keep_all(), note=f"a budget of {problem.budget_bytes} bytes: nothing fits")
        else:
            proposal = self._search(problem, SearchContext() if ctx is None else ctx)
        wall_s = time.perf_counter() - started
        if proposal.rival >= 0 and not self.chooses_partition:
            raise AssertionError(f"{self.name} answered for a rival partition without choosing partitions")
        problem = problem.member(proposal.rival)  # the partition the proposal chose (NOTE [ Choosing ... ] C5)
        actions = problem.allowed(proposal.actions)  # a disallowed swap was simulated as keep: answered so
        if not problem.allow_compress and np.any(actions == COMPRESS):
            raise AssertionError(f"{self.name} proposed compression without allow_compress")
        options = proposal.options or problem.options
        result = problem.evaluate(actions, options)
        if np.any(actions == SWAP) and not self.exact:  # exact solvers answer for the options as given
            options, result = best_release(problem, actions, options, result)
        if np.any(actions == RECOMPUTE) and not self.exact:
            options, result = best_regions(problem, actions, options, result)
        status = proposal.status or (Status.FEASIBLE if result.feasible else Status.INFEASIBLE)
        if status in (Status.FEASIBLE, Status.OPTIMAL) and not result.feasible:
            status = Status.INFEASIBLE  # a solver's own model can disagree with the simulator: trust the latter
        policy = Policy.from_vector(
            problem.workload,
            actions,
            hardware=problem.hardware.name,
            budget_bytes=problem.budget_bytes,
            options=options,
            searcher=self.name,
            trials=family.all_evaluations - start_evals,
            predicted=Prediction(result.peak_bytes, result.iter_s, result.samples_per_s),
            wall_s=wall_s,
        )
        evaluations = family.all_evaluations - start_evals
        return SearchResult(
            self.name, policy, result, status, wall_s, evaluations, proposal.gap, proposal.note, proposal.rival
        )

    @abc.abstractmethod
    def _search(self, problem: Problem, ctx: SearchContext) -> Proposal:
        """Propose actions for ``problem``; see the module docstring for the contract."""


# -- registry ------------------------------------------------------------------------------------------------
_REGISTRY: dict[str, type[Searcher]] = {}
S = TypeVar("S", bound=type[Searcher])


def register(cls: S) -> S:
    """Class decorator: make a searcher available by its ``name``."""
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"two searchers named {cls.name!r}")
    _REGISTRY[cls.name] = cls
    return cls


def _load_builtins() -> None:
    # Importing the packages registers their searchers.
    for package in (
        "agents.heuristics",
        "agents.solvers",
        "agents.refine",
        "agents.optuna_search",
        "agents.portfolio",
        "agents.rl",
        "agents.pretrained",
    ):
        importlib.import_module(package)


def list_searchers(*, exact: bool | None = None, composite: bool | None = None) -> list[str]:
    _load_builtins()
    return sorted(
        n
        for n, c in _REGISTRY.items()
        if (exact is None or c.exact == exact) and (composite is None or c.composite == composite)
    )


def baseline_names(*, exact: bool = False) -> list[str]:
    """The published methods: heuristics (``exact=False``) or exact solvers, composites excluded."""
    return list_searchers(exact=exact, composite=False)


def get_searcher(name: str) -> Searcher:
    """An instance of the searcher registered as ``name``; unknown names get a "did you mean"."""
    _load_builtins()
    if name not in _REGISTRY:
        close = difflib.get_close_matches(name, list(_REGISTRY), n=3, cutoff=0.5)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise AutotuneError(f"unknown searcher '{name}': {hint}expected one of {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]()


# -- helpers shared by heuristics --------------------------------------------------------------------------
RELEASES = (1, 2, 4, 8, 16)  # PolicyOptions.release_after values tried (Rule 4)


def best_release(
    problem: Problem, actions: np.ndarray, options: PolicyOptions, result: SimResult
) -> tuple[PolicyOptions, SimResult]:
    """The ``release_after`` of ``RELEASES`` under which ``actions`` do best (:func:`better`), starting from
    ``options`` and their ``result`` (returned as they are when none beats them)."""
    for release in RELEASES:
        if release == options.release_after:
            continue
        trial = dataclasses.replace(options, release_after=release)
        r = problem.evaluate(actions, trial)
        if better(r, result):
            options, result = trial, r
    return options, result


def best_regions(
    problem: Problem, actions: np.ndarray, options: PolicyOptions, result: SimResult
) -> tuple[PolicyOptions, SimResult]:
    """``actions`` with their regions run the other way (``region_nodes``, Rule 11) where that does better
    (:func:`better`); ``options`` and their ``result`` otherwise."""
    trial = dataclasses.replace(options, region_nodes=not options.region_nodes)
    r = problem.evaluate(actions, trial)
    return (trial, r) if better(r, result) else (options, result)


def apply_until_fits(
    problem: Problem,
    ranked: Iterable[tuple[int, int]],
    *,
    start: np.ndarray | None = None,
    options: PolicyOptions | None = None,
    accept: Callable[[SimResult], bool] | None = None,
) -> tuple[np.ndarray, SimResult]:
    """Apply ``(candidate, action)`` steps in order, simulating after each, and stop at the first policy
    that fits the budget (or satisfies ``accept``). Returns the actions and their result; if nothing fits,
    every step is applied. This is how every budget-aware heuristic stops dropping memory once the budget
    holds."""
    actions = problem.keep_all() if start is None else start.copy()
    fits = accept or (lambda r: r.feasible)
    result = problem.evaluate(actions, options)
    if fits(result):
        return actions, result
    for ci, action in ranked:
        if actions[ci] == action:
            continue
        actions[ci] = action
        result = problem.evaluate(actions, options)
        if fits(result):
            break
    return actions, result


def better(a: SimResult, b: SimResult | None) -> bool:
    """Whether ``a`` beats ``b``: feasible beats infeasible; then higher throughput (both feasible) or
    the smaller shortfall (both not: the peak, plus the swapped bytes a bounded host cannot pin); anything
    beats None. Strict, so that on ties the one found first stays."""
    if b is None:
        return True
    if a.feasible != b.feasible:
        return a.feasible
    return a.samples_per_s > b.samples_per_s if a.feasible else a.shortfall_bytes < b.shortfall_bytes


def best_of(results: Iterable[SearchResult]) -> SearchResult | None:
    """The best of ``results`` by :func:`better` (the first of equals), None for none."""
    best: SearchResult | None = None
    for r in results:
        if best is None or better(r.result, best.result):
            best = r
    return best


def first_fit_status(result: SimResult) -> Status:
    return Status.FEASIBLE if result.feasible else Status.INFEASIBLE


__all__ = [
    "KEEP",
    "RELEASES",
    "Problem",
    "Proposal",
    "SearchResult",
    "Searcher",
    "Status",
    "apply_until_fits",
    "baseline_names",
    "best_of",
    "best_regions",
    "best_release",
    "better",
    "get_searcher",
    "list_searchers",
    "register",
]
