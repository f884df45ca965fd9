"""Simulator: hand-computed answers on tiny workloads, agreement with the op-by-op reference, and with the
no-policy peak of the trace. Rule numbers refer to NOTE [ Simulator semantics ] in envs/simulator.py."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from agents.base import Problem, SearchContext, get_searcher
from envs.simulator import Floor, Simulator, compiled_twin, peak_floor, simulate, uniform_actions
from envs.simulator_reference import simulate_reference
from runtime.hardware import get_profile
from runtime.plan import regions_for
from runtime.policy import Action, Policy, PolicyOptions
from runtime.trace import capture
from runtime.vocab import COMPRESS, KEEP, RECOMPUTE, SWAP
from runtime.workload import OpInfo, Phase, Workload, peak_report
from tests.synthetic import (
    chain_workload,
    diamond_workload,
    fixed_profile,
    framed_chain_workload,
    two_op_chain_workload,
)
from tests.test_trace import mlp_build, tiny_cnn_build

S = 1000  # bytes per tensor
TAU = 1e-3  # seconds per op


def test_chain_keep_all() -> None:
    w = chain_workload(16, S, TAU)
    r = simulate(w, fixed_profile(), np.zeros(16, dtype=np.int8))
    # First backward op: x, c_0..c_15 and the gradient g_0 are live.
    assert (r.peak_bytes, r.peak_op) == (18 * S, 16)
    assert r.iter_s == pytest.approx(32 * TAU)
    assert r.recompute_s == r.stall_s == r.compress_s == 0.0


def test_chain_sqrt_checkpointing() -> None:
    """Chen et al.'s sqrt(n) checkpoints on 16 layers: keep c_3, c_7, c_11, c_15, recompute the rest."""
    w = chain_workload(16, S, TAU)
    acts = np.full(16, RECOMPUTE, dtype=np.int8)
    acts[[3, 7, 11, 15]] = KEEP
    r = simulate(w, fixed_profile(), acts)
    # Rule 7, recursively: c_14's first use (op 17) regenerates c_12, c_13, c_14 from c_11. Live then:
    # x, c_3, c_7, c_11, c_12..c_14, g_0 and g_1 = 9 tensors.
    assert (r.peak_bytes, r.peak_op) == (9 * S, 17)
    # Every dropped layer is re-run exactly once: 12 ops.
    assert r.recompute_s == pytest.approx(12 * TAU)
    assert r.iter_s == pytest.approx(44 * TAU)


def _swap_first(n: int, transfer_s: float) -> tuple[Simulator, np.ndarray]:
    w = chain_workload(n, S, TAU)
    acts = np.zeros(n, dtype=np.int8)
    acts[0] = SWAP
    bps = S / transfer_s
    return Simulator(w, fixed_profile(bps, bps)), acts


def test_swap_hidden_under_compute() -> None:
    """c_0 of a 4-layer chain, transfers of one op time, look-ahead 2: unpack points are ops 4..7, so
    the copy back is issued before op 5 (5 ms), arrives at 6 ms, before its use at op 7 (7 ms)."""
    sim, acts = _swap_first(4, TAU)
    r = sim.run(acts, options=PolicyOptions(prefetch_lookahead=2, release_after=1), timeline=True)
    assert r.stall_s == 0.0
    assert r.iter_s == pytest.approx(8 * TAU)
    assert r.d2h_bytes == r.h2d_bytes == S
    # Rule 4: the copy out runs 1-2 ms; the next pack point, c_1's pack after op 1 (2 ms), is its release
    # point and finds it done: c_0 leaves the device after op 1, as if dropped. Rule 5: the copy back is
    # allocated at op 5. Op 2 holds x, c_1, c_2 only.
    assert r.timeline is not None and r.timeline["live_bytes"][2] == 3 * S


def test_swap_that_cannot_hide() -> None:
    """Same with transfers of three op times: the copy back runs 5-8 ms, the use is at 7 ms: 1 ms of stall,
    the transfer time not covered by compute. Released three pack points later (c_3's, after op 3 at 4 ms,
    when the copy out of 1-4 ms has just ended), c_0 stays on the device to op 3 without a wait."""
    sim, acts = _swap_first(4, 3 * TAU)
    r = sim.run(acts, options=PolicyOptions(prefetch_lookahead=2, release_after=3), timeline=True)
    assert r.stall_s == pytest.approx(TAU)
    assert r.iter_s == pytest.approx(9 * TAU)
    assert r.timeline is not None and r.timeline["live_bytes"][3] == 5 * S  # x, c_0..c_3
    on_demand = sim.run(acts, options=PolicyOptions(prefetch_lookahead=0, release_after=3))
    assert on_demand.stall_s == pytest.approx(3 * TAU)  # issued at its use: the whole transfer


def test_an_early_release_point_waits_for_the_copy() -> None:
    """Rule 4 with release_after 1 and the copy out of 1-4 ms: at c_1's pack (after op 1, 2 ms) the compute
    stream waits 2 ms for it, then c_0 is gone from op 2 on (x, c_1, c_2 there). Everything after moves by
    2 ms: the copy back, issued before op 5 (7 ms), arrives at 10 ms, 1 ms after op 7 could start (9 ms)."""
    sim, acts = _swap_first(4, 3 * TAU)
    opts = PolicyOptions(prefetch_lookahead=2, release_after=1)
    r = sim.run(acts, options=opts, timeline=True)
    assert r.stall_s == pytest.approx(3 * TAU)
    assert r.iter_s == pytest.approx(11 * TAU)
    assert r.timeline is not None and r.timeline["live_bytes"][2] == 3 * S
    assert r.timeline["op_start_s"][2] == pytest.approx(4 * TAU)
    _assert_same(r, simulate_reference(sim.w, sim.hw, acts, options=opts))


def test_without_enough_pack_points_the_bytes_go_at_the_first_handled_use() -> None:
    """Rule 4 with release_after 4 and only three pack points after c_0's: it is let go just before its own
    first backward use (op 7), where the copy out has long ended: no wait, and c_0 is on the device to op 6."""
    sim, acts = _swap_first(4, 3 * TAU)
    opts = PolicyOptions(prefetch_lookahead=2, release_after=4)
    r = sim.run(acts, options=opts, timeline=True)
    assert r.stall_s == pytest.approx(TAU)  # the copy back only, as above
    assert r.timeline is not None and r.timeline["live_bytes"][2] == 4 * S  # x, c_0, c_1, c_2
    _assert_same(r, simulate_reference(sim.w, sim.hw, acts, options=opts))


def test_a_host_bound_chain_runs_at_the_hosts_pace() -> None:
    """Rule 1 with the host slower than the device: each op costs the host 2 ms to issue and the device 1 ms,
    so the 32 ops of the 16-layer chain start as the host issues them: the last at 64 ms, done at 65 ms."""
    w = chain_workload(16, S, TAU)
    keep = np.zeros(16, dtype=np.int8)
    hw = fixed_profile(op_s=2 * TAU)
    r = simulate(w, hw, keep, timeline=True)
    assert r.iter_s == pytest.approx(65 * TAU)
    assert r.host_s == pytest.approx(64 * TAU) and r.overhead_s == 0.0
    assert r.timeline is not None and r.timeline["op_start_s"][:3] == pytest.approx([2 * TAU, 4 * TAU, 6 * TAU])
    _assert_same(r, simulate_reference(w, hw, keep))
    # Device-bound (issuing takes half an op): only the first op waits for its issue.
    fast_host = simulate(w, fixed_profile(op_s=TAU / 2), keep)
    assert fast_host.iter_s == pytest.approx(TAU / 2 + 32 * TAU)


def test_the_runtimes_host_costs_show_where_the_host_is_behind() -> None:
    """Rule 12 on sqrt(n) checkpointing of the 16-layer chain (12 replayed ops, in chains of 3 at ops 17, 21,
    25, 29): hooks cost 0.25 ms per pack and per unpack (16 packs), the recorder 0.5 ms per forward op, a
    replayed op 1 ms beyond its issue (free). Host time: 8 + 4 + 4 + 12 = 28 ms, all of it overhead.
    Forward: op i is issued at 0.5 + 0.75 i ms, so op 0 waits 0.5 ms and the rest is device-bound (done at
    16.5 ms). Backward: at op 17 the host (12.25 ms) issues the 3 replays by 15.25 ms while the device, at
    17.5, runs them to 20.5: the device stays ahead of the host, and the iteration is 44 ms + 0.5 ms."""
    w = chain_workload(16, S, TAU)
    acts = np.full(16, RECOMPUTE, dtype=np.int8)
    acts[[3, 7, 11, 15]] = KEEP
    hw = fixed_profile(pack_s=TAU / 4, unpack_s=TAU / 4, record_op_s=TAU / 2, replay_op_s=TAU)
    r = simulate(w, hw, acts)
    assert r.overhead_s == pytest.approx(8 * TAU + 4 * TAU + 4 * TAU + 12 * TAU)
    assert r.host_s == pytest.approx(r.overhead_s)  # issuing costs nothing here
    assert r.recompute_s == pytest.approx(12 * TAU)
    assert r.iter_s == pytest.approx(44.5 * TAU)
    _assert_same(r, simulate_reference(w, hw, acts))
    # At 4 ms per replayed op the host falls behind: at op 17 it issues the replays at 16.25, 20.25 and
    # 24.25 ms, the device runs each when issued... and so on at ops 21, 25, 29: done at 67.25 ms.
    slow = fixed_profile(pack_s=TAU / 4, unpack_s=TAU / 4, record_op_s=TAU / 2, replay_op_s=4 * TAU)
    behind = simulate(w, slow, acts)
    assert behind.iter_s == pytest.approx(67.25 * TAU)
    _assert_same(behind, simulate_reference(w, slow, acts))
    # Two quiet ops (a view, a size query) after every forward op: not ops of the workload, but the recorder
    # records them, so it costs 3 x 0.5 ms per forward op: 24 ms instead of 8.
    for op in w.ops[:16]:
        op.quiet_ops = 2
    quiet = simulate(w, hw, acts)
    assert quiet.overhead_s == pytest.approx(24 * TAU + 4 * TAU + 4 * TAU + 12 * TAU)
    _assert_same(quiet, simulate_reference(w, hw, acts))


def test_a_region_recomputes_its_block_at_its_first_backward_op() -> None:
    """Rule 11 on a 4-layer chain in two blocks of two (tests/synthetic.py): recomputing c_0 and c_1 makes
    block b0 a region (runtime/plan.py: both packed inside it only, and c_2 kept). Backward reaches b0 at op
    6 (layer 1's backward): the device re-runs ops 0-1 there (2 ms) and c_0, c_1 are back from op 6 on. With
    a region costing the host 10 ms in forward and again in backward, the host is behind at op 0 (issued at
    10 ms) and at op 6 (issued at 20 ms, the device free at 16 ms): 2 ms of recompute, done at 24 ms."""
    w = framed_chain_workload(4, S, TAU, block=2)
    acts = np.array([RECOMPUTE, RECOMPUTE, KEEP, KEEP], dtype=np.int8)
    hw = fixed_profile(region_s=10 * TAU)
    r = simulate(w, hw, acts, timeline=True)
    assert r.regions == 1 and r.recompute_s == pytest.approx(2 * TAU)
    assert r.iter_s == pytest.approx(24 * TAU)
    assert r.overhead_s == pytest.approx(20 * TAU) and r.host_s == pytest.approx(20 * TAU)
    # Memory: c_0 and c_1 dropped after their forward use (ops 0-3: x and the live activations). Op 6
    # holds x, c_0 and c_1 (regenerated), the gradient coming in (made by op 5, outside the block) and its
    # own output; op 7 holds x, c_0, op 6's output and its own, and the gradient coming in still: the node's
    # caller holds it until the block's backward is done (Rule 11), where plain training freed it after op 6.
    assert r.timeline is not None
    assert r.timeline["live_bytes"] == [2 * S, 3 * S, 3 * S, 3 * S, 4 * S, 4 * S, 5 * S, 5 * S]
    _assert_same(r, simulate_reference(w, hw, acts))
    # Under checkpoint (region_nodes off) the gradient goes after op 6 as in plain training.
    ckpt = PolicyOptions(region_nodes=False)
    c = simulate(w, hw, acts, options=ckpt, timeline=True)
    assert c.timeline is not None
    assert c.timeline["live_bytes"] == [2 * S, 3 * S, 3 * S, 3 * S, 4 * S, 4 * S, 5 * S, 4 * S]
    _assert_same(c, simulate_reference(w, hw, acts, options=ckpt))
    # Keeping c_1 disqualifies b0 (P2), but not layer 0's own call, which makes c_0 and packs it alone.
    mixed = [RECOMPUTE, KEEP, KEEP, KEEP]
    assert [r.module for r in regions_for(w, np.array(mixed))] == ["b0.l0"]
    one = simulate(w, hw, np.array(mixed, dtype=np.int8))
    assert one.regions == 1 and one.recompute_s == pytest.approx(TAU)


def test_diamond_skip_connection() -> None:
    w = diamond_workload(S, TAU)
    hw = fixed_profile()
    keep = simulate(w, hw, [KEEP, KEEP], timeline=True)
    assert keep.timeline is not None
    assert keep.timeline["live_bytes"] == [2 * S, 3 * S, 4 * S, 5 * S, 5 * S, 4 * S, 2 * S]
    # Recompute b from a (kept): b leaves after op 2, comes back at op 4 for one op time.
    rb = simulate(w, hw, [KEEP, RECOMPUTE], timeline=True)
    assert rb.timeline is not None and rb.timeline["live_bytes"][3] == 4 * S
    assert (rb.peak_bytes, rb.recompute_s) == (5 * S, pytest.approx(TAU))
    # Recompute both: at op 4, a first (from x), then b (from a, now resident): two op times.
    both = simulate(w, hw, [RECOMPUTE, RECOMPUTE], timeline=True)
    assert both.timeline is not None and both.timeline["live_bytes"][3] == 3 * S
    assert both.recompute_s == pytest.approx(2 * TAU)
    # Recompute b while a is swapped: b's recompute needs a, so a comes back first (Rules 6, 7).
    mixed = simulate(w, fixed_profile(S / TAU, S / TAU), [SWAP, RECOMPUTE])
    assert mixed.recompute_s == pytest.approx(TAU) and mixed.h2d_bytes == S


def test_compress_halves_fp32_storage() -> None:
    """Rule 8 on the MLP: the float32 ReLU output (96 B) is held as 48 B of bf16 between forward and
    backward, with a pack and an unpack kernel."""
    w = capture(mlp_build(), name="mlp", batch_size=3)
    hw = get_profile("a100-40gb")
    acts = np.array([COMPRESS, KEEP, KEEP], dtype=np.int8)
    opts = PolicyOptions(lossy=True)
    r, ref = simulate(w, hw, acts, options=opts), simulate_reference(w, hw, acts, options=opts)
    assert r.compress_s == pytest.approx(2 * hw.op_time_s(0, 96 + 48, "fp32"))
    assert r.peak_bytes == ref.peak_bytes and r.iter_s == pytest.approx(ref.iter_s)


@pytest.mark.parametrize("profile", ["a100-40gb", "v100-16gb", "t4"])
def test_keep_all_equals_trace_peak(profile: str) -> None:
    hw = get_profile(profile)
    for build in (mlp_build(), tiny_cnn_build()):
        w = capture(build, name="w", batch_size=2)
        r = simulate(w, hw, np.zeros(len(w.candidates), dtype=np.int8))
        assert r.peak_bytes == peak_report(w, hw.alloc_granularity_bytes).peak_bytes
        # Issuing costs the host no more than an op's launch: only the first op waits for it (Rule 1).
        assert r.iter_s == pytest.approx(r.compute_s + hw.host.op_s)


def test_policy_object_and_vector_agree() -> None:
    w = capture(tiny_cnn_build(), name="cnn", batch_size=2)
    hw = get_profile("a100-40gb")
    policy = Policy.uniform(w, Action.SWAP, hardware=hw.name, options=PolicyOptions(prefetch_lookahead=1))
    by_policy = simulate(w, hw, policy)
    by_vector = simulate(w, hw, policy.to_vector(w), options=PolicyOptions(prefetch_lookahead=1))
    assert by_policy == by_vector


def test_uniform_recompute_keeps_block_inputs() -> None:
    w = capture(tiny_cnn_build(), name="cnn", batch_size=2)
    vec = uniform_actions(w, Action.RECOMPUTE)
    assert all((v == KEEP) == c.block_input for v, c in zip(vec, w.candidates, strict=True))


def _random_policies(k: int, count: int, seed: int) -> list[tuple[np.ndarray, PolicyOptions]]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        acts = rng.integers(0, 4, k).astype(np.int8)
        if i % 4 == 0:  # uniform policies too
            acts[:] = rng.integers(0, 4)
        opts = PolicyOptions(prefetch_lookahead=int(rng.integers(0, 6)), lossy=True,
                             compress_dtype=["bfloat16", "float8_e4m3fn"][i % 2], region_nodes=i % 3 != 0)  # fmt: skip
        out.append((acts, opts))
    return out


def _assert_same(fast, ref) -> None:  # type: ignore[no-untyped-def]
    for name in ("peak_bytes", "peak_op", "d2h_bytes", "h2d_bytes", "regions", "host_over_bytes", "feasible"):
        assert getattr(fast, name) == getattr(ref, name), name
    for name in ("iter_s", "recompute_s", "compress_s", "stall_s", "host_s", "overhead_s"):
        assert getattr(fast, name) == pytest.approx(getattr(ref, name), rel=1e-9, abs=1e-15), name
    if fast.timeline is not None:  # the reference always has one
        assert fast.timeline["live_bytes"] == ref.timeline["live_bytes"]
        assert fast.timeline["op_start_s"] == pytest.approx(ref.timeline["op_start_s"], rel=1e-9, abs=1e-15)


@pytest.mark.parametrize("profile", ["a100-40gb", "t4", "cpu"])
def test_fast_equals_reference_on_random_policies(profile: str) -> None:
    """The vectorised simulator (precomputed closures, no per-op loop) equals the op-by-op reference."""
    hw = get_profile(profile)
    for build, seed in ((tiny_cnn_build(), 1), (mlp_build(layers=3), 2)):
        w = capture(build, name="w", batch_size=2)
        sim = Simulator(w, hw)
        for acts, opts in _random_policies(len(w.candidates), 150, seed):
            _assert_same(sim.run(acts, options=opts, timeline=True), simulate_reference(w, hw, acts, options=opts))


def test_the_compiled_walk_equals_the_same_walk_run_as_python(monkeypatch: pytest.MonkeyPatch) -> None:
    """envs/walk.py compiled by numba (the host adds, the event walk, the live bytes) computes what its
    source computes as plain Python, to the bit: the timelines, clocks and every figure of random policies on
    both a GPU profile and the CPU's."""
    from envs import walk

    pairs = (
        (walk.compiled(), walk.walk),
        (walk.compiled_live(), walk.live_bytes),
        (walk.compiled_host(), walk.host_adds),
    )
    for compiled, source in pairs:
        assert compiled is not source and hasattr(compiled, "signatures")  # a numba dispatcher, not the source
    w = capture(tiny_cnn_build(), name="w", batch_size=2)
    for profile in ("a100-40gb", "cpu"):
        sim = Simulator(w, get_profile(profile))
        policies = _random_policies(len(w.candidates), 40, 7)
        fast = [sim.run(acts, options=opts, timeline=True).to_dict() for acts, opts in policies]
        with monkeypatch.context() as m:
            m.setattr(walk, "compiled", lambda: walk.walk)
            m.setattr(walk, "compiled_live", lambda: walk.live_bytes)
            m.setattr(walk, "compiled_host", lambda: walk.host_adds)
            plain = [sim.run(acts, options=opts, timeline=True).to_dict() for acts, opts in policies]
        assert fast == plain


def test_the_floor_of_the_diamond_is_its_keep_all_peak() -> None:
    """At op 4 (mul_backward) x, the seed s and gb are held as traced, and a and b are read: 5 tensors,
    whatever the policy; keeping both reaches it."""
    w = diamond_workload(S, TAU)
    hw = fixed_profile()
    assert peak_floor(w, hw) == Floor(5 * S, 4, S, 2 * S, 2 * S, 0)
    assert simulate(w, hw, [KEEP, KEEP]).peak_bytes == 5 * S


def test_the_floor_of_the_chain() -> None:
    """Backward op 17 reads c_14 and g_0 and writes g_1, with x live throughout: 4 tensors. Any c_i is
    live from its layer to the next one and at its backward op, so no op of the 16-layer chain needs more;
    no policy reaches it (recomputing c_14 at op 17 re-runs layers 0..14 or holds a checkpoint)."""
    w = chain_workload(16, S, TAU)
    assert peak_floor(w, fixed_profile()) == Floor(4 * S, 17, S, 2 * S, S, 0)


@pytest.mark.parametrize("profile", ["a100-40gb", "cpu"])
def test_no_policy_goes_below_the_floor(profile: str) -> None:
    """peak_floor is a bound on every action and option, regions included, in both simulators."""
    hw = get_profile(profile)
    workloads = [capture(b, name="w", batch_size=2) for b in (tiny_cnn_build(), mlp_build(layers=3))]
    workloads += [framed_chain_workload(12, S, TAU, block) for block in (3, 4)]
    for seed, w in enumerate(workloads):
        floor = peak_floor(w, hw).bytes
        sim = Simulator(w, hw)
        peaks = []
        for acts, opts in _random_policies(len(w.candidates), 120, seed):
            peaks.append(sim.run(acts, options=opts).peak_bytes)
            if len(peaks) % 10 == 0:
                assert simulate_reference(w, hw, acts, options=opts).peak_bytes >= floor
        assert min(peaks) >= floor


@pytest.mark.slow
def test_fast_equals_reference_on_resnet18() -> None:
    import torch
    import torchvision

    def build():  # type: ignore[no-untyped-def]
        x, y = torch.randn(2, 3, 64, 64), torch.randint(0, 1000, (2,))
        return (
            torchvision.models.resnet18(),
            (x, y),
            lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]),
        )

    w = capture(build, name="resnet18", batch_size=2)
    for profile in ("a100-40gb", "v100-16gb"):
        hw = get_profile(profile)
        sim = Simulator(w, hw)
        for acts, opts in _random_policies(len(w.candidates), 60, 3):
            _assert_same(sim.run(acts, options=opts, timeline=True), simulate_reference(w, hw, acts, options=opts))


def _with_optimizer_op(n: int, opt_s: float) -> Workload:
    """The 16-layer chain plus one optimizer op (reads and rewrites the persistent input) of ``opt_s``."""
    w = chain_workload(n, S, TAU)
    w.ops.append(OpInfo(2 * n, "aten._foreach_add_.List", Phase.OPTIMIZER, "<optimizer>", 0.0, 2 * S, (0,), (0,),
                        opt_s))  # fmt: skip
    return w


@pytest.mark.parametrize(("action", "one_micro_batch"), [("keep", 32), ("sqrt", 44)])
def test_gradient_accumulation_runs_micro_batches_k_times_and_the_step_once(action: str, one_micro_batch: int) -> None:
    """Rule 10: k micro-batches of the traced one (32 ops kept, 44 with sqrt checkpointing: see above) and
    one optimizer step of 2 tau; the peak is the traced micro-batch's."""
    acts = np.zeros(16, dtype=np.int8)
    if action == "sqrt":
        acts[:] = RECOMPUTE
        acts[[3, 7, 11, 15]] = KEEP
    single = _with_optimizer_op(16, 2 * TAU)
    one = simulate(single, fixed_profile(), acts)
    assert one.iter_s == pytest.approx((one_micro_batch + 2) * TAU)
    w = _with_optimizer_op(16, 2 * TAU)
    w.grad_accum = 3
    r = simulate(w, fixed_profile(), acts)
    assert r.iter_s == pytest.approx((3 * one_micro_batch + 2) * TAU)
    assert r.samples_per_s == pytest.approx(3 * w.batch_size / r.iter_s)
    assert r.peak_bytes == one.peak_bytes
    ref = simulate_reference(w, fixed_profile(), acts)
    assert ref.peak_bytes == r.peak_bytes
    assert (ref.iter_s, ref.samples_per_s) == pytest.approx((r.iter_s, r.samples_per_s), rel=1e-9)


def test_swapped_bytes_beyond_the_host_memory_do_not_fit() -> None:
    """Rule 2's host side: the runtime pins one host buffer per swapped tensor (R3), so on a profile bounding
    its host memory a policy that swaps more is infeasible however low its device peak, by exactly the excess;
    the reference agrees, a CPU profile (one memory) ignores the bound, and the search answers within it."""
    w = chain_workload(8, 1000, 1e-3)
    swap_all = [SWAP] * 8
    hw = dataclasses.replace(fixed_profile(), host_memory_bytes=5000)
    r = Simulator(w, hw).run(swap_all, budget_bytes=10**9)
    assert r.d2h_bytes == 8000 and r.host_over_bytes == 3000 and not r.feasible
    assert r.shortfall_bytes == r.peak_bytes + 3000
    _assert_same(r, simulate_reference(w, hw, swap_all, budget_bytes=10**9))
    unbounded = Simulator(w, fixed_profile()).run(swap_all, budget_bytes=10**9)
    assert unbounded.feasible and unbounded.host_over_bytes == 0 and unbounded.peak_bytes == r.peak_bytes
    cpu = dataclasses.replace(fixed_profile(is_gpu=False), host_memory_bytes=5000)
    assert Simulator(w, cpu).run(swap_all, budget_bytes=10**9).feasible
    # Five of eight swapped fit the host exactly; a search within a tight device budget stays within both.
    budget = Simulator(w, hw).run([SWAP] * 5 + [RECOMPUTE] * 3, budget_bytes=10**9).peak_bytes
    found = get_searcher("portfolio").search(Problem(w, hw, budget), SearchContext(time_limit_s=3))
    assert found.feasible and found.result.d2h_bytes <= 5000 and found.result.peak_bytes <= budget


def test_rule_16_a_compiled_step_drops_each_replays_temporaries_and_costs_the_host_nothing() -> None:
    """Three layers of two ops (tests/synthetic.py: t_i, then c_i), everything recomputed. At the first
    backward op every c_i is re-made, nested, each replay making t_i again. The eager runtime's replays hold
    their temporaries until the outermost one is done (Rule 7): x, the three c_i and the three t_i, 7 S. A
    compiled graph frees t_i once c_i is made (Rule 16): at most x, the three c_i and one t_i, 5 S, keep-all's
    peak. The runtime's host costs are gone, so the step is its compute and the recompute alone: 9 ops and 6
    replayed, 15 op times, where the eager runtime's 6 replayed ops cost the host 1 ms each. Both simulators
    agree."""
    s, n, tau = S, 3, TAU / 10  # the host behind: 1 ms a replayed op, 0.1 ms an op
    w = two_op_chain_workload(n, s, tau)
    hw = fixed_profile(replay_op_s=1e-3)
    tw, th = compiled_twin(w, hw, "aot_eager")
    assert th.name == hw.name and th.host.replay_op_s == 0.0 and tw.candidates == w.candidates
    assert compiled_twin(tw, th, "aot_eager") == (tw, th)  # the twin's twin is the twin
    everything = uniform_actions(w, Action.RECOMPUTE)
    eager, compiled = Simulator(w, hw).run(everything), Simulator(tw, th).run(everything)
    assert eager.peak_bytes == (2 * n + 1) * s
    assert compiled.peak_bytes == (n + 2) * s == Simulator(tw, th).run(uniform_actions(w, Action.KEEP)).peak_bytes
    assert compiled.iter_s == pytest.approx(5 * n * tau, rel=1e-12)
    assert eager.iter_s > 2 * n * 1e-3 > 3 * compiled.iter_s
    for ww, hh in ((w, hw), (tw, th)):
        for vec in (everything, np.array([RECOMPUTE, KEEP, RECOMPUTE], dtype=np.int8)):
            r, ref = Simulator(ww, hh).run(vec), simulate_reference(ww, hh, vec)
            assert (r.peak_bytes, r.iter_s) == (ref.peak_bytes, pytest.approx(ref.iter_s, rel=1e-12))
    # No module call is a region in a compiled step: the block the eager runtime recomputes as one (Rule 11:
    # 24 op times, 20 of them the region's host costs) is two replays there, 8 ops and 2 re-run. A policy made
    # on the twin still carries the eager runtime's regions in its schedule, for a file applied eagerly.
    fw = framed_chain_workload(4, S, TAU, block=2)
    acts = np.array([RECOMPUTE, RECOMPUTE, KEEP, KEEP], dtype=np.int8)
    fh = fixed_profile(region_s=10 * TAU)
    ftw, fth = compiled_twin(fw, fh, "aot_eager")
    eager, compiled = Simulator(fw, fh).run(acts), Simulator(ftw, fth).run(acts)
    assert (eager.regions, eager.iter_s) == (1, pytest.approx(24 * TAU))
    assert (compiled.regions, compiled.iter_s) == (0, pytest.approx(10 * TAU))
    assert compiled.iter_s == pytest.approx(simulate_reference(ftw, fth, acts).iter_s, rel=1e-12)
    made = Policy.from_vector(ftw, acts, hardware="fixed").schedule
    assert made is not None and len(made.regions) == 1
    assert made == Policy.from_vector(fw, acts, hardware="fixed").schedule
