"""The budget in the bytes that run out: what PyTorch's CUDA caching allocator reserves for a policy.

NOTE [ Reserved budget ]
A run fails when the caching allocator cannot reserve another segment, so on a GPU profile `autotune search`
(its default ``--budget-kind reserved``) answers with a policy whose *reserved* bytes fit the planned budget
(the budget less ``--reserve``), not only its allocated peak (the simulator's). The reserved peak comes from a
model of the allocator (NOTE [ CUDA caching allocator ] in envs/allocator.py) replaying the policy's
allocations (``envs.allocator.policy_stats``: the op-by-op simulator's accounting, three iterations): about
a quarter of a second a policy on ResNet-101 at batch 64, so it is computed for the answer and a few rivals,
not for every policy a search scores. In order:
  1. the search's answer, when three iterations of it run on the model with the device capped at the planned
     budget (``torch.cuda.set_per_process_memory_fraction``, as `autotune train` caps it: the allocator gives
     cached segments back before a request fails, A7); where keeping everything fits the tensors' budget and
     runs there, it is the answer at once, with no search (``run_search``'s ``keeping_runs``);
  2. else the fastest of its finalists (NOTE [ Finalists ]) that runs so, of at most ``CHECKS``: the fastest
     of each tier that keeps room free (1%, 3%, 10% of the budget), then the fastest of all, tried fastest
     first. The room matters: on ResNet-101 b64 within 6GB the 8 fastest (planned 0-1% under the budget)
     all ran out on the model, and a second search for 95% of the bytes answered 970.9 samples/s in 36.0 s
     wall; with the tiers' fastest among them, a 3%- or 10%-tier finalist runs there: 969.1 samples/s
     (-0.2%) in 21.2 s, no second search;
  3. else a new search, for the budget over the factor the last answer needs on the model (the least
     capacity it runs within, found to 1% of the budget by bisection, over its tensors' peak:
     ``next_planned``), at most ``SHRINK`` of the allocated bytes the last one planned for and not below the
     floor; again 1-2, at most ``ROUNDS`` searches in all, then step 5. A fixed ``SHRINK`` a search fell short
     where the allocator costs much: GPT-2 small b8 within 8GB (a100-40gb) needs about 1.2x its tensors (the
     logits' segments), its three searches (7.33, 6.96, 6.61 GiB of tensors) ran none, and the answer was
     swapping everything, 7.8 samples/s; with the factor (1.20, then 1.25) the third search, for 5.80 GiB,
     answers 17.5 (the answer planned for tensors alone, 18.1, runs out there).
  4. The baselines are held to the same kind (``autotune.search.reserved_baselines``): the table's best
     baseline is the fastest that runs on the model with the device so capped, each faster one that runs out
     there marked infeasible. Before, the answer (reserved bytes fit) stood beside a baseline judged by its
     tensors alone: on ResNet-101 b64 within 6GB, 970.0 samples/s against Capuchin's 975.2, whose policy runs
     out on the model. Where none runs, the heuristics are planned again for ``SHRINK`` of the tensor bytes, at
     most ``ROUNDS`` times, as the search is (step 3), and the fastest that runs then is the best baseline: in
     that case none of the nine runs, and Capuchin planned for 5.19 GiB of tensors does, 966.3 samples/s
     (before, the table said "none fits" beside the answer). Where the best baseline so held runs and is faster
     than the answer (a roomy finalist, a frugal policy, or none at all), it is the answer
     (``autotune.search.adopt_baseline``): on ViT-B/16 b64 within 6GB (a100-40gb) the fastest finalist that
     runs was at 153.9 samples/s and Capuchin planned for 5.19 GiB of tensors at 162.4 beside it, now the
     answer. `autotune baselines` holds its table the same way
     by default (``autotune.baselines.held_to_reserved``): every policy that fits in tensors is checked, each that
     runs out is infeasible, and none is planned again.
  5. Where no search's policy runs: the fastest of the most frugal uniform policies
     (``envs.simulator.frugal_starts``: recompute everything, every block's inside, swap everything) that
     runs there, slow as it is; no answer when none does. The error then names a budget: the least one of
     them reserves on the model with nothing capping the device (which never gives a segment back, so capped
     there it runs, and this step answers), plus the reserve. The impossible-budget check
     (``autotune.search.check_budget``) names the same budget: the first error's budget is accepted, not
     followed by a second error.
``--budget-kind allocated`` (the opt-out; the default before) plans for the simulator's peak alone, and step 1
only reports whether the answer runs within the budget on the model (a warning when it does not, which says whether
``expandable_segments:True`` alone would make it run: the cheaper lever, no search). On the CPU there is no
caching allocator and none of this is done; with ``--measure`` the finalists are trained capped at the budget,
the allocator's own verdict, and none of it is done either; `sweep` and `maxbatch` plan allocated bytes
(maxbatch checks its answer as step 1 does and warns; sweep checks each cell's chosen policy and says which
run out, NOTE [ Sweep storage ]). `autotune simulate` reports the model's peaks for any
policy, and `autotune train --device cuda` the measured ``max_memory_reserved`` beside the model's prediction.
``autotune search --expandable-segments`` plans all of this for PyTorch's ``expandable_segments:True`` (the
model's A8-A11), the setting ``autotune train --expandable-segments`` trains the answer with.
The default, and what it rests on. Counted in tensors alone, the main job's answer (`autotune search --model
resnet101 --budget 6GB`) and the best baseline's policy both run out on the model: a default that hands users
a policy its own model says fails is the wrong way round. The model's rules are PyTorch's code, and replaying
the requests an H200's allocator got reproduces ``max_memory_reserved`` to the byte (README "Results"); what
a fake trace asks for is within 0.72% of that with no policy, and under policies within 0.11% on GPT-2, within
3% for keep and swap on ResNet-50, but 10-12% under for recompute and a mix there. That gap is cuDNN's
convolution workspaces, which fake traces lack; with the device capped a workspace is not a request that
fails: PyTorch's cuDNN convolutions (aten/src/ATen/native/cudnn/Conv_v8.cpp, ``generate_and_filter_plans``;
Conv_v7.cpp, ``try_all``) catch the allocator's out-of-memory error and take a plan with a smaller workspace.
What is not checked on a GPU: sizes below ResNet-50 b64, where the segments of A4 weigh most. There the
default turns some budgets into errors: resnet18 b64 for a100-40gb within 1GB (825.67 MiB planned) runs no
searched policy on the model (two searches; the lowest tensor peak 776.49 MiB), and the error names 1.26 GiB,
what swapping everything reserves (1,160 MiB, the least it runs within capped too), where no policy needs
1.44 GiB: a budget that works, not the least that does. ``--budget-kind allocated`` plans as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from agents.base import Problem, SearchResult
from agents.finalists import MARGINS, Finalist, Finalists
from autotune.measured import finalist_policy
from envs.allocator import AllocatorStats, OutOfMemory, policy_stats
from runtime.errors import AutotuneError
from runtime.policy import PolicyOptions

BUDGET_KINDS = ("reserved", "allocated")
CHECKS = 8  # finalists whose reserved peak is computed per search (NOTE [ Reserved budget ], step 2)
ROUNDS = 3  # searches at most (step 3)
POOL = 8  # finalists kept per tier for step 2
SHRINK = 0.95  # step 3: the next search plans for this share of the allocated bytes of the last
OVER = "reserved bytes over budget"  # the note of a policy that runs out on the allocator's model


def check_kind(kind: str) -> str:
    if kind not in BUDGET_KINDS:
        raise AutotuneError(
            f"invalid --budget-kind {kind!r}: expected one of {', '.join(BUDGET_KINDS)} (reserved: what PyTorch's "
            "caching allocator holds, which is what runs out; allocated: the tensors alone)"
        )
    return kind


def reserved_stats(
    problem: Problem,
    actions: np.ndarray,
    options: PolicyOptions,
    capacity_bytes: int | None = None,
    expandable_segments: bool = False,
) -> AllocatorStats | None:
    """The allocator's stats over three iterations under the policy, with the device capped at
    ``capacity_bytes`` (A7: cached segments given back before a request fails) and ``expandable_segments`` or
    not (A8-A11); None when a request fails."""
    w, hw = problem.workload, problem.hardware
    try:
        return policy_stats(w, hw, actions, options, capacity_bytes=capacity_bytes,
                            expandable_segments=expandable_segments)  # fmt: skip
    except OutOfMemory:
        return None


def result_stats(
    problem: Problem, r: SearchResult, capacity_bytes: int | None, expandable_segments: bool = False
) -> AllocatorStats | None:
    """:func:`reserved_stats` of a searcher's policy, on the workload it is for (``r.rival``)."""
    member = problem.member(r.rival)
    return reserved_stats(member, r.policy.to_vector(member.workload), r.policy.options, capacity_bytes,
                          expandable_segments)  # fmt: skip


@dataclass
class ReservedFit:
    """What step 1-3 of NOTE [ Reserved budget ] did."""

    reserved_peak_bytes: int | None  # the answer's, the device capped at the budget (None: none fits)
    allocated_peak_bytes: int | None  # the allocator's allocated peak for it (blocks, rounded)
    fits: bool
    retries: int = 0  # A7: times the capped allocator gave cached segments back
    lowest_peak_bytes: int = 0  # when none fits: the lowest simulated peak among the policies checked
    # when none fits (step 5): what the most frugal uniform policy reserves on the model with nothing capping
    # the device (it never gives a segment back: a budget it runs within, where step 5 then answers), and which
    frugal_reserved_bytes: int | None = None
    frugal_policy: str = ""
    enforced: bool = True  # --budget-kind reserved: the answer had to fit; else only checked and reported
    checked: int = 0  # policies whose reserved peak was computed
    planned: list[int] = field(default_factory=list)  # the allocated budget of each search
    factors: list[float] = field(default_factory=list)  # step 3: the answer's reserve factor behind each later one
    source: str = "answer"  # "answer", "finalist", or "search N"
    expandable_segments: bool = False  # the model of expandable_segments:True (A8-A11), not the default's
    # only checked, not enforced, and over on the default's model: the answer's reserved peak on the model of
    # expandable_segments:True when it runs there (the cheaper lever), 0 when it runs out there too
    expandable_peak_bytes: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "reserved_peak_bytes": self.reserved_peak_bytes,
            "allocated_peak_bytes": self.allocated_peak_bytes,
            "fits": self.fits,
            "retries": self.retries,
            "checked": self.checked,
            "planned_bytes": self.planned,
            "reserve_factors": self.factors,
            "source": self.source,
            "enforced": self.enforced,
            "expandable_segments": self.expandable_segments,
            "expandable_peak_bytes": self.expandable_peak_bytes,
            "lowest_peak_bytes": self.lowest_peak_bytes if not self.fits else None,
            "frugal_reserved_bytes": self.frugal_reserved_bytes,
            "frugal_policy": self.frugal_policy or None,
        }


def _distinct_finalists(pool: Finalists | None) -> list[Finalist]:
    if pool is None:
        return []
    seen: set[bytes] = set()
    out: list[Finalist] = []
    for m in MARGINS:
        for f in pool.ranked(m):
            if f.key not in seen:
                seen.add(f.key)
                out.append(f)
    out.sort(key=lambda f: -f.result.samples_per_s)
    return out


def fit_one(
    problem: Problem, found: SearchResult, budget_bytes: int, rivals: int = CHECKS, expandable_segments: bool = False
) -> tuple[Finalist | None, ReservedFit]:
    """Steps 1-2 for one search: the answer or the fastest of up to ``rivals`` finalists that runs three
    iterations on the allocator's model (``expandable_segments`` or not) with the device capped at
    ``budget_bytes`` (None when none does)."""
    w = problem.workload
    first = Finalist(found.policy.to_vector(w), found.policy.options, found.result)
    picked: dict[bytes, Finalist] = {first.key: first}
    if rivals and problem.finalists is not None:
        pool = problem.finalists
        roomy = [tier[0] for m in MARGINS[1:] if (tier := pool.ranked(m))]  # step 2: room, which fragments want
        for f in [*roomy, *_distinct_finalists(pool)]:
            if len(picked) > rivals:
                break
            picked.setdefault(f.key, f)
    rest = sorted((f for k, f in picked.items() if k != first.key), key=lambda f: -f.result.samples_per_s)
    candidates = [first, *rest]
    for i, f in enumerate(candidates):
        st = reserved_stats(problem, f.actions, f.options, budget_bytes, expandable_segments)
        if st is not None:
            fit = ReservedFit(st.peak_reserved, st.peak_allocated, True, retries=st.retries, checked=i + 1)
            fit.source = "answer" if i == 0 else "finalist"
            fit.expandable_segments = expandable_segments
            return f, fit
    low = min(f.result.peak_bytes for f in candidates)
    return None, ReservedFit(None, None, False, checked=len(candidates), lowest_peak_bytes=low,
                             expandable_segments=expandable_segments)  # fmt: skip


def as_result(problem: Problem, found: SearchResult, f: Finalist) -> SearchResult:
    """A finalist as the search's answer (its policy recorded like the answer's)."""
    policy = finalist_policy(problem, f, found, found.policy.budget_bytes, found.searcher)
    return SearchResult(found.searcher, policy, f.result, found.status, found.wall_s, found.evaluations,
                        note=(found.note + "; " if found.note else "") + "reserved bytes fit")  # fmt: skip


def scaled_budget(planned_bytes: int) -> int:
    """Step 3 (the baselines' step 4): the allocated budget of the next search at most."""
    return int(planned_bytes * SHRINK)


def least_capacity(
    problem: Problem,
    actions: np.ndarray,
    options: PolicyOptions,
    tolerance_bytes: int,
    expandable_segments: bool = False,
) -> int:
    """The least device capacity (within ``tolerance_bytes``) at which a policy runs on the allocator's model: by
    bisection between its allocated peak (below which nothing runs) and what it reserves with nothing capping
    the device (within which it runs: a capped allocator that never reaches its cap acts as an uncapped one)."""
    st = reserved_stats(problem, actions, options, None, expandable_segments)
    assert st is not None  # nothing caps the device
    lo, hi = st.peak_allocated - 1, st.peak_reserved
    while hi - lo > tolerance_bytes:
        mid = (lo + hi) // 2
        if reserved_stats(problem, actions, options, mid, expandable_segments) is None:
            lo = mid
        else:
            hi = mid
    return hi


def next_planned(
    problem: Problem, found: SearchResult, budget_bytes: int, expandable_segments: bool = False
) -> tuple[int, float]:
    """Step 3: the tensor bytes the next search plans for, and the answer's reserve factor that set them. The
    answer needs ``factor`` times its tensors' peak on the model (:func:`least_capacity`, to 1% of the budget);
    the next search plans for the budget over that factor (on GPT-2 small b8 within 8GB about 1.21-1.28: the
    logits' segments), and at most ``SHRINK`` of what this one planned for (the factor grows as tensors shrink)."""
    w = problem.workload
    need = least_capacity(problem, found.policy.to_vector(w), found.policy.options, max(budget_bytes // 100, 1),
                          expandable_segments)  # fmt: skip
    factor = need / max(found.result.peak_bytes, 1)
    return min(scaled_budget(problem.budget_bytes), int(budget_bytes / factor)), factor


def new_pool(budget_bytes: int) -> Finalists:
    return Finalists(budget_bytes, capacity=POOL)


__all__ = [
    "BUDGET_KINDS",
    "CHECKS",
    "POOL",
    "ROUNDS",
    "ReservedFit",
    "as_result",
    "check_kind",
    "fit_one",
    "least_capacity",
    "new_pool",
    "next_planned",
    "reserved_stats",
    "scaled_budget",
]
