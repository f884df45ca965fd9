"""The ``Workload``: one training iteration as a schedule of ops over tensors.

A workload is what :mod:`runtime.trace` captures and what the simulator, the searchers and the runtime all
read. It is plain data (dataclasses of ints, floats and strings) so it can be saved as JSON and compared.

NOTE [ Tensors are storages ]
    Memory is allocated per storage, not per tensor: a view, a ``detach()`` or an in-place op's result
    shares its input's storage. So a :class:`TensorInfo` here is one *storage* allocation, identified by a
    small integer id, with the shape and dtype of the first tensor seen over it.

NOTE [ Op indices and lifetimes ]
    Ops are numbered 0..n-1 in execution order; ops that only alias (views, ``detach``) are not recorded.
    A tensor is live from ``alloc_op`` (the op that created it, or -1 for tensors that exist before the
    iteration starts) through ``free_op`` inclusive (the last op that completed before its storage was
    released, or ``None`` when it outlives the iteration). The live bytes during op ``i`` are therefore the
    sum of ``nbytes`` over tensors with ``alloc_op <= i`` and (``free_op is None`` or ``free_op >= i``):
    inputs and outputs of an op are both counted while it runs. The peak of the iteration is the maximum of
    that sum over ops (see :func:`memory_timeline`).

NOTE [ Candidates ]
    A candidate is an activation saved for backward: a storage allocated during the forward (or the loss)
    that autograd packed for a backward node. Parameters, buffers and input batches are excluded (dropping
    them would free nothing). Each candidate carries a stable ``key`` computed by
    :class:`runtime.keys.SavedTensorKeyer`, the same code the runtime runs at training time, so a policy
    written for a key finds its tensor again. ``free_op`` of its tensor is where it dies when kept;
    ``free_if_dropped_op`` is where it would die if autograd did not hold it (measured, not guessed: see
    NOTE [ Drop pass ] in runtime/trace.py). ``unpack_op`` is where backward first unpacks it: a node
    unpacks all it saved when it starts, before its first op, which is where the runtime's unpack hook
    brings a tensor back or makes it again, not at the node's op that reads it (``bwd_uses``); the
    simulator's first use (``Candidate.first_use``). ``unpack_seq`` orders the first unpacks, so also those of
    one node, in the node's own order (a multiplication's gradient unpacks its second factor first): the order
    in which the runtime brings them back or makes them again (Rule 7 in envs/simulator.py).

NOTE [ Frames ]
    A frame is one call of one module in the forward (``layer1.0#0``: path and call, as in the keys), with
    the range of forward ops that ran during it (nested calls included: frames nest like the calls), the
    tensors it was given and returned, and how many saved-tensor packs happened with it as the innermost
    module. Frame 0 is ``<loss>#0``: what runs outside the model (the loss); it encloses nothing. Each
    candidate lists its packs as (frame, last op completed). The runtime decides with them where it needs
    hooks at all, which module calls it can recompute with ``torch.utils.checkpoint`` (runtime/plan.py), and
    the simulator reads the same to cost exactly that.
"""

from __future__ import annotations

import enum
import gzip
import hashlib
import json
import os
from collections.abc import Container, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from runtime.errors import AutotuneError
from runtime.fileio import atomic_write
from runtime.keys import canonical_key

FORMAT = "autotune.workload/v1"


class TensorKind(str, enum.Enum):
    """What a storage holds, for the memory breakdown."""

    PARAMETER = "parameter"
    BUFFER = "buffer"  # module state that is not a parameter (BatchNorm running stats, masks)
    GRADIENT = "gradient"
    OPTIMIZER_STATE = "optimizer_state"
    INPUT = "input"  # the batch
    ACTIVATION = "activation"  # allocated in forward and saved for backward: the candidates
    TEMPORARY = "temporary"  # everything else allocated during the iteration
    LIBRARY = "library"  # what libraries hold through the iteration: cuBLAS's workspaces (runtime/target.py G6)


class Phase(str, enum.Enum):
    FORWARD = "forward"  # the model's forward and the loss
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"


@dataclass
class TensorInfo:
    """One storage allocation (see NOTE [ Tensors are storages ])."""

    id: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: str
    kind: TensorKind
    alloc_op: int  # -1: exists before the iteration starts
    free_op: int | None  # None: outlives the iteration

    @property
    def persistent(self) -> bool:
        return self.alloc_op < 0 and self.free_op is None


@dataclass
class OpInfo:
    """One aten op of the iteration (see NOTE [ Op indices and lifetimes ])."""

    index: int
    name: str  # e.g. "aten.convolution.default"
    phase: Phase
    module: str  # innermost module path in forward; for backward ops the module of the forward op
    flops: float
    bytes_moved: int  # bytes read and written (view sizes, not storage sizes)
    inputs: tuple[int, ...]  # tensor ids read (unique, in argument order)
    outputs: tuple[int, ...]  # tensor ids written: newly allocated, then mutated in place
    time_s: float | None = None  # measured on the trace's device in real mode
    dtype: str = "float32"  # dtype of the first floating-point output (decides the FLOP rate)
    # Device bytes the op allocated and released inside itself (cuDNN and cuBLAS workspaces), above what it
    # left allocated; measured from the CUDA allocator by real-mode traces, 0 elsewhere.
    workspace_bytes: int = 0
    frame: int = -1  # forward ops: the innermost module call running it (NOTE [ Frames ]); -1 elsewhere
    seeded: bool = False  # draws random numbers (dropout): recomputing it needs the random state restored
    # Real-mode traces on a GPU: seconds the host spent issuing this op (dispatch, launch and the Python up
    # to the next op), from host timestamps; None where not measured (NOTE [ Host clock ] in envs/simulator.py).
    host_s: float | None = None
    # Forward ops: aten ops dispatched right after this one that have no memory effect (views, detach, size
    # queries). They are not ops of the workload, but the runtime's recorder records them too (Rule 12).
    quiet_ops: int = 0
    # A sum of a shared parameter's gradients that PyTorch made in a new tensor and the runtime makes in place
    # into this input (NOTE [ Shared parameters' gradients ] in runtime/shared_grads.py; Rule 15); -1: none.
    in_place_into: int = -1


@dataclass
class Candidate:
    """An activation saved for backward (see NOTE [ Candidates ])."""

    key: str
    tensor: int  # TensorInfo.id
    nbytes: int
    producer: int  # op that allocated the storage
    writers: tuple[int, ...]  # later forward ops that wrote it in place (e.g. ReLU(inplace=True))
    save_op: int  # last op completed when autograd first saved it: its value is final from here on
    last_fwd_use: int  # last forward op reading or writing it
    bwd_uses: tuple[int, ...]  # backward ops reading it, in order
    free_if_dropped_op: int  # last forward op before its storage would be released were it not saved
    recompute_inputs: tuple[int, ...]  # tensors the producer chain (producer + writers) reads
    block: str = ""  # block of the producer (runtime.keys.block_paths): a recompute region
    block_input: bool = False  # also saved in another block than its producer's: a block boundary
    packs: tuple[tuple[int, int], ...] = ()  # each pack of its storage: (frame, last op completed), in order
    unpack_op: int = -1  # the op backward ran next when it first unpacked it (-1: never, or an older trace)
    unpack_seq: int = -1  # its first unpack's rank among all candidates' first unpacks (-1: as unpack_op)
    # Its first pack ran inside op ``save_op``, after its kernel (the op saves its own output): that op's inputs
    # were still alive, its workspace gone (NOTE [ What is recorded ] in runtime/trace.py; Rules 4, 8).
    packed_in_op: bool = False

    def first_use(self, n_ops: int) -> int:
        """Where backward first needs it (NOTE [ Candidates ]): the first unpack, when its node starts, before
        the node's first op (a multiplication's gradient unpacks both factors, then runs two ops); in a trace
        from before unpacks were recorded, the first backward op that reads it; ``n_ops`` when none does."""
        if self.unpack_op >= 0:
            return self.unpack_op
        return self.bwd_uses[0] if self.bwd_uses else n_ops

    @property
    def recompute_ops(self) -> tuple[int, ...]:
        """Ops that regenerate the storage, in order: its producer then its in-place writers."""
        return (self.producer, *self.writers)


@dataclass
class Frame:
    """One module call in the forward (see NOTE [ Frames ])."""

    index: int
    path: str  # module path; "<root>" for the model itself, "<loss>" for frame 0 (outside the model)
    call: int  # which call of that module since the step started (NOTE [ Key format ] in runtime/keys.py)
    parent: int  # the enclosing call; -1 for the root and for frame 0
    first_op: int  # first forward op run during the call
    last_op: int  # last forward op run during it (first_op - 1 when it ran none)
    packs: int = 0  # packs (any storage, parameters included) with this call as the innermost module
    args: tuple[int, ...] = ()  # tensor ids of its tensor arguments, positional then keyword (-1: unknown)
    outputs: tuple[int, ...] = ()  # tensor ids of the tensors it returned
    norm: bool = False  # a BatchNorm module: writes its running statistics in forward
    view_out: bool = False  # it returned a view (InstanceNorm's output): never one node (plan P10, regions N4)


@dataclass
class Workload:
    """One training iteration of one model at one batch size."""

    model: str
    batch_size: int
    seq_len: int | None
    optimizer: str
    device: str  # where it was traced: "cpu", "cuda:0 (NVIDIA H200)", ...
    mode: str  # "fake" (no memory, no times) or "real" (measured op times)
    torch_version: str
    ops: list[OpInfo]
    tensors: list[TensorInfo]
    candidates: list[Candidate]
    fingerprint: str = ""
    shape_fingerprint: str = ""
    meta: dict[str, Any] = field(default_factory=dict)
    precision: str = "fp32"  # fp32, or bf16/fp16 under torch.autocast (NOTE [ Precision ] in runtime.precision)
    grad_accum: int = 1  # micro-batches per optimizer step (NOTE [ Gradient accumulation ] in runtime.trace)
    frames: list[Frame] = field(default_factory=list)  # module calls of the forward (NOTE [ Frames ])
    # Image height and width where the trace was asked for another than the model's default
    # (autotune.models.given_image_size); None otherwise, and in files from before it was recorded.
    image_size: int | None = None

    # -- structure ---------------------------------------------------------------------------------------
    def phase_range(self, phase: Phase) -> range:
        """Op indices of one phase (phases are contiguous)."""
        idx = [op.index for op in self.ops if op.phase == phase]
        return range(idx[0], idx[-1] + 1) if idx else range(0)

    def candidate(self, key: str) -> Candidate:
        for c in self.candidates:
            if c.key == key:
                return c
        raise KeyError(key)

    def bytes_by_kind(self, persistent_only: bool = False) -> dict[TensorKind, int]:
        """Total bytes of every storage of each kind (each counted once, whenever it lived)."""
        out = {k: 0 for k in TensorKind}
        for t in self.tensors:
            if not persistent_only or t.alloc_op < 0:
                out[t.kind] += t.nbytes
        return out

    @property
    def activation_bytes(self) -> int:
        """Bytes of all saved activations (the candidates), parameters excluded."""
        return sum(c.nbytes for c in self.candidates)

    @property
    def parameter_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors if t.kind == TensorKind.PARAMETER)

    def compute_fingerprints(self) -> None:
        """Set ``fingerprint`` (structure only) and ``shape_fingerprint`` (structure and every size).

        ``fingerprint`` hashes the modules that run in forward, in order of first call, and the parameter
        shapes: it changes when the model changes (a layer, a width) and not with the batch size, the
        sequence length or the device (op names and a few saved tensors differ between CPU and CUDA
        kernels: cuDNN's BatchNorm, fused attention). ``shape_fingerprint`` also hashes the shapes and
        dtypes of the tensors that live through the iteration (parameters, optimizer state, the batch), not
        the libraries' workspaces (``library``: the process's, whatever the model, and absent from a CPU trace
        of the same model that trains a GPU plan).
        """
        h = hashlib.sha256()
        seen: set[str] = set()
        for op in self.ops:
            if op.phase == Phase.FORWARD and op.module not in seen:
                seen.add(op.module)
                h.update(f"M{op.module};".encode())
        for t in self.tensors:
            if t.kind == TensorKind.PARAMETER:
                h.update(f"P{t.shape}{t.dtype};".encode())
        # A partitioned trace (runtime/partition.py) runs the same modules on other tensors: another plan.
        for p in self.meta.get("partitions", ()):
            h.update(f"Q{p['module']}/{p['chunks']};".encode())
        self.fingerprint = h.hexdigest()[:16]
        h2 = hashlib.sha256(self.fingerprint.encode())
        h2.update(f"B{self.batch_size},{self.seq_len};".encode())
        if self.image_size is not None:  # a CNN's parameters are the same at every size: its images are not
            h2.update(f"I{self.image_size};".encode())
        for t in self.tensors:
            if t.persistent and t.kind != TensorKind.LIBRARY:
                h2.update(f"{t.kind.value}{t.shape}{t.dtype}{t.nbytes};".encode())
        self.shape_fingerprint = h2.hexdigest()[:16]

    # -- persistence -------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["format"] = FORMAT
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "<dict>") -> Workload:
        fmt = d.get("format") if isinstance(d, dict) else None
        if fmt != FORMAT:
            raise AutotuneError(
                f"{source}: workload format {fmt!r} is not supported: expected {FORMAT!r}; "
                "trace the model again with `autotune profile --model M --out FILE`"
            )
        try:
            ops = [
                OpInfo(
                    **{
                        **o,
                        "phase": Phase(o["phase"]),
                        "inputs": tuple(o["inputs"]),
                        "outputs": tuple(o["outputs"]),
                    }
                )
                for o in d["ops"]
            ]
            tensors = [
                TensorInfo(**{**t, "kind": TensorKind(t["kind"]), "shape": tuple(t["shape"])}) for t in d["tensors"]
            ]
            cands = [
                Candidate(
                    **{
                        **c,
                        "key": canonical_key(c["key"]),  # files from before producers had one name (runtime/keys.py)
                        "writers": tuple(c["writers"]),
                        "bwd_uses": tuple(c["bwd_uses"]),
                        "recompute_inputs": tuple(c["recompute_inputs"]),
                        "packs": tuple((int(f), int(op)) for f, op in c.get("packs", ())),
                    }
                )
                for c in d["candidates"]
            ]
            frames = [  # files from before frames were traced have none
                Frame(**{**f, "args": tuple(f["args"]), "outputs": tuple(f["outputs"])}) for f in d.get("frames", [])
            ]
            rest = {
                k: d[k]
                for k in (
                    "model",
                    "batch_size",
                    "seq_len",
                    "optimizer",
                    "device",
                    "mode",
                    "torch_version",
                    "fingerprint",
                    "shape_fingerprint",
                    "meta",
                )
            }
        except (KeyError, TypeError, ValueError) as e:
            raise AutotuneError(
                f"{source}: corrupted workload file ({type(e).__name__}: {e}); "
                "trace the model again with `autotune profile --model M --out FILE`"
            ) from None
        rest["precision"] = d.get("precision", "fp32")  # files from before precisions were traced
        rest["grad_accum"] = int(d.get("grad_accum", 1))
        rest["image_size"] = d.get("image_size")
        return cls(ops=ops, tensors=tensors, candidates=cands, frames=frames, **rest)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write JSON (gzip-compressed when the name ends in .gz), atomically: temp file, then rename."""
        path = Path(path)
        data = json.dumps(self.to_dict(), separators=(",", ":")).encode()
        if path.suffix == ".gz":
            data = gzip.compress(data, mtime=0)
        atomic_write(path, data)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Workload:
        path = Path(path)
        try:
            raw = path.read_bytes()
        except OSError as e:
            raise AutotuneError(f"cannot read workload file '{path}': {e.strerror}") from None
        try:
            if raw[:2] == b"\x1f\x8b":
                raw = gzip.decompress(raw)
            d = json.loads(raw)
        except (OSError, EOFError, ValueError) as e:
            raise AutotuneError(
                f"'{path}' is not a workload file (not valid JSON: {e}); "
                "trace the model again with `autotune profile --model M --out FILE`"
            ) from None
        return cls.from_dict(d, source=str(path))


# -- memory accounting ---------------------------------------------------------------------------------
@dataclass
class PeakReport:
    """The no-policy peak of one iteration and what was live at that moment."""

    peak_bytes: int
    peak_op: int  # index of the op during which the peak occurs
    by_kind_bytes: dict[str, int]  # live bytes per TensorKind at the peak
    persistent_bytes: int  # live across the whole iteration (parameters, optimizer state, ...)


def rounded(nbytes: int, granularity_bytes: int) -> int:
    """``nbytes`` rounded up to the allocator's granularity (512 B on CUDA, 1 on the CPU tracker)."""
    return -(-nbytes // granularity_bytes) * granularity_bytes


def memory_timeline(w: Workload, granularity_bytes: int = 1, exclude: Container[int] = ()) -> np.ndarray:
    """Live bytes during each op with no policy (NOTE [ Op indices and lifetimes ]), its workspace included,
    leaving out the tensors whose ids are in ``exclude`` (the simulator places candidates itself). Shape
    (n_ops,)."""
    n = len(w.ops)
    delta = np.zeros(n + 1, dtype=np.int64)  # difference array: +nbytes at alloc, -nbytes after free
    for t in w.tensors:
        start = max(t.alloc_op, 0)
        end = n if t.free_op is None else t.free_op + 1
        if end <= start or t.id in exclude:  # allocated and released outside any recorded op, or left out
            continue
        size = rounded(t.nbytes, granularity_bytes)
        delta[start] += size
        delta[end] -= size
    return np.cumsum(delta[:n]) + workspace_bytes(w)


def in_place_bytes(w: Workload, granularity_bytes: int = 1) -> np.ndarray:
    """Per op, the bytes of a sum PyTorch makes in a new tensor and autotune's runtime makes in place
    (``OpInfo.in_place_into``; simulator Rule 15): what every policy holds less than plain training there.
    Shape (n_ops,)."""
    out = np.zeros(len(w.ops), dtype=np.int64)
    for op in w.ops:
        if op.in_place_into >= 0:
            out[op.index] = sum(rounded(w.tensors[t].nbytes, granularity_bytes) for t in op.outputs
                                if w.tensors[t].alloc_op == op.index)  # fmt: skip
    return out


def workspace_bytes(w: Workload) -> np.ndarray:
    """Each op's workspace (``OpInfo.workspace_bytes``), live during the op only. Shape (n_ops,)."""
    return np.fromiter((op.workspace_bytes for op in w.ops), dtype=np.int64, count=len(w.ops))


def peak_report(w: Workload, granularity_bytes: int = 1) -> PeakReport:
    """Peak of the no-policy iteration with a breakdown by tensor kind at the peak; every allocation
    rounded up to ``granularity_bytes`` (see ``HardwareProfile.alloc_granularity_bytes``)."""
    timeline = memory_timeline(w, granularity_bytes)
    i = int(np.argmax(timeline)) if len(timeline) else 0
    by_kind = {k.value: 0 for k in TensorKind}
    for t in _live_at(w.tensors, i, len(w.ops)):
        by_kind[t.kind.value] += rounded(t.nbytes, granularity_bytes)
    persistent = sum(rounded(t.nbytes, granularity_bytes) for t in w.tensors if t.persistent)
    return PeakReport(int(timeline[i]) if len(timeline) else persistent, i, by_kind, persistent)


def _live_at(tensors: Iterable[TensorInfo], i: int, n_ops: int) -> Iterable[TensorInfo]:
    for t in tensors:
        end = n_ops if t.free_op is None else t.free_op
        if max(t.alloc_op, 0) <= i <= end:
            yield t
