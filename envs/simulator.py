"""Simulate one training iteration under a keep / swap / recompute / compress policy, in about a millisecond.

NOTE [ Simulator semantics ] -- the runtime (runtime/apply.py) implements the same rules; cite them by number.

Rule 1 (streams and clocks). The host issues the workload's ops in traced order, op i costing it h_i
    (Rule 12), and the compute stream runs op i for d_i = ``runtime.hardware.op_times_s`` from when both it
    is free and the host has issued op i. A device-to-host (D2H) and a host-to-device (H2D) copy stream each
    run their copies one at a time in the order issued, concurrently with compute and with each other (PCIe
    is full duplex, GPUs have a copy engine per direction); a copy of n bytes takes n / ``d2h_bytes_per_s``
    (or ``h2d_bytes_per_s``). On a profile without copy engines (``is_gpu`` false: the CPU) host and device
    are one clock: every cost adds, and copies run on it, complete when it resumes.
Rule 2 (memory). Memory is counted per op: the live bytes *during* op i are all allocations whose op
    interval [first, last] contains i; every allocation is rounded up to ``alloc_granularity_bytes``. Tensors
    that are not candidates keep their traced intervals [alloc_op, free_op]. An op's workspace (cuDNN,
    cuBLAS; measured by real CUDA traces) is live during that op alone. The peak is the maximum over ops;
    the policy is feasible when the peak is within the budget and, on a profile that bounds its host's
    memory (``host_memory_bytes``), the swapped bytes are within that: the runtime keeps one pinned host
    buffer per swapped tensor across iterations (runtime R3).
Rule 3 (keep). A kept candidate lives [producer, free_op], as traced.
Rule 4 (swap out). A swapped candidate's D2H copy is issued when op ``save_op`` ends (the pack hook: its value is
    final) and starts when the compute stream has finished that op and the D2H stream is free. Its device storage is
    let go at its *release point*: the pack point ``release_after`` places after its own (pack points: the first
    packs of the observed candidates, Rule 13, in candidate order), or, if there are not that many, just before the
    first backward use of any handled candidate (swapped, compressed or replayed); there the compute stream waits
    until the copy has ended (``stall_s``). It lives [producer, max(free_if_dropped_op, r)], r the op of the release
    point's pack (or that first use - 1). On a profile without copy engines host memory is the device's: the copy
    (on the one clock) lives [save_op + 1, free_op], and during op save_op too where that op packs its own output
    (``Candidate.packed_in_op``: the pack hook runs after its kernel, when its inputs are still alive and its
    workspace is gone; an input is packed before its reader's kernel, once the op before has ended), the original
    [producer, free_if_dropped_op], and nothing is copied back (Rules 5, 6 do not apply).
Rule 5 (prefetch). The unpack points U are the distinct first-backward-use ops of the candidates that no region
    serves (Rule 11), sorted (the runtime's unpack hook fires there: a first use is the first op of the backward
    node that first unpacks it, ``Candidate.first_use``, which may run before the op that reads it). The H2D copy of
    a swapped candidate whose first backward use is U[p] is issued just before op U[max(0, p - L)] runs, L =
    ``prefetch_lookahead`` (L = 0: on demand); copies due at the same op are issued in order of need (first backward
    use, then candidate index). A copy starts once the H2D stream is free, its own D2H copy has completed and the
    compute stream has reached the op where it is issued. Its device buffer is allocated at issue: it lives [issue
    op, free_op].
Rule 6 (stall). Before its first backward use u, the compute stream waits until a swapped tensor has
    arrived; the waiting is ``stall_s``.
Rule 7 (replay). A recomputed candidate that no region serves lives [producer, free_if_dropped_op]. Just before its
    first backward use u, the compute stream re-runs its closure (runtime.plan.closures_of): its producer chain
    (producer and in-place writers) and, recursively, the chains of its inputs that are not resident at u, where
    resident means persistent, live at u as traced (a candidate whose last backward use is before u is gone,
    whatever its action: the runtime re-makes it as a temporary, R6, R9), or held there by a region past its
    traced end (Rule 11: a call's arguments, to its backward; the runtime's replay reads what is live, R6); an
    input that a forward op writes in place after the closure's op that reads it is not resident there (its value
    has changed): its producer and the writers before that read are re-run too. Candidate inputs that are
    swapped, recomputed or compressed are materialized first (Rules 6-8, in candidate order), at u, so their
    memory starts at u and lasts to their own free_op (they are not recomputed twice); a recomputed one re-runs
    its closure as of u, not as of its own first use (runtime.plan.nested_closures: what is live at u is read as
    it is, R6). The regenerated tensor lives [u, free_op]. Every other storage the closure's ops write
    (regenerated temporaries, other outputs of multi-output ops, copies of arguments an op would mutate) is held
    during the recompute only: nested recomputations hold theirs until the outermost one is done, a storage that
    two of them write once (the runtime's replay makes it once and reads it again: R6), and an op that two of them
    run runs once; separate ones at the same op run one after another, in the order backward first unpacks them
    (``Candidate.unpack_seq``: a multiplication's gradient unpacks its second factor first; where that one's
    closure reads the first factor, the first's replay runs nested in it), each dropping what it holds before the
    next starts. The recomputes run before op u allocates its own outputs, so the live bytes of op u are the larger
    of (live during u) and, for each recompute there, (live during u, less u's own allocations and the candidates
    that the recomputes after it make, plus its held bytes). Its time is the sum of the closure's op times
    (``recompute_s``), issued by the host as one block (Rule 12) after which the device runs it. A recomputed
    candidate whose storage something other than autograd holds until u (a custom Function's ``ctx`` attribute:
    runtime/plan.py P11) is planned as kept, everywhere (regions included).
Rule 8 (compress). A compressed candidate is cast to ``compress_dtype`` when ``save_op`` ends, by a kernel on the
    compute stream that reads n bytes and writes n / r (r = element size ratio, at least 1). The full storage lives
    [producer, free_if_dropped_op], the packed one [save_op + 1, u - 1] (and during op save_op where it packs its
    own output, as in Rule 4); just before u an unpack kernel (reads n / r, writes n) re-creates it, living [u,
    free_op], and the packed one goes once that kernel is done: it is held at u, with what the materializations
    before it there made, before op u allocates its outputs (as a replay's temporaries, Rule 7). Both kernels are
    ``compress_s``. A candidate that is not a floating-point tensor wider than ``compress_dtype`` (an int64 index)
    is kept (R8), and so is one that the replay of a recomputed candidate reads (runtime/plan.py P12).
Rule 9 (time). ``iter_s`` is when both the compute stream and the host are done (the step ends with a
    synchronisation): compute + recompute + compress + stall and whatever the host adds where it is behind.
    ``samples_per_s`` = batch size / ``iter_s``.
Rule 10 (gradient accumulation). With ``grad_accum`` k > 1 the workload is one micro-batch that adds to
    existing gradients, then the optimizer step (NOTE [ Gradient accumulation ] in runtime.trace). The peak
    is the traced one; the iteration runs everything before the optimizer phase k times and the step once:
    ``iter_s`` = k (t - t_opt) + t_opt, with t Rule 9's time and t_opt the optimizer ops' time run alone
    (Rule 1's clocks from idle; nothing of a policy happens there), and ``samples_per_s`` = k x batch size /
    ``iter_s``.
Rule 11 (regions). A module call that runtime.plan's NOTE [ Recompute mechanisms ] makes a region runs as one
    autograd node (runtime/regions.py, NOTE [ Regions without a graph ]) or, with ``PolicyOptions.region_nodes``
    off, under torch.utils.checkpoint (runtime R10). At u_R the compute stream re-runs the call's forward ops,
    issued by the host as one block (Rule 12): a node at the first backward op of its module and all its ops;
    checkpoint at the first unpack of a tensor packed inside it by a node of the call (where that node starts,
    before its first op: ``Candidate.first_use``), from its first op to the last one after which something inside it
    was packed (checkpoint stops there). Every candidate made and packed inside it is regenerated: a recomputed one
    lives [producer, free_if_dropped_op] and again [u_R, free_op]; a kept one also has the regenerated copy, [u_R,
    its last backward use by the call's module], and where every backward use outside the call comes before u_R its
    original lives only to the later of free_if_dropped_op and u_R - 1 (the call's own backward reads the copy; the
    runtime lets it go when the last node outside that saved it is done, at the latest there). The other storages
    the re-run ops make live as in the forward (from their op to their traced free op, at most to the re-run's end)
    during the recompute, and under a node so do the candidates it makes again that nothing inside saves (its
    outputs); the recompute's peak above the regenerated candidates is held at u_R, before op u_R allocates its
    outputs, as in Rule 7. Held until the module's last backward op: the call's tensor arguments that are not
    candidates (the node or the checkpoint saves them); under a node also the gradients its backward reads that a
    backward op outside it made (its outputs' gradients, which the node's caller holds), and those it makes that an
    op outside it or an accumulation into an existing gradient frees (they leave the node when it returns). Under a
    node also its candidate arguments (kept: runtime/plan.py P4), which it saves until its backward returns (under
    autocast after their last use: the weights' gradients are cast after it); a tensor that two regions hold is held
    once, to the later end. A node runs the call's forward with autocast's cache off: a recomputed cast of a weight
    made inside it lives only to its last forward reader there (runtime.plan.node_forward_end), not to the end of
    autocast's region as the trace's cache held it, and so does a cast of a parameter that no op saves (a bias's:
    runtime.plan.node_uncached_casts).
Rule 12 (host costs). h_i is 0 on a profile without copy engines (op times are wall times there); on a GPU
    it is the op's measured host time, scaled to the plain iteration's, when the trace ran on that device,
    and ``host.op_s`` otherwise. The runtime's own work costs the host (``HardwareProfile.host``): each
    observed pack (Rule 13) ``pack_s`` after its op and ``unpack_s`` at its tensor's first backward use (for
    packs of non-candidates: the first backward op of their module); each call of a module with a hooked
    or recorded call ``frame_s`` at its first op (``<loss>``: one); each copy out (on every profile) or
    back ``swap_s``; each
    region ``region_s`` (checkpointed: plus ``region_pack_s`` per pack inside it), at its first op and again
    with its recompute, whose ops also cost their h_i; each op the recorder runs under ``record_op_s`` (the forward
    ops of the module calls whose ops a replay re-runs, as of its own first use (a replay nested in an earlier
    one's may re-run fewer: an upper bound), the calls they ran in included, and of the calls that
    write in place, after such an op read it, what it read (runtime R11); outside the model:
    from the model's end to the end of forward, where runtime R11 stops a little earlier, at the pack after
    the last op re-run), and as much again for each quiet op dispatched after it (``OpInfo.quiet_ops``:
    views and queries, which the workload leaves out and the recorder records); each replayed op
    ``replay_op_s`` plus its h_i; each compress kernel h of an op.
    The costs of one point are issued before the op there.
Rule 13 (observed packs). The runtime's saved-tensor hooks see a pack when one of its module calls (its
    frame, or one enclosing it) is *hooked* and it is not inside a region: hooked are the frames of the
    packs of the handled candidates (swapped, compressed, replayed) and of the carriers, the candidates whose
    first backward use is U[max(0, p - L)] for a swapped candidate at U[p] when L > 0 (Rule 5). A workload
    traced without frames has every pack observed.
Rule 14 (partition). A workload traced with partitions (runtime/partition.py, NOTE [ Partition ]; runtime
    R13) holds each slice's ops, tensors and frames as the runtime runs them: a partitioned call's submodule
    calls once per slice, the slices' saved tensors as candidates of their own, the split views and the
    concatenation, and backward slice by slice in the engine's order. No rule changes for it: Rules 1-13
    apply to those ops and candidates, and a partitioned submodule's calls, running once per slice, are never
    regions (P1 of runtime/plan.py).
Rule 15 (shared parameters' gradients). Where the trace marks an op as a sum PyTorch makes in a new tensor
    and the runtime makes in place (``OpInfo.in_place_into``; runtime R14, NOTE [ Shared parameters'
    gradients ] in runtime/shared_grads.py), under every policy, keep-all included, the op allocates nothing
    and the input it writes lives on to the sum's free op: the live bytes of that op are the traced ones
    less the sum's. Without a policy (plain training: :meth:`Simulator.no_policy`) it is as traced, and so is a
    sum with a term that a region run as a node makes (Rule 11; the node's call runs without a graph, where the
    runtime's hooks see no use: R14's S1), which autograd makes once the node has returned: it is not one of the
    node's backward ops (what the node holds to its last one has gone by then).
Rule 16 (a compiled step). A policy applied under ``torch.compile`` (runtime/compiled.py, NOTE [ Compiled
    policies ] C8) is simulated on :func:`compiled_twin` of the workload and profile, with Rules 1-15 as they
    stand: the whole model is one selective-checkpoint region whose recomputed ops the partitioner places
    before their first backward use, so no module call is a region (Rule 11; nor are packs observed, Rule 13) and
    every recomputed candidate is re-made by Rule 7, except that a replay's temporaries (the storages its
    closure makes but its target) live each from its op to the closure's last op that reads it, nested
    replays included (the graph frees a value after its last use; the eager runtime's replays hold theirs
    until the outermost is done), so each replay holds the most of its own live at once, with what the
    replays before it at that op made and its target; nothing of autotune runs per op, so the runtime's host
    costs of Rule 12 (packs, unpacks, hooked calls, regions, the recorder, replays, copies) are 0 (an op's
    own issue cost h_i stays: the compiled code still launches its kernels); and a shared parameter's
    gradients are summed in place (Rule 15) only under inductor, whose buffer reuse writes the sum into a
    term's storage, while aot_eager and every other backend run PyTorch's sum, in a new tensor, as traced.

Two implementations share these rules: :class:`Simulator` (vectorised where it can be, an event walk where it
cannot, for search) and :func:`simulate_reference` (op by op with explicit clocks and a live set, for tests).
They must agree exactly.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from envs import walk
from envs.walk import USE
from runtime.hardware import HardwareProfile, get_profile, host_times_s, op_times_s
from runtime.keys import runs_in
from runtime.plan import (
    Closure,
    RegionPlanner,
    as_run,
    closures_of,
    compiled_replay_peak,
    deps_csr,
    forward_writers,
    held_outside,
    nested_closures,
    node_forward_end,
    node_uncached_casts,
    reads_csr,
    replay_copies,
    replay_inputs_kept,
)
from runtime.policy import Policy, PolicyOptions
from runtime.vocab import COMPRESS, KEEP, RECOMPUTE, SWAP, Action, compressible, itemsize
from runtime.workload import Phase, TensorKind, Workload, in_place_bytes, memory_timeline, rounded, workspace_bytes

if TYPE_CHECKING:
    from envs.features import CandidateFeatures

POOL_ROWS = 8  # Rule 7: rows kept for regions that hold what closures read, at most this times the base rows


@dataclass
class SimResult:
    """One simulated iteration. Times in seconds, sizes in bytes."""

    peak_bytes: int
    iter_s: float
    samples_per_s: float
    compute_s: float
    recompute_s: float
    compress_s: float
    stall_s: float
    d2h_bytes: int
    h2d_bytes: int
    feasible: bool
    budget_bytes: int | None
    peak_op: int
    timeline: dict[str, list[float]] | None = field(default=None, repr=False)  # op_start_s, live_bytes
    host_s: float = 0.0  # the host's busy time (Rule 12): issuing ops and the runtime's own work
    overhead_s: float = 0.0  # ... of which the runtime's own work (hooks, copies, regions, recorder, replays)
    regions: int = 0  # module calls recomputed as one node each (Rule 11)
    host_over_bytes: int = 0  # swapped bytes beyond the profile's host_memory_bytes (Rule 2); 0 within it

    @property
    def shortfall_bytes(self) -> int:
        """How far an infeasible policy is from fitting, for searches that compare them: its peak plus the
        swapped bytes its host cannot pin (Rule 2)."""
        return self.peak_bytes + self.host_over_bytes

    @property
    def host_wait_s(self) -> float:
        """Rule 9's last term: what the iteration lasts beyond the compute stream's work (kernels, recompute,
        compress, stalls), where it waits for the host (issuing ops, the runtime's hooks and replays); one
        micro-batch's iteration (``grad_accum`` 1) only, as the parts are one micro-batch's (Rule 10)."""
        return max(0.0, self.iter_s - self.compute_s - self.recompute_s - self.compress_s - self.stall_s)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if self.timeline is None:
            d.pop("timeline")
        d["host_wait_s"] = self.host_wait_s
        return d


def host_over(hw: HardwareProfile, swapped_bytes: int) -> int:
    """Rule 2's host side: the swapped tensors' pinned bytes beyond what the profile's host holds (0: fits)."""
    if hw.host_memory_bytes is None or not hw.is_gpu:
        return 0
    return max(0, swapped_bytes - hw.host_memory_bytes)


def _as_vector(w: Workload, policy: Policy | Sequence[int] | np.ndarray) -> np.ndarray:
    if isinstance(policy, Policy):
        return policy.to_vector(w)
    vec = np.asarray(policy, dtype=np.int8)
    if vec.shape != (len(w.candidates),):
        raise ValueError(f"action vector of shape {vec.shape}, expected ({len(w.candidates)},)")
    return vec


def accumulated_s(w: Workload, t: float, optimizer_s: float) -> float:
    """Rule 10: the time of ``w.grad_accum`` micro-batches and one optimizer step, from one of each (``t``)."""
    return t if w.grad_accum == 1 else w.grad_accum * (t - optimizer_s) + optimizer_s


def optimizer_s(w: Workload, op_s: np.ndarray) -> float:
    """Compute time of the optimizer ops (their kernels alone; Rule 10 runs them on Rule 1's clocks)."""
    ops = w.phase_range(Phase.OPTIMIZER)
    return float(op_s[ops.start : ops.stop].sum())


@dataclass
class _RegionCost:
    """What a region costs and holds (Rules 11, 12), once per region of a workload."""

    use: int  # u_R; n when nothing of it is unpacked
    device_s: float  # the re-run ops' compute time
    host_s: float  # their h_i, the region's own cost and its packs', for the recompute
    forward_host_s: float  # the region's own cost and its packs', in forward
    transient: int  # bytes above the regenerated candidates at the recompute's peak
    regenerated: list[tuple[int, int]]  # (candidate, last op of its regenerated copy; -1 for its free_op)
    # (tensor, first op, last op, bytes): arguments and gradients the call holds longer; a tensor two regions
    # hold (one argument of two calls, q_proj's and v_proj's) is held once, to the later end (_region_view)
    held: list[tuple[int, int, int, int]]
    intervals: tuple[np.ndarray, np.ndarray, np.ndarray] = (np.zeros(0), np.zeros(0), np.zeros(0))  # Rule 2
    out_of_place: tuple[int, ...] = ()  # Rule 15's sums with a term the node makes: in a new tensor, as traced


@dataclass
class _Rows:
    """Rule 7's closures per row, as the walk reads them (:meth:`Simulator._rows_of`)."""

    bounds: np.ndarray  # two per candidate: its rows are bounds[2 ci]:bounds[2 ci + 1], the last its own closure
    row_from: np.ndarray
    deps_ptr: np.ndarray
    deps_idx: np.ndarray
    rec_device: np.ndarray
    rec_transient: np.ndarray
    temp_ptr: np.ndarray
    temp_idx: np.ndarray
    temp_bytes: np.ndarray
    ops_ptr: np.ndarray
    ops_idx: np.ndarray
    rec_own: np.ndarray
    rec_host: np.ndarray

    def appended(self, other: _Rows) -> tuple[_Rows, int]:
        """These rows and ``other``'s after them (their candidates' bounds still these), and where ``other``'s
        start."""
        at = len(self.row_from)
        per_row = ("row_from", "rec_device", "rec_transient", "rec_own", "rec_host")
        csr = {"deps_ptr": ("deps_idx",), "temp_ptr": ("temp_idx", "temp_bytes"), "ops_ptr": ("ops_idx",)}
        out: dict[str, np.ndarray] = {"bounds": self.bounds}
        for name in per_row:
            out[name] = np.concatenate([getattr(self, name), getattr(other, name)])
        for ptr, data in csr.items():
            mine = getattr(self, ptr)
            out[ptr] = np.concatenate([mine, getattr(other, ptr)[1:] + mine[-1]])
            for name in data:
                out[name] = np.concatenate([getattr(self, name), getattr(other, name)])
        return _Rows(**out), at


@dataclass
class _RegionView:
    """What a set of regions fixes, whatever else the policy does (Rules 5, 11, 13)."""

    served: np.ndarray  # candidates the regions recompute
    outside: np.ndarray  # frames outside every region (their packs are observed)
    costs: list[_RegionCost]
    points: np.ndarray  # Rule 5's unpack points, of the candidates no region serves
    first_use: np.ndarray
    n_ops: int
    interval_at: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # Rule 2, in run's form
    interval_w: np.ndarray = field(default_factory=lambda: np.zeros(0))
    alloc_ws: np.ndarray | None = None  # what each op allocates, where a sum of Rule 15 is made as traced
    rows: _Rows | None = None  # Rule 7's closures where a region holds what one reads (None: the simulator's)
    _triggers: dict[int, np.ndarray] = field(default_factory=dict)
    _up_pos: tuple[np.ndarray, np.ndarray] | None = None  # the points and the end; each first use's position

    def triggers(self, lookahead: int) -> np.ndarray:
        """Rule 5: the op before which each candidate's H2D copy is issued (cached)."""
        if lookahead not in self._triggers:
            if self._up_pos is None:
                self._up_pos = np.append(self.points, self.n_ops), np.searchsorted(self.points, self.first_use)
            up, pos = self._up_pos
            self._triggers[lookahead] = up[np.maximum(0, pos - lookahead)]
        return self._triggers[lookahead]


class Simulator:
    """Scores policies for one workload on one hardware profile (NOTE [ Simulator semantics ])."""

    def __init__(self, w: Workload, hw: HardwareProfile | str) -> None:
        hw = get_profile(hw) if isinstance(hw, str) else hw  # a profile's name, as the CLI's --gpu takes it
        self.w, self.hw = w, hw
        self.compiled = bool(w.meta.get("compiled"))  # Rule 16: the twin of a compiled step (compiled_twin)
        n = self.n_ops = len(w.ops)
        g = hw.alloc_granularity_bytes
        self.op_s = np.asarray(op_times_s(w, hw), dtype=np.float64)
        self.host_op_s = np.asarray(host_times_s(w, hw), dtype=np.float64)  # h_i (Rule 12)
        # Rule 12: the ops the recorder records at op i, the quiet ones after it (views, queries) included.
        self._record_weight = 1.0 + np.array([op.quiet_ops for op in w.ops], dtype=np.float64)
        self._record_s = self._record_weight * hw.host.record_op_s
        fwd = w.phase_range(Phase.FORWARD)
        self._forward_span = (fwd.start, fwd.stop)  # without frames the recorder runs in all of forward
        self.op_start_s = np.concatenate([[0.0], np.cumsum(self.op_s)[:-1]])  # compute alone, no host clock
        self.compute_s = float(self.op_s.sum())
        self.optimizer_s = optimizer_s(w, self.op_s)
        opt = w.phase_range(Phase.OPTIMIZER)
        self._opt_start = opt.start if len(opt) else n
        cands = w.candidates
        self.k = len(cands)
        cand_of_tensor = {c.tensor: i for i, c in enumerate(cands)}
        self._cand_of_tensor = cand_of_tensor

        # Rule 2: tensors that are not candidates, as traced; Rule 15: less the sums made in place.
        self.in_place = in_place_bytes(w, g)
        self.base_live = memory_timeline(w, g, exclude=cand_of_tensor) - self.in_place  # workspaces included
        self.workspace = workspace_bytes(w)
        self.base_alloc = np.zeros(n, dtype=np.int64)  # bytes of non-candidate outputs each op allocates
        for t in w.tensors:
            if t.id not in cand_of_tensor and t.alloc_op >= 0 and (t.free_op is None or t.free_op >= t.alloc_op):
                self.base_alloc[t.alloc_op] += rounded(t.nbytes, g)
        self.base_alloc -= self.in_place

        self.size = np.array([rounded(c.nbytes, g) for c in cands], dtype=np.int64)
        self.nbytes = np.array([c.nbytes for c in cands], dtype=np.float64)
        self.producer = np.array([c.producer for c in cands], dtype=np.int64)
        self.save_op = np.array([c.save_op for c in cands], dtype=np.int64)
        self.in_op = np.array([c.packed_in_op for c in cands], dtype=np.bool_)  # Rules 4, 8: packed inside save_op
        self.drop = np.array([c.free_if_dropped_op for c in cands], dtype=np.int64)
        self.free_keep = np.array(
            [n - 1 if w.tensors[c.tensor].free_op is None else w.tensors[c.tensor].free_op for c in cands],
            dtype=np.int64,
        )
        # A candidate no backward op reads is never materialized: its first use is "after the end".
        self.first_use = np.array([c.first_use(n) for c in cands], dtype=np.int64)
        self._held_outside = held_outside(w)  # recomputed, kept (Rule 7; runtime/plan.py P11)
        self.unpack_points = sorted({int(u) for u in self.first_use if u < n})
        self._u_pos = [bisect.bisect_left(self.unpack_points, int(u)) for u in self.first_use]
        self.sync_copies = not hw.is_gpu  # Rule 1
        self.d2h_s = self.nbytes / hw.d2h_bytes_per_s
        self.h2d_s = self.nbytes / hw.h2d_bytes_per_s
        closures = closures_of(w)
        self.closure_ops: list[frozenset[int]] = [cl.ops for cl in closures]  # Rule 7: the ops re-run
        # Rule 7 for the walk (envs/walk.py), per *row*: a candidate's closure as of the ops from where it holds
        # (_rows_of; regions that hold a tensor a closure reads change those rows: _held_rows).
        self._closures = closures
        self._nested = nested_closures(w, closures)
        self._pieces: dict[tuple[Closure, int], tuple[list[int], tuple[float, int, tuple[int, ...]], float]] = {}
        self._rows = self._rows_of(self._nested)
        # Rule 7, per candidate: (recompute seconds, transient bytes, candidate dependencies), its last row's
        self.closures = [self._pieces[(self._nested[ci][-1][1], c.tensor)][1] for ci, c in enumerate(cands)]
        self._readers: dict[int, list[int]] | None = None  # tensor id -> the candidates whose closures read it
        # _held_rows: each candidate's rows where regions hold what it reads, appended to the rows as they come
        self._pool = self._rows
        self._held_at: dict[tuple[int, frozenset[tuple[int, int]]], tuple[int, int] | None] = {}
        # P12 (Rule 8): the candidates each candidate's closure reads, kept where compressed and it recomputed.
        self._reads_ptr, self._reads_idx = reads_csr(closures)
        self._no_floors = np.empty((0, 3))
        self._no_served = np.zeros(self.k, dtype=bool)
        self._no_ops = np.zeros(0, dtype=np.int64)
        self._no_weights = np.zeros(0)
        self._compress_cache: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self._compressible: dict[str, np.ndarray] = {}  # Rule 8, per compression dtype
        needed = np.flatnonzero(self.first_use < n)
        self._fetch_order = needed[np.lexsort((needed, self.first_use[needed]))]  # Rule 5
        seq = np.array([c.unpack_seq for c in cands], dtype=np.int64)
        self._need_order = needed[np.lexsort((needed, seq[needed], self.first_use[needed]))]  # Rule 7
        self._triggers: dict[int, np.ndarray] = {}
        self._views: dict[tuple[tuple[int, ...], bool], _RegionView] = {}
        self._optimizer_alone = self._optimizer_alone_s()
        # What run reads per policy, precomputed: positions among the unpack points, swaps in issue order (Rule
        # 4: save_op, then candidate index), copy durations as lists for the walk.
        self._save_order = np.lexsort((np.arange(self.k), self.save_op))
        self._cand_index = np.arange(self.k)
        self._packed_w: dict[str, np.ndarray] = {}
        self._used = self.first_use < n
        self._save_after = self.save_op + 1
        # Events of the walk as keys 4 x op + kind: uses (3) at first use, copies out (0) after save_op.
        self._use_key = self.first_use * 4 + 3
        self._d2h_key = self._save_after * 4
        self._dcum = np.zeros(n + 1)
        np.add.accumulate(self.op_s + np.zeros(n), out=self._dcum[1:])  # Dc of a policy adding no compute
        # Rule 2 as changes to keep-all's memory: one past the end of each candidate's storage kept, dropped
        # (an interval ending before it starts ends just before it), and of a copy made at save_op.
        self._size_f = self.size.astype(np.float64)
        self._keep_end = np.maximum(self.free_keep, self.producer - 1) + 1
        self._drop_end = np.maximum(self.drop, self.producer - 1) + 1
        self._keep_end_from_save = np.maximum(self.free_keep, self.save_op - 1) + 1
        keep_delta = np.bincount(
            np.concatenate([self.producer, self._keep_end]),
            weights=np.concatenate([self._size_f, -self._size_f]),
            minlength=n + 1,
        )[:n]
        self._live_keep = self.base_live + np.add.accumulate(keep_delta.astype(np.int64))
        # ... and as changes from one op to the next, for the policy's own changes to join (in float64: byte
        # counts, and their sums, are exact below 2**53).
        self._live_keep_delta = np.diff(self._live_keep, prepend=0).astype(np.float64)
        self._alloc_ws = self.base_alloc + self.workspace  # Rules 7, 11: what op u itself allocates
        self._workspace_f = self.workspace.astype(np.float64)  # Rules 4, 8: gone when an op packs its outputs
        self._observation_setup(closures)

    @functools.cached_property
    def features(self) -> CandidateFeatures:
        """Per-candidate features (envs/features.py) from this simulator's own costs, computed once."""
        from envs.features import compute_features

        return compute_features(self)

    @functools.cached_property
    def forward_s(self) -> float:
        """Seconds of the forward's ops (Rule 1's op times)."""
        return float(sum(t for t, op in zip(self.op_s, self.w.ops, strict=True) if op.phase == Phase.FORWARD))

    @property
    def first_pack_op(self) -> np.ndarray:
        """The op after which each candidate is first packed (Rule 4's release points; Rule 13)."""
        return self._pack_ops

    def _temporaries(self, cl: Closure, target: int) -> list[int]:
        """Rule 7: the storages (tensor ids) a closure's replayed ops write, but the target's own."""
        w = self.w
        return sorted({t for op in cl.ops for t in (*w.ops[op].outputs, *replay_copies(w, op))} - {target})

    def _rows_of(self, nested: list[list[tuple[int, Closure]]], cis: Sequence[int] | None = None) -> _Rows:
        """Rule 7 for the walk (envs/walk.py), per *row*: a candidate's closure as of the ops from where it holds
        (runtime.plan.nested_closures: a replay nested in an earlier one's runs it as of that one's use; rows of
        ci are ``bounds[2 ci]:bounds[2 ci + 1]``, from ops ``row_from``, the last its own closure), as arrays:
        seconds, bytes, the candidate inputs (CSR: those of row r are ``deps_idx[deps_ptr[r]:deps_ptr[r + 1]]``),
        the host's seconds (h_i and the replay's own per op, Rule 12) and their runtime part; the bytes storage by
        storage (CSR: tensor ids and rounded sizes), for nested recomputations that write the same storage
        (counted once), and the ops they run (CSR), for nested recomputations that run the same op (run once).
        ``cis``: the candidates ``nested`` holds the rows of (default: every one, in order)."""
        w, g, cands = self.w, self.hw.alloc_granularity_bytes, self.w.candidates
        rows = [cl for entries in nested for _, cl in entries]
        pieces = []
        for ci, entries in zip(range(len(nested)) if cis is None else cis, nested, strict=True):
            for _, cl in entries:
                key = (cl, cands[ci].tensor)
                if key not in self._pieces:
                    temps = self._temporaries(cl, cands[ci].tensor)
                    self._pieces[key] = (
                        temps,
                        self._closure_cost(cl.ops, cl.deps, temps, cands[ci].tensor),
                        self.host_op_s[sorted(cl.ops)].sum(),
                    )
                pieces.append(self._pieces[key])
        row_len = [len(cl.ops) for cl in rows]
        temp_idx = np.array([tid for temps, _, _ in pieces for tid in temps], dtype=np.int64)
        deps_ptr, deps_idx = deps_csr(rows)
        rec_own = np.array([length * self.hw.host.replay_op_s for length in row_len], dtype=np.float64)
        return _Rows(
            bounds=np.repeat(np.concatenate([[0], np.cumsum([len(e) for e in nested])]), 2)[1:-1].astype(np.int64),
            row_from=np.array([start for entries in nested for start, _ in entries], dtype=np.int64),
            deps_ptr=deps_ptr,
            deps_idx=deps_idx,
            rec_device=np.array([cost[0] for _, cost, _ in pieces], dtype=np.float64),
            rec_transient=np.array([cost[1] for _, cost, _ in pieces], dtype=np.int64),
            temp_ptr=np.concatenate([[0], np.cumsum([len(temps) for temps, _, _ in pieces])]).astype(np.int64),
            temp_idx=temp_idx,
            temp_bytes=np.array([rounded(w.tensors[tid].nbytes, g) for tid in temp_idx], dtype=np.int64),
            ops_ptr=np.concatenate([[0], np.cumsum(row_len)]).astype(np.int64),
            ops_idx=np.array([op for cl in rows for op in sorted(cl.ops)], dtype=np.int64),
            rec_own=rec_own,
            rec_host=np.array([host for _, _, host in pieces], dtype=np.float64) + rec_own,
        )

    def _held_rows(self, held: dict[int, int]) -> _Rows | None:
        """Rule 7 under regions that hold tensors past their traced end (Rule 11's arguments): the closures that
        read one re-made where it is still held read it as it is instead (runtime R6). None: no closure changes."""
        w = self.w
        if self._readers is None:
            self._readers = {}
            for ci, entries in enumerate(self._nested):
                for tid in {t for op in entries[-1][1].ops for t in w.ops[op].inputs}:
                    self._readers.setdefault(tid, []).append(ci)
        longer = {tid: end for tid, end in held.items() if (f := w.tensors[tid].free_op) is not None and end > f}
        mine: dict[int, list[tuple[int, int]]] = {}  # candidate -> the held tensors its closure reads
        for tid in longer:
            for ci in self._readers.get(tid, ()):
                mine.setdefault(ci, []).append((tid, longer[tid]))
        if len(self._pool.row_from) > POOL_ROWS * len(self._rows.row_from):  # views keep the rows they read
            self._pool, self._held_at = self._rows, {}
        bounds = None
        for ci in sorted(mine):
            key = (ci, frozenset(mine[ci]))
            if key not in self._held_at:  # per candidate and what it reads held, across region sets: pooled
                (entries,) = nested_closures(w, self._closures, dict(mine[ci]), [ci])
                if entries == self._nested[ci]:
                    self._held_at[key] = None
                else:
                    self._pool, at = self._pool.appended(self._rows_of([entries], [ci]))
                    self._held_at[key] = (at, at + len(entries))
            if (span := self._held_at[key]) is not None:
                bounds = self._pool.bounds.copy() if bounds is None else bounds
                bounds[2 * ci : 2 * ci + 2] = span
        return None if bounds is None else replace(self._pool, bounds=bounds)

    def _closure_cost(
        self, ops: frozenset[int], deps: tuple[int, ...], temporaries: list[int], target: int
    ) -> tuple[float, int, tuple[int, ...]]:
        """Rule 7: (recompute seconds, transient bytes, candidate dependencies) of one candidate's closure:
        ``temporaries``, every storage the replayed ops write but the target, are held during the recompute
        (Rule 16, a compiled step: each to its last reader in the closure, the most live at once)."""
        w, g = self.w, self.hw.alloc_granularity_bytes
        if self.compiled:
            transient = compiled_replay_peak(w, ops, target, g)[0]
        else:
            transient = sum(rounded(w.tensors[tid].nbytes, g) for tid in temporaries)
        return float(self.op_s[sorted(ops)].sum()), transient, tuple(sorted(deps))

    def trigger_ops(self, lookahead: int) -> np.ndarray:
        """Rule 5 with no region: the op before which each candidate's H2D copy is issued."""
        if lookahead not in self._triggers:
            up = np.array([*self.unpack_points, self.n_ops], dtype=np.int64)
            pos = np.array(self._u_pos, dtype=np.int64)
            self._triggers[lookahead] = up[np.maximum(0, pos - lookahead)]
        return self._triggers[lookahead]

    def as_run(self, policy: Policy | Sequence[int] | np.ndarray, options: PolicyOptions) -> np.ndarray:
        """The action codes :meth:`run` simulates for ``policy``: a recomputed tensor something outside autograd
        holds kept (P11), a compressed one that cannot be or that a replay reads kept (R8, P12)."""
        act = as_run(_as_vector(self.w, policy), self._held_outside)
        return replay_inputs_kept(self._as_compressed(act, options.compress_dtype), self._reads_ptr, self._reads_idx)

    def _as_compressed(self, act: np.ndarray, dtype: str) -> np.ndarray:
        """Rule 8 / runtime R8: a compressed candidate that is not a floating-point tensor wider than ``dtype``
        (an int64 index, a bfloat16 activation) is kept (one a replay reads is kept too, by ``replay_inputs_kept``:
        runtime/plan.py P12)."""
        compress = act == COMPRESS
        if not compress.any():
            return act
        return np.where(compress & ~self.compressible(dtype), KEEP, act).astype(act.dtype)

    def compressible(self, dtype: str) -> np.ndarray:
        """Rule 8, per candidate: a floating-point tensor wider than ``dtype`` (others are kept)."""
        if dtype not in self._compressible:
            dtypes = [self.w.tensors[c.tensor].dtype for c in self.w.candidates]
            self._compressible[dtype] = np.array([compressible(d, dtype) for d in dtypes], dtype=bool)
        return self._compressible[dtype]

    def compression(self, dtype: str) -> tuple[np.ndarray, np.ndarray]:
        """(packed sizes, seconds of one pack or unpack kernel) per candidate (Rule 8)."""
        if dtype not in self._compress_cache:
            g, hw = self.hw.alloc_granularity_bytes, self.hw
            target = itemsize(dtype)
            packed, cost = [], []
            for c in self.w.candidates:
                ratio = max(1.0, itemsize(self.w.tensors[c.tensor].dtype) / target)
                packed.append(rounded(int(c.nbytes / ratio), g))
                cost.append(hw.op_time_s(0.0, c.nbytes + c.nbytes / ratio, "fp32"))
            self._compress_cache[dtype] = (np.array(packed, dtype=np.int64), np.array(cost))
        return self._compress_cache[dtype]

    # -- Rules 11-13: what the runtime's hooks see, regions, the recorder -----------------------------------
    def _observation_setup(self, closures: list[Any]) -> None:
        w, n = self.w, self.n_ops
        frames = w.frames
        # Rule 16: a compiled step's module calls are never regions (its recomputes are the partitioner's)
        self.has_frames = bool(frames) and all(c.packs for c in w.candidates) and not self.compiled
        self.planner = RegionPlanner(w, closures) if self.has_frames else None
        self._regions: dict[tuple[int, bool], _RegionCost] = {}
        first_bwd = next((op.index for op in w.ops if op.phase == Phase.BACKWARD), n)
        self._first_bwd = first_bwd
        if not self.has_frames:
            self._pack_ops = self.save_op.copy()  # first pack: after save_op
            self._pack_after = self.save_op + 1  # Rule 12: each pack's cost after its op ...
            self._pack_unpack_op = np.minimum(self.first_use, n)  # ... and its unpack's at its tensor's first use
            none_i, none_f = np.zeros(0, dtype=np.int64), np.zeros(0)
            self._frame_arrays = (none_i, none_i, none_i, none_i, none_i, none_i, none_f, none_i,
                                  np.zeros(1, dtype=np.int64), none_i, np.zeros(0, dtype=bool), none_i, none_i, -1,
                                  none_i, 0, none_i)  # fmt: skip
            self._no_outside = np.zeros(0, dtype=bool)
            return
        nf = len(frames)
        pc, pf, po = [], [], []
        for ci, c in enumerate(w.candidates):
            for f, op in c.packs:
                pc.append(ci)
                pf.append(f)
                po.append(op)
        self._pack_cand = np.array(pc, dtype=np.int64)
        self._pack_frame = np.array(pf, dtype=np.int64)
        self._pack_op = np.array(po, dtype=np.int64)
        self._pack_ops = np.array([c.packs[0][1] for c in w.candidates], dtype=np.int64)
        self._first_pack = np.searchsorted(self._pack_cand, np.arange(self.k))  # packs are in candidate order
        cand_packs = np.bincount(self._pack_frame, minlength=nf)
        self._noncand_packs = np.maximum(0, np.array([f.packs for f in frames], dtype=np.int64) - cand_packs)
        self._frame_first_op = np.array([max(f.first_op, 0) for f in frames], dtype=np.int64)
        path_ids: dict[str, int] = {}
        self._frame_path = np.array([path_ids.setdefault(f.path, len(path_ids)) for f in frames], dtype=np.int64)
        by_module: dict[str, int] = {}
        self._bwd_ops_of_module: dict[str, list[int]] = {}
        for info in w.ops:
            if info.phase == Phase.BACKWARD:
                by_module.setdefault(info.module, info.index)
                self._bwd_ops_of_module.setdefault(info.module, []).append(info.index)
        self._frame_bwd_op = np.array([by_module.get(f.path, first_bwd) for f in frames], dtype=np.int64)
        assert self.planner is not None
        self._frame_end = self.planner.end
        # Backward ops that add into a gradient made before them (accumulation; Rule 11's crossing gradients).
        self._accumulates = {
            o.index
            for o in w.ops
            if o.phase == Phase.BACKWARD
            and any(w.tensors[t].kind == TensorKind.GRADIENT and w.tensors[t].alloc_op != o.index for t in o.outputs)
        }
        # Rule 12's recorder: the frames of each candidate's closure ops, flattened.
        root = next((f for f in frames if f.path == "<root>"), None)
        self._root_last = root.last_op if root is not None else -1
        self._root_first = root.first_op if root is not None else 0
        # The recorder runs in the calls of a closure's ops and of the forward ops that write in place, after a
        # closure op read it, what it read (runtime R11: the replay must see that write, R6).
        writers = forward_writers(w)
        recorded = [
            ops | {j for op in ops for t in w.ops[op].inputs for j in writers.get(t, ()) if j > op}
            for ops in self.closure_ops
        ]
        lists = [sorted({w.ops[op].frame for op in ops if w.ops[op].frame >= 0}) for ops in recorded]
        self._closure_frames = [np.array(lst, dtype=np.int64) for lst in lists]
        self._loss_before_root = np.array(
            [any(w.ops[op].frame == 0 and op < self._root_first for op in ops) for ops in recorded], dtype=bool
        )
        # Rule 12's recorder: each frame's span of forward ops (frame 0, outside the model, from the model's end).
        spans = [(f.first_op, f.last_op) for f in frames]
        if spans:
            spans[0] = (self._root_last + 1, spans[0][1])
        # Per policy, as masks: each pack's costs (Rule 12); the frames with packs of tensors that are not
        # candidates, and theirs.
        self._n_paths = len(path_ids)
        self._frame_packs = cand_packs + self._noncand_packs  # packs observed in each frame when it is
        self._frame_reach = self.planner.end + 1  # one past the last frame inside each
        hc = self.hw.host
        self._pack_after = self._pack_op + 1
        self._pack_unpack_op = np.minimum(self.first_use[self._pack_cand], n)
        other = np.flatnonzero(self._noncand_packs > 0)  # frames with packs of tensors that are not candidates
        self._other_first_op, self._other_bwd_op = self._frame_first_op[other], self._frame_bwd_op[other]
        self._other_pack_s = self._noncand_packs[other] * hc.pack_s
        self._other_unpack_s = self._noncand_packs[other] * hc.unpack_s
        # ... the four as one list of (frame observed, op, seconds), in that order: packs, their unpacks, the packs
        # of tensors that are not candidates, their unpacks; and the frame of each candidate's first pack.
        n_packs = len(self._pack_op)
        self._pack_cost_frame = np.concatenate([self._pack_frame, self._pack_frame, other, other])
        self._pack_cost_at = np.concatenate(
            [self._pack_after, self._pack_unpack_op, self._other_first_op, self._other_bwd_op]
        )
        self._pack_cost_s = np.concatenate(
            [np.full(n_packs, hc.pack_s), np.full(n_packs, hc.unpack_s), self._other_pack_s, self._other_unpack_s]
        )
        self._first_pack_frame = self._pack_frame[self._first_pack]
        # Rule 12's recorder per candidate: the frames of its closure's ops (flattened, ``clo_ptr`` where each
        # candidate's start), and each frame's span of forward ops the recorder runs under (frame 0, outside
        # the model, from the model's end; a frame with no ops: none), which envs/walk.py unites per policy.
        clo_ptr = np.zeros(self.k + 1, dtype=np.int64)
        clo_ptr[1:] = np.cumsum([len(fr) for fr in self._closure_frames])
        clo = np.concatenate(self._closure_frames) if self._closure_frames else np.zeros(0, dtype=np.int64)
        self._frame_arrays = (
            self._pack_cand,
            self._pack_frame,
            self._frame_reach,
            self._first_pack_frame,
            self._pack_cost_frame,
            self._pack_cost_at,
            self._pack_cost_s,
            self._frame_packs,
            clo_ptr,
            clo.astype(np.int64),
            self._loss_before_root,
            np.array([lo for lo, _ in spans], dtype=np.int64),
            np.array([hi for _, hi in spans], dtype=np.int64),
            spans[0][1] if spans and spans[0][1] >= 0 else -1,  # the loss's ops: from op 0 to there
            self._frame_path,
            self._n_paths,
            self._frame_first_op,
        )
        self._no_outside = np.zeros(nf, dtype=bool)

    def region_cost(self, f: int, nodes: bool = True) -> _RegionCost:
        """Rule 11 for frame ``f`` as a region, one node (``nodes``) or checkpointed (cached)."""
        if (f, nodes) in self._regions:
            return self._regions[(f, nodes)]
        w, n, g = self.w, self.n_ops, self.hw.alloc_granularity_bytes
        assert self.planner is not None
        frame = w.frames[f]
        end = int(self._frame_end[f])
        path = frame.path

        module_ops = {op for m, ops in self._bwd_ops_of_module.items() if runs_in(m, path) for op in ops}
        # Rule 15: a sum of a parameter's gradients with a term that the node makes is PyTorch's, in a new tensor
        # (the runtime's hooks see no use of the parameter inside a call run without a graph, R14), made in
        # autograd's buffer once the node has returned: not one of the node's ops.
        out_of_place = tuple(
            int(j)
            for j in np.flatnonzero(self.in_place)
            if nodes and (int(j) in module_ops or any(w.tensors[t].alloc_op in module_ops for t in w.ops[j].inputs))
        )
        module_ops -= set(out_of_place)

        def in_module(op: int) -> bool:
            return op in module_ops

        inside = sorted(self.planner.packed_in[f])
        first = frame.first_op
        if nodes:  # the node runs before the call's first backward op, and re-runs the whole call
            use = min(module_ops) if module_ops else n
            rerun = range(first, max(first, frame.last_op) + 1)
        else:  # checkpoint: at the first unpack, up to the last op that saved something inside
            use = n  # the first unpack by a node of the call: where a node starts (Candidate.first_use)
            for ci in inside:
                c = w.candidates[ci]
                u = c.first_use(n)
                use = min(use, u if in_module(u) else min((b for b in c.bwd_uses if in_module(b)), default=n))
            last_pack = max(op for ci in inside for pf, op in w.candidates[ci].packs if f <= pf <= end)
            rerun = range(first, max(first, min(last_pack, frame.last_op)) + 1)
        regenerated: list[tuple[int, int]] = []
        released: list[tuple[int, int, int]] = []  # (first op, last op, bytes): kept outputs freed earlier
        internal = set(self.planner.internal[f].tolist())
        for ci in inside:
            c = w.candidates[ci]
            if not first <= c.producer <= frame.last_op:
                continue  # an input (P4)
            if ci in internal:
                regenerated.append((ci, -1))
                gone = node_forward_end(w, ci, frame.last_op) if nodes else c.free_if_dropped_op
                if gone < c.free_if_dropped_op:  # a weight's cast, which the node's forward does not cache
                    released.append((gone + 1, c.free_if_dropped_op, -int(self.size[ci])))
            else:  # a kept output packed inside: its copy until the call's module is done with it
                own = [b for b in c.bwd_uses if in_module(b)]
                regenerated.append((ci, max(own) if own else use))
                # ... and the original, where every use outside the call comes before it, until u_R
                if all(b < use for b in c.bwd_uses if not in_module(b)):
                    last = max(c.free_if_dropped_op, use - 1)
                    if last < self.free_keep[ci]:
                        released.append((last + 1, int(self.free_keep[ci]), -int(self.size[ci])))
        if nodes:  # the casts a node's forward lets go after their product that no op saves (a bias's)
            for tid, last in node_uncached_casts(w, first, frame.last_op).items():
                t = w.tensors[tid]
                released.append((last + 1, int(t.free_op if t.free_op is not None else n), -rounded(t.nbytes, g)))
        regen = {w.candidates[ci].tensor for ci, _ in regenerated}
        transient = 0
        live = 0
        temps: dict[int, int] = {}  # freed at op -> bytes
        later = sum(int(self.size[ci]) for ci, _ in regenerated)  # regenerated, not yet re-made
        made_at: dict[int, int] = {}
        for ci, _ in regenerated:
            made_at[w.candidates[ci].producer] = made_at.get(w.candidates[ci].producer, 0) + int(self.size[ci])
        for op in rerun:
            for tid in w.ops[op].outputs:
                t = w.tensors[tid]
                if t.alloc_op == op and tid not in regen and (nodes or tid not in self._cand_of_tensor):
                    # A candidate made again that nothing inside saves (the call's outputs) goes after the re-run.
                    free = n if tid in self._cand_of_tensor or t.free_op is None else t.free_op
                    if free >= op:
                        live += rounded(t.nbytes, g)
                        temps[free] = temps.get(free, 0) + rounded(t.nbytes, g)
            later -= made_at.get(op, 0)
            transient = max(transient, live - later)
            live -= temps.pop(op, 0)
        packs = int(sum(w.frames[x].packs for x in range(f, end + 1)))
        last_bwd = max(module_ops, default=-1)
        held: list[tuple[int, int, int, int]] = []
        for tid in sorted(set(frame.args) - {-1} - set(self._cand_of_tensor)):
            t = w.tensors[tid]
            if t.free_op is not None and t.free_op < last_bwd:
                held.append((tid, t.free_op + 1, last_bwd, rounded(t.nbytes, g)))
        # A node saves its candidate arguments too (kept: runtime/plan.py P4) until its backward returns, which
        # may be after their last backward use (under autocast the weights' gradients are cast after it).
        for tid in sorted(set(frame.args) & set(self._cand_of_tensor)) if nodes else ():
            ci = self._cand_of_tensor[tid]
            if int(self.free_keep[ci]) < last_bwd:
                held.append((tid, int(self.free_keep[ci]) + 1, last_bwd, int(self.size[ci])))
        # Gradients that cross the node's boundary live until its backward is done: what comes in (the
        # outputs' gradients, held by the node's caller) and what goes out to be freed by an op outside it or
        # by an accumulation into an existing gradient (which runs once the node returns).
        crossing: set[int] = set()
        accumulates = self._accumulates
        for op in module_ops if nodes else ():
            info = w.ops[op]
            for tid in info.inputs:
                a = w.tensors[tid].alloc_op
                if a >= 0 and a not in module_ops and w.ops[a].phase == Phase.BACKWARD:
                    crossing.add(tid)
            for tid in info.outputs:
                t = w.tensors[tid]
                leaves = t.free_op is not None and (t.free_op not in module_ops or t.free_op in accumulates)
                if t.alloc_op == op and leaves:
                    crossing.add(tid)
        for tid in sorted(crossing):
            t = w.tensors[tid]
            if t.free_op is not None and t.free_op < last_bwd:
                held.append((tid, t.free_op + 1, last_bwd, rounded(t.nbytes, g)))
        hc = self.hw.host
        own_s = hc.region_s + (0.0 if nodes else hc.region_pack_s * packs)  # the node runs nothing per pack
        cost = _RegionCost(
            use=use,
            device_s=float(self.op_s[list(rerun)].sum()),
            host_s=own_s + float(self.host_op_s[list(rerun)].sum()),
            forward_host_s=own_s,
            transient=max(0, transient),
            regenerated=regenerated,
            held=held,
            out_of_place=out_of_place,
        )
        starts = [cost.use] * len(regenerated) if cost.use < n else []
        ends = [int(self.free_keep[ci]) if last < 0 else last for ci, last in regenerated] if cost.use < n else []
        sizes = [int(self.size[ci]) for ci, _ in regenerated] if cost.use < n else []
        cost.intervals = (
            np.array(starts + [a for a, _, _ in released], dtype=np.int64),
            np.array(ends + [b for _, b, _ in released], dtype=np.int64),
            np.array(sizes + [z for _, _, z in released], dtype=np.int64),
        )
        self._regions[(f, nodes)] = cost
        return cost

    def _region_view(self, regions: tuple[int, ...], nodes: bool = True) -> _RegionView:
        """What a set of regions fixes for every policy that has them (cached, a few hundred sets at most)."""
        view = self._views.get((regions, nodes))
        if view is None:
            assert self.planner is not None
            if len(self._views) >= 256:
                self._views.pop(next(iter(self._views)))
            served = self.planner.served(list(regions))
            costs = [self.region_cost(f, nodes) for f in regions]
            at_l: list[np.ndarray] = [np.zeros(0, dtype=np.int64)]
            w_l: list[np.ndarray] = [np.zeros(0)]
            held: dict[int, tuple[int, int, int]] = {}  # Rule 11: each tensor held once, to its latest end
            for rc in costs:
                for tid, a, b, z in rc.held:
                    held[tid] = (a, max(b, held[tid][1]) if tid in held else b, z)
            h = list(held.values())
            kept = (np.array([a for a, _, _ in h], np.int64), np.array([b for _, b, _ in h], np.int64),
                    np.array([z for _, _, z in h], np.int64))  # fmt: skip
            for s0, e0, z0 in [rc.intervals for rc in costs] + [kept]:  # +size at each start, -size past each end
                at_l += [s0, np.maximum(e0, s0 - 1) + 1]
                w_l += [z0, -z0]
            undone = np.array(sorted({j for rc in costs for j in rc.out_of_place}), dtype=np.int64)
            alloc_ws = None
            if len(undone):  # Rule 15 undone: the sum's bytes during its op, which allocates them
                at_l += [undone, undone + 1]
                w_l += [self.in_place[undone].astype(np.float64), -self.in_place[undone].astype(np.float64)]
                alloc_ws = self._alloc_ws.copy()
                alloc_ws[undone] += self.in_place[undone]
            # The unpack points of the candidates no region serves (sorted, distinct), from a mask over ops.
            at_use = np.zeros(self.n_ops + 1, dtype=bool)
            at_use[self.first_use[~served]] = True
            view = _RegionView(
                served=served,
                outside=~self.planner.inside(list(regions)),
                costs=costs,
                points=np.flatnonzero(at_use[: self.n_ops]),
                first_use=self.first_use,
                n_ops=self.n_ops,
                interval_at=np.concatenate(at_l),
                interval_w=np.concatenate(w_l),
                alloc_ws=alloc_ws,
                rows=self._held_rows({tid: b for tid, (_, b, _) in held.items()}),
            )
            self._views[(regions, nodes)] = view
        return view

    # -- one evaluation -----------------------------------------------------------------------------------
    def run(
        self,
        policy: Policy | Sequence[int] | np.ndarray,
        *,
        budget_bytes: int | None = None,
        options: PolicyOptions | None = None,
        timeline: bool = False,
    ) -> SimResult:
        w, n, k, hw = self.w, self.n_ops, self.k, self.hw
        hc = hw.host
        if options is None:
            options = policy.options if isinstance(policy, Policy) else PolicyOptions()
        act = self.as_run(policy, options)
        lookahead = max(0, int(options.prefetch_lookahead))
        release_after = max(1, int(options.release_after))
        packed, pack_s = self.compression(options.compress_dtype)
        sync = self.sync_copies
        cands = self._cand_index
        keep_mask, swp_mask, comp_mask = act == KEEP, act == SWAP, act == COMPRESS
        swapping = np.count_nonzero(swp_mask) > 0
        copies = swapping and not sync

        # Rule 11: regions, and what they serve.
        planner = self.planner
        regions = planner.select(act, bool(options.region_nodes)) if planner is not None else []
        # Rule 5: each copy back's trigger op, among the unpack points of the candidates no region serves.
        if regions:
            view = self._region_view(tuple(regions), bool(options.region_nodes))
            served = view.served
            handled = ~keep_mask & ~served
            trigger_all = view.triggers(lookahead)
        else:
            handled = ~keep_mask
            trigger_all = self.trigger_ops(lookahead)
        uses_arr = self._need_order[handled[self._need_order]]  # handled candidates in order of need
        # Rules 8, 12, 13: what the policy adds before ops on the host and compute clocks (envs/walk.py), then
        # the regions' (Rule 11), summed per op before they are added.
        swp = self._save_order[swp_mask[self._save_order]]
        hx, dx = np.zeros(n + 1), np.zeros(n + 1)
        point = np.empty(k, dtype=bool)
        n_observed, frame_calls, record_weight, dx_touched = walk.compiled_host()(
            n,
            act,
            handled,
            served if regions else self._no_served,
            bool(regions),
            view.outside if regions else self._no_outside,
            self.has_frames,
            lookahead > 0 and copies,
            trigger_all,
            self._used,
            self.first_use,
            *self._frame_arrays,
            hc.frame_s,
            self._pack_after,
            self._pack_unpack_op,
            hc.pack_s,
            hc.unpack_s,
            *self._forward_span,
            self._save_after,
            pack_s,
            hc.op_s if hw.is_gpu else 0.0,
            hc.record_op_s > 0,
            self._record_s,
            self._record_weight,
            swp,
            sync,
            self.d2h_s,
            hc.swap_s,
            SWAP,
            RECOMPUTE,
            COMPRESS,
            hx,
            dx,
            point,
        )
        overhead_s = n_observed * (hc.pack_s + hc.unpack_s) + frame_calls * hc.frame_s
        compress_s = float(pack_s[comp_mask].sum())
        recompute_s = 0.0
        region_costs = view.costs if regions else []
        if regions:
            h_one: dict[int, float] = {}
            d_one: dict[int, float] = {}
            for f, rc in zip(regions, region_costs, strict=True):
                at = int(self._frame_first_op[f])
                h_one[at] = h_one.get(at, 0.0) + rc.forward_host_s
                overhead_s += rc.forward_host_s
                if rc.use < n:
                    h_one[rc.use] = h_one.get(rc.use, 0.0) + rc.host_s
                    d_one[rc.use] = d_one.get(rc.use, 0.0) + rc.device_s
                    recompute_s += rc.device_s
                    overhead_s += rc.forward_host_s  # the region's own part of the recompute's host time
            for at, value in h_one.items():
                hx[at] += value
            for at, value in d_one.items():
                dx[at] += value
            dx_touched = dx_touched or bool(d_one)
        overhead_s += record_weight * hc.record_op_s
        if swapping:
            overhead_s += len(swp) * hc.swap_s

        # Rule 4: the swaps' release points.
        if copies:
            point_idx = cands[point] if self.has_frames else cands  # without frames every first pack is one
            rank = np.full(k, -1, dtype=np.int64)
            rank[point_idx] = cands[: len(point_idx)]
            rank = rank[swp]
            first_handled = int(self.first_use[uses_arr[0]]) if len(uses_arr) else n  # swapped ones are handled
            target = rank + release_after
            in_fwd = (rank >= 0) & (target < len(point_idx))
            release_op = np.where(  # the op after which the device bytes go
                in_fwd, self._pack_ops[point_idx[np.minimum(target, len(point_idx) - 1)]], first_handled - 1
            )
            release_event = release_op + 1  # the op before which it happens

        # The walk (Rules 1, 4-7, 12). Events come before op x; at one x, in this order: copies out, releases,
        # copies back (Rule 5: by first use, then candidate index), uses (Rule 7: in unpack order); then op x.
        hcum = np.zeros(n + 1)
        np.add.accumulate(self.host_op_s + hx[:n], out=hcum[1:])  # Hc
        if dx_touched:
            dcum = np.zeros(n + 1)
            np.add.accumulate(self.op_s + dx[:n], out=dcum[1:])  # Dc
        else:
            dcum = self._dcum  # (adding 0.0 changes no op time)
        reach = hcum[1:] - dcum[:-1]  # A_k: when the host has issued op k, less the compute before it
        d2h_end = np.zeros(k)  # each swapped candidate's copy out's end (Rule 4)
        begin_at, ih, ed = 0, 0.0, 0.0
        if copies:
            fetch_arr = self._fetch_order[swp_mask[self._fetch_order]]
            # Rule 4 in forward, at once when no release point waits for its copy.
            e_after = dcum[1:] + np.maximum.accumulate(np.maximum(reach, 0.0))  # each op's end, no wait on the way
            dur = self.d2h_s[swp]
            csum = np.add.accumulate(dur)
            swp_end = csum + np.maximum.accumulate(e_after[self.save_op[swp]] - (csum - dur))
            fwd_rel = release_event < self._first_bwd
            fwd_events = np.count_nonzero(swp_end[fwd_rel] > e_after[release_event[fwd_rel] - 1]) > 0
            # Events as keys 4 x op + kind (kinds in the order above), ``pos`` those of copies back and uses.
            keys = [self._use_key[uses_arr], trigger_all[fetch_arr] * 4 + 2]
            if fwd_events:
                keys += [release_event * 4 + 1, self._d2h_key[swp]]
                ci_a = np.concatenate([uses_arr, fetch_arr, swp, swp])
            else:
                d2h_end[swp] = swp_end
                begin_at = self._first_bwd
                ih, ed = float(hcum[begin_at]), float(e_after[begin_at - 1]) if begin_at > 0 else 0.0
                late = release_event >= begin_at
                keys.append(release_event[late] * 4 + 1)
                ci_a = np.concatenate([uses_arr, fetch_arr, swp[late]])
            key_a = np.concatenate(keys)
            # By op, then kind; a stable sort keeps each kind's events in their order (of need, of issue).
            order_ev = np.argsort(key_a, kind="stable")
            key_a = key_a[order_ev]
            key_a = key_a[: np.searchsorted(key_a, 4 * n)]  # a release at n: none
            ev_ci = ci_a[order_ev[: len(key_a)]]
            ev_kind = key_a & 3
            sorted_pos = key_a >> 2
        else:  # only uses, already in order of need
            sorted_pos = self.first_use[uses_arr]
            ev_ci = uses_arr
            ev_kind = np.full(len(uses_arr), USE, dtype=np.int64)
        # The clocks are read at the start, each op with events and the end; between each two, a segment of ops
        # with no event inside (Hc, Dc at its ends, the largest reach inside), walked in turn.
        at_start = (sorted_pos[0] if len(sorted_pos) else n) == begin_at  # events at the start: walked first
        rows = view.rows if regions and view.rows is not None else self._rows  # Rule 7, where regions hold inputs
        extra = np.zeros(n, dtype=np.int64)  # Rule 7: what recomputes hold before each op, above what they make
        moved = np.empty(2 * k, dtype=np.int64)  # made again in backward: candidate, op, ...
        floors = np.empty((n + 1, 3)) if timeline else self._no_floors  # the clocks after the events at an op
        ih, ed, stall_s, host_dyn, own_dyn, compress_s, recompute_s, n_moved, n_floors = walk.compiled()(
            sorted_pos,
            ev_kind,
            ev_ci,
            n,
            hcum,
            dcum,
            reach,
            begin_at,
            bool(at_start),
            ih,
            ed,
            compress_s,
            recompute_s,
            sync,
            timeline,
            act,
            rows.bounds,
            rows.row_from,
            rows.deps_ptr,
            rows.deps_idx,
            rows.rec_device,
            rows.rec_transient,
            rows.temp_ptr,
            rows.temp_idx,
            rows.temp_bytes,
            len(w.tensors),
            self.compiled,
            rows.ops_ptr,
            rows.ops_idx,
            self.op_s,
            self.host_op_s,
            hw.host.replay_op_s,
            rows.rec_own,
            rows.rec_host,
            pack_s,
            self.h2d_s,
            self.d2h_s,
            d2h_end,
            hc.op_s if hw.is_gpu else 0.0,
            hc.swap_s,
            KEEP,
            SWAP,
            RECOMPUTE,
            COMPRESS,
            self.size,
            packed,
            extra,
            moved,
            floors,
        )
        moved = moved[:n_moved]
        t_end = max(ih, ed)
        overhead_s += own_dyn
        iter_s = accumulated_s(w, t_end, self._optimizer_alone)

        # Rule 2 (envs/walk.py: live_bytes), Rules 7 and 11's recomputes held at their op included.
        for rc in region_costs:
            if rc.use < n and rc.transient > extra[rc.use]:
                extra[rc.use] = rc.transient
        live = walk.compiled_live()(
            n,
            act,
            handled,
            served if regions else self._no_served,
            bool(regions),
            copies,
            swapping,
            sync,
            swp,
            release_op if copies else self._no_ops,
            trigger_all,
            moved,
            n_moved,
            self._size_f,
            self._keep_end,
            self._drop_end,
            self.drop,
            self.producer,
            self.save_op,
            self._keep_end_from_save,
            self.free_keep,
            self.first_use,
            self._used,
            self._packed_f(options.compress_dtype, packed),
            self.in_op,
            self._workspace_f,
            view.interval_at if regions else self._no_ops,
            view.interval_w if regions else self._no_weights,
            self._live_keep_delta,
            extra,
            view.alloc_ws if regions and view.alloc_ws is not None else self._alloc_ws,
            KEEP,
            SWAP,
            COMPRESS,
        )
        peak_op = int(live.argmax())
        peak = int(live[peak_op])
        swapped_bytes = int(self.nbytes[swp].sum())
        over = host_over(hw, swapped_bytes)
        host_total = float(hcum[n]) + host_dyn
        return SimResult(
            peak_bytes=peak,
            iter_s=iter_s,
            samples_per_s=w.batch_size * w.grad_accum / iter_s,
            compute_s=self.compute_s,
            recompute_s=recompute_s,
            compress_s=compress_s,
            stall_s=stall_s + (float(self.d2h_s[swp].sum()) if sync else 0.0),
            d2h_bytes=swapped_bytes,
            h2d_bytes=0 if sync else swapped_bytes,
            feasible=(budget_bytes is None or peak <= budget_bytes) and not over,
            budget_bytes=budget_bytes,
            peak_op=peak_op,
            timeline=self._timeline(hx, dx, floors[:n_floors], live) if timeline else None,
            host_s=host_total,
            overhead_s=overhead_s,
            regions=len(regions),
            host_over_bytes=over,
        )

    def no_policy(self, *, budget_bytes: int | None = None, timeline: bool = False) -> SimResult:
        """Plain training, without autotune's runtime: every tensor kept and the shared parameters'
        gradients summed as PyTorch sums them (Rule 15), where a keep-all policy sums them in place."""
        r = self.run(np.zeros(self.k, dtype=np.int8), budget_bytes=budget_bytes, timeline=timeline)
        if not self.in_place.any():
            return r
        live = self._live_keep + self.in_place
        peak_op = int(np.argmax(live))
        peak = int(live[peak_op])
        if r.timeline is not None:
            r.timeline["live_bytes"] = live.astype(float).tolist()
        r.peak_bytes, r.peak_op = peak, peak_op
        r.feasible = (budget_bytes is None or peak <= budget_bytes) and not r.host_over_bytes
        return r

    def _packed_f(self, dtype: str, packed: np.ndarray) -> np.ndarray:
        """Rule 8's packed sizes as float64 weights (cached)."""
        if dtype not in self._packed_w:
            self._packed_w[dtype] = packed.astype(np.float64)
        return self._packed_w[dtype]

    def _optimizer_alone_s(self) -> float:
        """Rule 10: the optimizer ops on Rule 1's clocks from idle (no policy acts there)."""
        a = self._opt_start
        h, d = self.host_op_s[a:], self.op_s[a:]
        if not len(d):
            return 0.0
        if self.sync_copies:
            return float(h.sum() + d.sum())
        hcum, dcum = np.cumsum(h), np.concatenate([[0.0], np.cumsum(d)])
        return float(dcum[-1] + max(0.0, float((hcum - dcum[:-1]).max())))

    def _timeline(
        self, hx: np.ndarray, dx: np.ndarray, floors_rows: np.ndarray, live: np.ndarray
    ) -> dict[str, list[float]]:
        """Op start times on the compute stream (Rule 1), from the walk's clocks at its events (rows of op,
        host clock, compute clock), and live bytes."""
        floors = {int(at): (float(h), float(d)) for at, h, d in floors_rows.tolist()}
        ih = ed = 0.0
        starts = []
        for i in range(self.n_ops):
            if i in floors:
                ih, ed = floors[i]
            if self.sync_copies:
                start = ed + hx[i] + self.host_op_s[i] + dx[i]
            else:
                ih += hx[i] + self.host_op_s[i]
                start = max(ed, ih) + dx[i]
            starts.append(float(start))
            ed = start + self.op_s[i]
            if self.sync_copies:
                ih = ed
        return {"op_start_s": starts, "live_bytes": live.astype(float).tolist()}


def simulate(
    w: Workload,
    hw: HardwareProfile,
    policy: Policy | Sequence[int] | np.ndarray,
    *,
    budget_bytes: int | None = None,
    options: PolicyOptions | None = None,
    timeline: bool = False,
) -> SimResult:
    """One-off simulation; build a :class:`Simulator` once to score many policies."""
    return Simulator(w, hw).run(policy, budget_bytes=budget_bytes, options=options, timeline=timeline)


#: Rule 16: the torch.compile backends whose buffer reuse sums a shared parameter's gradients in place.
IN_PLACE_BACKENDS = frozenset({"inductor"})
#: Rule 16: the host costs of the runtime's own work, none of which runs in a compiled step.
RUNTIME_HOST_COSTS = ("frame_s", "pack_s", "unpack_s", "swap_s", "region_s", "region_pack_s", "record_op_s",
                      "replay_op_s")  # fmt: skip


_COMPILED = "; the runtime's own costs 0 under torch.compile (Rule 16)"


def compiled_twin(w: Workload, hw: HardwareProfile, backend: str = "inductor") -> tuple[Workload, HardwareProfile]:
    """Rule 16: the workload and profile that simulate a step trained under ``torch.compile`` with ``backend``
    (``policy.compiled``): marked ``meta["compiled"]`` (both simulators then plan no region and free each
    replay's temporaries at their last reader), the runtime's host costs 0, and Rule 15's sums as traced
    unless the backend reuses buffers. The candidates, keys, frames, fingerprints and the profile's name are
    the originals', so a policy made on the twin is the workload's, its schedule's regions included (the
    eager runtime's, where the file is applied eagerly). Idempotent: the twin's twin is the twin."""
    ops = w.ops
    if backend not in IN_PLACE_BACKENDS and any(op.in_place_into >= 0 for op in ops):
        ops = [replace(op, in_place_into=-1) if op.in_place_into >= 0 else op for op in ops]
    zero = dict.fromkeys(RUNTIME_HOST_COSTS, 0.0)
    source = hw.host.source if hw.host.source.endswith(_COMPILED) else f"{hw.host.source}{_COMPILED}"
    host = replace(hw.host, **zero, source=source)
    return replace(w, ops=ops, meta={**w.meta, "compiled": backend}), replace(hw, host=host)


def uniform_actions(w: Workload, action: Action) -> np.ndarray:
    """The same action for every candidate, as ``autotune simulate --action`` means it.

    For ``recompute``, block inputs (``Candidate.block_input``) are kept: recomputing them too would, by
    Rule 7, regenerate the whole forward at the first backward use and save nothing. Keeping them is what
    ``torch.utils.checkpoint`` on every block does."""
    vec = np.full(len(w.candidates), Action(action).code, dtype=np.int8)
    if action == Action.RECOMPUTE:
        vec[[i for i, c in enumerate(w.candidates) if c.block_input]] = KEEP
    return vec


def frugal_starts(w: Workload) -> dict[str, np.ndarray]:
    """The uniform policies that hold least, by what they do: where a search for a low budget starts."""
    return {
        "recompute everything": np.full(len(w.candidates), RECOMPUTE, dtype=np.int8),
        "recompute every block's inside": uniform_actions(w, Action.RECOMPUTE),
        "swap everything": uniform_actions(w, Action.SWAP),
    }


@dataclass(frozen=True)
class Floor:
    """A lower bound on the peak of every policy (:func:`peak_floor`), with what makes it up at its op."""

    bytes: int
    op: int  # the op where no policy can hold less
    state_bytes: int  # parameters, optimizer state, the batch: live through the whole iteration
    held_bytes: int  # the other tensors that are not candidates (gradients, temporaries), as traced
    activation_bytes: int  # candidates live there whatever is done with them
    workspace_bytes: int


def peak_floor(w: Workload, hw: HardwareProfile) -> Floor:
    """What any policy holds at least, at the op where that is most (NOTE [ Simulator semantics ]).

    Under every action a candidate is live over [producer, free_if_dropped_op] (Rules 3, 4, 7, 8, 11: the
    original storage) and over [first, last backward use] (kept, copied back, regenerated or unpacked there:
    Rules 3, 5, 7, 8, 11); tensors that are not candidates keep their traced intervals or longer (Rules 2,
    7, 11); an op's workspace is live during it (Rule 2), and a recompute only adds (Rule 7). So the live
    bytes of op i under any policy are at least those intervals' sum at i, and the peak at least its
    maximum. Admissible, not tight: it is what no policy can go below, not what one reaches."""
    n, g = len(w.ops), hw.alloc_granularity_bytes
    cands = {c.tensor for c in w.candidates}
    state = sum(rounded(t.nbytes, g) for t in w.tensors if t.persistent and t.id not in cands)
    others = memory_timeline(w, g, exclude=cands) - in_place_bytes(w, g)  # workspace and state included; Rule 15
    ws = workspace_bytes(w)
    delta = np.zeros(n + 1, dtype=np.int64)
    for c in w.candidates:
        size = rounded(w.tensors[c.tensor].nbytes, g)
        spans = [(c.producer, c.free_if_dropped_op)]
        if c.bwd_uses:
            first, last = min(c.bwd_uses), max(c.bwd_uses)
            if first <= c.free_if_dropped_op + 1:  # overlapping or adjacent: one span
                spans = [(c.producer, max(last, c.free_if_dropped_op))]
            else:
                spans.append((first, last))
        for a, b in spans:
            delta[a] += size
            delta[b + 1] -= size
    if not n:
        return Floor(state, 0, state, 0, 0, 0)
    held = np.cumsum(delta[:n])
    total = others + held
    i = int(np.argmax(total))
    return Floor(int(total[i]), i, state, int(others[i] - ws[i] - state), int(held[i]), int(ws[i]))
