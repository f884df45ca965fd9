"""What PyTorch's CUDA caching allocator reserves for a sequence of allocations and frees.

A run fails when the caching allocator cannot find a block, and that depends on the bytes it has reserved from
the device (segments, cached free blocks, the unused ends of split blocks), not only on the bytes in use: the
simulator's peak (envs/simulator.py) is the latter. This module replays a request sequence through a model of
the allocator and reports both.

NOTE [ CUDA caching allocator ] -- the rules, numbered, from PyTorch's c10/cuda/CUDACachingAllocator.cpp
(DeviceCachingAllocator: malloc, get_free_block, should_split, get_allocation_size, free_block,
release_cached_blocks; the same in torch 2.11-2.14), with the default configuration (no max_split_size, no
roundup_power2_divisions, expandable_segments off, no garbage collection threshold).
    A1. Sizes. A request is rounded up to a multiple of 512 bytes, and to 512 at least (``round_size``).
    A2. Pools. Requests of at most 1 MiB go to the small pool, the others to the large pool; each pool keeps
        its free blocks per stream, and a block freed on a stream is only reused by requests on that stream.
    A3. Best fit. A request takes the smallest free block of its pool and stream that is at least its size;
        among blocks of one size, the one at the lowest address (the pool's order: stream, size, address).
    A4. Segments. With no such block the allocator reserves a new segment from the device (cudaMalloc): 2 MiB
        for a small request, 20 MiB for a request under 10 MiB, otherwise the request rounded up to 2 MiB
        (``segment_size``). Segments are never given back but by A7.
    A5. Splits. A block larger than the request is split, the rest staying free in the pool, when that rest is
        at least 512 bytes (small pool) or more than 1 MiB (large pool); otherwise the request gets the whole
        block (its "allocated" bytes are the block's, as PyTorch counts them).
    A6. Frees. A freed block merges with the free blocks next to it in its segment and returns to its pool.
    A7. Out of memory. When a new segment would take the reserved bytes past the capacity (the device's memory,
        or the fraction ``torch.cuda.set_per_process_memory_fraction`` allows), the allocator first gives
        back every free segment that is whole (no part in use) and tries again; if the segment still does not
        fit, the request fails (out of memory).
    Addresses: a new segment is placed after every segment reserved before it (cudaMalloc's addresses are
    the driver's; only the order among equal sizes in A3 depends on them).
With ``expandable_segments:True`` in ``PYTORCH_CUDA_ALLOC_CONF`` (``CachingAllocator(expandable_segments=True)``)
A1, A2 and A6 hold as they are; A3-A5 and A7 become A8-A11 (the same file: ExpandableSegment, get_free_block,
should_split, alloc_block, find_expandable_block, try_allocate_expandable_block, map_block, release_blocks,
unmap_block), read at PyTorch commit 001074d, from before the allocator's settings moved to
c10/core/AllocatorConfig.h. The 2.14 headers show one change here: the large pool's 20 MiB is now the setting
``large_segment_size_mb``, default 20 MiB. That 2.11-2.14 keep these function bodies is an assumption until a
GPU run compares them (experiments/gpu_check.py):
    A8. One growing segment per pool and stream. A pool's first request on a stream reserves address space
        only (``find_expandable_block``: 1 1/8 of the device's memory; here ``ADDRESS_SPACE``, every later
        segment above it), no memory. Physical memory is mapped into it in pages, 2 MiB (``SMALL_BUFFER``) in
        the small pool and 20 MiB (``LARGE_BUFFER``) in the large one (``ExpandableSegment``: one
        cuMemCreate per page); reserved bytes, and so ``max_memory_reserved``, count the mapped pages
        (``map_block``, ``unmap_block``), never the address space.
    A9. Best fit and splits. A3 still picks the free block, but a block that ends where unmapped space begins
        counts as its size plus that space (``get_free_block``'s ``expandable_size``): from the smallest
        block that fits the search moves on to the next larger one while that one's counted size is smaller,
        so a free block in the middle of the segment is taken before the growing end. Any block, in either
        pool, is split when the rest is at least 512 bytes (``should_split``: A5's 1 MiB rule is off).
    A10. Growing. With no free block that fits, the allocator maps pages at the lowest address where the free
        and unmapped space that follows (a free block just before it included) holds the request
        (``find_expandable_block``, ``try_allocate_expandable_block``): normally the segment's end, so the
        free block at the end and the new pages, merged (``map_block``: A6 for mapped neighbours), serve it;
        only the pages the request still needs are mapped. The capacity check of A7 is made before, with
        A4's segment size for the request (``alloc_block``: ``total_allocated_memory + alloc_size``), not the
        pages mapped after it: a mapping can take the reserved bytes past the capacity by less than a page.
    A11. Frees and giving back. A freed block stays mapped (A6); reserved bytes do not fall. Pages are unmapped
        only where A7 gives memory back (``release_cached_blocks`` on the way to out of memory, or
        ``torch.cuda.empty_cache``): every whole page inside a free block is unmapped, the block's ends that
        share a page with a block in use stay mapped and free (``unmap_block``), and a segment left with
        nothing mapped is given back whole (``release_blocks``). The next growth fills the lowest unmapped
        gap that fits first (A10).
    Not modelled: a request that no address space can hold (A8's space is larger than the device), and the
    driver running out of pages before the capacity (cuMemCreate failing): the capacity here is the fraction
    ``set_per_process_memory_fraction`` allows, which is how the budget is enforced.

NOTE [ The first iteration ]
    A trace is taken in the steady state (NOTE [ Steady state ] in runtime/trace.py): the optimizer's state
    exists before its iteration starts. A training run's first iteration has none: PyTorch's optimizers
    create it in their first ``step()`` (SGD's momentum buffers as clones of the gradients, Adam's ``exp_avg``
    and ``exp_avg_sq`` as zeros, parameter by parameter), after the first backward, when the iteration's
    activations are free blocks of cached segments; by A3 the state takes pieces of those segments and keeps
    them for good. So the requests replayed are the setup without that state, a first iteration that
    allocates it (in the trace's order of registration, the optimizer's) before the first request of the
    first optimizer op, then the steady iteration again and again. Measured on an H200 (GPT-2 small 8 x
    1024, SGD with momentum, the fixture tests/fixtures/gpu/h200_traces.json.gz): the 147 MiB momentum buffer
    of the tied embedding took 1 of the 3 cached 1.535 GiB logits segments, and the second iteration reserved
    a fourth one; the model with the state in the setup was 7.0% under ``max_memory_reserved``, with the
    first iteration 0.04% under.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from runtime.hardware import HardwareProfile
from runtime.policy import PolicyOptions
from runtime.workload import Phase, TensorKind, Workload

MIN_BLOCK = 512  # A1
SMALL_SIZE = 1 << 20  # A2: the largest small request
SMALL_BUFFER = 2 << 20  # A4: a small pool's segment
LARGE_BUFFER = 20 << 20  # A4: a segment for requests under MIN_LARGE_ALLOC
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20
ITERATIONS = 3  # iterations replayed: reserved bytes only grow (A4), and by the second the cache holds them
ADDRESS_SPACE = 1 << 48  # A8: address space per expandable segment (PyTorch: 1 1/8 of the device; only its
# order against the gaps of A11 matters, and a device's memory is far below it)


def page_size(small: bool) -> int:
    """A8: the bytes mapped at a time into an expandable segment of the small or the large pool."""
    return SMALL_BUFFER if small else LARGE_BUFFER


def round_size(nbytes: int) -> int:
    """A1: the bytes a request of ``nbytes`` asks for."""
    return MIN_BLOCK if nbytes < MIN_BLOCK else -(-nbytes // MIN_BLOCK) * MIN_BLOCK


def segment_size(size: int) -> int:
    """A4: the segment reserved for a (rounded) request of ``size`` bytes that no free block fits."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


class OutOfMemory(Exception):
    """A7: a request the allocator cannot serve within the capacity."""


@dataclass(eq=False)
class _Block:
    address: int
    size: int
    small: bool
    stream: int
    allocated: bool = False
    prev: _Block | None = None  # neighbours in the segment (A5, A6)
    next: _Block | None = None
    mapped: bool = True  # A8: False for an expandable segment's address space with no pages behind it
    base: int = -1  # A8: the address where its expandable segment starts (-1: not in one)

    @property
    def key(self) -> tuple[int, int]:
        return (self.size, self.address)


@dataclass
class AllocatorStats:
    """Bytes as PyTorch's ``torch.cuda.memory_stats`` counts them: ``allocated`` (blocks in use, A5),
    ``reserved`` (segments), their peaks, and ``requested`` (what the program asked for)."""

    allocated: int = 0
    reserved: int = 0
    requested: int = 0
    peak_allocated: int = 0
    peak_reserved: int = 0
    peak_requested: int = 0
    segments: int = 0  # segments held: cudaMalloc'd ones, and expandable ones (A8), which PyTorch's own
    # ``segment`` statistic leaves out
    retries: int = 0  # A7: times the allocator gave segments back to try again


class CachingAllocator:
    """The caching allocator of NOTE [ CUDA caching allocator ]; ``capacity_bytes`` None: no limit;
    ``expandable_segments``: PyTorch's ``expandable_segments:True`` (A8-A11)."""

    def __init__(self, capacity_bytes: int | None = None, *, expandable_segments: bool = False) -> None:
        self.capacity = capacity_bytes
        self.expandable = expandable_segments
        self.stats = AllocatorStats()
        self._free: dict[tuple[bool, int], list[tuple[int, int]]] = {}  # (small, stream) -> sorted (size, address)
        self._by_address: dict[int, _Block] = {}  # free blocks
        self._unmapped: dict[tuple[bool, int], list[int]] = {}  # A8: (small, stream) -> sorted addresses
        self._unmapped_at: dict[int, _Block] = {}  # A8: address space with no pages behind it
        self._live: dict[int, tuple[_Block, int]] = {}  # handle -> (block, requested bytes)
        self._next_address = 0
        self._next_handle = 0

    # -- the program's side ---------------------------------------------------------------------------------
    def malloc(self, nbytes: int, stream: int = 0) -> int:
        """A handle for ``nbytes`` on ``stream`` (A1-A5, A7; A8-A10); raises :class:`OutOfMemory`."""
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        block = self._best_fit(small, stream, size)
        if block is None:
            block = self._grow(small, stream, size) if self.expandable else self._new_segment(small, stream, size)
        rest = block.size - size
        if (rest >= MIN_BLOCK) if small or self.expandable else (rest > SMALL_SIZE):  # A5, A9
            remaining = _Block(block.address + size, rest, small, stream, prev=block, next=block.next, base=block.base)
            if block.next is not None:
                block.next.prev = remaining
            block.next, block.size = remaining, size
            self._cache(remaining)
        block.allocated = True
        handle = self._next_handle
        self._next_handle += 1
        self._live[handle] = (block, nbytes)
        s = self.stats
        s.allocated += block.size
        s.requested += nbytes
        s.peak_allocated = max(s.peak_allocated, s.allocated)
        s.peak_requested = max(s.peak_requested, s.requested)
        return handle

    def free(self, handle: int) -> None:
        """A6: the block of ``handle`` back to its pool, merged with its free neighbours (A11: still mapped)."""
        block, nbytes = self._live.pop(handle)
        self.stats.allocated -= block.size
        self.stats.requested -= nbytes
        block.allocated = False
        self._cache(self._merge(block, mapped=True))

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache``: what A7 gives back before a request fails (A11: the free pages of
        expandable segments)."""
        self._release_cached()

    # -- the allocator's side -------------------------------------------------------------------------------
    def _best_fit(self, small: bool, stream: int, size: int) -> _Block | None:
        """A3; A9 with expandable segments."""
        pool = self._free.get((small, stream))
        if not pool:
            return None
        i = bisect.bisect_left(pool, (size, -1))
        if i == len(pool):
            return None
        if self.expandable:  # A9: past a block at the growing end while the next larger one counts less
            while i + 1 < len(pool) and self._reach(pool[i + 1][1]) < self._reach(pool[i][1]):
                i += 1
        block = self._by_address[pool[i][1]]
        self._uncache(block)
        return block

    def _reach(self, address: int) -> int:
        """A9: a free block's size, and the unmapped space right after it."""
        block = self._by_address[address]
        after = block.next
        return block.size + (after.size if after is not None and not after.mapped else 0)

    def _make_room(self, seg: int, size: int) -> None:
        """A7 (and A10, with A4's ``seg``): give cached memory back when ``seg`` more bytes would pass the
        capacity; raise :class:`OutOfMemory` when that is not enough."""
        s = self.stats
        if self.capacity is not None and s.reserved + seg > self.capacity:
            self._release_cached()
            s.retries += 1
            if s.reserved + seg > self.capacity:
                raise OutOfMemory(
                    f"a {seg} B segment for a {size} B request: {s.reserved} B reserved ({s.allocated} B allocated) "
                    f"of {self.capacity} B"
                )

    def _new_segment(self, small: bool, stream: int, size: int) -> _Block:
        """A4, and A7 when the capacity is reached."""
        seg = segment_size(size)
        self._make_room(seg, size)
        s = self.stats
        block = _Block(self._next_address, seg, small, stream)
        self._next_address += seg
        s.reserved += seg
        s.segments += 1
        s.peak_reserved = max(s.peak_reserved, s.reserved)
        return block

    def _grow(self, small: bool, stream: int, size: int) -> _Block:
        """A10: a free block of at least ``size`` bytes made by mapping pages (A7's check first)."""
        self._make_room(segment_size(size), size)
        block = self._expandable_start(small, stream, size)
        if not block.mapped:
            block = self._map(block, min(block.size, size))
        while block.size < size:  # a free block at the end: the pages after it
            after = block.next
            assert after is not None and not after.mapped
            block = self._map(after, min(size - block.size, after.size))
        self._uncache(block)
        return block

    def _expandable_start(self, small: bool, stream: int, size: int) -> _Block:
        """A10: the lowest unmapped block (or the free block just before it) where free and unmapped space
        holds ``size``; A8: a new segment's address space when none does."""
        for address in self._unmapped.get((small, stream), []):
            start = self._unmapped_at[address]
            if start.prev is not None and not start.prev.allocated:
                start = start.prev
            room = 0
            after: _Block | None = start
            while room < size and after is not None and not after.allocated:
                room += after.size
                after = after.next
            if room >= size:
                return start
        span = -(-ADDRESS_SPACE // page_size(small)) * page_size(small)
        block = _Block(self._next_address, span, small, stream, mapped=False, base=self._next_address)
        self._next_address += span
        self.stats.segments += 1
        self._cache_unmapped(block)
        return block

    def _map(self, block: _Block, nbytes: int) -> _Block:
        """A8, A10: pages for the first ``nbytes`` of unmapped ``block`` (its rest stays unmapped); the pages
        merge with the free blocks next to them. Returns the free block they are part of."""
        mapped = min(-(-nbytes // page_size(block.small)) * page_size(block.small), block.size)
        self._uncache_unmapped(block)
        block.mapped = True
        if mapped < block.size:
            rest = _Block(block.address + mapped, block.size - mapped, block.small, block.stream, prev=block,
                          next=block.next, mapped=False, base=block.base)  # fmt: skip
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, mapped
            self._cache_unmapped(rest)
        block = self._merge(block, mapped=True)
        self._cache(block)
        s = self.stats
        s.reserved += mapped
        s.peak_reserved = max(s.peak_reserved, s.reserved)
        return block

    def _release_cached(self) -> None:
        """A7: every free block that is a whole segment goes back to the device; A11: every whole page inside
        a free block of an expandable segment is unmapped."""
        for block in list(self._by_address.values()):
            if block.base >= 0:
                self._unmap(block)
            elif block.prev is None and block.next is None:
                self._uncache(block)
                self.stats.reserved -= block.size
                self.stats.segments -= 1

    def _unmap(self, block: _Block) -> None:
        """A11: the whole pages inside free ``block`` unmapped; its ends stay mapped and free. An expandable
        segment left with nothing mapped is given back."""
        page = page_size(block.small)
        end = block.address + block.size
        first = block.base + -(-(block.address - block.base) // page) * page
        last = block.base + (end - block.base) // page * page
        if first >= last:
            return
        self._uncache(block)
        if first > block.address:
            before = _Block(block.address, first - block.address, block.small, block.stream, prev=block.prev,
                            next=block, base=block.base)  # fmt: skip
            if block.prev is not None:
                block.prev.next = before
            block.prev = before
            self._cache(before)
        if end > last:
            after = _Block(last, end - last, block.small, block.stream, prev=block, next=block.next, base=block.base)
            if block.next is not None:
                block.next.prev = after
            block.next = after
            self._cache(after)
        block.address, block.size, block.mapped = first, last - first, False
        block = self._merge(block, mapped=False)
        self.stats.reserved -= last - first
        if block.prev is None and block.next is None:
            self.stats.segments -= 1  # the segment's address space goes back too
        else:
            self._cache_unmapped(block)

    def _merge(self, block: _Block, *, mapped: bool) -> _Block:
        """A6: ``block`` with the neighbours in its segment that are free and ``mapped`` as it is."""
        for neighbour in (block.prev, block.next):
            if neighbour is not None and not neighbour.allocated and neighbour.mapped == mapped:
                if mapped:
                    self._uncache(neighbour)
                else:
                    self._uncache_unmapped(neighbour)
                if neighbour is block.prev:
                    block.address, block.prev = neighbour.address, neighbour.prev
                    if block.prev is not None:
                        block.prev.next = block
                else:
                    block.next = neighbour.next
                    if block.next is not None:
                        block.next.prev = block
                block.size += neighbour.size
        return block

    def _cache(self, block: _Block) -> None:
        bisect.insort(self._free.setdefault((block.small, block.stream), []), block.key)
        self._by_address[block.address] = block

    def _uncache(self, block: _Block) -> None:
        pool = self._free[(block.small, block.stream)]
        del pool[bisect.bisect_left(pool, block.key)]
        del self._by_address[block.address]

    def _cache_unmapped(self, block: _Block) -> None:
        bisect.insort(self._unmapped.setdefault((block.small, block.stream), []), block.address)
        self._unmapped_at[block.address] = block

    def _uncache_unmapped(self, block: _Block) -> None:
        pool = self._unmapped[(block.small, block.stream)]
        del pool[bisect.bisect_left(pool, block.address)]
        del self._unmapped_at[block.address]


# -- request sequences ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Request:
    """One call the program makes: allocate ``nbytes`` for ``tensor`` (on ``stream``), or free it
    (``nbytes`` None)."""

    tensor: int
    nbytes: int | None
    stream: int = 0


class IterationRequests(NamedTuple):
    """A training run's requests (NOTE [ The first iteration ]): ``setup`` allocates what exists before the
    first iteration, ``iteration`` is each iteration, and the first one also allocates the optimizer's
    ``state``, before its request ``at``. Each iteration frees what it allocates but the state, and allocates
    again what it frees of the setup, so that iterations can follow each other."""

    setup: list[Request]
    state: list[Request]
    iteration: list[Request]
    at: int

    @property
    def first(self) -> list[Request]:
        """The first iteration: the state allocated before request ``at``."""
        return [*self.iteration[: self.at], *self.state, *self.iteration[self.at :]]

    def steady(self) -> list[Request]:
        """The setup with the state, then one later iteration (the trace's view: NOTE [ Steady state ])."""
        return [*self.setup, *self.state, *self.iteration]

    def replay(
        self, iterations: int = ITERATIONS, capacity_bytes: int | None = None, *, expandable_segments: bool = False
    ) -> AllocatorStats:
        """:func:`replay` of the setup and ``iterations`` iterations, the first one first."""
        return replay(
            [*self.setup, *self.first],
            capacity_bytes,
            repeat=self.iteration,
            times=iterations - 1,
            expandable_segments=expandable_segments,
        )


def _state(w: Workload) -> list[int]:
    """The tensors of the optimizer's state that live through the iteration (NOTE [ The first iteration ])."""
    return [t.id for t in w.tensors if t.kind == TensorKind.OPTIMIZER_STATE and t.alloc_op < 0 and t.free_op is None]


def _first_iteration(
    w: Workload, setup: list[Request], iteration: list[Request], ops: Sequence[int], state: Iterable[int]
) -> IterationRequests:
    """NOTE [ The first iteration ]: the requests of ``state`` out of ``setup``, allocated in the first
    iteration before the first request of the first optimizer op (``ops``: each request's op)."""
    state = set(state)
    step = next((op.index for op in w.ops if op.phase == Phase.OPTIMIZER), None)
    if not state or step is None:
        return IterationRequests(setup, [], iteration, len(iteration))
    at = next((k for k, op in enumerate(ops) if op >= step), len(iteration))
    lazy = [r for r in setup if r.tensor in state]
    return IterationRequests([r for r in setup if r.tensor not in state], lazy, iteration, at)


def replay(
    requests: Iterable[Request],
    capacity_bytes: int | None = None,
    *,
    repeat: Sequence[Request] = (),
    times: int = 0,
    expandable_segments: bool = False,
) -> AllocatorStats:
    """The allocator's stats after ``requests``, then ``repeat`` ``times`` over (the iterations of a training
    run after what lives through all of them: parameters, optimizer state), with ``expandable_segments`` or
    not (A8-A11). Raises :class:`OutOfMemory` when a request does not fit ``capacity_bytes``."""
    alloc = CachingAllocator(capacity_bytes, expandable_segments=expandable_segments)
    handles: dict[int, int] = {}
    for r in itertools.chain(requests, *(repeat for _ in range(times))):
        if r.nbytes is None:
            alloc.free(handles.pop(r.tensor))
        else:
            handles[r.tensor] = alloc.malloc(r.nbytes, r.stream)
    return dataclasses.replace(alloc.stats)


def recorded_requests(recorded: Iterable[Sequence[Any]]) -> list[Request]:
    """Requests recorded from PyTorch's allocator (``torch.cuda.memory._snapshot()``'s trace, as
    experiments/gpu_check.py keeps it: ``["alloc", address, bytes, stream]`` and ``["free", address, 0,
    stream]``), the address naming the block; the frees of blocks allocated before the recording are left
    out (nothing to free in a replay)."""
    live: set[int] = set()
    out: list[Request] = []
    for kind, addr, size, stream in recorded:
        if kind == "alloc":
            live.add(addr)
            out.append(Request(addr, size, stream))
        elif addr in live:
            live.discard(addr)
            out.append(Request(addr, None, stream))
    return out


def workload_requests(w: Workload) -> IterationRequests:
    """The requests of a training run of ``w`` with no policy: each op allocates its outputs, then its
    workspace, frees the workspace, then frees what it was the last to use (NOTE [ Op indices and
    lifetimes ] in runtime/workload.py); the optimizer's state is allocated in the first iteration (NOTE
    [ The first iteration ])."""
    n = len(w.ops)
    setup: list[Request] = []
    allocs: list[list[Request]] = [[] for _ in range(n)]
    frees: list[list[Request]] = [[] for _ in range(n)]
    end: list[Request] = []
    for t in w.tensors:
        if t.alloc_op >= n or (t.free_op is not None and t.free_op < max(t.alloc_op, 0)):
            continue  # allocated and released outside any recorded op (memory_timeline leaves it out too)
        if t.alloc_op < 0:
            setup.append(Request(t.id, t.nbytes))
        else:
            allocs[t.alloc_op].append(Request(t.id, t.nbytes))
        if t.free_op is not None:
            frees[t.free_op].append(Request(t.id, None))
        if t.alloc_op < 0 and t.free_op is not None:
            end.append(Request(t.id, t.nbytes))
        elif t.alloc_op >= 0 and t.free_op is None:
            end.append(Request(t.id, None))
    workspace = -1 - max((t.id for t in w.tensors), default=0)  # an id no tensor has
    iteration: list[Request] = []
    ops: list[int] = []
    for op in w.ops:
        iteration += allocs[op.index]
        if op.workspace_bytes:
            iteration += [Request(workspace, op.workspace_bytes), Request(workspace, None)]
        iteration += frees[op.index]
        ops += [op.index] * (len(iteration) - len(ops))
    return _first_iteration(w, setup, [*iteration, *end], ops, _state(w))


# -- a static plan (seed 003) ------------------------------------------------------------------------------
@dataclass(frozen=True)
class OffsetPlan:
    """Where each interval's bytes sit in one arena (``offsets``, in the order given) and the arena's size."""

    offsets: tuple[int, ...]
    arena_bytes: int


def plan_offsets(intervals: Sequence[tuple[int, int, int]], align: int = MIN_BLOCK) -> OffsetPlan:
    """Offsets in one arena for ``intervals`` of (first op, last op, bytes), so that no two live at one op
    share an address: the memory pool of "Efficient Memory Management for GPU-based Deep Learning Systems"
    (seed 003), which knows every lifetime from the iteration's regularity. Its problem (dynamic storage
    allocation) is NP-complete; this is the greedy heuristic by size: largest first (longest-lived first
    among equal sizes), each at the lowest offset where it overlaps, in time, nothing placed. The arena is
    at least the peak of the live bytes (each size rounded up to ``align``)."""
    n = len(intervals)
    start = np.array([s for s, _, _ in intervals], dtype=np.int64)
    end = np.array([e for _, e, _ in intervals], dtype=np.int64)
    size = np.array([-(-z // align) * align for _, _, z in intervals], dtype=np.int64)
    order = np.lexsort((start, -(end - start), -size))
    offset = np.zeros(n, dtype=np.int64)
    placed = np.zeros(n, dtype=bool)
    for i in order.tolist():
        clash = np.flatnonzero(placed & (start <= end[i]) & (end >= start[i]))
        at = 0
        for j in clash[np.argsort(offset[clash], kind="stable")].tolist():  # first fit, from the bottom
            if offset[j] >= at + size[i]:
                break
            at = max(at, int(offset[j] + size[j]))
        offset[i], placed[i] = at, True
    return OffsetPlan(tuple(offset.tolist()), int((offset + size).max()) if n else 0)


def workload_intervals(w: Workload) -> list[tuple[int, int, int]]:
    """(first op, last op, bytes) of each storage of ``w``'s iteration with no policy, and of each op's
    workspace (NOTE [ Op indices and lifetimes ] in runtime/workload.py; what exists before the iteration or
    outlives it spans it whole)."""
    n = len(w.ops)
    out = []
    for t in w.tensors:
        first, last = max(t.alloc_op, 0), n - 1 if t.free_op is None else t.free_op
        if first <= last and t.alloc_op < n:
            out.append((first, last, t.nbytes))
    out += [(op.index, op.index, op.workspace_bytes) for op in w.ops if op.workspace_bytes]
    return out


def policy_requests(
    w: Workload, hw: HardwareProfile, actions: Sequence[int] | np.ndarray, options: PolicyOptions | None = None
) -> IterationRequests:
    """The requests of a training run of ``w`` under a policy, like :func:`workload_requests`:
    every storage of the simulator's memory accounting (NOTE [ Simulator semantics ], Rule 2: kept, copied
    back, regenerated, packed, a recompute's held bytes, workspaces), allocated and freed in the order the
    op-by-op simulator (envs/simulator_reference.py) makes them, on one stream (copies back are allocated on
    the compute stream: runtime R4). Their live bytes reach the simulator's peak exactly."""
    from envs.simulator_reference import simulate_reference

    log: list[Any] = []
    simulate_reference(w, hw, [int(a) for a in actions], options=options, allocations=log)
    setup = [Request(a.handle, a.nbytes) for a in log if a.op < 0]
    iteration = [Request(a.handle, a.nbytes) for a in log if a.op >= 0]
    sizes = {r.tensor: r.nbytes for r in setup}
    live = dict(sizes)
    for r in iteration:
        if r.nbytes is None:
            live.pop(r.tensor)
        else:
            live[r.tensor] = r.nbytes
    end = [Request(h, None) for h in live if h not in sizes]  # allocated by the iteration and left
    end += [Request(h, z) for h, z in sizes.items() if h not in live]  # of the setup, freed by the iteration
    ops = [a.op for a in log if a.op >= 0]
    handles = {a.tensor: a.handle for a in log if a.op < 0}
    state = {handles[t] for t in _state(w) if t in handles}
    return _first_iteration(w, setup, [*iteration, *end], ops + [len(w.ops)] * len(end), state)


def policy_stats(
    w: Workload,
    hw: HardwareProfile,
    actions: Sequence[int] | np.ndarray,
    options: PolicyOptions | None = None,
    iterations: int = ITERATIONS,
    capacity_bytes: int | None = None,
    expandable_segments: bool = False,
) -> AllocatorStats:
    """The caching allocator's stats over ``iterations`` iterations of ``w`` under a policy (one simulation
    op by op: for a few policies, such as a search's finalists, not for every one it scores), with
    ``expandable_segments`` or not (A8-A11); raises :class:`OutOfMemory` when a request does not fit
    ``capacity_bytes``."""
    return policy_requests(w, hw, actions, options).replay(
        iterations, capacity_bytes, expandable_segments=expandable_segments
    )


def request_intervals(requests: Sequence[Request]) -> list[tuple[int, int, int]]:
    """(first, last, bytes) of each allocation in ``requests``, in positions of the sequence (so that what
    is freed before another is allocated never shares its time, even within one op); what is never freed
    lives to the end. :func:`plan_offsets` of them places the sequence in one arena."""
    opened: dict[int, tuple[int, int]] = {}
    out: list[tuple[int, int, int]] = []
    for i, r in enumerate(requests):
        if r.nbytes is None:
            first, nbytes = opened.pop(r.tensor)
            out.append((first, i - 1, nbytes))
        else:
            opened[r.tensor] = (i, r.nbytes)
    out += [(first, len(requests), nbytes) for first, nbytes in opened.values()]
    return out


def no_policy_stats(w: Workload, iterations: int = ITERATIONS, *, expandable_segments: bool = False) -> AllocatorStats:
    """The caching allocator's stats over ``iterations`` iterations of ``w`` with no policy (reserved bytes
    only grow, A4 and A11: by the second iteration the cache holds what every iteration asks for), with
    ``expandable_segments`` or not (A8-A11)."""
    return workload_requests(w).replay(iterations, expandable_segments=expandable_segments)


__all__ = [
    "ADDRESS_SPACE",
    "ITERATIONS",
    "LARGE_BUFFER",
    "MIN_BLOCK",
    "SMALL_BUFFER",
    "SMALL_SIZE",
    "AllocatorStats",
    "CachingAllocator",
    "IterationRequests",
    "OffsetPlan",
    "OutOfMemory",
    "Request",
    "no_policy_stats",
    "page_size",
    "plan_offsets",
    "policy_requests",
    "policy_stats",
    "recorded_requests",
    "replay",
    "request_intervals",
    "round_size",
    "segment_size",
    "workload_intervals",
    "workload_requests",
]
