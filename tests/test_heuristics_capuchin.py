"""Capuchin (Peng et al., ASPLOS 2020): a swap that hides is taken first; where the host link is too slow
for any swap to hide, the hybrid policy recomputes the tensor with the best memory saving per second."""

from __future__ import annotations

import dataclasses

import numpy as np

from agents.base import Problem, Status, get_searcher
from runtime.hardware import HardwareProfile
from runtime.vocab import KEEP, RECOMPUTE, SWAP
from runtime.workload import Workload
from tests.synthetic import chain_workload, fixed_profile

S = 1000  # bytes per tensor
TAU = 1e-3  # seconds per op
N = 8  # layers: the no-policy peak is x, c_0..c_7 and g_0 = 10 * S at op 8


def gpu_profile(bytes_per_s: float) -> HardwareProfile:
    """The fixed-time profile with copy engines (Rule 1): copies overlap compute, as on a GPU."""
    return dataclasses.replace(fixed_profile(bytes_per_s, bytes_per_s), is_gpu=True)


def _chain_with_costly_first_layer() -> Workload:
    """The chain of tests/synthetic.py, except that layer 0 takes 10 op times: recomputing c_0 is ten
    times dearer than recomputing any other c_i (each needs only its kept predecessor)."""
    w = chain_workload(N, S, TAU)
    w.ops[0].time_s = 10 * TAU
    return w


def test_swaps_the_tensor_whose_transfer_hides() -> None:
    # 1 GB/s: a 1000-byte copy takes 1 us, far inside c_0's idle window of 14 op times.
    p = Problem(_chain_with_costly_first_layer(), gpu_profile(1e9), budget_bytes=(N + 1) * S)
    r = get_searcher("capuchin").search(p)
    expected = np.full(N, KEEP)
    expected[0] = SWAP  # the largest free time; a recompute of c_1 would have been cheaper to pick by MSPS
    assert r.status == Status.FEASIBLE
    assert r.policy.to_vector(p.workload).tolist() == expected.tolist()
    assert r.result.stall_s == 0.0 and r.result.recompute_s == 0.0  # the in-trigger sweep hid the copy back


def test_recomputes_the_cheap_tensor_when_the_link_is_slow() -> None:
    # 1 kB/s: every copy takes a second, ~70 times any idle window, so no swap hides.
    p = Problem(_chain_with_costly_first_layer(), gpu_profile(1e3), budget_bytes=(N + 1) * S)
    r = get_searcher("capuchin").search(p)
    expected = np.full(N, KEEP)
    expected[1] = RECOMPUTE  # largest MSPS among the tensors off the peak: c_1..c_6 tie, c_1 first; not c_0
    assert r.status == Status.FEASIBLE
    assert r.policy.to_vector(p.workload).tolist() == expected.tolist()
    assert r.result.d2h_bytes == 0 and r.result.recompute_s == TAU
