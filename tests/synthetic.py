"""Hand-built workloads with fixed op times, for simulator tests with hand-computed answers.

The profile ``fixed`` makes ``op_times_s`` return the ops' own ``time_s`` (a real-mode workload traced "on"
that profile), so every op takes exactly what the test says; copies run at the profile's host-link rates.
"""

from __future__ import annotations

import dataclasses

from runtime.hardware import HardwareProfile, HostCosts
from runtime.workload import Candidate, Frame, OpInfo, Phase, TensorInfo, TensorKind, Workload


def fixed_profile(
    h2d_bytes_per_s: float = 1e9, d2h_bytes_per_s: float = 1e9, is_gpu: bool = True, **host_s: float
) -> HardwareProfile:
    """``is_gpu``: copies on copy engines (Rule 1); False puts them on the compute stream, as on the CPU.
    ``host_s``: host costs (``HostCosts`` fields, seconds); none by default: the host is never behind."""
    return HardwareProfile(
        name="fixed",
        description="test profile: op times are the workload's own",
        memory_bytes=2**40,
        flops_per_s={"fp32": 1e12},
        memory_bytes_per_s=1e12,
        h2d_bytes_per_s=h2d_bytes_per_s,
        d2h_bytes_per_s=d2h_bytes_per_s,
        launch_overhead_s=0.0,
        is_gpu=is_gpu,
        alloc_granularity_bytes=1,
        host=dataclasses.replace(HostCosts(), **host_s, source="test") if host_s else HostCosts(),
    )


def _workload(ops: list[OpInfo], tensors: list[TensorInfo], cands: list[Candidate], name: str) -> Workload:
    w = Workload(
        model=name, batch_size=1, seq_len=None, optimizer="sgd", device="test", mode="real",
        torch_version="", ops=ops, tensors=tensors, candidates=cands, meta={"device_profile": "fixed"},
    )  # fmt: skip
    w.compute_fingerprints()
    return w


def chain_workload(n: int, size: int, op_s: float) -> Workload:
    """n equal layers: forward op i makes activation c_i from c_{i-1} (op 0 from the input x, persistent).

    Each c_i is saved for backward (a candidate), dropped from the program after the next layer read it
    (``free_if_dropped_op`` = i + 1, the last one at n - 1). Backward op n + j is layer (n - 1 - j)'s
    backward: it reads c_{n-1-j}, which is then released (``free_op`` = n + j), and makes a gradient g_j
    that the next backward op consumes (g_j lives [n + j, n + j + 1]). Every op takes ``op_s``; every
    tensor is ``size`` bytes.
    """
    tensors = [TensorInfo(0, size, (size,), "uint8", TensorKind.INPUT, -1, None)]
    ops: list[OpInfo] = []
    cands: list[Candidate] = []
    for i in range(n):
        tid = i + 1
        tensors.append(TensorInfo(tid, size, (size,), "uint8", TensorKind.ACTIVATION, i, 2 * n - 1 - i))
        ops.append(OpInfo(i, "aten.layer.default", Phase.FORWARD, f"layer{i}", 0.0, 2 * size, (tid - 1,),
                          (tid,), op_s))  # fmt: skip
    for j in range(n):
        layer = n - 1 - j
        gid = n + 1 + j
        last = j == n - 1
        tensors.append(TensorInfo(gid, size, (size,), "uint8", TensorKind.TEMPORARY, n + j,
                                  n + j if last else n + j + 1))  # fmt: skip
        reads = (layer + 1,) if j == 0 else (layer + 1, gid - 1)
        ops.append(OpInfo(n + j, "aten.layer_backward.default", Phase.BACKWARD, f"layer{layer}", 0.0,
                          3 * size, reads, (gid,), op_s))  # fmt: skip
    for i in range(n):
        cands.append(Candidate(
            key=f"layer{i}#0.0:Layer", tensor=i + 1, nbytes=size, producer=i, writers=(), save_op=i,
            last_fwd_use=min(i + 1, n - 1), bwd_uses=(2 * n - 1 - i,), free_if_dropped_op=min(i + 1, n - 1),
            recompute_inputs=(i,), block=f"layer{i}", block_input=False,
        ))  # fmt: skip
    return _workload(ops, tensors, cands, f"chain{n}")


def diamond_workload(size: int, op_s: float) -> Workload:
    """A skip connection: a = f(x); b = g(a); c = a * b; loss = h(c).

    Tensors (``size`` bytes each): x (input, persistent), a, b, c, the loss gradient seed s, and the
    gradients ga, gb. Ops, each ``op_s``:
        0 f: x -> a      1 g: a -> b      2 mul: a, b -> c      3 h: c -> s (c dropped after, not saved)
        4 mul_backward: s, a, b -> gb (and a's part, accumulated in place into gb's buffer: one tensor)
        5 g_backward: gb, a -> ga      6 f_backward: ga, x -> (parameter gradient, ignored)
    Candidates: a (saved by g and mul; used in backward by ops 4 and 5, released after 5) and b (saved by
    mul; used by op 4, released after it). Both are dropped after op 2 if not saved.
    """
    k = TensorKind
    tensors = [
        TensorInfo(0, size, (size,), "uint8", k.INPUT, -1, None),  # x
        TensorInfo(1, size, (size,), "uint8", k.ACTIVATION, 0, 5),  # a
        TensorInfo(2, size, (size,), "uint8", k.ACTIVATION, 1, 4),  # b
        TensorInfo(3, size, (size,), "uint8", k.TEMPORARY, 2, 3),  # c
        TensorInfo(4, size, (size,), "uint8", k.TEMPORARY, 3, 4),  # s
        TensorInfo(5, size, (size,), "uint8", k.TEMPORARY, 4, 5),  # gb
        TensorInfo(6, size, (size,), "uint8", k.TEMPORARY, 5, 6),  # ga
    ]
    f, b = Phase.FORWARD, Phase.BACKWARD
    ops = [
        OpInfo(0, "aten.f.default", f, "f", 0.0, 2 * size, (0,), (1,), op_s),
        OpInfo(1, "aten.g.default", f, "g", 0.0, 2 * size, (1,), (2,), op_s),
        OpInfo(2, "aten.mul.Tensor", f, "<root>", 0.0, 3 * size, (1, 2), (3,), op_s),
        OpInfo(3, "aten.h.default", f, "h", 0.0, 2 * size, (3,), (4,), op_s),
        OpInfo(4, "aten.mul_backward.default", b, "<root>", 0.0, 4 * size, (4, 1, 2), (5,), op_s),
        OpInfo(5, "aten.g_backward.default", b, "g", 0.0, 3 * size, (5, 1), (6,), op_s),
        OpInfo(6, "aten.f_backward.default", b, "f", 0.0, 2 * size, (6, 0), (), op_s),
    ]
    cands = [
        Candidate("g#0.0:F", 1, size, producer=0, writers=(), save_op=0, last_fwd_use=2, bwd_uses=(4, 5),
                  free_if_dropped_op=2, recompute_inputs=(0,), block="f", block_input=True),
        Candidate("<root>#0.0:G", 2, size, producer=1, writers=(), save_op=1, last_fwd_use=2, bwd_uses=(4,),
                  free_if_dropped_op=2, recompute_inputs=(1,), block="g", block_input=True),
    ]  # fmt: skip
    return _workload(ops, tensors, cands, "diamond")


def two_op_chain_workload(n: int, size: int, op_s: float) -> Workload:
    """n layers of two ops: op 2i makes a temporary t_i from c_{i-1} (op 0 from the input x, persistent),
    which op 2i + 1 reads to make activation c_i and then frees. Each c_i is saved for backward (a candidate),
    dropped from the program after the next layer read it (``free_if_dropped_op`` 2i + 2, the last one's at its
    own op); t_i is saved by nothing. Backward op 2n + j is layer (n - 1 - j)'s backward, as in
    :func:`chain_workload`: it reads c_{n-1-j}, released there, and makes a gradient g_j that the next backward
    op consumes. Replaying c_i re-runs ops 2i and 2i + 1 and makes t_i again (simulator Rule 7: a
    temporary). Every op takes ``op_s``; every tensor is ``size`` bytes. Tensor ids: x 0, t_i 2i + 1, c_i
    2i + 2, g_j 2n + 1 + j."""
    k = TensorKind
    tensors = [TensorInfo(0, size, (size,), "uint8", k.INPUT, -1, None)]
    ops: list[OpInfo] = []
    cands: list[Candidate] = []
    for i in range(n):
        t, c, prev = 2 * i + 1, 2 * i + 2, 2 * i
        tensors.append(TensorInfo(t, size, (size,), "uint8", k.TEMPORARY, 2 * i, 2 * i + 1))
        tensors.append(TensorInfo(c, size, (size,), "uint8", k.ACTIVATION, 2 * i + 1, 3 * n - 1 - i))
        ops.append(OpInfo(2 * i, "aten.pre.default", Phase.FORWARD, f"layer{i}", 0.0, 2 * size, (prev,), (t,), op_s))
        ops.append(OpInfo(2 * i + 1, "aten.layer.default", Phase.FORWARD, f"layer{i}", 0.0, 2 * size, (t,), (c,),
                          op_s))  # fmt: skip
        dropped = min(2 * i + 2, 2 * n - 1)
        cands.append(Candidate(
            key=f"layer{i}#0.0:Layer", tensor=c, nbytes=size, producer=2 * i + 1, writers=(), save_op=2 * i + 1,
            last_fwd_use=dropped, bwd_uses=(3 * n - 1 - i,), free_if_dropped_op=dropped, recompute_inputs=(t,),
            block=f"layer{i}", block_input=False,
        ))  # fmt: skip
    for j in range(n):
        layer, gid, op = n - 1 - j, 2 * n + 1 + j, 2 * n + j
        tensors.append(TensorInfo(gid, size, (size,), "uint8", k.TEMPORARY, op, op if j == n - 1 else op + 1))
        reads = (2 * layer + 2,) if j == 0 else (2 * layer + 2, gid - 1)
        ops.append(OpInfo(op, "aten.layer_backward.default", Phase.BACKWARD, f"layer{layer}", 0.0, 3 * size, reads,
                          (gid,), op_s))  # fmt: skip
    return _workload(ops, tensors, cands, f"twochain{n}")


def framed_chain_workload(n: int, size: int, op_s: float, block: int) -> Workload:
    """:func:`chain_workload` with module calls (NOTE [ Frames ]): layer i is the module ``b<j>.l<i>``, a
    child of block ``b<j>`` (j = i // ``block``), the blocks children of the model. Each layer packs its
    own output (``c_i``, read by its backward) and one parameter, so a block of layers is a region candidate
    (runtime/plan.py) once its outputs but the last... are recomputed."""
    w = chain_workload(n, size, op_s)
    frames = [Frame(0, "<loss>", 0, -1, 0, n - 1), Frame(1, "<root>", 0, -1, 0, n - 1, args=(0,), outputs=(n,))]
    blocks = (n + block - 1) // block
    for j in range(blocks):
        first, last = j * block, min(n, (j + 1) * block) - 1
        bf = len(frames)
        frames.append(Frame(bf, f"b{j}", 0, 1, first, last, args=(first,), outputs=(last + 1,)))
        for i in range(first, last + 1):
            frames.append(Frame(len(frames), f"b{j}.l{i}", 0, bf, i, i, packs=2, args=(i,), outputs=(i + 1,)))
    for i, c in enumerate(w.candidates):
        layer = next(f for f in frames if f.path.endswith(f".l{i}"))
        w.ops[i].frame = layer.index
        c.packs = ((layer.index, i),)
        c.key = f"{layer.path}#0.0:Layer"
    for op in w.ops[n:]:
        layer = n - 1 - (op.index - n)
        op.module = next(f.path for f in frames if f.path.endswith(f".l{layer}"))
    w.frames = frames
    w.compute_fingerprints()
    return w
