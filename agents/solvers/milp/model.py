"""Keep / swap / recompute (/ compress) per unit of activations by mixed-integer linear programming.

Jain, Jain, Nrusimha, Gholami, Abbeel, Keutzer, Stoica and Gonzalez, "Checkmate: Breaking the Memory Wall
with Optimal Tensor Rematerialization", MLSys 2020: rematerialization as a MILP over a (coarsened) graph,
memory constrained at every stage. Patil, Jain, Mandal, Nrusimha, Gonzalez and Stoica, "POET: Training
Neural Networks on Tiny Devices with Integrated Rematerialization and Paging", ICML 2022 (and torchtitan's
activation-checkpoint planner) add paging to host memory as a third choice. We keep their shape -- one
binary per unit and action, memory rows per time step, time as the objective -- but the schedule is not
free: the simulator fixes when everything happens (Rules 1-9), so the MILP only chooses the actions and
*models* what the simulator then does. The searcher simulates the answer and trusts the simulator.

NOTE [ MILP model ] -- every variable and row, by its name in the model (``name[...]``).
    Units are runs of candidates of one block in forward order, merged or split to at most ``max_units``
    (:func:`decision_units`); candidates under ``TINY_FRACTION`` of the activation bytes are kept, not
    decided. Times are in milliseconds, memory in ``mem_unit`` bytes. Everything the simulator derives
    from the policy is written as a function of the binaries x, so that the optimum is the simulator's.
    Variables:
      x[u,a]           binary: unit u takes action a (keep, swap, recompute; compress if allowed).
      pulled[u,a,j]    x[u,a] AND "a recomputed unit reading u has started regenerating by start point j"
                       (start points: the ops where a recomputed unit's own regeneration begins). Rule 7
                       then materializes u's inputs to it there, before their own first use: recomputed
                       (with their inputs inside u), fetched (swap: the H2D copy is issued, and waited for,
                       there) or unpacked (compress). In [0, 1]; the rows pin it to 0 or 1.
      stall[i]         compute-stream time spent waiting for copies up to need position i (Rule 6); need
                       positions are the decided candidates in backward order of first use.
      d2h_end[c], h2d_end[c]   when candidate c's device-to-host / host-to-device copy ends (Rules 4, 5).
      fwd_wait[r]      compute-stream time spent in forward waiting for copies out, up to the r-th release
                       point (Rule 4: the release points after a swapped candidate's own pack).
      handled_by[o]    1 when some decided candidate used in backward by op o is not kept: a swapped
                       candidate without a release point in forward holds its bytes until then (Rule 4).
      late_hold[c,o]   the bytes swapped c still holds at op o for lack of a forward release point.
      peak             only when minimising the peak (no policy fits the budget).
    Rows:
      one_action[u]                      exactly one action per unit.
      no_good[r]                         not the r-th assignment the simulator rejected (see Repairs).
      pull_lb[u,a,v,j], pull_ub_action[u,a,j], pull_ub_dependent[u,a,j]
                                         pulled = x[u,a] AND OR_v started(v, j), v the units reading u;
                                         started(v, j) is x[v,recompute] from v's own start point on and
                                         pulled[v,recompute,j] before it (a chain of recomputes).
      stall_monotone[i], stall[c], stall_pulled[c,j]
                                         waiting accumulates; the compute stream reaches c's first use (or
                                         the start point where c is pulled) no earlier than its copy ends.
      d2h_fifo[c], d2h_issue[c]          D2H copies run one at a time in issue order, from save_op's end.
      h2d_fifo[c], h2d_issue[c], h2d_issue_pulled[c,j], h2d_after_d2h[c]
                                         H2D copies run one at a time in order of need, each from its
                                         Rule 5 trigger op (or the start point that pulls it, if earlier),
                                         never before its D2H copy ended.
      fwd_wait_monotone[r], release[c]   forward waiting accumulates; the compute stream passes c's release
                                         point no earlier than its copy out ends.
      late_release[c,i]                  ... and, without one in forward, the first backward use of a
                                         candidate that is not kept (need position i) no earlier either.
      handled_by_ub[o], late_hold[c,o]   handled_by is at most the count of non-kept candidates used by o
                                         (and 1); late_hold is at least x[c,swap] - handled_by.
      memory[o]                          live bytes during op o (Rule 2, intervals of Rules 3-8, pulls and
                                         holds) within the budget (at most peak when minimising it).
    Objective (Rule 9): compute + the recompute of every candidate materialized + pack and unpack kernels +
    the total forward and backward wait. The host clock (Rules 1, 12) is not modelled: on profiles with
    host costs the model is optimistic, and the simulator has the last word.

    Exactness. When every unit is one candidate and no two decided candidates are first used in backward
    by the same op, the model is a relaxation of the simulator: every policy's simulated run satisfies all
    rows with its own numbers (copy ends, stalls, holds), at its simulated time. It is looser only in that
    stall is bounded below, not pinned: the solver may "wait" for a copy to end so that it frees memory,
    which the simulator never does. So an optimum the simulator accepts at the same time is the
    simulator's best policy; tests/test_solvers.py checks this against brute force over every policy of
    small chains (whose every pack the runtime observes, Rule 13, and which have no regions, Rule 11).
    Elsewhere the model approximates: a unit's candidates are pulled together, as early as the dependent
    unit starts (conservative); transients of pulled recomputes are not counted; release points are every
    candidate's first pack (the simulator observes a subset: later, so the hold is optimistic); regions
    are not modelled (their candidates are costed as replays).

    Repairs. When the simulator finds the answer over budget, HiGHS solves again with a no-good row that
    cuts that assignment off (on exact models this keeps the relaxation, so the final optimum is still
    proved), and after ``_CUTS_BEFORE_TIGHTENING`` cuts the budget lowered by the excess (then it is no
    longer a proof: the status comes from the simulator). With no accepted answer, the warm start is
    returned.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from agents.solvers.milp.data import MilpData
from agents.solvers.milp.highs import Lin, SparseMilp
from runtime.vocab import COMPRESS, KEEP, RECOMPUTE, SWAP

_NAMES = {KEEP: "keep", SWAP: "swap", RECOMPUTE: "recompute", COMPRESS: "compress"}


@dataclass
class Built:
    """A built MILP and the handles the searcher reads back."""

    milp: SparseMilp
    x: dict[tuple[int, int], int]
    memory_rows: list[int]


def build_milp(data: MilpData, budget_bytes: int | None, no_goods: Sequence[Sequence[int]] = ()) -> Built:
    """The MILP of NOTE [ MILP model ] (minimum peak when ``budget_bytes`` is None), without the unit actions
    of ``no_goods`` (see Repairs)."""
    return _Builder(data, budget_bytes).build(no_goods)


Key = tuple[int, int]  # a moment of backward: (op, candidate), in the simulator's order of need


class _Builder:
    """Adds the columns and rows of NOTE [ MILP model ] one group at a time (one method per group)."""

    def __init__(self, data: MilpData, budget_bytes: int | None) -> None:
        self.data, self.budget_bytes = data, budget_bytes
        problem = data.problem
        sim = self.sim = problem.simulator
        self.n, self.k, self.n_units = sim.n_ops, sim.k, len(data.units)
        self.acts = data.actions
        ms = 1e3  # seconds -> milliseconds
        opts = problem.options
        self.trigger_op = sim.trigger_ops(max(0, int(opts.prefetch_lookahead)))  # Rule 5: H2D issue op
        packed, pack_s = sim.compression(opts.compress_dtype)
        self.packed_bytes = packed.astype(np.float64)
        self.pack_ms = pack_s * ms  # one pack or unpack kernel (Rule 8)
        self.recompute_ms = np.array([cl[0] for cl in sim.closures]) * ms  # Rule 7 closure time
        self.transient_bytes = np.array([cl[1] for cl in sim.closures], dtype=np.float64)
        self.start_ms, self.op_ms = sim.op_start_s * ms, sim.op_s * ms  # traced op starts and durations
        self.d2h_ms, self.h2d_ms = sim.d2h_s * ms, sim.h2d_s * ms
        self.size_bytes = sim.size.astype(np.float64)
        self.decided = [c for members in data.units for c in members]
        self.uo = data.unit_of
        copies_ms = self.d2h_ms.sum() + self.h2d_ms.sum()
        # A bound on any time difference in the model: twice everything the iteration could contain.
        self.big_m = 2 * (sim.compute_s * ms + self.recompute_ms.sum() + 2 * self.pack_ms.sum() + copies_ms) + 1.0
        self.last_fwd = max((op.index for op in problem.workload.ops if op.phase.value == "forward"), default=-1)
        self.m = SparseMilp()
        self.m.offset = sim.compute_s * ms
        self.x: dict[tuple[int, int], int] = {}
        self.pulled: dict[tuple[int, int, int], int] = {}
        self.stall: list[int] = []
        self.d2h_end: dict[int, int] = {}
        # Backward moments in the simulator's order of need: decided candidates by (first use, index).
        use = sim.first_use
        self.need = sorted((c for c in self.decided if use[c] < self.n), key=lambda c: (int(use[c]), c))
        self.need_key: list[Key] = [(int(use[c]), c) for c in self.need]
        # Rule 4 with every candidate's first pack a release point: swapped c lets go after op release_op[c],
        # the compute stream waiting for its copy before op release_op[c] + 1; -1: not in forward.
        release_after = max(1, int(opts.release_after))
        points = sim.first_pack_op
        self.release_op = {
            c: int(points[c + release_after]) if c + release_after < self.k else -1 for c in self.decided
        }
        self.release_at = sorted({op + 1 for op in self.release_op.values() if op >= 0})  # fwd_wait positions
        self.fwd_wait: list[int] = []
        # Start points: where a recomputed unit's own regeneration begins (the first use that pulls it).
        self.starts = sorted({s for s in data.unit_start if s < self.n}) if RECOMPUTE in self.acts else []
        self.start_key: list[Key] = [(s, min(c for c in self.decided if use[c] == s)) for s in self.starts]

    def build(self, no_goods: Sequence[Sequence[int]]) -> Built:
        self.add_actions(no_goods)
        self.add_pulls()
        self.add_stalls_and_objective()
        self.add_copies()
        hold_terms = self.add_hold()
        memory_rows = self.add_memory(hold_terms)
        return Built(self.m, self.x, memory_rows)

    # -- x[u,a], one_action, no_good ----------------------------------------------------------------------------
    def add_actions(self, no_goods: Sequence[Sequence[int]]) -> None:
        m, x = self.m, self.x
        for u in range(self.n_units):
            for a in self.acts:
                x[u, a] = m.var(f"x[{u},{_NAMES[a]}]", binary=True)
            m.row(f"one_action[{u}]", Lin({x[u, a]: 1.0 for a in self.acts}), 1.0, 1.0)
        for r, unit_action in enumerate(no_goods):
            m.row(f"no_good[{r}]", Lin({x[u, a]: 1.0 for u, a in enumerate(unit_action)}), hi=self.n_units - 1.0)

    # -- pulled[u,a,j] and its rows -----------------------------------------------------------------------------
    def before(self, key: Key) -> int:
        """Index of the last start point strictly before ``key`` (-1: none)."""
        return bisect.bisect_left(self.start_key, key) - 1

    def started(self, v: int, j: int) -> Lin:
        """1 when recomputed unit v has started regenerating by start point j."""
        if self.starts[j] >= self.data.unit_start[v]:
            return Lin({self.x[v, RECOMPUTE]: 1.0})
        return self.pulled_by(v, RECOMPUTE, j)

    def pulled_by(self, u: int, a: int, j: int) -> Lin:
        return Lin({self.pulled[u, a, j]: 1.0}) if (u, a, j) in self.pulled else Lin()

    def first_pull(self, u: int, a: int, j: int) -> Lin:
        """1 when unit u is pulled exactly at start point j (pulled is monotone in j)."""
        return self.pulled_by(u, a, j).add_lin(self.pulled_by(u, a, j - 1), -1.0)

    def ever_pulled(self, u: int, a: int) -> Lin:
        js = [j for (v, b, j) in self.pulled if v == u and b == a]
        return self.pulled_by(u, a, max(js)) if js else Lin()

    def add_pulls(self) -> None:
        data, m, x = self.data, self.m, self.x
        use = self.sim.first_use
        for u in reversed(range(self.n_units)) if self.starts else ():  # dependents are built first
            for a in (a for a in self.acts if a != KEEP):
                members = data.pulled_set(u, a)
                if not members or not data.dependents[u]:
                    continue
                horizon = max(int(data.regen_op[c] if a == RECOMPUTE else use[c]) for c in members)
                for j, s in enumerate(self.starts):
                    ups = [self.started(v, j) for v in data.dependents[u]]
                    if s >= horizon or not any(e.terms for e in ups):
                        continue
                    col = self.pulled[u, a, j] = m.var(f"pulled[{u},{_NAMES[a]},{j}]", 0.0, 1.0)
                    for v, e in zip(data.dependents[u], ups, strict=True):
                        lb = Lin({col: 1.0, x[u, a]: -1.0}).add_lin(e, -1.0)
                        m.row(f"pull_lb[{u},{_NAMES[a]},{v},{j}]", lb, lo=-1.0)
                    m.row(f"pull_ub_action[{u},{_NAMES[a]},{j}]", Lin({col: 1.0, x[u, a]: -1.0}), hi=0.0)
                    any_dependent = Lin({col: 1.0})
                    for e in ups:
                        any_dependent.add_lin(e, -1.0)
                    m.row(f"pull_ub_dependent[{u},{_NAMES[a]},{j}]", any_dependent, hi=0.0)

    # -- stall[i], the compute-stream clock, the objective -----------------------------------------------------
    def inserted(self, key: Key, with_stall: bool) -> Lin:
        """Milliseconds the compute stream spent before ``key`` beyond the traced ops: every pack kernel (they
        run in forward), the recomputes and unpacks materialized earlier (at their own moment or pulled),
        and, optionally, the stalls so far (Rules 6-9)."""
        data, x, acts = self.data, self.x, self.acts
        use, regen = self.sim.first_use, data.regen_op
        e, j = Lin(), self.before(key)
        if self.fwd_wait:  # every forward wait comes before any backward moment
            e.add(self.fwd_wait[-1], 1.0)
        for c in self.decided:
            u = self.uo[c]
            if COMPRESS in acts:
                e.add(x[u, COMPRESS], self.pack_ms[c])
                if use[c] < self.n and (int(use[c]), c) < key:
                    e.add(x[u, COMPRESS], self.pack_ms[c])
                elif c in data.boundary[u]:
                    e.add_lin(self.pulled_by(u, COMPRESS, j), self.pack_ms[c])
            if RECOMPUTE in acts:
                if regen[c] < self.n and (int(regen[c]), c) < key:
                    e.add(x[u, RECOMPUTE], self.recompute_ms[c])
                elif c in data.closure[u]:
                    e.add_lin(self.pulled_by(u, RECOMPUTE, j), self.recompute_ms[c])
        i = bisect.bisect_left(self.need_key, key) - 1
        if with_stall and i >= 0:
            e.add(self.stall[i], 1.0)
        return e

    def clock(self, o: int) -> Lin:
        """Start of op o after every insertion before it, stalls included: what Rule 4's release compares
        with (stall is only bounded below, so this is the relaxed side: see the NOTE)."""
        e = Lin(const=float(self.start_ms[o]))
        if o <= self.last_fwd:  # forward: the pack kernels after each save_op (Rule 8) and the waits (Rule 4)
            for c in self.decided if COMPRESS in self.acts else ():
                if self.sim.save_op[c] + 1 <= o:
                    e.add(self.x[self.uo[c], COMPRESS], self.pack_ms[c])
            r = bisect.bisect_right(self.release_at, o) - 1
            if r >= 0 and self.fwd_wait:
                e.add(self.fwd_wait[r], 1.0)
            return e
        return e.add_lin(self.inserted((o, self.k), with_stall=True))

    def add_stalls_and_objective(self) -> None:
        m, x, data = self.m, self.x, self.data
        self.stall = [m.var(f"stall[{i}]") for i in range(len(self.need))]
        for i in range(1, len(self.need)):
            m.row(f"stall_monotone[{i}]", Lin({self.stall[i]: 1.0, self.stall[i - 1]: -1.0}), lo=0.0)
        if SWAP in self.acts:
            self.fwd_wait = [m.var(f"fwd_wait[{r}]") for r in range(len(self.release_at))]
            for r in range(1, len(self.fwd_wait)):
                row = Lin({self.fwd_wait[r]: 1.0, self.fwd_wait[r - 1]: -1.0})
                m.row(f"fwd_wait_monotone[{r}]", row, lo=0.0)
            if self.fwd_wait:
                m.cost[self.fwd_wait[-1]] += 1.0

        def charge(e: Lin, cost_ms: float) -> None:
            for col, coef in e.terms.items():
                m.cost[col] += coef * cost_ms

        # Rule 9: compute (the offset) + recompute of every candidate materialized + kernels + stall.
        use = self.sim.first_use
        for c in self.decided:
            u = self.uo[c]
            if RECOMPUTE in self.acts:
                own = data.regen_op[c] < self.n
                charge(Lin({x[u, RECOMPUTE]: 1.0}) if own else self.ever_pulled(u, RECOMPUTE), self.recompute_ms[c])
            if COMPRESS in self.acts:
                charge(Lin({x[u, COMPRESS]: 1.0}), self.pack_ms[c])
                unpacked = Lin({x[u, COMPRESS]: 1.0}) if use[c] < self.n else self.ever_pulled(u, COMPRESS)
                charge(unpacked, self.pack_ms[c])
        if self.stall:
            m.cost[self.stall[-1]] += 1.0

    # -- d2h_end, h2d_end and the rows of Rules 4-6 -----------------------------------------------------------
    def add_copies(self) -> None:
        m, x, big_m = self.m, self.x, self.big_m
        sim = self.sim
        sv, use = sim.save_op, sim.first_use
        swappable = [c for c in self.decided if SWAP in self.acts]
        prev = -1
        for c in sorted(swappable, key=lambda c: (int(sv[c]), c)):
            col = self.d2h_end[c] = m.var(f"d2h_end[{c}]")
            xs = x[self.uo[c], SWAP]
            if prev >= 0:
                m.row(f"d2h_fifo[{c}]", Lin({col: 1.0, prev: -1.0, xs: -self.d2h_ms[c]}), lo=0.0)
            issue = self.clock(int(sv[c])).add_lin(Lin(const=float(self.op_ms[sv[c]])))
            m.row(f"d2h_issue[{c}]", Lin({col: 1.0, xs: -self.d2h_ms[c]}).add_lin(issue, -1.0), lo=0.0)
            prev = col
        for c, col in self.d2h_end.items():  # Rule 4: the wait at the release point
            xs = x[self.uo[c], SWAP]
            if self.release_op[c] >= 0:
                o = self.release_op[c] + 1
                m.row(f"release[{c}]", self.clock(o).add(col, -1.0).add(xs, -big_m), lo=-big_m)
                continue
            for i, d in enumerate(self.need):  # the first non-kept use; the clock only moves on
                at = self.inserted(self.need_key[i], with_stall=False).add(self.stall[i], 1.0).add(col, -1.0)
                at.add(xs, -big_m).add(x[self.uo[d], KEEP], big_m).const += float(self.start_ms[use[d]])
                m.row(f"late_release[{c},{i}]", at, lo=-big_m)
        prev = -1
        for i, c in enumerate(self.need):
            if c not in self.d2h_end:
                continue
            u, xs, h2d = int(self.uo[c]), x[self.uo[c], SWAP], self.h2d_ms[c]
            col = m.var(f"h2d_end[{c}]")
            if prev >= 0:
                m.row(f"h2d_fifo[{c}]", Lin({col: 1.0, prev: -1.0, xs: -h2d}), lo=0.0)
            m.row(f"h2d_after_d2h[{c}]", Lin({col: 1.0, self.d2h_end[c]: -1.0, xs: -h2d}), lo=0.0)
            # Issued at the trigger op, unless a recomputed dependent pulled it earlier (then at that moment).
            t = int(self.trigger_op[c])
            issue = self.inserted((t, -1), with_stall=True).add_lin(Lin(const=float(self.start_ms[t])))
            relax = self.pulled_by(u, SWAP, self.before((t, -1)))
            m.row(f"h2d_issue[{c}]", Lin({col: 1.0, xs: -h2d}).add_lin(issue, -1.0).add_lin(relax, big_m), lo=0.0)
            arrive = self.inserted(self.need_key[i], with_stall=False).add(self.stall[i], 1.0).add(col, -1.0)
            arrive.add(xs, -big_m).const += float(self.start_ms[use[c]])
            m.row(f"stall[{c}]", arrive, lo=-big_m)
            for j, key in enumerate(self.start_key):
                if (u, SWAP, j) not in self.pulled or key >= self.need_key[i]:
                    continue
                exactly_j = self.first_pull(u, SWAP, j)
                at = self.inserted(key, with_stall=True).add_lin(Lin(const=float(self.start_ms[key[0]])))
                if key < (t, -1):
                    row = Lin({col: 1.0, xs: -h2d}).add_lin(at, -1.0).add_lin(exactly_j, -big_m)
                    m.row(f"h2d_issue_pulled[{c},{j}]", row, lo=-big_m)
                w = bisect.bisect_left(self.need_key, key)
                wait = self.inserted(key, with_stall=False).add(self.stall[w], 1.0).add(col, -1.0)
                wait.add_lin(exactly_j, -big_m).const += float(self.start_ms[key[0]])
                m.row(f"stall_pulled[{c},{j}]", wait, lo=-big_m)
            prev = col

    # -- the bytes a swapped candidate holds after the program dropped it (Rule 4's release) ---------------
    def add_hold(self) -> dict[int, Lin]:
        """The hold bytes to add to each memory row: to the release point in forward; without one, until a
        candidate that is not kept is first used in backward (handled_by, late_hold)."""
        m, x, sim, mu = self.m, self.x, self.sim, self.data.mem_unit
        last_row, use = self.last_row, sim.first_use
        terms: dict[int, Lin] = {o: Lin() for o in range(last_row + 1)}
        handled_by: dict[int, int] = {}
        for c in self.d2h_end:
            xs, size = x[self.uo[c], SWAP], self.size_bytes[c] / mu
            drop = int(sim.drop[c])
            if self.release_op[c] >= 0:
                for o in range(drop + 1, min(self.release_op[c], last_row) + 1):
                    terms[o].add(xs, size)
                continue
            for o in range(drop + 1, min(int(use[c]) - 1, last_row) + 1):
                if o not in handled_by:
                    col = handled_by[o] = m.var(f"handled_by[{o}]", 0.0, 1.0)
                    count = Lin({col: 1.0})
                    for d in self.decided:
                        if use[d] <= o:
                            count.add(x[self.uo[d], KEEP], 1.0).const -= 1.0
                    m.row(f"handled_by_ub[{o}]", count, hi=0.0)
                hold = m.var(f"late_hold[{c},{o}]", 0.0, 1.0)
                m.row(f"late_hold[{c},{o}]", Lin({hold: 1.0, xs: -1.0, handled_by[o]: 1.0}), lo=0.0)
                terms[o].add(hold, size)
        return terms

    # -- memory[o] (Rule 2) --------------------------------------------------------------------------------------
    @property
    def last_row(self) -> int:
        """The last op at which a decided candidate can be live."""
        return int(self.sim.free_keep[self.decided].max()) if self.decided else -1

    def live_bytes(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Bytes live at each op per (unit, action), from the actions' intervals (Rules 3-8): on their own,
        from a pull on (before their own materialization), and packed bytes an early unpack frees."""
        sim, data, last_row = self.sim, self.data, self.last_row
        n, use, regen = self.n, sim.first_use, data.regen_op
        shape = (self.n_units, 4, last_row + 2)
        own, early, unpacked = np.zeros(shape), np.zeros(shape), np.zeros(shape)  # difference arrays first

        def live(into: np.ndarray, u: int, a: int, lo: int, hi: int, nbytes: float) -> None:
            lo, hi = max(int(lo), 0), min(int(hi), last_row)
            if lo <= hi:
                into[u, a, lo] += nbytes
                into[u, a, hi + 1] -= nbytes

        for c in self.decided:
            u, z = int(self.uo[c]), self.size_bytes[c]
            p, drop, free = int(sim.producer[c]), int(sim.drop[c]), int(sim.free_keep[c])
            last_use = int(use[c]) if use[c] < n else n - 1  # a packed copy nobody unpacks lives to the end
            for a in self.acts:
                if a == KEEP:
                    live(own, u, a, p, free, z)  # Rule 3
                    continue
                live(own, u, a, p, drop, z)  # until the program drops it (Rules 4, 7, 8)
                # Back on the device from: the H2D issue (Rule 5), the regeneration (7), the unpack (8).
                back = {SWAP: int(self.trigger_op[c]) if use[c] < n else n, RECOMPUTE: int(regen[c])}.get(a, last_use)
                back = back if use[c] < n or a == RECOMPUTE else n
                if back < n:
                    live(own, u, a, back, free, z)  # the H2D buffer (Rule 5), the regenerated or unpacked copy
                if a == RECOMPUTE and back < n:
                    live(own, u, a, back, back, self.transient_bytes[c])  # the closure's other intermediates
                if a == COMPRESS:
                    live(own, u, a, sim.save_op[c], last_use, self.packed_bytes[c])
                if c in data.pulled_set(u, a):
                    live(early, u, a, 0, min(back - 1, free), z)
                    if a == COMPRESS:
                        live(unpacked, u, a, 0, last_use, self.packed_bytes[c])
        mu = data.mem_unit
        own, early, unpacked = (np.cumsum(arr, axis=2)[:, :, : last_row + 1] / mu for arr in (own, early, unpacked))
        return own, early, unpacked

    def add_memory(self, hold_terms: dict[int, Lin]) -> list[int]:
        m, x, sim, mu = self.m, self.x, self.sim, self.data.mem_unit
        last_row = self.last_row
        own, early, unpacked = self.live_bytes()
        const = sim.base_live[: last_row + 1].astype(np.float64)  # tensors that are not candidates (Rule 2)
        for c in sorted(set(range(self.k)) - set(self.decided)):  # candidates kept without a decision
            if sim.producer[c] <= last_row:
                const[sim.producer[c] : min(sim.free_keep[c], last_row) + 1] += self.size_bytes[c]
        const /= mu
        after = float(sim.base_live[last_row + 1 :].max(initial=0)) / mu  # once every decided one died
        peak = -1
        if self.budget_bytes is None:  # minimise the peak alone
            peak = m.var("peak", lb=after)
            m.cost, m.offset = [0.0] * len(m.cost), 0.0
            m.cost[peak] = 1.0
        budget = math.inf if self.budget_bytes is None else self.budget_bytes / mu
        rows = []
        for o in range(last_row + 1):
            e = Lin(const=float(const[o]))
            j_at, j_before = self.before((o, self.k)), self.before((o, -1))  # pulls at or before o; before o
            for u in range(self.n_units):
                for a in self.acts:
                    e.add(x[u, a], float(own[u, a, o]))
                    if early[u, a, o]:
                        e.add_lin(self.pulled_by(u, a, j_at), float(early[u, a, o]))
                    if unpacked[u, a, o]:
                        e.add_lin(self.pulled_by(u, a, j_before), -float(unpacked[u, a, o]))
            e.add_lin(hold_terms[o])
            if not e.terms and e.const <= budget:
                continue  # nothing decided lives here, and it fits
            if peak >= 0:
                rows.append(m.row(f"memory[{o}]", e.add(peak, -1.0), hi=0.0))
            else:
                rows.append(m.row(f"memory[{o}]", e, hi=budget))
        if after > budget:
            m.row("memory[after]", Lin(const=after), hi=budget)  # infeasible, and the row says where
        return rows
