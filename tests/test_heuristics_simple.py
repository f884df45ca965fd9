"""The simpler published heuristics, each on a small workload whose answer is known by hand or by brute
force: none, checkpoint-sqrt (Chen et al.), vdnn (Rhu et al.), superneurons (Wang et al.), zhang-swap
(Zhang et al.), torch-budget (torch.compile's knapsack). The shared contract is in
tests/test_searchers_contract.py. Rule numbers refer to NOTE [ Simulator semantics ] in envs/simulator.py."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
import torch
from torch import nn

from agents.base import Problem, Status, get_searcher
from agents.heuristics._knapsack import dp_knapsack, greedy_knapsack, ilp_knapsack
from agents.heuristics._selection import closure_classes
from agents.heuristics.checkpoint import budget_checkpoints, mirror_plan, sqrt_checkpoints
from agents.heuristics.superneurons import SuperNeurons
from agents.heuristics.torch_budget import Partitioner, TorchMemoryBudget, activation_fraction
from agents.heuristics.vdnn import VDNN_LOOKAHEAD, layer_inputs
from agents.heuristics.zhang import ZhangSwap
from envs.simulator import Simulator
from runtime.hardware import HardwareProfile, get_profile
from runtime.policy import PolicyOptions
from runtime.trace import capture
from runtime.vocab import KEEP, RECOMPUTE, SWAP
from runtime.workload import Workload, peak_report
from tests.synthetic import chain_workload, fixed_profile
from tests.test_trace import tiny_cnn_build

S = 1000  # bytes per tensor
TAU = 1e-3  # seconds per op
_HW = get_profile("v100-16gb")


def conv_bn_build(batch: int = 8):  # type: ignore[no-untyped-def]
    """Three Conv-BN-ReLU layers, global pooling and a classifier: a miniature ResNet stem."""

    def build():  # type: ignore[no-untyped-def]
        torch.manual_seed(0)
        layers: list[nn.Module] = []
        for c_in in (3, 16, 16):
            layers += [nn.Conv2d(c_in, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU()]
        net = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 5))
        x, y = torch.randn(batch, 3, 16, 16), torch.randint(0, 5, (batch,))
        return net, (x, y), lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1])

    return build


_CNN = capture(conv_bn_build(), name="conv-bn", batch_size=8)
_CNN_PEAK = peak_report(_CNN, _HW.alloc_granularity_bytes).peak_bytes


# -- none ----------------------------------------------------------------------------------------------------
def test_none_keeps_everything_and_reports_infeasible() -> None:
    w = capture(tiny_cnn_build(batch=4), name="cnn", batch_size=4)
    peak = peak_report(w, _HW.alloc_granularity_bytes).peak_bytes
    over = get_searcher("none").search(Problem(w, _HW, budget_bytes=peak - 1))
    assert over.status == Status.INFEASIBLE and not np.any(over.policy.to_vector(w))
    assert over.result.peak_bytes == peak
    assert get_searcher("none").search(Problem(w, _HW, budget_bytes=peak)).status == Status.FEASIBLE


# -- checkpoint-sqrt (Chen et al. 2016) ------------------------------------------------------------------------
def test_sqrt_plan_keeps_four_evenly_spaced_checkpoints_of_sixteen() -> None:
    """tests/test_simulator.py::test_chain_sqrt_checkpointing computes this plan by hand: keep c_3, c_7,
    c_11, c_15; each dropped layer is re-run once (12 op times); the peak is 9 tensors."""
    w = chain_workload(16, S, TAU)
    assert sqrt_checkpoints(w) == {3, 7, 11, 15}
    actions = mirror_plan(w, sqrt_checkpoints(w))
    assert np.flatnonzero(actions == KEEP).tolist() == [3, 7, 11, 15]
    assert np.all(actions[[i for i in range(16) if i % 4 != 3]] == RECOMPUTE)
    r = Simulator(w, fixed_profile()).run(actions)
    assert r.recompute_s == pytest.approx(12 * TAU)
    assert r.peak_bytes == 9 * S


def test_algorithm2_stores_a_point_once_its_segment_exceeds_the_budget() -> None:
    """Algorithm 2 on the 16-chain: with B = 3 tensors a segment closes at its 4th tensor (4 > 3)."""
    w = chain_workload(16, S, TAU)
    assert budget_checkpoints(w, 3 * S) == ({3, 7, 11, 15}, 4 * S, 4 * S)
    assert budget_checkpoints(w, 0)[0] == set(range(16))  # B = 0: every point is stored


def test_checkpoint_search_meets_the_sqrt_peak_at_most_at_its_cost() -> None:
    w = chain_workload(16, S, TAU)
    r = get_searcher("checkpoint-sqrt").search(Problem(w, fixed_profile(), budget_bytes=9 * S))
    assert r.feasible and r.result.peak_bytes <= 9 * S
    assert r.result.recompute_s <= 12 * TAU + 1e-12  # the sqrt plan is one of the plans it weighs
    assert not np.any(r.policy.to_vector(w) == SWAP)  # recompute only


# -- vdnn (Rhu et al. 2016) ----------------------------------------------------------------------------------
_TINY = capture(tiny_cnn_build(batch=16), name="cnn", batch_size=16)


@pytest.mark.parametrize(("w", "n_conv_inputs"), [(_TINY, 1), (_CNN, 2)], ids=["tiny-cnn", "conv-bn"])
def test_vdnn_offloads_exactly_the_convolution_inputs(w: Workload, n_conv_inputs: int) -> None:
    """vDNN_conv: with a budget that needs every convolution input offloaded, those and nothing else are
    swapped, prefetched one layer ahead."""
    p0 = Problem(w, _HW, budget_bytes=peak_report(w, _HW.alloc_granularity_bytes).peak_bytes)
    conv_inputs, _ = layer_inputs(p0)
    feats = p0.simulator.features
    assert conv_inputs == [i for i in range(p0.n) if "conv" in feats.consumer_classes[i]]
    assert len(conv_inputs) == n_conv_inputs
    options = PolicyOptions(prefetch_lookahead=VDNN_LOOKAHEAD, release_after=1)
    all_conv = np.zeros(p0.n, dtype=np.int8)
    all_conv[conv_inputs] = SWAP
    budget = p0.simulator.run(all_conv, options=options).peak_bytes
    assert budget < p0.budget_bytes  # a budget under the no-policy peak
    for last in conv_inputs:  # each of them is needed: keeping any one misses the budget
        fewer = all_conv.copy()
        fewer[last] = KEEP
        assert p0.simulator.run(fewer, options=options).peak_bytes > budget

    r = get_searcher("vdnn").search(Problem(w, _HW, budget_bytes=budget))
    assert r.feasible
    assert np.flatnonzero(r.policy.to_vector(w) == SWAP).tolist() == conv_inputs
    assert not np.any(r.policy.to_vector(w) == RECOMPUTE)
    assert r.policy.options.prefetch_lookahead == 1


# -- superneurons (Wang et al. 2018) --------------------------------------------------------------------------
@pytest.mark.parametrize("fraction", [0.85, 0.7, 0.6])
def test_superneurons_recomputes_only_cheap_layers_and_offloads_conv_outputs(fraction: float) -> None:
    """Conv-BN-ReLU x 3: convolution outputs (saved by BatchNorm) are offloaded, never recomputed; what is
    recomputed re-runs only cheap ops (normalization, activation, the pooling's mean); lower budgets need
    offloading."""
    budget = int(_CNN_PEAK * fraction)
    r = SuperNeurons().search(Problem(_CNN, _HW, budget_bytes=budget))
    assert r.status == Status.FEASIBLE and r.feasible and r.result.peak_bytes <= budget  # each budget is met
    actions = r.policy.to_vector(_CNN)
    sim = Problem(_CNN, _HW, budget_bytes=_CNN_PEAK).simulator
    feats, regenerated = sim.features, closure_classes(sim)
    recomputed, swapped = np.flatnonzero(actions == RECOMPUTE), np.flatnonzero(actions == SWAP)
    assert len(recomputed) + len(swapped) > 0
    assert all(feats.producer_class[i] not in ("conv", "matmul") for i in recomputed)
    assert all(regenerated[i] <= {"norm", "activation", "elementwise"} for i in recomputed)
    assert all(feats.producer_class[i] == "conv" for i in swapped)  # UTP offloads convolution outputs
    assert r.policy.options.prefetch_lookahead == 1
    if fraction <= 0.7:
        assert len(swapped) > 0


# -- zhang-swap (Zhang et al. 2019) ---------------------------------------------------------------------------
def _gpu_link(transfer_s: float) -> HardwareProfile:
    """The fixed-time profile with copy engines (Rule 1: copies overlap compute), moving S bytes in
    ``transfer_s``."""
    return dataclasses.replace(fixed_profile(S / transfer_s, S / transfer_s), is_gpu=True)


def test_zhang_swaps_longest_idle_first_without_overhead() -> None:
    """8-layer chain, transfers of one op time: c_i's idle interval is (14 - 2i) op times, so the DOA
    order is c_0, c_1, ...; each swap takes one tensor off the first backward op (Rules 4-5), so a budget
    3 tensors under the 10-tensor peak needs exactly c_0, c_1, c_2, and their copies hide (no stall)."""
    w = chain_workload(8, S, TAU)
    hw = _gpu_link(TAU)
    problem = Problem(w, hw, budget_bytes=7 * S)
    feats = problem.simulator.features
    assert np.all(np.diff(feats.idle_s) < 0)  # idle intervals shrink along the chain

    doa = ZhangSwap(priorities=("DOA",), modes=("no-overhead",)).search(problem)
    assert doa.status == Status.FEASIBLE and doa.result.peak_bytes <= 7 * S
    assert doa.feasible and doa.result.stall_s == 0.0
    assert np.flatnonzero(doa.policy.to_vector(w) == SWAP).tolist() == [0, 1, 2]
    assert doa.result.iter_s == pytest.approx(16 * TAU)

    best = get_searcher("zhang-swap").search(Problem(w, hw, budget_bytes=7 * S))
    assert best.status == Status.FEASIBLE and best.result.peak_bytes <= 7 * S
    assert best.feasible and best.result.stall_s == 0.0 and best.result.iter_s == pytest.approx(16 * TAU)


def test_zhang_no_overhead_mode_refuses_transfers_that_cannot_hide() -> None:
    """With transfers 20 op times long, no round trip fits any idle interval: the no-overhead mode swaps
    nothing, while stick-to-limit meets the budget at the price of stalls."""
    w = chain_workload(8, S, TAU)
    hw = _gpu_link(20 * TAU)
    quiet = ZhangSwap(modes=("no-overhead",)).search(Problem(w, hw, budget_bytes=9 * S))
    assert quiet.status == Status.INFEASIBLE and not np.any(quiet.policy.to_vector(w) == SWAP)
    loud = ZhangSwap(modes=("stick-to-limit",)).search(Problem(w, hw, budget_bytes=9 * S))
    assert loud.status == Status.FEASIBLE and loud.result.peak_bytes <= 9 * S and loud.result.stall_s > 0


# -- torch-budget (torch.compile's activation_memory_budget) ----------------------------------------------------
def _mm_chain(sizes: list[int], times_s: list[float]) -> Workload:
    """The chain workload with matrix products (banned ops: knapsack items) of the given sizes and times."""
    w = chain_workload(len(sizes), S, TAU)
    for i, (nbytes, t) in enumerate(zip(sizes, times_s, strict=True)):
        w.ops[i].name, w.ops[i].time_s = "aten.mm.default", t
        w.tensors[i + 1].nbytes = w.candidates[i].nbytes = nbytes
    return w


def test_torch_budget_saves_the_knapsack_optimum() -> None:
    """Six matrix products; the budget leaves 13/16 of the activation memory: the saved set is the
    brute-force 0-1 knapsack optimum (recompute c_1 and c_3), which greedy by runtime per byte misses."""
    sizes, times_s = [3000, 1000, 4000, 2000, 5000, 1000], [4e-3, 1e-3, 6e-3, 2.5e-3, 5.5e-3, 3e-3]
    w = _mm_chain(sizes, times_s)
    problem = Problem(w, fixed_profile(), budget_bytes=15 * S)
    fraction = activation_fraction(problem)  # (15 - x - g_0) / 18 tensors' worth of bytes
    assert fraction == pytest.approx(13 / 16)
    weights = [s / sum(sizes) for s in sizes]
    subsets = [m for m in itertools.product((0, 1), repeat=6) if np.dot(m, weights) <= fraction + 1e-12]
    values = sorted(((float(np.dot(m, times_s)), m) for m in subsets), reverse=True)
    optimum = values[0][1]
    assert values[0][0] > values[1][0] and optimum == (1, 0, 1, 0, 1, 1)  # unique
    assert sorted(greedy_knapsack(weights, times_s, fraction)[1]) != [i for i in range(6) if optimum[i]]

    part = Partitioner.build(problem)
    assert not np.any(part.free_aggr)  # matrix products are banned: all six are knapsack items
    plan = TorchMemoryBudget().plan(problem, fraction, part)
    assert tuple(int(a == KEEP) for a in plan) == optimum
    r = get_searcher("torch-budget").search(problem)
    assert r.feasible and np.array_equal(r.policy.to_vector(w), plan)
    assert r.result.recompute_s == pytest.approx(times_s[1] + times_s[3])


def test_torch_knapsack_solvers_against_brute_force() -> None:
    """dp and ilp reach the optimum on random instances (memory on the DP's 1/10000 grid); greedy never
    beats it."""
    rng = np.random.default_rng(0)
    for _ in range(20):
        n = int(rng.integers(1, 9))
        memory = [int(m) / 10_000 for m in rng.integers(1, 3000, n)]
        runtimes = [float(r) for r in rng.uniform(0.1, 5.0, n)]
        capacity = float(rng.uniform(0.0, sum(memory)))
        best = max(
            sum(r for r, b in zip(runtimes, m, strict=True) if b)
            for m in itertools.product((0, 1), repeat=n)
            if sum(x for x, b in zip(memory, m, strict=True) if b) <= capacity
        )
        for solver in (dp_knapsack, ilp_knapsack):
            value, saved, recompute = solver(memory, runtimes, capacity)
            assert sorted(saved + recompute) == list(range(n))
            assert sum(memory[i] for i in saved) <= capacity + 1e-9
            assert sum(runtimes[i] for i in saved) == pytest.approx(best, rel=1e-6)
            assert value == pytest.approx(best, rel=1e-6)
        assert greedy_knapsack(memory, runtimes, capacity)[0] <= best + 1e-9


def test_torch_budget_lowers_the_fraction_until_the_simulated_peak_fits() -> None:
    """Eight equal matrix products, budget 8 of the 10-tensor peak: the translated fraction (6/8) saves
    all but c_3 and c_6, but regenerating c_6 at its use (op 9) next to two gradients peaks at 9 tensors.
    Bisection on the fraction also recomputes c_0 (the cheapest left), which fits."""
    times_s = [1e-3, 2e-3, 3e-3, 1e-3, 2e-3, 3e-3, 1e-3, 2e-3]
    problem = Problem(_mm_chain([S] * 8, times_s), fixed_profile(), budget_bytes=8 * S)
    fraction = activation_fraction(problem)
    assert fraction == pytest.approx(6 / 8)
    first = TorchMemoryBudget().plan(problem, fraction)
    assert np.flatnonzero(first == RECOMPUTE).tolist() == [3, 6]
    assert problem.simulator.run(first).peak_bytes == 9 * S
    r = get_searcher("torch-budget").search(problem)
    assert r.feasible and r.result.peak_bytes == 8 * S
    assert np.flatnonzero(r.policy.to_vector(problem.workload) == RECOMPUTE).tolist() == [0, 3, 6]


# -- all of them on a real model ------------------------------------------------------------------------------
@pytest.mark.slow
def test_resnet50_at_70_percent_of_its_peak() -> None:
    """ResNet-50, batch 64, on an A100 at 70% of the no-policy peak: the recompute heuristics fit, none
    does not; vDNN fits only by making the forward wait for its copies out (Rule 4: PCIe cannot move 1.6
    GiB during a 14 ms forward), at under half the speed of checkpointing."""
    from autotune.workloads import TraceRequest, trace_model

    w, _ = trace_model(TraceRequest(model="resnet50", batch_size=64))
    hw = get_profile("a100-40gb")
    budget = int(0.7 * peak_report(w, hw.alloc_granularity_bytes).peak_bytes)
    found = {name: get_searcher(name).search(Problem(w, hw, budget_bytes=budget)) for name in _NAMES}
    status = {name: r.status for name, r in found.items()}
    assert status["none"] == Status.INFEASIBLE
    assert status["checkpoint-sqrt"] == status["superneurons"] == status["torch-budget"] == Status.FEASIBLE
    assert status["vdnn"] == Status.FEASIBLE and found["vdnn"].result.stall_s > 0
    assert found["vdnn"].result.samples_per_s < 0.5 * found["checkpoint-sqrt"].result.samples_per_s


_NAMES = ("none", "checkpoint-sqrt", "vdnn", "superneurons", "zhang-swap", "torch-budget")
