"""Measure the host clock's costs (``HostCosts``, Rule 12 in envs/simulator.py) on the device at hand.

The runtime applies policies to a chain of modules of a few ``relu`` each on tensors of 16 floats: kernels of
microseconds, so that what a policy adds to a step is host time. Each cost comes from two configurations
that differ in what the runtime reports doing (``RuntimeStats``: packs seen, hooked module calls, regions,
ops recorded and replayed, swaps), as in a two-point fit; the times are steady-state steps (the first,
learning step excluded), the fastest of several against a plain step run alongside, since noise only
ever adds time. ``calibrate`` takes about a second; ``runtime.hardware.calibrate_cpu`` puts its result
into the ``cpu`` profile, and experiments/gpu_check.py prints it for a GPU.

    hooks, m relus per module        d(m) = P(m) (relu pack + unpack) + C frame   -> frame
    hooks, CNN blocks                d = P (pack + unpack) + C frame               -> pack + unpack
    regions (checkpointed), m relus  d(m) = 2 N (region + m region_pack) + kernels -> region, region_pack
    the recorder alone, CNN blocks   a forward under it, less a plain forward      -> record_op
    replays of tiny blocks' ReLUs    d = hooks + record + R (replay_op + kernel)    -> replay_op
    swaps (every relu)               d = hooks + S swap                              -> swap

The costs of a pack, of recording and of replaying an op depend on the op (its tensors, its schema, how
much data its kernel touches after the Python work): they are measured on residual blocks (convolution,
BatchNorm, ReLU, add: what a CNN packs and records) of 64 channels of 16 x 16, and replays on tiny ones;
a transformer's ops differ.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable

import numpy as np
import torch

from runtime.apply import PolicyRuntime, RuntimeStats
from runtime.hardware import HostCosts
from runtime.policy import Policy, PolicyOptions
from runtime.replay import Recorder
from runtime.trace import capture
from runtime.workload import Workload

_MODULES = 24  # N
_WIDTH = 16
# The blocks' size: kernels of some tens of microseconds on a CPU, as a real model's. The recorder's Python
# work between two kernels costs more when they touch more data (caches): 21 us an op at 4 channels of 4 x 4,
# 28 at 64 of 16 x 16, 32 on ResNet-50 at 64 px (2 threads, this project's CPU).
_CHANNELS, _SIDE = 64, 16


class _Relus(torch.nn.Module):
    """m relus, then an add: the add's output (the next module's input) is saved by nothing, so every
    module call of ``_network`` can be a region (runtime/plan.py)."""

    def __init__(self, m: int) -> None:
        super().__init__()
        self.m = m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.m):
            x = torch.relu(x)
        return x + 1.0


class _Block(torch.nn.Module):
    """A residual block of tiny size: what a CNN's recorded and replayed ops look like."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn = torch.nn.BatchNorm2d(c)
        self.relu = torch.nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.bn(self.conv(x))) + x


Net = Callable[[torch.device], tuple[torch.nn.Module, tuple[torch.Tensor, ...]]]


def _network(m: int, device: torch.device) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(_WIDTH, _WIDTH, device=device), *[_Relus(m) for _ in range(_MODULES)])
    return model, (torch.randn(1, _WIDTH, device=device),)


def _blocks(
    device: torch.device, channels: int = _CHANNELS, side: int = _SIDE
) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    with torch.device(device):
        model = torch.nn.Sequential(*[_Block(channels) for _ in range(_MODULES // 2)])
        return model, (torch.randn(2, channels, side, side),)


def _loss(model: torch.nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return model(batch[0]).sum()


class _Bench:
    """One network, plain and under one policy, timed in alternation."""

    def __init__(self, net: Net, device: torch.device, codes: Callable[[Workload], np.ndarray] | None,
                 force: bool, options: PolicyOptions | None = None) -> None:  # fmt: skip
        self.device = device
        self.model, self.batch = net(device)
        self.force = force
        self.rt: PolicyRuntime | None = None
        if codes is not None:
            batch = self.batch[0].shape[0]  # the policy's own (R11 warns of larger inputs than a policy's)
            w = capture(lambda: (*net(torch.device("cpu")), _loss), name="host-costs", batch_size=batch)
            self.rt = PolicyRuntime(Policy.from_vector(w, codes(w), hardware=device.type, options=options), self.model)
        self.stats = RuntimeStats()

    def step(self, policy: bool) -> float:
        ctx = self.rt.step(force_hooks=self.force) if policy and self.rt is not None else contextlib.nullcontext()
        _sync(self.device)
        start = time.perf_counter()
        with ctx as stats:
            _loss(self.model, self.batch).backward()
        _sync(self.device)
        if policy and stats is not None:
            self.stats = stats
        self.model.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    def extra_s(self, budget_s: float) -> float:
        """Seconds a step under the policy takes more than a plain one (their fastest runs)."""
        self.step(True)  # the first step learns (R11)
        plain: list[float] = []
        policy: list[float] = []
        start = time.perf_counter()
        while time.perf_counter() - start < budget_s or len(plain) < 5:
            plain.append(self.step(False))
            policy.append(self.step(True))
        return min(policy) - min(plain)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _forward_op_s(net: Net, device: torch.device, budget_s: float) -> tuple[float, float]:
    """(seconds per forward op, plain; more seconds per op under the recorder)."""
    model, batch = net(device)
    ops = [0]

    def forward(record: bool) -> float:
        rec = Recorder(device) if record else None
        _sync(device)
        start = time.perf_counter()
        with rec if rec is not None else contextlib.nullcontext():
            _loss(model, batch)
        _sync(device)
        if rec is not None:
            ops[0] = len(rec.ops)
        return time.perf_counter() - start

    plain: list[float] = []
    recorded: list[float] = []
    start = time.perf_counter()
    while time.perf_counter() - start < budget_s or len(plain) < 5:
        plain.append(forward(False))
        recorded.append(forward(True))
    return min(plain) / ops[0], (min(recorded) - min(plain)) / ops[0]


def _by_position(choose: Callable[[int, int], int], m: int) -> Callable[[Workload], np.ndarray]:
    """Action codes for ``_network(m)``: its candidates are the relus' outputs, m per module, in order."""
    return lambda w: np.array([choose(i % m, m) for i in range(len(w.candidates))], dtype=np.int8)


def _relu_outputs_recomputed(w: Workload) -> np.ndarray:
    """For ``_blocks``: replay each block's ReLU output (its BatchNorm and the in-place ReLU), keep the rest:
    no call can be a region (the convolution's output is kept, P2)."""
    return np.array([2 if c.key.endswith(":Relu") else 0 for c in w.candidates], dtype=np.int8)


def calibrate(device: str = "cpu", seconds: float = 1.0) -> HostCosts:
    """The runtime's host costs on ``device``, measured in about ``seconds`` (see the module docs)."""
    dev = torch.device(device)
    share = seconds / 8
    relus = {m: functools.partial(_network, m) for m in (1, 2, 3)}
    hooks = {m: _Bench(relus[m], dev, _by_position(lambda i, m: 0, m), force=True) for m in (1, 2)}
    d_hooks = {m: b.extra_s(share) for m, b in hooks.items()}
    p1, p2 = hooks[1].stats.packs, hooks[2].stats.packs
    relu_pack = max(0.0, (d_hooks[2] - d_hooks[1]) / max(1, p2 - p1))
    frame_s = max(0.0, (d_hooks[1] - p1 * relu_pack) / max(1, hooks[1].stats.hooked_calls))
    # A ReLU packs its output; a convolution and a BatchNorm pack parameters and statistics too, whose packs
    # and unpacks cost more (2 us against 6 on this project's CPU): the per-pack cost is the blocks'.
    forced = _Bench(_blocks, dev, lambda w: np.zeros(len(w.candidates), dtype=np.int8), force=True)
    d_forced = forced.extra_s(share)
    st = forced.stats
    per_pack = max(relu_pack, (d_forced - st.hooked_calls * frame_s) / max(1, st.packs))

    relu_op_s, _ = _forward_op_s(relus[3], dev, share / 2)
    # Regions under checkpoint, whose Python hooks cost per pack (regions as one node run nothing per pack
    # and are planned at the same cost per call: envs/simulator.py Rule 12).
    checkpointed = PolicyOptions(region_nodes=False)
    regions = {m: _Bench(relus[m], dev, _by_position(lambda i, m: 2, m), force=False, options=checkpointed)
               for m in (1, 3)}  # fmt: skip
    d_regions = {m: b.extra_s(share) - m * _MODULES * relu_op_s for m, b in regions.items()}
    n = max(1, regions[1].stats.regions)
    region_pack_s = max(0.0, (d_regions[3] - d_regions[1]) / (2 * n * 2))
    region_s = max(0.0, d_regions[1] / (2 * n) - region_pack_s)

    _, record_op_s = _forward_op_s(_blocks, dev, share / 2)  # ops of a CNN: convolution, BatchNorm, ReLU, add
    # Replays on tiny blocks, whose kernels are short enough that their mean time stands for the replayed ones'.
    tiny = functools.partial(_blocks, channels=4, side=4)
    op_s, tiny_record_s = _forward_op_s(tiny, dev, share / 2)
    replay = _Bench(tiny, dev, _relu_outputs_recomputed, force=False)
    d_replay = replay.extra_s(share)
    st = replay.stats
    known = st.packs * per_pack + st.hooked_calls * frame_s + st.recorded_ops * tiny_record_s
    replay_op_s = max(0.0, (d_replay - known) / max(1, st.recomputed_ops) - op_s)

    swap = _Bench(relus[1], dev, _by_position(lambda i, m: 1, 1), force=False)
    d_swap = swap.extra_s(share)
    st = swap.stats
    swap_s = max(0.0, (d_swap - st.packs * relu_pack - st.hooked_calls * frame_s) / max(1, st.swaps))
    return HostCosts(
        op_s=0.0 if dev.type == "cpu" else relu_op_s,  # on the CPU op times are wall times already (Rule 12)
        frame_s=frame_s,
        pack_s=per_pack / 2,  # the pack and the unpack are not told apart: half each
        unpack_s=per_pack / 2,
        swap_s=swap_s,
        region_s=region_s,
        region_pack_s=region_pack_s,
        record_op_s=max(0.0, record_op_s),
        replay_op_s=replay_op_s,
        source=f"measured on {device} with the runtime (runtime/host_costs.py, torch {torch.__version__})",
    )
