"""DTR: evict the tensor with the smallest h_DTR whenever an allocation would exceed the memory cap.

Kirisame, Lyubomirsky, Haan, Brennan, He, Roesch, Chen and Tatlock, "Dynamic Tensor Rematerialization",
ICLR 2021. DTR is a greedy online runtime (Sec. 2-3, Algorithm 1): before each operator it makes room under
a fixed memory cap by evicting, one at a time, the resident evictable tensor with the smallest

    h_DTR(t) = (c(t) + sum_{u in e*(t)} c(u)) / (m(t) * s(t))

with c the compute cost of rematerializing t, m its size, s its *staleness* (time since its last access)
and e*(t) its *evicted neighbourhood*: the evicted tensors that must be rematerialized before t can be
(its evicted ancestors, through evicted tensors) and those that would need t resident to be (its evicted
descendants, likewise). An evicted tensor is rematerialized, recursively, when an operator needs it.

Variant: we compute **h_DTR with the exact e\\*** (the paper's own definition), not the union-find
"equivalence class" approximation h_DTR^eq nor the neighbour-free h_DTR^local: our graph is small and
static, so the exact neighbourhood is cheap. The graph is the candidates' recompute dependencies
(``CandidateFeatures.recompute_deps``) and c(t) is the Rule 7 closure time (``recompute_s``): the producer
chain of t, non-candidate intermediates included, from candidate inputs assumed resident.

Adaptation (DTR is dynamic, a policy is static). We replay the simulated iteration op by op with the cap =
the budget (:func:`dtr_replay`), and every candidate DTR evicts becomes ``recompute`` in the policy. Our
counterpart of DTR's on-demand rematerialization is Rule 7: the tensor is regenerated, recursively, just
before its first backward use. The mismatch: DTR may also evict a tensor the forward still reads and
recompute it *during* the forward, or evict it again after rematerializing it in the backward; a static
policy only drops a saved tensor between its last forward use and its first backward use, once. So only
candidates the program no longer holds (``free_if_dropped_op`` passed) and not yet needed in backward are
evictable, and a rematerialized one stays. The static policy is then simulated; where its peak still
exceeds the budget (the readings differ: e.g. closure intermediates held during a recompute, which the
replay does not count), we keep evicting at the simulated peak by the same score until it fits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from agents.base import Problem, Proposal, SearchContext, Searcher, register
from envs.features import CandidateFeatures
from envs.simulator import SimResult, Simulator
from runtime.vocab import KEEP, RECOMPUTE

_MIN_STALENESS_S = 1e-12  # a tensor touched by the previous op has staleness 0: h = cost / (m * 1e-12)


@dataclass(frozen=True)
class Eviction:
    """One eviction of the replay: before op ``op``, candidate ``candidate`` with score ``h``."""

    op: int
    candidate: int
    h: float  # h_DTR: seconds of recompute per (byte * second of staleness)


def _dependents(feats: CandidateFeatures) -> list[list[int]]:
    out: list[list[int]] = [[] for _ in range(feats.k)]
    for ci, deps in enumerate(feats.recompute_deps):
        for d in deps:
            out[d].append(ci)
    return out


def evicted_neighbourhood(
    feats: CandidateFeatures, dependents: list[list[int]], evicted: np.ndarray, t: int
) -> set[int]:
    """e*(t): evicted ancestors of ``t`` reachable through evicted tensors, and evicted descendants
    likewise (DTR's definition)."""
    found: set[int] = set()
    for step in (lambda u: feats.recompute_deps[u], lambda u: dependents[u]):
        stack = [t]
        while stack:
            for v in step(stack.pop()):
                if evicted[v] and v not in found and v != t:
                    found.add(v)
                    stack.append(v)
    return found


def h_dtr(
    feats: CandidateFeatures,
    dependents: list[list[int]],
    evicted: np.ndarray,
    t: int,
    staleness_s: float,
    nbytes: int,
) -> float:
    """h_DTR(t) = (c(t) + sum of c over e*(t)) / (m(t) * s(t))."""
    cost_s = float(feats.recompute_s[t]) + sum(
        float(feats.recompute_s[u]) for u in evicted_neighbourhood(feats, dependents, evicted, t)
    )
    return cost_s / (max(1, nbytes) * max(staleness_s, _MIN_STALENESS_S))


# score(candidate, op, now_s, evicted, last_access_s) -> the lower, the sooner evicted
Score = Callable[[int, int, float, np.ndarray, np.ndarray], float]


def dtr_replay(sim: Simulator, cap_bytes: int, score: Score | None = None) -> list[Eviction]:
    """Replay the iteration op by op under ``cap_bytes`` (DTR, Algorithm 1) and return its evictions;
    ``score`` replaces h_DTR as the eviction order (agents/heuristics/megtaichi.py)."""
    feats = sim.features
    dependents = _dependents(feats)
    w, n, k = sim.w, sim.n_ops, sim.k
    cand_of = {c.tensor: i for i, c in enumerate(w.candidates)}
    touched = [[cand_of[t] for t in (*op.inputs, *op.outputs) if t in cand_of] for op in w.ops]
    produced_at: list[list[int]] = [[] for _ in range(n + 1)]
    needed_at: list[list[int]] = [[] for _ in range(n + 1)]  # by first backward use (n: never)
    for ci in range(k):
        produced_at[int(sim.producer[ci])].append(ci)
        needed_at[int(sim.first_use[ci])].append(ci)
    counted = np.zeros(k, dtype=bool)  # bytes on the device now
    evicted = np.zeros(k, dtype=bool)  # dropped and not yet rematerialized: e* is built over these
    remat = np.zeros(k, dtype=bool)  # rematerialized in backward: stays (a static policy drops once)
    last_access_s = np.zeros(k)
    extra_s = 0.0  # recompute seconds inserted on the compute stream so far
    log: list[Eviction] = []

    def rematerialize(ci: int) -> float:
        """Rule 7: regenerate ``ci`` and, recursively, its evicted dependencies; returns the seconds."""
        spent, stack = 0.0, [ci]
        while stack:
            c = stack.pop()
            if evicted[c]:
                evicted[c], remat[c], counted[c] = False, True, True
                spent += float(feats.recompute_s[c])
                stack.extend(feats.recompute_deps[c])
        return spent

    for i in range(n):
        counted[sim.free_keep < i] = False  # released after op i - 1
        counted[produced_at[i]] = True
        for ci in needed_at[i]:
            if evicted[ci]:  # (it may have come back already, as another one's dependency)
                extra_s += rematerialize(ci)
        now_s = float(sim.op_start_s[i]) + extra_s
        live = int(sim.base_live[i]) + int(sim.size[counted].sum())
        busy = set(touched[i])
        while live > cap_bytes:
            # Evictable: on the device, no longer held by the program, not yet needed in backward, not
            # read or written by this op, and not rematerialized already (see the module docstring).
            pool = [
                c
                for c in np.flatnonzero(counted & ~remat).tolist()
                if sim.drop[c] < i < sim.first_use[c] and c not in busy
            ]
            if not pool:
                break  # over the cap with nothing evictable: DTR would fail here; the search reports it
            if score is None:
                scores = {
                    c: h_dtr(feats, dependents, evicted, c, now_s - last_access_s[c], int(sim.size[c])) for c in pool
                }
            else:
                scores = {c: score(c, i, now_s, evicted, last_access_s) for c in pool}
            victim = min(pool, key=lambda c: (scores[c], c))
            evicted[victim], counted[victim] = True, False
            live -= int(sim.size[victim])
            log.append(Eviction(i, victim, scores[victim]))
        last_access_s[touched[i]] = now_s + float(sim.op_s[i])
    return log


@register
class DTR(Searcher):
    """DTR (Kirisame et al., ICLR 2021) as a static policy: the tensors its greedy h_DTR eviction drops
    under the budget, replayed on the simulated iteration, are recomputed."""

    name = "dtr"
    summary = "Kirisame et al., ICLR 2021: evict by smallest h_DTR = cost / (size * staleness), recompute"

    def _search(self, problem: Problem, ctx: SearchContext) -> Proposal:
        sim = problem.simulator
        feats = sim.features
        log = dtr_replay(sim, problem.budget_bytes)
        actions = problem.keep_all()
        actions[[e.candidate for e in log]] = RECOMPUTE
        result = problem.evaluate(actions)
        # The static reading can differ from the dynamic one: keep evicting by h_DTR at the simulated peak,
        # with staleness measured from each candidate's last forward access in the traced iteration.
        dependents = _dependents(feats)
        last_fwd = np.array([c.last_fwd_use for c in problem.workload.candidates], dtype=np.int64)
        last_access_s: list[float] = (sim.op_start_s[last_fwd] + sim.op_s[last_fwd]).tolist()

        def h_at(p: int) -> Callable[[int], float]:
            evicted, now_s = actions == RECOMPUTE, float(sim.op_start_s[p])
            return lambda c: h_dtr(feats, dependents, evicted, c, now_s - last_access_s[c], int(sim.size[c]))

        extra = evict_at_peak(problem, actions, result, h_at)
        return Proposal(actions, note=f"{len(log)} evictions in the replay, {extra} after it")


def evict_at_peak(
    problem: Problem, actions: np.ndarray, result: SimResult, scorer: Callable[[int], Callable[[int], float]]
) -> int:
    """Where a replay's static policy still exceeds the budget on the simulator, recompute one more kept
    candidate at a time, the lowest ``scorer(peak op)(candidate)`` among those evictable at the simulated
    peak, until it fits or none is left. Changes ``actions`` in place; returns how many it added."""
    sim, extra = problem.simulator, 0
    while not result.feasible:
        p = result.peak_op
        pool = np.flatnonzero((actions == KEEP) & (sim.drop < p) & (p < sim.first_use)).tolist()
        if not pool:
            break
        score = scorer(p)
        actions[min(pool, key=lambda c: (score(c), c))] = RECOMPUTE
        result = problem.evaluate(actions)
        extra += 1
    return extra
