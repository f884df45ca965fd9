"""Simulator: hand-computed answers on tiny workloads, agreement with the op-by-op reference, and with the
no-policy peak of the trace. Rule numbers refer to NOTE [ Simulator semantics ] in envs/simulator.py."""

from __future__ import annotations

import numpy as np
import pytest

from envs.simulator import COMPRESS, KEEP, RECOMPUTE, SWAP, Simulator, simulate, uniform_actions
from envs.simulator_reference import simulate_reference
from runtime.hardware import get_profile
from runtime.policy import Action, Policy, PolicyOptions
from runtime.trace import capture
from runtime.workload import OpInfo, Phase, Workload, peak_report
from tests.synthetic import chain_workload, diamond_workload, fixed_profile
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


def _swap_first(n: int, transfer_s: float, lookahead: int) -> tuple[Simulator, np.ndarray, PolicyOptions]:
    w = chain_workload(n, S, TAU)
    acts = np.zeros(n, dtype=np.int8)
    acts[0] = SWAP
    bps = S / transfer_s
    return Simulator(w, fixed_profile(bps, bps)), acts, PolicyOptions(prefetch_lookahead=lookahead)


def test_swap_hidden_under_compute() -> None:
    """c_0 of a 4-layer chain, transfers of one op time, look-ahead 2: unpack points are ops 4..7, so
    the copy back is issued before op 5 (5 ms), arrives at 6 ms, before its use at op 7 (7 ms)."""
    sim, acts, opts = _swap_first(4, TAU, 2)
    r = sim.run(acts, options=opts, timeline=True)
    assert r.stall_s == 0.0
    assert r.iter_s == pytest.approx(8 * TAU)
    assert r.d2h_bytes == r.h2d_bytes == S
    # Rule 4: the copy out ends at 2 ms = op 2's start, so c_0 leaves the device after op 1 as if dropped;
    # Rule 5: the copy back is allocated at op 5. Op 2 holds x, c_1, c_2 only.
    assert r.timeline is not None and r.timeline["live_bytes"][2] == 3 * S


def test_swap_that_cannot_hide() -> None:
    """Same with transfers of three op times: the copy back runs 5-8 ms, the use is at 7 ms: 1 ms of stall,
    the transfer time not covered by compute. The copy out (1-4 ms) keeps c_0 on the device to op 3."""
    sim, acts, opts = _swap_first(4, 3 * TAU, 2)
    r = sim.run(acts, options=opts, timeline=True)
    assert r.stall_s == pytest.approx(TAU)
    assert r.iter_s == pytest.approx(9 * TAU)
    assert r.timeline is not None and r.timeline["live_bytes"][3] == 5 * S  # x, c_0..c_3
    on_demand = sim.run(acts, options=PolicyOptions(prefetch_lookahead=0))
    assert on_demand.stall_s == pytest.approx(3 * TAU)  # issued at its use: the whole transfer


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
        assert r.iter_s == pytest.approx(r.compute_s)


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
                             compress_dtype=["bfloat16", "float8_e4m3fn"][i % 2])  # fmt: skip
        out.append((acts, opts))
    return out


def _assert_same(fast, ref) -> None:  # type: ignore[no-untyped-def]
    for name in ("peak_bytes", "peak_op", "d2h_bytes", "h2d_bytes"):
        assert getattr(fast, name) == getattr(ref, name), name
    for name in ("iter_s", "recompute_s", "compress_s", "stall_s"):
        assert getattr(fast, name) == pytest.approx(getattr(ref, name), rel=1e-9, abs=1e-15), name
    assert fast.timeline["live_bytes"] == ref.timeline["live_bytes"]


@pytest.mark.parametrize("profile", ["a100-40gb", "t4", "cpu"])
def test_fast_equals_reference_on_random_policies(profile: str) -> None:
    """The vectorised simulator (precomputed closures, no per-op loop) equals the op-by-op reference."""
    hw = get_profile(profile)
    for build, seed in ((tiny_cnn_build(), 1), (mlp_build(layers=3), 2)):
        w = capture(build, name="w", batch_size=2)
        sim = Simulator(w, hw)
        for acts, opts in _random_policies(len(w.candidates), 150, seed):
            _assert_same(sim.run(acts, options=opts, timeline=True), simulate_reference(w, hw, acts, options=opts))


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
