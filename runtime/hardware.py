"""Hardware profiles: what a device offers a training iteration, and how long an op takes on it.

A :class:`HardwareProfile` holds the few numbers the simulator needs: device memory, peak FLOP/s per
compute class, device-memory bandwidth, host-link bandwidth each way and a per-op launch overhead. Profiles
come from three places: a built-in table of common NVIDIA GPUs (datasheet numbers, each with its source),
:func:`detect` (the local GPU via NVML), and :func:`calibrate_cpu` (micro-benchmarks on this machine's CPU).

Op time follows the roofline model (Williams, Waterman and Patterson, "Roofline: an insightful visual
performance model for multicore architectures", CACM 2009): an op is bound either by arithmetic or by
memory traffic, so its time is the larger of the two, plus a fixed launch overhead::

    op_time_s = launch_overhead_s + max(flops / flops_per_s[class], bytes_moved / memory_bytes_per_s)

Limits of the model, all of which make real ops slower than predicted, never faster:

- Datasheet peaks are rarely reached: large GEMMs get 70-90% of them, small or skinny ones far less,
  and cuDNN picks convolution algorithms whose efficiency varies with shape. Calibrate on the device
  (runtime.measure) to correct for it.
- The launch overhead is added, not overlapped: on a GPU the host launches ahead of the device, so for
  ops longer than the launch cost the overhead is mostly hidden. For streams of tiny ops it is exact.
- FP64, integer and sparse tensor-core rates are not modelled; float64 ops are costed at the fp32 rate.
- Copies over the host link assume pinned host memory; pageable memory is about half as fast.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import math
import os
import re
import time
import types
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from runtime.errors import AutotuneError

if TYPE_CHECKING:
    from runtime.workload import Workload

#: The rate classes of ``HardwareProfile.flops_per_s``: plain FP32 CUDA cores, then tensor-core rates.
COMPUTE_CLASSES: tuple[str, ...] = ("fp32", "tf32", "bf16", "fp16", "fp8")

#: Planned for when no GPU is detected and no profile is named: the most common training GPU in clouds.
DEFAULT_PROFILE = "a100-40gb"

_TERA = 1e12  # datasheets give FLOP/s in decimal tera
_GB = 1e9  # ... and bandwidths in decimal GB/s
_MIB = 2**20

# Effective pinned-memory copy rates per direction over a x16 host link (assumption, not a datasheet
# value): about 80% of the raw link rate, which is what cudaMemcpyAsync from pinned memory reaches in
# NVIDIA's bandwidthTest on typical servers. Raw rates: PCIe 3.0 15.75, 4.0 31.5, 5.0 63 GB/s per direction.
_PCIE3_BYTES_PER_S = 12 * _GB
_PCIE4_BYTES_PER_S = 25 * _GB
_PCIE5_BYTES_PER_S = 50 * _GB

# Per-op launch overhead of eager PyTorch on a GPU (an estimate): the dispatcher plus cudaLaunchKernel cost
# about 5-10 us of host time per op on a server CPU. It depends on the host CPU rather than the GPU, so every
# built-in GPU profile shares it; calibrate on the machine for a better number.
_EAGER_LAUNCH_S = 6e-6


@dataclass(frozen=True)
class HostCosts:
    """Seconds of host (CPU, Python) time: eager PyTorch issuing an op, and the runtime's own work (NOTE
    [ Host clock ] in envs/simulator.py, Rule 12). ``source`` says where the numbers come from."""

    op_s: float = 0.0  # issuing one aten op: dispatch, the kernel launch, the Python around it
    frame_s: float = 0.0  # one call of a module the runtime hooks (R11): its pre- and post-hook
    pack_s: float = 0.0  # one pack the runtime's saved-tensor hooks observe (runtime R11)
    unpack_s: float = 0.0  # ... and its unpack in backward
    swap_s: float = 0.0  # issuing one copy out or back: the stream waits, the event, the pinned buffer (R3, R4)
    region_s: float = 0.0  # one region (R10), once in forward and once recomputing
    region_pack_s: float = 0.0  # each pack inside a checkpointed region: its Python hooks, forward and recompute
    record_op_s: float = 0.0  # one forward op under the recorder (R6)
    replay_op_s: float = 0.0  # replaying one recorded op, beyond issuing it (R6)
    source: str = "none: host time not modelled"

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if f.name != "source":
                object.__setattr__(self, f.name, _positive_float(getattr(self, f.name), f"host.{f.name}", 0.0))
        if not isinstance(self.source, str):
            raise AutotuneError(f"host.source={self.source!r}: expected a string saying where the numbers come from")


def _profile_from_fields(fields: dict[str, Any]) -> HardwareProfile:
    """A pickled :class:`HardwareProfile` made again (``HardwareProfile.__reduce__``)."""
    return HardwareProfile(**fields)


@dataclass(frozen=True)
class HardwareProfile:
    """One device as the simulator sees it. Rates are peaks in SI units (decimal GB/s, not GiB/s).

    ``memory_bytes`` is the device memory total; for built-in GPUs it is what NVML (``nvidia-smi``)
    reports on recent drivers, in MiB x 2**20, which is slightly less than the label (driver reservation,
    and 1/16 for ECC on GDDR6 data-centre cards). ``h2d_bytes_per_s`` and ``d2h_bytes_per_s`` count the
    bytes of the tensor copied, not bytes read plus written. ``memory_bytes_per_s`` counts every byte read
    or written, like the ``bytes_moved`` of an op.
    """

    name: str
    description: str
    memory_bytes: int
    flops_per_s: Mapping[str, float] = dataclasses.field(hash=False)
    memory_bytes_per_s: float
    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    launch_overhead_s: float
    is_gpu: bool
    # Every allocation is rounded up to this many bytes. PyTorch's CUDA caching allocator rounds requests
    # to multiples of 512 B (kMinBlockSize in c10/cuda/CUDACachingAllocator.cpp), and
    # max_memory_allocated counts the rounded blocks. The CPU tracker counts storage bytes as they are.
    alloc_granularity_bytes: int = 512
    host: HostCosts = dataclasses.field(default_factory=HostCosts)  # the host clock's costs (Rule 12)
    # CUDA compute capability (major, minor): which fused kernels the GPU runs, as a fake trace for it takes
    # them (NOTE [ GPU-faithful fake traces ] in runtime/target.py). None: not a GPU, or not known.
    compute_capability: tuple[int, int] | None = None
    # Host memory the runtime may pin for swapped tensors: it keeps one pinned buffer per swapped key across
    # iterations (runtime R3), so a policy swapping more bytes than this does not fit (simulator Rule 2).
    # None: not bounded (a plan for another machine, whose host is not known).
    host_memory_bytes: int | None = None
    # Streaming multiprocessors: how CUDA's reductions split their work, and so the staging buffer they
    # allocate (NOTE [ GPU-faithful fake traces ] G7 in runtime/target.py). None: not known (no such buffers
    # in a fake trace for it).
    multiprocessors: int | None = None

    def __post_init__(self) -> None:
        # Profiles can come from a user's JSON file, so bad values are user errors, not assertions.
        if not isinstance(self.name, str) or not self.name.strip():
            raise AutotuneError(f"hardware profile name {self.name!r}: expected a non-empty string")
        object.__setattr__(self, "name", self.name.strip().lower())
        where = f"hardware profile '{self.name}'"
        if type(self.memory_bytes) is not int or self.memory_bytes <= 0:  # bool is an int subclass: excluded
            raise AutotuneError(
                f"{where}: memory_bytes={self.memory_bytes!r}, expected a positive whole number of bytes"
            )
        for field in ("memory_bytes_per_s", "h2d_bytes_per_s", "d2h_bytes_per_s"):
            object.__setattr__(self, field, _positive_float(getattr(self, field), f"{where}: {field}"))
        object.__setattr__(
            self,
            "launch_overhead_s",
            _positive_float(self.launch_overhead_s, f"{where}: launch_overhead_s", 0.0),
        )
        if not isinstance(self.flops_per_s, Mapping) or "fp32" not in self.flops_per_s:
            raise AutotuneError(
                f"{where}: flops_per_s={self.flops_per_s!r}, expected a mapping with at least an 'fp32' rate"
            )
        rates: dict[str, float] = {}
        for cls, rate in self.flops_per_s.items():
            if cls not in COMPUTE_CLASSES:
                raise AutotuneError(
                    f"{where}: flops_per_s has an unknown class {cls!r}, expected one of {', '.join(COMPUTE_CLASSES)}"
                )
            rates[cls] = _positive_float(rate, f"{where}: flops_per_s[{cls!r}]")
        # A read-only view, so a frozen profile cannot be changed through its mapping either.
        object.__setattr__(self, "flops_per_s", types.MappingProxyType(rates))
        if not isinstance(self.is_gpu, bool):
            raise AutotuneError(f"{where}: is_gpu={self.is_gpu!r}, expected true or false")
        host_bytes = self.host_memory_bytes
        if host_bytes is not None and (type(host_bytes) is not int or host_bytes <= 0):
            raise AutotuneError(
                f"{where}: host_memory_bytes={host_bytes!r}, expected a positive whole number of bytes or null"
            )
        if isinstance(self.host, Mapping):  # from a JSON file
            try:
                object.__setattr__(self, "host", HostCosts(**self.host))
            except TypeError as e:
                raise AutotuneError(f"{where}: host: {e}; expected the fields of HostCosts") from None
        sm = self.multiprocessors
        if sm is not None and (type(sm) is not int or sm <= 0):
            raise AutotuneError(
                f"{where}: multiprocessors={sm!r}, expected a positive whole number (the GPU's streaming "
                "multiprocessors, e.g. 132 for an H200) or null"
            )
        cc = self.compute_capability
        if cc is not None:
            if not isinstance(cc, (list, tuple)) or len(cc) != 2 or not all(type(x) is int and x >= 0 for x in cc):
                raise AutotuneError(
                    f"{where}: compute_capability={cc!r}, expected [major, minor] (e.g. [9, 0] for a Hopper "
                    "GPU) or null"
                )
            object.__setattr__(self, "compute_capability", (cc[0], cc[1]))
        if not isinstance(self.host, HostCosts):
            raise AutotuneError(f"{where}: host={self.host!r}, expected host costs (HostCosts or a JSON object)")
        if type(self.alloc_granularity_bytes) is not int or self.alloc_granularity_bytes <= 0:
            raise AutotuneError(
                f"{where}: alloc_granularity_bytes={self.alloc_granularity_bytes!r}, expected a positive "
                "whole number of bytes (512 for CUDA's caching allocator, 1 for none)"
            )

    def __reduce__(self) -> tuple[Any, tuple[dict[str, Any]]]:
        """Pickled and deep-copied as its fields, the rates a plain dict (a ``mappingproxy`` pickles not):
        a Problem or environment sent to another process, or ``gym.make``'s copy of its keyword arguments,
        failed, and the environment lost its spec."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields["flops_per_s"] = dict(self.flops_per_s)
        return (_profile_from_fields, (fields,))

    def rate_flops_per_s(self, compute_class: str) -> float:
        """Peak FLOP/s of a compute class, falling back to fp32 where the device lacks the class
        (a V100 has no bf16 tensor cores: PyTorch runs bf16 there, but no faster than fp32)."""
        if compute_class not in COMPUTE_CLASSES:
            raise ValueError(f"unknown compute class {compute_class!r}, expected one of {COMPUTE_CLASSES}")
        return self.flops_per_s.get(compute_class, self.flops_per_s["fp32"])

    def op_time_s(self, flops: float, bytes_moved: float, compute_class: str) -> float:
        """Roofline time of one op: launch overhead plus the larger of compute time and memory time."""
        assert flops >= 0 and bytes_moved >= 0, (flops, bytes_moved)
        compute_s = flops / self.rate_flops_per_s(compute_class)
        memory_s = bytes_moved / self.memory_bytes_per_s
        return self.launch_overhead_s + max(compute_s, memory_s)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict; :meth:`from_dict` reads it back."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["flops_per_s"] = dict(self.flops_per_s)
        data["host"] = dataclasses.asdict(self.host)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> HardwareProfile:
        """Build a profile from :meth:`to_dict`'s output; missing or unknown keys are rejected."""
        expected = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(data, Mapping):
            raise AutotuneError(f"hardware profile: expected a JSON object, got {type(data).__name__}")
        optional = {"host", "compute_capability", "multiprocessors"}  # absent from older files
        missing, unknown = expected - data.keys() - optional, data.keys() - expected
        if missing or unknown:
            raise AutotuneError(
                f"hardware profile {data.get('name', '?')!r}: missing keys {sorted(missing)}, unknown keys "
                f"{sorted(unknown)}; expected exactly {sorted(expected)} (as written by to_dict)"
            )
        return cls(**data)


def _positive_float(value: object, what: str, minimum: float = math.ulp(0.0)) -> float:
    """``value`` as a finite float >= ``minimum`` (positive by default), or an AutotuneError naming it."""
    # bool is an int subclass, but `true` in a JSON profile is a mistake, not the number 1
    if isinstance(value, int | float) and not isinstance(value, bool):
        number = float(value)
        if math.isfinite(number) and number >= minimum:
            return number
    bound = "a positive number" if minimum > 0 else "a number >= 0"
    raise AutotuneError(f"{what}={value!r}, expected {bound}")


# The host clock of the built-in GPU profiles: what runtime/host_costs.py measured on an H200 machine's host
# (experiments/gpu_check.py step 2, torch 2.11.0+cu130, 16 host cores; tests/fixtures/gpu/host_costs.json).
# Issuing an op took 5.9 us (the eager launch estimate above was 6); the runtime's own work: frame 11.8 us,
# pack and unpack 3.5 each, swap 132 (stream waits, the event and the pinned buffer of a real copy: the 2-core
# CPU's 12-14 were a clone), region 92, region pack 4.8, record 30, replay 127. The host CPU, not the GPU,
# sets them: every built-in GPU profile shares them; a profile file can carry its own machine's. Region and
# region pack were measured under torch.utils.checkpoint; a region as one node (runtime/regions.py) runs
# nothing per pack and is planned at the same cost per call, not yet measured on a GPU host.
_GPU_HOST = HostCosts(
    op_s=5.9e-6,
    frame_s=11.8e-6,
    pack_s=3.5e-6,
    unpack_s=3.5e-6,
    swap_s=132e-6,
    region_s=92e-6,
    region_pack_s=4.8e-6,
    record_op_s=30e-6,
    replay_op_s=127e-6,
    source="measured on an H200 machine's host (runtime/host_costs.py, torch 2.11.0+cu130)",
)


def _gpu(
    name: str,
    description: str,
    memory_mib: int,
    tflops: Mapping[str, float],
    memory_gb_per_s: float,
    host_link_bytes_per_s: float,
    compute_capability: tuple[int, int],
    multiprocessors: int,
) -> HardwareProfile:
    """A built-in GPU profile from datasheet units (MiB, TFLOP/s, GB/s); the host link is symmetric."""
    return HardwareProfile(
        name=name,
        description=description,
        memory_bytes=memory_mib * _MIB,
        flops_per_s={cls: t * _TERA for cls, t in tflops.items()},
        memory_bytes_per_s=memory_gb_per_s * _GB,
        h2d_bytes_per_s=host_link_bytes_per_s,
        d2h_bytes_per_s=host_link_bytes_per_s,
        launch_overhead_s=_EAGER_LAUNCH_S,
        is_gpu=True,
        host=_GPU_HOST,
        compute_capability=compute_capability,
        multiprocessors=multiprocessors,
    )


# Tensor-core rates are dense; datasheets print the 2:4-sparsity rate (marked *), which is twice the dense
# one. Compute capabilities (the figure before the last): NVIDIA's list of CUDA GPUs (V100 7.0, T4 7.5, A100
# 8.0, RTX 3090 8.6, L4 and RTX 4090 8.9, H100 and H200 9.0). Multiprocessors (the last): the same datasheets
# and whitepapers; the H200's 132 is also what the reduction buffers recorded on one imply (runtime/target.py
# G7). Memory: nvidia-smi's total on recent drivers, as seen on
# real machines (older drivers print a few hundred MiB less for some cards, e.g. 40536 MiB for an A100 40GB and
# 24268 MiB for an RTX 3090).
_BUILTIN: tuple[HardwareProfile, ...] = (
    # NVIDIA Tesla V100 datasheet (2020), SXM2: 15.7 TFLOPS FP32, 125 tensor (FP16); 900 GB/s HBM2; host
    # over PCIe 3.0 x16 (NVLink links the GPUs only). No TF32/BF16: those fall back to the FP32 rate.
    # nvidia-smi: 16160 MiB.
    _gpu("v100-16gb", "NVIDIA V100 SXM2 16GB (Volta, HBM2, PCIe 3.0 host link)",
         16160, {"fp32": 15.7, "fp16": 125.0}, 900.0, _PCIE3_BYTES_PER_S, (7, 0), 80),
    # Same datasheet, 32GB model; nvidia-smi: 32510 MiB.
    _gpu("v100-32gb", "NVIDIA V100 SXM2 32GB (Volta, HBM2, PCIe 3.0 host link)",
         32510, {"fp32": 15.7, "fp16": 125.0}, 900.0, _PCIE3_BYTES_PER_S, (7, 0), 80),
    # NVIDIA A100 datasheet (2021): 19.5 TFLOPS FP32, 156 TF32, 312 BF16/FP16 dense; 1,555 GB/s HBM2 (40GB);
    # PCIe 4.0 x16. nvidia-smi: 40960 MiB.
    _gpu("a100-40gb", "NVIDIA A100 40GB (Ampere, HBM2, PCIe 4.0 host link)",
         40960, {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}, 1555.0, _PCIE4_BYTES_PER_S, (8, 0), 108),
    # Same datasheet, A100 80GB SXM: 2,039 GB/s HBM2e (the PCIe card: 1,935). nvidia-smi: 81920 MiB.
    _gpu("a100-80gb", "NVIDIA A100 80GB SXM (Ampere, HBM2e, PCIe 4.0 host link)",
         81920, {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}, 2039.0, _PCIE4_BYTES_PER_S, (8, 0), 108),
    # NVIDIA H100 datasheet (2023), SXM: 67 TFLOPS FP32; 989 TF32*, 1,979 BF16/FP16*, 3,958 FP8* (sparse);
    # 3.35 TB/s HBM3; PCIe 5.0 x16. nvidia-smi ("NVIDIA H100 80GB HBM3"): 81559 MiB.
    _gpu("h100-80gb", "NVIDIA H100 80GB SXM5 (Hopper, HBM3, PCIe 5.0 host link)",
         81559, {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5, "fp8": 1979.0}, 3350.0,
         _PCIE5_BYTES_PER_S, (9, 0), 132),
    # Same datasheet, H100 PCIe: 51 TFLOPS FP32; 756 TF32*, 1,513 BF16/FP16*, 3,026 FP8*; 2 TB/s HBM2e;
    # PCIe 5.0 x16. nvidia-smi ("NVIDIA H100 PCIe"): 81559 MiB.
    _gpu("h100-pcie", "NVIDIA H100 80GB PCIe (Hopper, HBM2e, PCIe 5.0 host link)",
         81559, {"fp32": 51.0, "tf32": 378.0, "bf16": 756.5, "fp16": 756.5, "fp8": 1513.0}, 2000.0,
         _PCIE5_BYTES_PER_S, (9, 0), 114),
    # NVIDIA H200 datasheet (2024), SXM: 67 TFLOPS FP32; 989 TF32*, 1,979 BF16/FP16*, 3,958 FP8*; 141 GB
    # HBM3e at 4.8 TB/s; PCIe 5.0 x16. nvidia-smi ("NVIDIA H200"): 143771 MiB. (H200 NVL is slower: not this.)
    _gpu("h200", "NVIDIA H200 141GB SXM (Hopper, HBM3e, PCIe 5.0 host link)",
         143771, {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5, "fp8": 1979.0}, 4800.0,
         _PCIE5_BYTES_PER_S, (9, 0), 132),
    # NVIDIA L4 datasheet (2023): 30.3 TFLOPS FP32; 120 TF32*, 242 BF16/FP16*, 485 FP8*; 24 GB GDDR6 at
    # 300 GB/s; PCIe 4.0 x16. nvidia-smi: 23034 MiB (ECC, on by default, holds 1/16 of the GDDR6).
    _gpu("l4", "NVIDIA L4 24GB (Ada Lovelace, GDDR6, PCIe 4.0 host link)",
         23034, {"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0, "fp8": 242.5}, 300.0,
         _PCIE4_BYTES_PER_S, (8, 9), 58),
    # NVIDIA T4 datasheet (2019): 8.1 TFLOPS FP32, 65 mixed-precision FP16/FP32 tensor; 16 GB GDDR6 at
    # 320 GB/s; PCIe 3.0 x16. No TF32/BF16. nvidia-smi: 15360 MiB (ECC on by default, 1/16 of the GDDR6).
    _gpu("t4", "NVIDIA T4 16GB (Turing, GDDR6, PCIe 3.0 host link)",
         15360, {"fp32": 8.1, "fp16": 65.0}, 320.0, _PCIE3_BYTES_PER_S, (7, 5), 40),
    # NVIDIA Ampere GA102 architecture whitepaper (v2, 2021), RTX 3090: 35.6 TFLOPS FP32; tensor with FP32
    # accumulate (what PyTorch uses) 35.6 TF32, 71 BF16/FP16 dense (GeForce runs FP32 accumulate at half
    # rate); 936 GB/s GDDR6X; PCIe 4.0 x16. nvidia-smi: 24576 MiB.
    _gpu("rtx3090", "NVIDIA GeForce RTX 3090 24GB (Ampere, GDDR6X, PCIe 4.0 host link)",
         24576, {"fp32": 35.6, "tf32": 35.6, "bf16": 71.0, "fp16": 71.0}, 936.0, _PCIE4_BYTES_PER_S, (8, 6), 82),
    # NVIDIA Ada Lovelace architecture whitepaper (v2.1, 2023), RTX 4090: 82.6 TFLOPS FP32; with FP32
    # accumulate 82.6 TF32, 165.2 BF16/FP16 dense; 1,008 GB/s GDDR6X; PCIe 4.0 x16. FP8: the whitepaper
    # gives 660.6 dense; we assume half, 330.3, for FP32 accumulate (what torch._scaled_mm uses), by the
    # same GeForce halving as FP16 (unchecked). nvidia-smi: 24564 MiB.
    _gpu("rtx4090", "NVIDIA GeForce RTX 4090 24GB (Ada Lovelace, GDDR6X, PCIe 4.0 host link)",
         24564, {"fp32": 82.6, "tf32": 82.6, "bf16": 165.2, "fp16": 165.2, "fp8": 330.3}, 1008.0,
         _PCIE4_BYTES_PER_S, (8, 9), 128),
)  # fmt: skip
_BY_NAME: dict[str, HardwareProfile] = {p.name: p for p in _BUILTIN}


def list_profiles() -> list[HardwareProfile]:
    """The built-in GPU profiles, oldest chips first (``cpu`` is calibrated on demand, not listed)."""
    return list(_BUILTIN)


def get_profile(name: str) -> HardwareProfile:
    """A built-in profile by name (case-insensitive), or ``cpu``: this machine's CPU, calibrated once."""
    key = name.strip().lower()
    if key == "cpu":
        return calibrate_cpu()
    if key in _BY_NAME:
        return _BY_NAME[key]
    valid = [*_BY_NAME, "cpu"]
    # A bare model ("h100", "a100") names several sizes, and difflib would rank "h200" above "h100-80gb".
    close = [v for v in valid if v.startswith(key)] or difflib.get_close_matches(key, valid, n=1)
    hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
    raise AutotuneError(
        f"unknown hardware profile '{name}': {hint}expected one of {', '.join(valid)}; "
        "see `autotune hardware` for their numbers"
    )


# --- which rate an op runs at --------------------------------------------------------------------------

_CONV_OPS = frozenset(
    {"convolution", "_convolution", "convolution_backward", "conv1d", "conv2d", "conv3d", "conv_transpose1d",
     "conv_transpose2d", "conv_transpose3d", "cudnn_convolution", "cudnn_convolution_transpose",
     "mkldnn_convolution", "_slow_conv2d_forward", "_slow_conv2d_backward", "slow_conv3d_forward"}
)  # fmt: skip
_MATMUL_OPS = frozenset(
    {"mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "_scaled_mm", "_addmm_activation",
     "einsum", "_int_mm"}
)  # fmt: skip
_DTYPE_CLASS = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16"}


def compute_class_for(op_name: str, dtype: str) -> str:
    """The rate class an aten op runs at, from PyTorch's defaults on CUDA.

    fp32 convolutions run on TF32 tensor cores (``torch.backends.cudnn.allow_tf32`` defaults to True), fp32
    matmuls and attention on plain FP32 cores (``torch.backends.cuda.matmul.allow_tf32`` defaults to False);
    bf16/fp16/fp8 matmul, convolution and attention run at their tensor-core rate. Everything else
    (elementwise, reductions, copies) is costed at fp32, as it is bandwidth bound anyway.
    ``op_name`` is e.g. ``"aten.addmm.default"`` (or ``"aten::addmm"``), ``dtype`` e.g. ``"bfloat16"``.
    """
    base = re.sub(r"^aten(\.|::)", "", op_name).split(".")[0]
    kind = "conv" if base in _CONV_OPS else "matmul" if base in _MATMUL_OPS or "attention" in base else None
    if kind is None:
        return "fp32"
    dtype = dtype.removeprefix("torch.")
    if dtype.startswith("float8"):
        return "fp8"
    if dtype in _DTYPE_CLASS:
        return _DTYPE_CLASS[dtype]
    return "tf32" if kind == "conv" and dtype in ("float32", "float") else "fp32"


# --- GPU detection ---------------------------------------------------------------------------------------


@dataclass
class Detection:
    """What :func:`detect` found. ``profile`` is None when no GPU was found or it has no built-in profile;
    then ``suggested`` holds the nearest profile by memory, if there is a GPU at all."""

    profile: HardwareProfile | None
    device_name: str | None
    memory_bytes: int | None
    message: str
    suggested: HardwareProfile | None = None


def profile_name_for_device(device_name: str, memory_bytes: int | None = None) -> str | None:
    """The built-in profile for an NVML device name, or None if there is none.

    ``memory_bytes`` tells the 40/80GB A100 and 16/32GB V100 apart when the name does not. Variants with
    other rates (V100S, H100 NVL, H200 NVL, RTX 3090 Ti, RTX 4090 D) get None on purpose.
    """
    # "NVIDIA A100-SXM4-40GB" -> ["a100", "sxm4", "40gb"]; "NVIDIA GeForce RTX 4090" -> ["rtx", "4090"]
    tokens = [t for t in re.split(r"[\s\-_]+", device_name.lower()) if t and t not in ("nvidia", "tesla", "geforce")]
    if not tokens:
        return None
    model, rest = tokens[0], tokens[1:]
    gib = memory_bytes / 2**30 if memory_bytes is not None else None

    def by_size(small: str, large: str, large_token: str, small_token: str, split_gib: float) -> str | None:
        if large_token in rest:
            return large
        if small_token in rest:
            return small
        return None if gib is None else large if gib > split_gib else small

    if model == "v100":
        return by_size("v100-16gb", "v100-32gb", "32gb", "16gb", 24)
    if model == "a100":
        return by_size("a100-40gb", "a100-80gb", "80gb", "40gb", 60)
    if model == "h100":
        return "h100-pcie" if "pcie" in rest else None if "nvl" in rest else "h100-80gb"
    if model == "h200":
        return None if "nvl" in rest else "h200"
    if model in ("l4", "t4") and not rest:
        return model
    if model == "rtx" and rest in (["3090"], ["4090"]):
        return "rtx" + rest[0]
    return None


def nearest_profile_by_memory(memory_bytes: int) -> HardwareProfile:
    """The built-in GPU profile whose memory is closest to ``memory_bytes`` (the first one on a tie)."""
    return min(_BUILTIN, key=lambda p: abs(p.memory_bytes - memory_bytes))


_CHOOSE_HINT = "choose another with --gpu NAME (list them with `autotune hardware`)"


def detect() -> Detection:
    """Find the local NVIDIA GPU through NVML and match it to a built-in profile. Never raises.

    With several GPUs, GPU 0 is used; NVML numbers GPUs in PCI order and ignores CUDA_VISIBLE_DEVICES.
    """
    try:
        import pynvml
    except ImportError:
        return _no_gpu("pynvml is not installed: pip install nvidia-ml-py")
    nvml_error: type[BaseException] = getattr(pynvml, "NVMLError", Exception)
    not_found: type[BaseException] = getattr(pynvml, "NVMLError_LibraryNotFound", nvml_error)
    try:
        pynvml.nvmlInit()
    except not_found:
        return _no_gpu("NVML library not found")
    except Exception as err:  # an NVMLError (driver not loaded, ...) or anything else: never crash planning
        return _no_gpu(f"NVML failed to start: {err}")
    try:
        count = int(pynvml.nvmlDeviceGetCount())
        if count == 0:
            return _no_gpu("NVML found no devices")
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        raw_name = pynvml.nvmlDeviceGetName(handle)
        name = raw_name.decode() if isinstance(raw_name, bytes) else str(raw_name)  # bytes in old pynvml
        memory_bytes = int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
    except Exception as err:  # same reason as above
        return _no_gpu(f"NVML query failed: {err}")
    finally:
        with contextlib.suppress(Exception):  # shutting down is best effort; the answer is already in hand
            pynvml.nvmlShutdown()
    where = f"GPU 0 '{name}' ({memory_bytes / 2**30:.2f} GiB)" + (f", 1 of {count} GPUs" if count > 1 else "")
    profile_name = profile_name_for_device(name, memory_bytes)
    if profile_name is not None:
        profile = _BY_NAME[profile_name]
        return Detection(profile, name, memory_bytes, f"detected {where}: planning for {profile.name}")
    nearest = nearest_profile_by_memory(memory_bytes)
    message = (
        f"detected {where}, which has no built-in profile: planning for the nearest by memory, "
        f"{nearest.name} ({nearest.memory_bytes / 2**30:.2f} GiB); {_CHOOSE_HINT}"
    )
    return Detection(None, name, memory_bytes, message, suggested=nearest)


def _no_gpu(reason: str) -> Detection:
    message = f"no NVIDIA GPU detected ({reason}); planning for {DEFAULT_PROFILE} by default; {_CHOOSE_HINT}"
    return Detection(None, None, None, message)


def resolve_profile(name: str | None) -> tuple[HardwareProfile, str]:
    """The profile to plan for and a line saying why: the named one, else the detected GPU, else the
    nearest built-in to an unknown GPU, else :data:`DEFAULT_PROFILE`. ``"cpu"`` calibrates this CPU."""
    if name is not None:
        profile = get_profile(name)
        return profile, f"planning for {profile.name}: {profile.description}"
    found = detect()
    if found.profile is not None:
        return found.profile, found.message
    if found.suggested is not None:
        return found.suggested, found.message
    return _BY_NAME[DEFAULT_PROFILE], found.message


# --- CPU calibration -----------------------------------------------------------------------------------


def _best_time_s(fn: Callable[[], object], budget_s: float, max_reps: int = 100) -> float:
    """Fastest of repeated runs of ``fn`` within ``budget_s``: the minimum is the least noisy estimate
    of what the hardware can do (noise only ever adds time). A warm-up run goes first; if it alone took
    the budget, one more run decides (the first call of a dtype can spend a tenth of a second creating
    oneDNN kernels: once, that made the bf16 rate 140x too slow), and no more (fp16 matmul emulated on an
    old CPU must not take seconds)."""
    start = time.perf_counter()
    fn()  # first call pays for page faults, thread-pool start-up and kernel selection
    warm_up_s = time.perf_counter() - start
    if warm_up_s >= budget_s:
        t0 = time.perf_counter()
        fn()
        return min(warm_up_s, time.perf_counter() - t0)
    best, start = math.inf, time.perf_counter()
    for _ in range(max_reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        if time.perf_counter() - start >= budget_s:
            break
    return best


def _host_memory_bytes() -> int:
    """Total RAM, or the container's cgroup v2 limit when that is lower (it is what the process may use)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit.isdigit():
            total = min(total, int(limit))
    except OSError:
        pass  # no cgroup v2 limit visible: the machine's RAM is the limit
    return total


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "unknown CPU"


def calibrate_cpu(seconds: float = 0.5) -> HardwareProfile:
    """A ``cpu`` profile measured on this machine in about ``seconds`` (cached per process).

    Measures the best-of-several rate of a 512x512 ``torch.mm`` in float32, bfloat16 and float16 (2*n^3
    FLOPs; a dtype without native CPU support may get one sample only), of a 64 MiB ``copy_``
    (memory bandwidth counts its read and its write; a swap on the CPU is such a host copy, so the host
    link rates count the tensor's bytes once), and the time of one tiny ``torch.add`` (launch overhead).
    Uses ``torch.get_num_threads()`` threads as configured.
    """
    if not seconds > 0:
        raise AutotuneError(f"calibration time {seconds!r} s: expected a positive number of seconds, e.g. 0.5")
    # One cache key per duration however it is passed: calibrate_cpu() and calibrate_cpu(0.5) measure once.
    return _calibrate_cpu(float(seconds))


@functools.cache
def _calibrate_cpu(seconds: float) -> HardwareProfile:
    import torch  # here, not at the top: listing or detecting profiles should not pay torch's import time

    started = time.perf_counter()
    share = seconds / 5  # fp32 matmul, bf16, fp16, copy, launch
    rates: dict[str, float] = {}
    with torch.no_grad():
        n = 512
        for cls, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
            a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
            mm = functools.partial(torch.mm, a, b, out=torch.empty(n, n, dtype=dtype))
            rates[cls] = 2 * n**3 / _best_time_s(mm, share)
        rates["tf32"] = rates["fp32"]  # CPUs have no TF32 mode: fp32 convolutions run at the fp32 rate

        nbytes = 64 * _MIB  # larger than the last-level cache of most CPUs, so this measures DRAM
        src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
        copy_s = _best_time_s(lambda: dst.copy_(src), share)

        x, y = torch.ones(1), torch.ones(1)
        calls = 100

        def tiny_ops() -> None:
            for _ in range(calls):
                torch.add(x, y)

        launch_s = _best_time_s(tiny_ops, share) / calls
    host = _cpu_host_costs(seconds)
    elapsed = time.perf_counter() - started
    return HardwareProfile(
        name="cpu",
        description=(
            f"this machine's CPU ({_cpu_model()}, {torch.get_num_threads()} thread"
            f"{'s' if torch.get_num_threads() != 1 else ''}), calibrated in "
            f"{elapsed:.2f} s: {rates['fp32'] / 1e9:.1f} GFLOP/s fp32 matmul, "
            f"{2 * nbytes / copy_s / 1e9:.1f} GB/s copy (read+write)"
        ),
        memory_bytes=_host_memory_bytes(),
        flops_per_s=rates,
        memory_bytes_per_s=2 * nbytes / copy_s,
        h2d_bytes_per_s=nbytes / copy_s,
        d2h_bytes_per_s=nbytes / copy_s,
        launch_overhead_s=launch_s,
        is_gpu=False,
        alloc_granularity_bytes=1,  # the CPU tracker (runtime.measure) counts storage bytes exactly
        host=host,
    )


# A busy machine: more runnable processes (the 1-minute load average) than this many per core plus one (this one).
BUSY_LOAD_PER_CORE = 1.0


def _cpu_host_costs(seconds: float) -> HostCosts:
    """The runtime's host costs on this CPU (runtime/host_costs.py), in about four times ``seconds``, on one
    thread: they are Python's work between kernels, and one thread leaves them less exposed to other processes
    (measured on a 2-core machine with three busy processes beside it: the recorder's cost per op 87-98 us on
    one thread, 156-333 on two, 32 on either when idle). A busy machine is said once: what is measured then
    is inflated, and so are the cpu profile's predicted times."""
    import torch

    from runtime.host_costs import calibrate  # the runtime itself: imported here, not at the top

    busy = _busy()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        costs = calibrate("cpu", 4 * seconds)
    finally:
        torch.set_num_threads(threads)
    busy = busy or _busy()
    if busy:
        warnings.warn(
            f"autotune: this machine was busy while its host costs were measured ({busy}): the cpu profile's "
            "predicted times may be too long; plan again when it is quieter",
            stacklevel=2,
        )
        return dataclasses.replace(costs, source=f"{costs.source}; measured while busy ({busy})")
    return costs


def _busy() -> str:
    """'load average L on C cores' when the machine runs more than it has cores for (else '')."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # not on every platform
        return ""
    cores = os.cpu_count() or 1
    return f"load average {load:.1f} on {cores} cores" if load > cores * BUSY_LOAD_PER_CORE + 1 else ""


# --- op times for a workload ---------------------------------------------------------------------------


def host_times_s(w: Workload, profile: HardwareProfile) -> list[float]:
    """Host seconds of issuing each op of ``w`` on ``profile`` (h_i of Rule 12 in envs/simulator.py).

    0 on a profile without copy engines: there the host is the device, and op times are the wall time an
    op takes (measured and scaled to a plain iteration, or estimated with the launch overhead). On a GPU, the
    host times measured by a real-mode trace on that very device, scaled so that they add up to the plain
    iteration's host time (NOTE [ Op time calibration ]); otherwise the profile's ``host.op_s`` per op."""
    n = len(w.ops)
    if not profile.is_gpu:
        return [0.0] * n
    if w.mode == "real" and w.meta.get("device_profile") == profile.name:
        measured = [op.host_s for op in w.ops]
        plain = w.meta.get("plain_host_s")
        if plain and all(t is not None for t in measured):
            times = [float(t) for t in measured if t is not None]
            total = sum(times)
            return [t * plain / total for t in times] if total > 0 else times
    return [profile.host.op_s] * n


def op_times_s(w: Workload, profile: HardwareProfile) -> list[float]:
    """Seconds of each op of ``w`` on ``profile``.

    Measured times when the workload was traced in real mode on the very device the profile describes
    (``w.meta["device_profile"] == profile.name``); otherwise the roofline estimate of
    :meth:`HardwareProfile.op_time_s` from each op's FLOPs, bytes moved and dtype.

    NOTE [ Op time calibration ]
        Ops timed one by one under the tracer's dispatch mode add up to more than an iteration really takes
        (on resnet18 at batch 8 on the CPU, 776 ms against 581 ms: the recorder's work between ops costs
        caches, and each op is timed in isolation). The real-mode trace also times plain iterations
        (``meta["plain_iter_s"]``, the median of five), and the measured op times are scaled so that they
        add up to it: the split between ops is measured, the total is what training sees. The median, not
        the fastest: on a shared 2-core CPU one step of the ResNet-50 proxy took 154 to 245 ms over 30
        steps (median 175), and a plan made from the fastest would be 12% short of a typical step.
    """
    if w.mode == "real" and w.meta.get("device_profile") == profile.name:
        measured = [op.time_s for op in w.ops]
        if all(t is not None for t in measured):
            times = [float(t) for t in measured if t is not None]
            plain = w.meta.get("plain_iter_s")
            scale = plain / sum(times) if plain and sum(times) > 0 else 1.0
            return [t * scale for t in times]
    classes = functools.lru_cache(maxsize=None)(compute_class_for)
    return [profile.op_time_s(op.flops, op.bytes_moved, classes(op.name, op.dtype)) for op in w.ops]
