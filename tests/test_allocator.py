"""The caching allocator model (envs/allocator.py): each rule of NOTE [ CUDA caching allocator ] on request
sequences whose reserved and allocated bytes are computed by hand, and a workload's request sequence against
its no-policy memory timeline."""

from __future__ import annotations

import random

import pytest

from envs.allocator import (
    CachingAllocator,
    OffsetPlan,
    OutOfMemory,
    Request,
    no_policy_stats,
    plan_offsets,
    policy_stats,
    recorded_requests,
    replay,
    round_size,
    segment_size,
    workload_requests,
)
from runtime.hardware import get_profile
from runtime.workload import OpInfo, Phase, TensorInfo, TensorKind, Workload, peak_report
from tests.synthetic import _workload, chain_workload, diamond_workload

KIB, MIB = 1 << 10, 1 << 20


def test_a1_sizes_round_up_to_512_bytes() -> None:
    assert [round_size(n) for n in (1, 511, 512, 513, 1000)] == [512, 512, 512, 1024, 1024]


def test_a4_segment_sizes() -> None:
    """2 MiB for small requests, 20 MiB under 10 MiB, else the request rounded up to 2 MiB."""
    assert segment_size(512) == segment_size(MIB) == 2 * MIB
    assert segment_size(MIB + 512) == segment_size(10 * MIB - 512) == 20 * MIB
    assert segment_size(10 * MIB) == 10 * MIB
    assert segment_size(10 * MIB + 512) == 12 * MIB


def test_a2_a5_small_requests_share_a_2_mib_segment() -> None:
    """Four 500 KB requests split one 2 MiB segment (what is left each time is >= 512 B); the fifth does not
    fit the 49,152 B left and takes a new segment."""
    a = CachingAllocator()
    for _ in range(4):
        a.malloc(512_000)
    assert (a.stats.reserved, a.stats.allocated, a.stats.segments) == (2 * MIB, 2_048_000, 1)
    a.malloc(512_000)
    assert (a.stats.reserved, a.stats.segments) == (4 * MIB, 2)


def test_a5_a_large_block_is_not_split_for_a_rest_of_1_mib_or_less() -> None:
    """3 MiB takes a 20 MiB segment and leaves 17 MiB (split: more than 1 MiB); 16.5 MiB then takes those 17 MiB
    whole (0.5 MiB would be left): allocated counts the block, 20 MiB, for 19.5 MiB requested."""
    a = CachingAllocator()
    a.malloc(3 * MIB)
    a.malloc(16 * MIB + 512 * KIB)
    assert (a.stats.reserved, a.stats.allocated, a.stats.requested) == (20 * MIB, 20 * MIB, 19 * MIB + 512 * KIB)


def test_a3_a4_a_free_block_too_small_stays_reserved() -> None:
    """A 12 MiB block freed and cached cannot serve 14 MiB: a new segment, 26 MiB reserved for 14 MiB in use."""
    a = CachingAllocator()
    a.free(a.malloc(12 * MIB))
    a.malloc(14 * MIB)
    assert (a.stats.reserved, a.stats.allocated, a.stats.peak_reserved) == (26 * MIB, 14 * MIB, 26 * MIB)


def test_a3_best_fit_takes_the_smallest_block_that_fits() -> None:
    """Free 12 MiB and 10 MiB blocks: a 10 MiB request takes the 10 MiB one, so 12 MiB still fit after it."""
    a = CachingAllocator()
    x, y = a.malloc(12 * MIB), a.malloc(10 * MIB)
    a.free(x)
    a.free(y)
    a.malloc(10 * MIB)
    a.malloc(12 * MIB)
    assert (a.stats.reserved, a.stats.segments) == (22 * MIB, 2)


def test_a6_frees_merge_with_free_neighbours() -> None:
    """Two 3 MiB blocks and the 14 MiB rest of one 20 MiB segment merge back into it once both are freed, and
    19 MiB then fits without a new segment; with one of them still in use it does not."""
    a = CachingAllocator()
    x, y = a.malloc(3 * MIB), a.malloc(3 * MIB)
    a.free(y)
    a.malloc(19 * MIB)  # 3 + 14 MiB free around y's place: not enough beside x
    assert a.stats.reserved == 40 * MIB
    b = CachingAllocator()
    x, y = b.malloc(3 * MIB), b.malloc(3 * MIB)
    b.free(x)
    b.free(y)
    b.malloc(19 * MIB)
    assert (b.stats.reserved, b.stats.allocated) == (20 * MIB, 20 * MIB)  # the 1 MiB rest is not split off


def test_a2_a_block_freed_on_one_stream_serves_only_that_stream() -> None:
    a = CachingAllocator()
    a.free(a.malloc(MIB, stream=0))
    a.malloc(MIB, stream=1)
    assert a.stats.reserved == 4 * MIB
    a.malloc(MIB, stream=0)
    assert a.stats.reserved == 4 * MIB


def test_a7_whole_free_segments_go_back_before_out_of_memory() -> None:
    """Within 24 MiB: 14 MiB after a cached 12 MiB segment fits once that segment is given back; 12 MiB more
    does not (14 + 12 > 24, and nothing whole is free)."""
    a = CachingAllocator(capacity_bytes=24 * MIB)
    a.free(a.malloc(12 * MIB))
    a.malloc(14 * MIB)
    assert (a.stats.reserved, a.stats.retries, a.stats.peak_reserved) == (14 * MIB, 1, 14 * MIB)
    with pytest.raises(OutOfMemory, match="14680064 B reserved"):
        a.malloc(12 * MIB)


def test_replay_runs_the_iteration_again_and_again() -> None:
    """What the first iteration reserved serves the next ones: the peak does not grow after it."""
    setup = [Request(0, 12 * MIB)]
    iteration = [Request(1, 3 * MIB), Request(2, 5 * MIB), Request(1, None), Request(2, None)]
    once, three = replay(setup, repeat=iteration, times=1), replay(setup, repeat=iteration, times=3)
    assert once.peak_reserved == three.peak_reserved == 32 * MIB  # the 12 MiB segment and one of 20 MiB
    assert three.allocated == 12 * MIB


def test_plan_offsets_by_hand() -> None:
    """Three 4 KiB tensors, each living two ops, the next born when the last dies: two slots, the first reused.
    Then 6 KiB over ops 0-1, 2 KiB at op 0, 4 KiB at op 1: largest first, 6 at 0, 4 above it, 2 above it too
    (it meets 6 at op 0): 10 KiB, op 1's peak."""
    plan = plan_offsets([(0, 1, 4 * KIB), (1, 2, 4 * KIB), (2, 3, 4 * KIB)])
    assert plan == OffsetPlan((0, 4 * KIB, 0), 8 * KIB)
    plan = plan_offsets([(0, 1, 6 * KIB), (0, 0, 2 * KIB), (1, 1, 4 * KIB)])
    assert plan == OffsetPlan((0, 6 * KIB, 6 * KIB), 10 * KIB)


def test_a_planned_pool_never_overlaps_live_tensors_and_holds_at_least_the_peak() -> None:
    rng = random.Random(0)
    intervals = []
    for _ in range(300):
        s = rng.randrange(50)
        intervals.append((s, s + rng.randrange(20), rng.choice([512, 4 * KIB, MIB, 3 * MIB + 7])))
    plan = plan_offsets(intervals)
    sized = [(s, e, o, -(-z // 512) * 512) for (s, e, z), o in zip(intervals, plan.offsets, strict=True)]
    for i, (s1, e1, o1, z1) in enumerate(sized):
        for s2, e2, o2, z2 in sized[i + 1 :]:
            assert not (s1 <= e2 and s2 <= e1 and o1 < o2 + z2 and o2 < o1 + z1)  # alive together: apart
    peak = max(sum(z for s, e, _, z in sized if s <= t <= e) for t in range(70))
    assert peak <= plan.arena_bytes == max(o + z for _, _, o, z in sized)


@pytest.mark.parametrize("build", [lambda: chain_workload(8, 3 * MIB, 1e-3), lambda: diamond_workload(700 * KIB, 1e-3)])
def test_a_workloads_requests_peak_where_its_memory_timeline_does(build) -> None:  # type: ignore[no-untyped-def]
    """The requests in flight at their peak are the no-policy timeline's peak (bytes as asked, before A1)."""
    w = build()
    requests = workload_requests(w)
    setup, iteration = requests.setup, requests.iteration
    assert all(r.nbytes is not None for r in setup)
    assert sum(r.nbytes is None for r in iteration) == sum(r.nbytes is not None for r in iteration)  # balanced
    stats = no_policy_stats(w)
    assert stats.peak_requested == peak_report(w, 1).peak_bytes
    assert stats.requested == sum(t.nbytes for t in w.tensors if t.alloc_op < 0)  # as each iteration found it
    assert stats.peak_reserved >= stats.peak_allocated >= stats.peak_requested


def _chain_with_momentum(state_bytes: int) -> Workload:
    """chain_workload(2, 30 MiB) and an optimizer step (op 4) that updates a momentum buffer of ``state_bytes``
    (the optimizer's state: it exists before the traced iteration, NOTE [ Steady state ])."""
    w = chain_workload(2, 30 * MIB, 1e-3)
    sid = len(w.tensors)
    tensors = [*w.tensors, TensorInfo(sid, state_bytes, (state_bytes,), "uint8", TensorKind.OPTIMIZER_STATE, -1, None)]
    ops = [*w.ops, OpInfo(4, "aten._foreach_add_.List", Phase.OPTIMIZER, "", 0.0, 2 * state_bytes, (sid,), (), 1e-3)]
    return _workload(ops, tensors, list(w.candidates), "chain2+momentum")


def test_the_optimizers_state_is_allocated_in_the_first_iteration_where_activations_were_cached() -> None:
    """NOTE [ The first iteration ], by hand. x and c1, c2, g0, g1 take 30 MiB each (one segment each, A4);
    c2 is freed at op 2, where g0 is allocated, and g1 takes c2's block at op 3, which frees c1, g0, g1.
    The first iteration reserves x + c1 + c2 + g0 = 120 MiB and ends with three free 30-MiB segments; the
    12-MiB momentum buffer, allocated at op 4, splits one of them (best fit, A3; a rest of 18 MiB, A5), so
    the second iteration finds two free 30-MiB blocks for c1 and c2 and reserves a fifth segment for g0:
    150 MiB. With the state held from the start (the trace's order) the model found 120 + 12 = 132 MiB."""
    w = _chain_with_momentum(12 * MIB)
    requests = workload_requests(w)
    assert [r.nbytes for r in requests.state] == [12 * MIB]
    assert all(r.tensor != requests.state[0].tensor for r in requests.setup)
    assert requests.first == [*requests.iteration[:8], *requests.state, *requests.iteration[8:]]  # after op 3's 8
    stats = no_policy_stats(w)
    assert stats.peak_reserved == 150 * MIB
    assert stats.peak_allocated == 132 * MIB  # the bytes in use do not move
    assert replay(requests.steady(), repeat=requests.iteration, times=2).peak_reserved == 132 * MIB
    assert no_policy_stats(w, iterations=1).peak_reserved == 120 * MIB  # the first iteration alone
    assert policy_stats(w, get_profile("a100-40gb"), [0, 0]).peak_reserved == 150 * MIB  # a policy's requests too


@pytest.mark.parametrize(
    ("model", "batch", "seq_len"), [("gpt2", 8, 1024), ("resnet50", 64, None), ("vit_b_16", 32, None)]
)
def test_a_fake_trace_for_the_h200_reserves_what_its_allocator_did(
    model: str, batch: int, seq_len: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fake trace on this CPU for the h200 profile, its no-policy run through the allocator's model (the
    process's cuBLAS workspaces included, runtime/target.py G6), against ``max_memory_reserved`` of the
    H200 run in the fixture (experiments/gpu_check.py step 5: SGD with momentum, three iterations from a
    clean cache): within 1% (GPT-2 -0.04%, ResNet-50 -0.72%, ViT-B/16 -0.44%). With the optimizer's state in
    the setup (before NOTE [ The first iteration ]) GPT-2 was -7.0%; without the reductions' staging buffers
    (runtime/target.py G7) ViT-B/16 was -3.9%."""
    from tests.test_target import fake_h200_trace, h200_traces

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)  # PyTorch's default, as the H200 ran
    measured = h200_traces()[model]
    assert (measured["batch"], measured["seq_len"]) == (batch, seq_len)
    w = fake_h200_trace(model, batch, seq_len)
    assert no_policy_stats(w).peak_reserved == pytest.approx(measured["allocator_reserved_peak_bytes"], rel=0.01)


# -- a policy's requests (autotune/reserved.py, NOTE [ Reserved budget ]) ------------------------------------
def _in_flight_peak(requests: list[Request]) -> int:
    live: dict[int, int] = {}
    peak = 0
    for r in requests:
        if r.nbytes is None:
            del live[r.tensor]
        else:
            assert r.tensor not in live  # every storage allocated once before it is freed
            live[r.tensor] = r.nbytes
        peak = max(peak, sum(live.values()))
    assert not live or all(h >= 0 for h in live)
    return peak


@pytest.mark.parametrize(
    "case",
    ["synthetic/a100-40gb", "synthetic/cpu", "framed/host costs", "chain/slow link"],
)
def test_a_policys_requests_peak_where_the_simulator_does(case: str) -> None:
    """Every storage of the simulator's accounting as requests (kept, copied back, regenerated, packed, a
    recompute's temporaries, workspaces), replayed in the op-by-op simulator's order: the bytes in flight
    peak at the simulator's peak, exactly, on 40 random policies and options per workload and profile; each
    iteration frees what it allocates."""
    from envs.allocator import policy_requests
    from envs.simulator import Simulator
    from runtime.hardware import get_profile
    from runtime.policy import PolicyOptions
    from runtime.synthetic import synthetic_workload
    from tests.synthetic import fixed_profile, framed_chain_workload
    from tests.test_search import _PROFILES, TAU, S

    name, profile = case.split("/")
    w = synthetic_workload() if name == "synthetic" else (
        framed_chain_workload(6, S, TAU, block=2) if name == "framed" else chain_workload(7, S, TAU))  # fmt: skip
    hw = get_profile(profile) if name == "synthetic" else fixed_profile(**_PROFILES[profile])  # type: ignore[arg-type]
    sim = Simulator(w, hw)
    rng = random.Random(0)
    for i in range(40):
        density = rng.random()
        actions = [rng.randrange(4) if rng.random() < density and i else 0 for _ in range(sim.k)]
        opts = PolicyOptions(prefetch_lookahead=rng.randrange(5), release_after=rng.choice([1, 2, 4]), lossy=True)
        requests = policy_requests(w, hw, actions, opts)
        setup, iteration = requests.setup + requests.state, requests.iteration
        assert _in_flight_peak([*setup, *iteration]) == sim.run(actions, options=opts).peak_bytes
        assert sum(r.nbytes is None for r in iteration) == sum(r.nbytes is not None for r in iteration)


def test_keeping_everything_requests_what_the_workload_does() -> None:
    """With every candidate kept the policy's requests reserve what the no-policy sequence reserves (the same
    storages; bytes rounded to the profile's 512 B)."""
    from envs.allocator import policy_stats
    from runtime.hardware import get_profile
    from runtime.synthetic import synthetic_workload

    w, hw = synthetic_workload(), get_profile("a100-40gb")
    kept = policy_stats(w, hw, [0] * len(w.candidates))
    alone = no_policy_stats(w)
    assert (kept.peak_reserved, kept.peak_allocated) == (alone.peak_reserved, alone.peak_allocated)


def test_a_capped_device_gives_cached_segments_back_or_fails() -> None:
    """A7 on a policy's requests: capped at its uncapped reserved peak it runs as before (no retry); capped
    below its allocated peak it fails (the giving back itself: test_a7_whole_free_segments_go_back_...)."""
    from envs.allocator import policy_stats
    from runtime.hardware import get_profile
    from runtime.synthetic import synthetic_workload

    w, hw = synthetic_workload(), get_profile("a100-40gb")
    actions = [0, 2, 0, 2, 0, 0, 0, 0, 0]
    free = policy_stats(w, hw, actions)
    assert free.peak_reserved > free.peak_allocated  # cached blocks and split ends: something to give back
    assert policy_stats(w, hw, actions, capacity_bytes=free.peak_reserved) == free
    with pytest.raises(OutOfMemory):
        policy_stats(w, hw, actions, capacity_bytes=free.peak_allocated - 1)


def test_request_intervals_share_no_time_when_one_is_freed_before_the_other() -> None:
    """a and b live together, then b and c, then c and d (never freed); a is freed before c is asked for and b
    before d, so c takes a's place and d b's: two blocks of 512 B (each request rounded up), the most in flight
    at once."""
    from envs.allocator import request_intervals

    seq = [Request(0, 100), Request(1, 200), Request(0, None), Request(2, 100), Request(1, None), Request(3, 50)]
    intervals = request_intervals(seq)
    assert sorted(intervals) == [(0, 1, 100), (1, 3, 200), (3, 6, 100), (5, 6, 50)]
    plan = plan_offsets(intervals)
    assert plan.arena_bytes == 2 * 512 and plan.offsets[0] == plan.offsets[2] != plan.offsets[1] == plan.offsets[3]


# -- expandable segments (A8-A11) ------------------------------------------------------------------------------
def test_a8_a9_a10_growing_segment_tiles_what_default_segments_strand() -> None:
    """Three 12 MiB tensors freed, then three of 13 MiB (a batch one larger). Default: three 12 MiB segments
    (A4), whole, none of which holds 13 MiB, so three more of 14 MiB: 36 + 42 = 78 MiB reserved, the 1 MiB
    rests not split off (A5). Expandable: one large-pool segment mapped in 20 MiB pages. 12 MiB maps [0, 20)
    and leaves [12, 20) free; the second 12 MiB fits no free block, so [20, 40) is mapped and merges with
    [12, 20) (A10): [12, 24) taken, [24, 40) free; the third takes [24, 36). Freed, the three merge with
    [36, 40) into one 40 MiB block (A6), which the three 13 MiB tensors split (A9: rests >= 512 B are split):
    40 MiB reserved, 39 MiB allocated."""
    for expandable, reserved, allocated in ((False, 78 * MIB, 42 * MIB), (True, 40 * MIB, 39 * MIB)):
        a = CachingAllocator(expandable_segments=expandable)
        for h in [a.malloc(12 * MIB) for _ in range(3)]:
            a.free(h)
        for _ in range(3):
            a.malloc(13 * MIB)
        assert (a.stats.reserved, a.stats.allocated, a.stats.peak_reserved) == (reserved, allocated, reserved)


def test_a8_the_small_pool_grows_in_2_mib_pages_across_their_boundaries() -> None:
    """Five 700 KiB requests (716,800 B, a multiple of 512). Default: two fit a 2 MiB segment (663,552 B left),
    so three segments, 6 MiB. Expandable: the third takes the 663,552 B left and 53,248 B of a second page
    mapped after it (A10), the fourth and fifth follow: 3,584,000 B in two pages, 4 MiB."""
    for expandable, reserved in ((False, 6 * MIB), (True, 4 * MIB)):
        a = CachingAllocator(expandable_segments=expandable)
        for _ in range(5):
            a.malloc(716_800)
        assert (a.stats.reserved, a.stats.allocated) == (reserved, 3_584_000)


def test_a8_a_whole_page_for_a_request_that_default_segments_size_exactly() -> None:
    """Expandable segments can reserve more: 12 MiB alone is a 12 MiB segment by default (A4) but a 20 MiB page
    (A8); expandable reserved bytes are not always the fewer."""
    one = [Request(0, 12 * MIB)]
    assert replay(one).peak_reserved == 12 * MIB
    assert replay(one, expandable_segments=True).peak_reserved == 20 * MIB


def test_a9_a_free_block_inside_the_segment_is_taken_before_its_growing_end() -> None:
    """4 MiB maps [0, 20) and takes [0, 4); 7 MiB [4, 11), 3 MiB [11, 14); the 7 MiB freed. For 5 MiB the free
    [14, 20) at the growing end is the smallest block that fits (A3), but it counts as 6 MiB plus the unmapped
    space after it, more than the 7 MiB of [4, 11): the block inside is taken and the end stays free (A9)."""
    a = CachingAllocator(expandable_segments=True)
    a.malloc(4 * MIB)
    x = a.malloc(7 * MIB)
    a.malloc(3 * MIB)
    a.free(x)  # free: [4, 11) inside, [14, 20) at the end
    h = a.malloc(5 * MIB)
    assert a._live[h][0].address == 4 * MIB  # inside, not at 14 MiB
    assert a.stats.reserved == 20 * MIB


def test_a11_frees_keep_pages_mapped_until_memory_is_given_back() -> None:
    """30 MiB maps [0, 40) (two pages), 12 MiB [40, 60) after the 10 MiB left free: [30, 42) in use, [42, 60)
    free. Freeing the 30 MiB keeps 60 MiB reserved (A11). ``empty_cache`` unmaps the one whole page inside the
    free [0, 30): [0, 20); [20, 30) shares a page with a block in use and stays; nothing in [42, 60) is a whole
    page: 40 MiB reserved. 25 MiB then fits no free block; the lowest unmapped gap with the free block after it,
    [0, 20) and [20, 30), holds it, so [0, 20) is mapped again rather than the end grown (A10): 60 MiB, the
    tensor at address 0."""
    a = CachingAllocator(expandable_segments=True)
    x = a.malloc(30 * MIB)
    a.malloc(12 * MIB)
    a.free(x)
    assert a.stats.reserved == 60 * MIB
    a.empty_cache()
    assert (a.stats.reserved, a.stats.allocated) == (40 * MIB, 12 * MIB)
    h = a.malloc(25 * MIB)
    assert (a.stats.reserved, a._live[h][0].address, a.stats.segments) == (60 * MIB, 0, 1)


def test_a10_a11_a_capped_device_unmaps_free_pages_before_out_of_memory() -> None:
    """Within 80 MiB: as above, 60 MiB mapped and the 30 MiB freed; 35 MiB fits no free block and A4 sizes it
    36 MiB: 60 + 36 > 80, so the free pages are unmapped first ([0, 20): 40 MiB) and 40 + 36 <= 80 (A10). The
    gap at 0 with [20, 30) holds 30 MiB, too few; the end does: [42, 60) and one more page, [60, 80): 60 MiB
    reserved, 47 MiB allocated, one retry. Then 25 MiB (26 by A4): 60 + 26 > 80 and no free block holds a whole
    page ([20, 30) and [77, 80) share theirs): out of memory. An expandable segment given back whole when a
    retry unmaps its last page."""
    a = CachingAllocator(80 * MIB, expandable_segments=True)
    x = a.malloc(30 * MIB)
    a.malloc(12 * MIB)
    a.free(x)
    a.malloc(35 * MIB)
    s = a.stats
    assert (s.reserved, s.peak_reserved, s.allocated, s.retries) == (60 * MIB, 60 * MIB, 47 * MIB, 1)
    with pytest.raises(OutOfMemory, match="62914560 B reserved"):
        a.malloc(25 * MIB)
    b = CachingAllocator(24 * MIB, expandable_segments=True)
    b.free(b.malloc(12 * MIB))  # [0, 20) mapped, all free
    b.malloc(14 * MIB)  # fits the free 20 MiB: no retry
    assert (b.stats.reserved, b.stats.retries) == (20 * MIB, 0)
    c = CachingAllocator(24 * MIB, expandable_segments=True)
    c.free(c.malloc(12 * MIB, stream=1))  # a segment of stream 1, then nothing of it in use
    c.malloc(12 * MIB, stream=0)  # 20 + 12 > 24: stream 1's page unmapped, its segment given back
    assert (c.stats.reserved, c.stats.segments, c.stats.retries) == (20 * MIB, 1, 1)


def test_a8_one_segment_per_pool_and_stream() -> None:
    a = CachingAllocator(expandable_segments=True)
    a.malloc(MIB, stream=0)
    a.malloc(3 * MIB, stream=0)
    a.malloc(MIB, stream=1)
    a.free(a.malloc(3 * MIB, stream=1))
    a.malloc(3 * MIB, stream=0)
    assert (a.stats.segments, a.stats.reserved) == (4, 2 * MIB + 20 * MIB + 2 * MIB + 20 * MIB)


def _check_structure(a: CachingAllocator) -> None:
    """Reserved bytes are the blocks in use and the free mapped ones; segments are tiled by their blocks; no
    two free mapped blocks touch (A6); unmapped blocks start and end on pages (A8, A11)."""
    from envs.allocator import page_size

    live = [b for b, _ in a._live.values()]
    assert a.stats.reserved == sum(b.size for b in live) + sum(b.size for b in a._by_address.values())
    for b in [*live, *a._by_address.values(), *a._unmapped_at.values()]:
        if b.next is not None:
            assert b.next.prev is b and b.next.address == b.address + b.size
            assert b.allocated or b.next.allocated or b.mapped != b.next.mapped
        if not b.mapped:
            assert (b.address - b.base) % page_size(b.small) == 0 and b.size % page_size(b.small) == 0


@pytest.mark.parametrize("seed", range(6))
def test_random_requests_keep_the_rules_guarantees(seed: int) -> None:
    """Random requests (small, 1-10 MiB, large; two streams), with and without a cap: at every step reserved
    >= allocated and the structure holds (``_check_structure``); without a cap reserved bytes never fall (A4,
    A11); with one, expandable segments exceed it by less than a page (A10: the check sizes a request by A4,
    at most 18 MiB under the 20 MiB pages it maps). Not asserted: that expandable segments reserve less, which
    the rules do not promise (test_a8_a_whole_page_...)."""
    rng = random.Random(seed)
    sizes = [rng.choice([rng.randrange(1, MIB), rng.randrange(MIB, 10 * MIB), rng.randrange(10 * MIB, 90 * MIB)])
             for _ in range(300)]  # fmt: skip
    for cap in (None, 400 * MIB):
        for expandable in (False, True):
            a = CachingAllocator(cap, expandable_segments=expandable)
            live: list[int] = []
            last = 0
            for n in sizes:
                if live and rng.random() < 0.45:
                    a.free(live.pop(rng.randrange(len(live))))
                try:
                    live.append(a.malloc(n, stream=rng.randrange(2)))
                except OutOfMemory:
                    assert cap is not None
                    if live:
                        a.free(live.pop(0))
                s = a.stats
                assert s.reserved >= s.allocated >= s.requested
                _check_structure(a)
                if cap is None:
                    assert s.reserved >= last
                elif expandable:
                    assert s.reserved <= cap + 18 * MIB
                else:
                    assert s.reserved <= cap
                last = s.reserved
            assert a.stats.peak_reserved >= a.stats.peak_allocated >= a.stats.peak_requested


def test_expandable_workload_replay_matches_the_timeline_peak() -> None:
    """On a workload with no policy: the bytes requested peak where the timeline does with expandable segments
    too (the same requests), and the mapped bytes hold the allocated peak."""
    w = chain_workload(8, 3 * MIB, 1e-3)
    stats = no_policy_stats(w, expandable_segments=True)
    assert stats.peak_requested == peak_report(w, 1).peak_bytes
    assert stats.peak_reserved >= stats.peak_allocated >= stats.peak_requested


@pytest.mark.parametrize("model", ["resnet50", "gpt2", "vit_b_16", "bert-base", "gpt2/bf16"])
def test_h200_requests_replayed_reproduce_the_reserved_peak(model: str) -> None:
    """Every request an H200's caching allocator got in a training step (experiments/gpu_check.py step 5, the
    fixture), replayed through the model after the two cuBLAS workspaces the process already held (runtime/
    target.py G6: allocated before the recording, in no request of it): the reserved peak is
    ``max_memory_reserved``'s within 0.1% (ViT-B/16 2 MiB under, the others to the byte). Without
    the workspaces it was 0.4-1.3% under. BERT-base's first recording was left out (its process held 0.5 GB
    more before it, a model of earlier traces not yet collected, which no request shows); the fixture's is
    from a clean process, as GPT-2's in bf16."""
    from runtime.target import CUBLAS_HANDLES, cublas_workspace_bytes
    from tests.test_target import h200_traces

    row = h200_traces()[model]
    size = cublas_workspace_bytes((9, 0))
    held = [Request(-1 - i, size) for i in range(CUBLAS_HANDLES)]
    rest = row.get("held_before_bytes", 0) - CUBLAS_HANDLES * size  # recorded since (experiments/gpu_check.py)
    # What else the process held, 1-2 MiB in these rows: small tensors (a batch's ids, RNG states), which the
    # small pool keeps in 2 MiB segments of their own; as one large block it would open a 20 MiB segment that
    # later requests fill (BERT-base: 9.0% under, against to the byte as small blocks).
    held += [Request(-10 - i, 1 << 20) for i in range(max(0, rest) // (1 << 20))]
    seq = held + recorded_requests(row["requests"])
    got = replay(seq).peak_reserved
    assert got == pytest.approx(row["allocator_reserved_peak_bytes"], rel=1e-3)
    assert got <= row["allocator_reserved_peak_bytes"]


@pytest.mark.parametrize("model", ["resnet50", "gpt2"])
def test_h200_reserved_under_policies(model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [ Reserved budget ] against the H200 (the fixture's policy rows: experiments/gpu_check.py step 5,
    keep, swap, recompute and a random mix applied by the runtime from a clean cache, three iterations with
    the optimizer's state made in the first, as `autotune train` runs them): the model replaying the requests
    the allocator got under each policy is within 4% of ``max_memory_reserved`` (ResNet-50 -1.0% to -3.5%,
    GPT-2 -0.4% to -0.9%: streams and events the replay does not see), and the model of the policy planned on a
    fake trace for the h200 (what a user without a GPU plans with) is within 0.2% on GPT-2 (all four) and
    within 3% on ResNet-50 for keep and swap (-0.7%, -2.7%). Not asserted: ResNet-50's recompute, -11.7%
    (allocated -7.9%), and its mix, -10.2% (allocated -3.5%). Their recorded peaks are at a convolution's
    backward that allocates a cuDNN workspace (316,670,607 bytes under recompute), which fake traces do not
    have. Recompute had been within 1.4%, by Rule 11 holding each region's kept output twice where the runtime
    holds it once (measured to the byte on the CPU: tests/test_regions.py)."""
    import numpy as np

    from envs.allocator import policy_stats
    from envs.simulator import uniform_actions
    from runtime.policy import Action, PolicyOptions
    from tests.test_target import fake_h200_trace, h200_traces

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)  # PyTorch's default, as the H200 ran
    row = h200_traces()[model]
    batch, seq = row["batch"], row["seq_len"]
    w = fake_h200_trace(model, batch, seq)
    real = list(row["real"]["saved"])  # the real trace's candidates, in order: the mix was drawn over them
    mix = dict(zip(real, np.random.default_rng(0).integers(0, 3, len(real)).astype(np.int8), strict=True))
    hw = get_profile("h200")
    for label, measured in row["policies"].items():
        reserved = measured["allocator_reserved_peak_bytes"]
        replayed = replay(recorded_requests(measured["requests"])).peak_reserved
        assert abs(replayed - reserved) <= 0.04 * reserved, (label, replayed, reserved)
        if label == "mixed":
            vec = np.array([mix[c.key] for c in w.candidates], dtype=np.int8)
        else:
            vec = uniform_actions(w, {"keep": Action.KEEP, "swap": Action.SWAP, "recompute": Action.RECOMPUTE}[label])
        if model == "resnet50" and label in ("recompute", "mixed"):
            continue
        modelled = policy_stats(w, hw, vec, PolicyOptions()).peak_reserved
        tolerance = 0.002 if model == "gpt2" else 0.03
        assert abs(modelled - reserved) <= tolerance * reserved, (label, modelled, reserved)
