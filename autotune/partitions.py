"""Which submodule to partition, and into how many slices, when a budget lies below what no policy of the
unpartitioned model can reach (runtime/partition.py, NOTE [ Partition ]; shared/seeds/002, MegTaiChi).

NOTE [ Choosing a partition ]
    C1. When. Only with the user's consent (``--allow-partition``), and only where the budget is below 1.1x
        the unpartitioned floor (``envs.simulator.peak_floor``): above it a policy of keep, swap, recompute
        and compress has room, and slices cost time (smaller kernels, the concatenation). Where the budget is
        at or above that floor, the unpartitioned model is searched too, beside the partitions (C4), and
        the fastest answer is taken (autotune search): on VGG-16 b64 (a100-40gb) at
        72% and 69% of its peak the unpartitioned answer was 0.2-0.5% faster than 2 slices', 1.4-2.5% than
        4 slices'.
    C2. Where. The floor is set at one op; the submodule calls that run it (its frame and the frames
        enclosing it, from the outermost) are the candidates, if partitionable by the workload's own record:
        a submodule (not the model, not the loss) called once per forward, with no BatchNorm inside (Q3 of
        NOTE [ Partition ]; frames record it), whose first tensor argument carries the batch (first
        dimension = batch size).
    C3. How many. For each candidate, outermost first, 2, 4 and 8 slices (at most the batch size): the
        model is traced with that partition, and the first one where a frugal uniform policy (recompute
        everything, every block's inside, swap everything: ``envs.simulator.frugal_starts``) fits the budget
        is that candidate's: the fewest slices that a policy certainly fits in (more slices run smaller
        kernels and more concatenations: VGG-16 b64 at 45%, features/4 answered 887.9 samples/s and
        features/8 854.1). The floor is no guide (admissible, not reachable: a residual CNN's two slices
        lowered it 30% while no policy came within 10% of the budget). The outermost candidate's that has one
        is the rule's choice (``Choice.partitions``): what maxbatch (a short search per size) and baselines (the
        methods compared on one model) plan on, without tracing the other candidates. No candidate has
        one: among those whose floor is within the budget (a search may still find a policy there), the one
        whose frugal policy holds least is the choice, alone; with none within it, the lowest floor, so that
        the budget check names the least budget a partition reaches.
    C4. Which: the search chooses. Every candidate's partition of C3 is searched, the rule's first, each for
        its share of the time left (one that converges early leaves the rest to the next), and the fastest
        answer is taken (with the unpartitioned model's where C1 says): which call to slice is not the rule's
        to guess. On the GroupNorm CNN of experiments/user_models.py (b64, a100-40gb, 350 MiB), the rule's
        ``blocks/2`` answered 7,421.4 samples/s and ``blocks.0/4`` (the first block alone, on 4 slices)
        9,073.4, +22%. The portfolio (the default searcher) searches them so, in turn.
    C5. Which, among a searcher's own decisions. A searcher that can (``Searcher.chooses_partition``: Optuna's
        TPE and NSGA-II, refinement, the RL agent) gets C4's workloads at once, as one problem and its rivals
        (``agents.base.Problem.rivals``), the baselines of each as its seeds, and all the time: Optuna draws a
        ``partition`` parameter in each trial (one study, ``NAME.partitions``), the RL agent's first action
        takes a partition (``envs.memory_env.PartitionChoiceEnv``: its mask, those whose floor is within the
        budget), and refinement starts on the partition whose best heuristic is fastest and carries its policy
        to the others (same key, same action), keeping the fastest. Its answer says which
        (``Proposal.rival``). The exact solver (MILP) is exact per partition: C4's turns take the best of
        them. Where the answer is measured (``--measure``) or checked on the allocator's model (``--budget-kind
        reserved``, the default on a GPU profile) the finalists are one partition's, and the partitions are
        searched in turn. On the GroupNorm CNN above, together against in turn at equal time: optuna-tpe
        7,304.9 against 7,140.8 samples/s in 10 s and 7,379.7 against 7,508.4 in 20 s, ppo 8,435.9 against
        8,677.0 and 8,262.6 both, all on ``blocks.0/4``.
    Traces are fake (seconds each); at most 3 per candidate, 2 candidates.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from envs.simulator import Simulator, peak_floor
from runtime.hardware import HardwareProfile
from runtime.keys import OUTSIDE, ROOT, runs_in
from runtime.partition import Partition
from runtime.workload import Frame, Workload

if TYPE_CHECKING:
    from autotune.workloads import TraceRequest

WHEN_BELOW = 1.1  # C1: partitions are tried where the budget is below this times the floor
SLICES = (2, 4, 8)  # C3
CANDIDATES = 2  # C3: frames tried, outermost first


@dataclass
class Choice:
    """What :func:`choose` traced and took (``partitions`` empty: none was needed or none helped)."""

    workload: Workload
    partitions: tuple[Partition, ...]  # the rule's choice (C3; empty: none was needed or none helped)
    tried: list[tuple[Partition, int, int]]  # (partition, its floor, its frugal peak: bytes), in the order traced
    floor_bytes: int  # the unpartitioned floor
    frugal_bytes: int  # the unpartitioned frugal peak (C3)
    others: list[Workload] = dataclasses.field(default_factory=list)  # C4: the other candidates' C3 partitions

    def searched(self, unpartitioned: Workload, budget_bytes: int) -> list[Workload]:
        """C1, C4: the workloads to search, the fastest answer taken: the rule's choice, the other candidates'
        and the unpartitioned model where the budget is at or above its floor too (search, sweep)."""
        if self.partitions and budget_bytes >= self.floor_bytes:
            return [self.workload, *self.others, unpartitioned]
        return [self.workload, *self.others]


def candidate_frames(w: Workload, op: int) -> list[Frame]:
    """C2: the partitionable submodule calls that run op ``op`` (a backward op: its forward module's call),
    outermost first."""
    frames = w.frames
    calls: dict[str, int] = {}
    for f in frames:
        calls[f.path] = calls.get(f.path, 0) + 1
    o = w.ops[op]
    inner = o.frame
    if inner < 0:  # a backward or optimizer op: the call of its forward module, where that is one call
        owned = [f.index for f in frames if f.path == o.module]
        inner = owned[0] if len(owned) == 1 else -1
    chain: list[Frame] = []
    while inner >= 0:
        chain.append(frames[inner])
        inner = frames[inner].parent
    norm_paths = [f.path for f in frames if f.norm]
    out = []
    for f in reversed(chain):
        if f.path in (ROOT, OUTSIDE) or calls[f.path] != 1:
            continue
        if any(runs_in(p, f.path) for p in norm_paths):
            continue
        first = f.args[0] if f.args else -1
        if first < 0 or not w.tensors[first].shape or w.tensors[first].shape[0] != w.batch_size:
            continue
        out.append(f)
    return out


def choose(
    w: Workload,
    hw: HardwareProfile,
    budget_bytes: int,
    trace: Callable[[tuple[Partition, ...]], Workload],
    progress: Callable[[str], None] = lambda _msg: None,
    others: bool = True,
) -> Choice:
    """NOTE [ Choosing a partition ]: ``w`` unpartitioned, ``trace`` traces the same model with partitions.
    ``others``: trace the other candidates' partitions too, for a search to choose among (C4); without, the
    rule's choice alone (maxbatch and baselines plan on one model)."""
    floor = peak_floor(w, hw)
    choice = Choice(w, (), [], floor.bytes, frugal_bytes(w, hw))
    if budget_bytes >= WHEN_BELOW * floor.bytes:
        return choice
    traced: list[tuple[int, int, Workload, Partition]] = []  # (floor, frugal peak, workload, partition)
    certain: list[tuple[Workload, Partition]] = []  # C3: each candidate's fewest slices a frugal policy fits in
    for frame in candidate_frames(w, floor.op)[:CANDIDATES]:
        for k in SLICES:
            if k > w.batch_size:
                break
            p = Partition(frame.path, k)
            progress(f"tracing {w.model} with {frame.path} in {k} slices")
            pw = trace((p,))
            frugal, pfloor = frugal_bytes(pw, hw), peak_floor(pw, hw).bytes
            choice.tried.append((p, pfloor, frugal))
            traced.append((pfloor, frugal, pw, p))
            if frugal <= budget_bytes:
                certain.append((pw, p))
                break
        if certain and not others:
            break
    if certain:  # C4: the outermost candidate's first, the others searched beside it
        (choice.workload, first), choice.others = certain[0], [cw for cw, _ in certain[1:]]
        choice.partitions = (first,)
        return choice
    within = [t for t in traced if t[0] <= budget_bytes]
    pick = min(within, key=lambda t: t[1]) if within else min(traced, key=lambda t: t[0], default=None)
    if pick is not None and pick[0] < floor.bytes:
        choice.workload, choice.partitions = pick[2], (pick[3],)
    return choice


def retracer(req: TraceRequest) -> Callable[[tuple[Partition, ...]], Workload]:
    """``choose``'s ``trace`` for the commands: ``req``'s model traced again with the partitions asked for."""
    from autotune.workloads import trace_model

    return lambda parts: trace_model(dataclasses.replace(req, partitions=parts))[0]


def partition_tag(w: Workload) -> str:
    """The partitions a workload was traced with, for study names (``.featuresx4``; empty: none)."""
    return "".join(f".{p['module']}x{p['chunks']}" for p in w.meta.get("partitions", ()))


def frugal_bytes(w: Workload, hw: HardwareProfile) -> int:
    """C3: the least peak of the frugal uniform policies."""
    from autotune.search import FRUGAL_OPTIONS
    from envs.simulator import frugal_starts

    sim = Simulator(w, hw)
    return min(sim.run(a, options=FRUGAL_OPTIONS).peak_bytes for a in frugal_starts(w).values())
