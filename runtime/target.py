"""Fake traces that take the target GPU's device-dependent choices (NOTE [ GPU-faithful fake traces ]).

NOTE [ GPU-faithful fake traces ]
    A fake-mode trace runs on the CPU's kernels (runtime.trace), with no GPU present. Where PyTorch or a model
    library chooses by device, a plan for a GPU profile must see what that GPU runs, not what the CPU does:

    G1. Attention. ``F.scaled_dot_product_attention`` picks its kernel from the tensors' real device. On the
        CPU, with dropout, it takes the math path, which saves the (B, H, L, L) attention probabilities (and
        the dropout mask) for backward; CUDA's fused kernels save none of them. For a GPU target each call is
        routed to the fused op the GPU would pick, so that autograd saves what that kernel saves (q, k, v,
        the output, the log-sum-exp and the random-number seed and offset). The choice follows PyTorch's
        selection rules (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp; priority order flash,
        memory-efficient, math, cuDNN, as ``torch._C._get_sdp_priority_order()`` gives on torch 2.11-2.14,
        except that the first call on a Hopper or Blackwell GPU (compute capability 9.x, 10.x) with a recent
        cuDNN (above 9.15.0, as torch 2.11's CUDA 13 wheels ship) puts cuDNN first for the process:
        ``check_prefer_cudnn_attention``; an H200 run of GPT-2 small in bf16 ran cuDNN attention in every
        layer, and the priority order it printed changed from [flash, efficient, math, cuDNN] to [cuDNN,
        flash, efficient, math] after the first attention):
        - cuDNN attention, where it comes first: fp16 or bf16, head dimensions at most 128 and multiples of 8,
          4-D query, key and value, with or without ``attn_mask`` (a GPU machine with an older cuDNN runs
          flash instead: not modelled);
        - flash attention: fp16 or bf16, compute capability 8.0 or more, no ``attn_mask``, head dimension at
          most 256 and a multiple of 8, query, key and value of one dtype and head count;
        - memory-efficient attention: fp32, fp16, or bf16 from compute capability 8.0; compute capability 5.0
          or more; head dimension a multiple of 16 bytes' worth of elements (4 in fp32, 8 in fp16/bf16);
          any ``attn_mask``;
        - else math (the call runs as it is).
        Each profile names its compute capability (``HardwareProfile.compute_capability``); a profile
        without one (the ``cpu`` profile, a user's file that leaves it out) keeps the CPU's choice. Calls
        from inside ``torch.nn.functional``'s own composites (``multi_head_attention_forward``, which
        ``nn.MultiheadAttention`` and torchvision's ViT run) are routed too: the mode is off inside their
        torch-function dispatch, so the module-level name is the router's for the trace.
    G2. Dropout. On CUDA, ``F.dropout`` in training runs the fused ``native_dropout``, which saves a one-byte
        mask; on the CPU it draws a mask in the input's dtype (four bytes an element in fp32) and multiplies.
        For a GPU target a (not in-place) dropout runs as ``native_dropout``. Torch-function modes are off
        in backward, where ``torch.utils.checkpoint`` called in a model's own code re-runs its forward: there
        too the module-level ``F.dropout`` and ``F.scaled_dot_product_attention`` are the router's for the
        trace, so the recompute takes the kernels the forward took (checkpoint checks that it saves the same).
    G3. Optimizers. On CUDA tensors PyTorch's optimizers default to their ``foreach`` implementation (one
        kernel over all parameters, whose step temporaries are those of every parameter at once); on the
        CPU to the for-loop one. A GPU target's trace uses ``foreach``.
    G4. transformers' masks. Its masking utilities skip the causal mask (letting SDPA's ``is_causal`` do
        it) only when they can read the position ids and see that the sequences are not packed, and skip
        the padding mask of SDPA (causal or bidirectional, ``_ignore_causal_mask_sdpa``,
        ``_ignore_bidirectional_mask_sdpa``) only when they can read it and see no padding; a fake tensor
        cannot be read, so a fake trace built the (B, 1, L, L) mask that real training never makes (BERT-base
        8 x 512: an 8 MiB mask saved by every layer's attention, 12 saved keys the H200's real trace lacked).
        Under every fake trace (CPU or GPU target) position ids are taken as unpacked and padding masks as
        padding nothing, as the zoo's batches are, and the mask path is real training's.
    G5. Autocast. A bf16/fp16 trace runs under the CPU's autocast, whose op lists are not CUDA's
        (aten/src/ATen/autocast_mode.cpp): CUDA runs ``pow``, ``exp``, ``log``, ``rsqrt``, the norms
        (``layer_norm``, ``group_norm``, ``rms_norm``) and more in fp32, makes ``softmax``,
        ``log_softmax``, ``sum`` and ``cumsum`` return fp32 where no dtype is asked, promotes the inputs of
        ``addcmul``, ``index_put`` and a few more to the widest, and casts ``einsum``, ``mv``, ``addmv`` and
        others to the lower precision; the CPU does none of these. For a GPU target those policies are
        registered, for the trace only, as Python kernels at the CPU's autocast dispatch key (above
        autograd, as autocast's own: the casts are recorded and differentiated, and the ops a composite
        calls inside are cast too). ``scaled_dot_product_attention``, in CUDA's lower-precision list, has its
        floating inputs cast before G1 chooses its kernel, since the router sees the call before autocast
        does (Llama's rotary embedding leaves q and k in fp32 under autocast: G1 saw mixed dtypes and left the
        call to the CPU, which traced its own flash kernel, where CUDA runs cuDNN or flash on bf16 copies).
        Not done: CUDA's ``norm`` overloads (``fp32_append_dtype``); the ops
        only the CPU's lists hold (3-D pooling, padding, FFT, linear algebra; ``cat`` and ``stack``
        promotion) keep the CPU's policy.
    G6. Library workspaces. cuBLAS keeps a workspace per (handle, stream) from its first call to the end of
        the process, allocated through the caching allocator (aten/src/ATen/cuda/CublasHandlePool.cpp,
        ``parseChosenWorkspaceSize``): ``CUBLAS_WORKSPACE_CONFIG``'s ``:KiB:count`` pairs summed, else 32 MiB
        on compute capability 9.x to 12.x (Hopper, Blackwell) and 4096 KiB x 2 + 16 KiB x 8 on older GPUs.
        Training uses two handles, the Python thread's in forward and autograd's device thread's in backward.
        A trace sees neither (no tensor holds them; a real trace's op workspace is what an op frees again),
        so every trace for a GPU (fake for a GPU target, real on CUDA) gets them as two persistent tensors of
        kind ``library`` (:func:`add_library_workspaces`). Measured on an H200 (torch 2.11,
        tests/fixtures/gpu/h200_traces.json.gz): the allocator held, beyond every request of the step, 71.3 MB
        for GPT-2 small (2 x 32 MiB = 67.1 MB of it), 87.6 MB for ViT-B/16 and 92.6 MB for ResNet-50; the
        rest, 4-26 MB, more on convolutional models (cuDNN's own), is not modelled.
    G7. Reductions' staging buffers. A CUDA reduction (``sum``, ``mean``) that splits each output's inputs
        across thread blocks allocates, inside the op, a staging buffer through the caching allocator
        (aten/src/ATen/native/cuda/Reduce.cuh, ``setReduceConfig`` and ``ReduceConfig::global_memory_size``,
        the same in torch 2.11 and 2.14): in training, the bias gradients, sums over the batch and sequence
        of an activation-sized gradient. A real CUDA trace reads it off the allocator as the op's workspace;
        a fake trace for a GPU target computes it (:func:`reduction_workspace_bytes`) from the GPU's
        multiprocessors (``HardwareProfile.multiprocessors``) and threads per multiprocessor (by compute
        capability), for the case that allocates large ones: a contiguous input reduced over its leading
        dimensions. Reductions over the trailing dimensions split across blocks only for few outputs, whose
        buffers are a few KiB (not modelled), and so is the 4-byte-per-block semaphore array beside each
        buffer. Measured on an H200 (tests/fixtures/gpu/h200_traces.json.gz, fp32): every staging buffer of
        ViT-B/16 b32 and GPT-2 small 8 x 1024 to the byte (132.00 MiB for a 3072-wide bias over 6,304 or
        8,192 rows, 132.75 MiB for 2304 over 8,192, 111.38 MiB over 6,304, 48.00 MiB and 37.12 MiB for
        768); with them the allocator's model on ViT-B/16's fake trace went from 3.9% to 0.4% under its
        ``max_memory_reserved`` (envs/allocator.py, with NOTE [ The first iteration ]).
    G8. The memory-efficient attention's backward workspace. Its backward (PyTorch's copy of xFormers'
        kernel, mem_eff_attention/kernel_backward.h, ``workspace_size``) allocates, inside the op, a float
        buffer of ``B * H * align4(gq)`` elements where the query gradient is accumulated: ``gq =
        ceil(Lq / 64) * ceil(D / 64) * (64 * 64 + 4)`` for the kernel an fp32 call with a head dimension of
        at most 64 runs on compute capability 8.0 or more (64 x 64 tiles, a 16-byte lock beside each). A fake
        trace for such a GPU gives that op this workspace; other dtypes and head dimensions run other tiles
        (and bf16/fp16 runs flash on these GPUs: G1), not modelled. Measured on an H200 (the fixture, fp32, D
        = 64): 25,190,400 bytes a layer for GPT-2 small 8 x 1024 (B H = 96, Lq = 1024) and ViT-B/16 b32 (384,
        197), 12,595,200 for BERT-base 8 x 512, each to the byte.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map_only

from runtime.hardware import HardwareProfile

_SDPA = torch.nn.functional.scaled_dot_product_attention
_DROPOUT = torch.nn.functional.dropout
_FLASH_DTYPES = (torch.float16, torch.bfloat16)


def sdpa_backend(
    capability: tuple[int, int] | None,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
) -> str:
    """The kernel ("cudnn", "flash", "efficient" or "math") a GPU of ``capability`` runs for this call (G1)."""
    if capability is None:
        return "math"
    dtype, head_dim = query.dtype, query.shape[-1]
    same = key.dtype == dtype and value.dtype == dtype and key.shape[-1] == head_dim == value.shape[-1]
    one_head_count = query.dim() == 4 and key.shape[-3] == query.shape[-3] == value.shape[-3]
    if (
        capability[0] in (9, 10)
        and dtype in _FLASH_DTYPES
        and query.dim() == key.dim() == value.dim() == 4
        and max(head_dim, value.shape[-1]) <= 128
        and head_dim % 8 == 0 == value.shape[-1] % 8
        and same
    ):
        return "cudnn"
    if (
        dtype in _FLASH_DTYPES
        and capability >= (8, 0)
        and attn_mask is None
        and head_dim <= 256
        and head_dim % 8 == 0
        and same
        and one_head_count
    ):
        return "flash"
    efficient_dtypes = (torch.float32, torch.float16, torch.bfloat16) if capability >= (8, 0) else (
        torch.float32, torch.float16)  # fmt: skip
    alignment = 16 // query.element_size()
    if dtype in efficient_dtypes and capability >= (5, 0) and head_dim % alignment == 0 and same and one_head_count:
        return "efficient"
    return "math"


class _FusedKernels(TorchFunctionMode):
    """Routes ``scaled_dot_product_attention`` to the fused op the target GPU would run (G1), and dropout to
    CUDA's fused one (G2)."""

    def __init__(self, capability: tuple[int, int]) -> None:
        super().__init__()
        self.capability = capability
        self.routed: dict[str, int] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is _SDPA:
            return self._attention(*args, **kwargs)
        if func is _DROPOUT:
            return self._dropout(*args, **kwargs)
        return func(*args, **kwargs)

    def _dropout(self, input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> Any:
        if not training or inplace or not 0.0 < p < 1.0 or not input.is_floating_point():
            return _DROPOUT(input, p, training, inplace)
        self.routed["dropout"] = self.routed.get("dropout", 0) + 1
        return torch.ops.aten.native_dropout(input, p, True)[0]

    def _attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> Any:
        if torch.is_autocast_enabled("cpu"):  # G5: CUDA autocast casts SDPA's inputs before the kernel is chosen
            low = torch.get_autocast_dtype("cpu")
            query, key, value = (t.to(low) if t.is_floating_point() else t for t in (query, key, value))
            if attn_mask is not None and attn_mask.is_floating_point():
                attn_mask = attn_mask.to(low)
        backend = sdpa_backend(self.capability, query, key, value, attn_mask)
        self.routed[backend] = self.routed.get(backend, 0) + 1
        aten = torch.ops.aten
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        if backend in ("cudnn", "efficient") and attn_mask is not None and attn_mask.dtype == torch.bool:
            # the fused ops take an additive bias
            attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill_(~attn_mask, float("-inf"))
        if backend == "cudnn":
            out = aten._scaled_dot_product_cudnn_attention(
                query, key, value, attn_mask, grad, dropout_p, is_causal, False, scale=scale
            )
            return out[0]
        if backend == "flash":
            out = aten._scaled_dot_product_flash_attention(
                query, key, value, dropout_p, is_causal, return_debug_mask=False, scale=scale
            )
            return out[0]
        if backend == "efficient":
            if attn_mask is not None:
                attn_mask = attn_mask.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
            out = aten._scaled_dot_product_efficient_attention(
                query, key, value, attn_mask, grad, dropout_p, is_causal, scale=scale
            )
            return out[0]
        return _SDPA(
            query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
            enable_gqa=enable_gqa,
        )  # fmt: skip


# G5: CUDA autocast's policies where the CPU's lists have none (autocast_mode.cpp: AT_FORALL_FP32,
# AT_FORALL_FP32_SET_OPT_DTYPE, AT_FORALL_PROMOTE, AT_FORALL_LOWER_PRECISION_FP, less what AutocastCPU registers).
_CUDA_FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt", "sinh",
    "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm", "native_layer_norm",
    "rms_norm", "group_norm", "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim", "cosine_similarity", "dist",
    "pdist", "renorm", "logsumexp",
)  # fmt: skip
_CUDA_FP32_SET_OPT_DTYPE = (
    "softmax.int", "softmax.Dimname", "log_softmax.int", "log_softmax.Dimname", "cumprod", "cumprod.dimname",
    "cumsum", "cumsum.dimname", "linalg_vector_norm", "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum",
    "sum.dim_IntList", "sum.dim_DimnameList",
)  # fmt: skip
_CUDA_PROMOTE = ("addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "index_put", "tensordot", "scatter_add")
_CUDA_LOWER = ("addmv", "addr", "mv", "einsum", "chain_matmul", "linalg_multi_dot", "convolution",
               "_scaled_dot_product_flash_attention")  # fmt: skip
_LOWER_FP = (torch.float16, torch.bfloat16)


def _overload(name: str) -> Any:
    """``torch.ops.aten.<op>.<overload>`` for "op.overload" ("op": the default), None on a torch without it."""
    op, _, overload = name.partition(".")
    packet = getattr(torch.ops.aten, op, None)
    return None if packet is None else getattr(packet, overload or "default", None)


def _cast(values: Any, dtype: torch.dtype, only: tuple[torch.dtype, ...]) -> Any:
    """``values`` with the floating tensors of a dtype in ``only`` cast to ``dtype``."""

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() and t.dtype in only else t

    return tree_map_only(torch.Tensor, cast, values)


def _cuda_kernel(op: Any, policy: str) -> Any:
    """One op under one of CUDA autocast's policies, then run below the CPU's autocast (G5)."""
    below = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
    dtype_at = next((i for i, a in enumerate(op._schema.arguments) if a.name == "dtype"), None)

    def kernel(*args: Any, **kwargs: Any) -> Any:
        if policy == "fp32":
            args, kwargs = _cast((args, kwargs), torch.float32, _LOWER_FP)
        elif policy == "lower":
            args, kwargs = _cast((args, kwargs), torch.get_autocast_dtype("cpu"), (torch.float32,))
        elif policy == "promote":
            tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            floats = {t.dtype for t in tensors if t.is_floating_point()}
            if len(floats) > 1:  # fp16 with bf16 gives fp32, as autocast's promote_type does
                widest = functools.reduce(torch.promote_types, floats)
                args, kwargs = _cast((args, kwargs), widest, tuple(floats - {widest}))
        elif args and isinstance(args[0], torch.Tensor) and args[0].is_floating_point():  # fp32_set_opt_dtype
            if dtype_at is not None and len(args) > dtype_at:
                if args[dtype_at] is None:
                    args = (*args[:dtype_at], torch.float32, *args[dtype_at + 1 :])
            elif kwargs.get("dtype") is None:
                kwargs = {**kwargs, "dtype": torch.float32}
        with torch._C._ExcludeDispatchKeyGuard(below):
            return op(*args, **kwargs)

    return kernel


@contextlib.contextmanager
def cuda_autocast_lists() -> Iterator[None]:
    """G5: while it is on, the CPU's autocast follows CUDA's policies for the ops where they differ."""
    lib = torch.library.Library("aten", "IMPL")
    try:
        for names, policy in ((_CUDA_FP32, "fp32"), (_CUDA_FP32_SET_OPT_DTYPE, "fp32_set_opt_dtype"),
                              (_CUDA_PROMOTE, "promote"), (_CUDA_LOWER, "lower")):  # fmt: skip
            for name in names:
                op = _overload(name)
                if op is not None:
                    lib.impl(name, _cuda_kernel(op, policy), "AutocastCPU")
        yield
    finally:
        lib._destroy()


@contextlib.contextmanager
def _unpacked_positions() -> Iterator[None]:
    """G4: transformers' packed-sequence check answers "not packed" for fake position ids, and its SDPA mask
    skips answer "no padding" for a fake padding mask."""
    try:
        import transformers.masking_utils as masking
    except ImportError:  # transformers absent, or too old to have the check: nothing to do
        yield
        return
    from torch._subclasses.fake_tensor import FakeTensor

    def unpacked_if_fake(find: Any) -> Any:
        def check(position_ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            return None if isinstance(position_ids, FakeTensor) else find(position_ids, *args, **kwargs)

        return check

    def unpadded_if_fake(skip: Any) -> Any:
        def check(padding_mask: torch.Tensor | None, *args: Any, **kwargs: Any) -> Any:
            return skip(None if isinstance(padding_mask, FakeTensor) else padding_mask, *args, **kwargs)

        return check

    wrappers = {"find_packed_sequence_indices": unpacked_if_fake, "_ignore_causal_mask_sdpa": unpadded_if_fake,
                "_ignore_bidirectional_mask_sdpa": unpadded_if_fake}  # fmt: skip
    saved = {name: getattr(masking, name) for name in wrappers if hasattr(masking, name)}
    for name, original in saved.items():
        setattr(masking, name, wrappers[name](original))
    try:
        yield
    finally:
        for name, original in saved.items():
            setattr(masking, name, original)


@contextlib.contextmanager
def fake_trace_choices(target: HardwareProfile | None) -> Iterator[_FusedKernels | None]:
    """The device-dependent choices of a fake trace for ``target`` (G1, G2, G4, G5; G3 is make_optimizer's
    ``foreach``): yields the kernel router, or None when the target keeps the CPU's kernels."""
    gpu, capability, _ = trace_key(target)
    with _unpacked_positions(), cuda_autocast_lists() if gpu else contextlib.nullcontext():
        if capability is None:
            yield None
            return
        with _FusedKernels(capability) as router, _routed_inside_functional(router):
            yield router


@contextlib.contextmanager
def _routed_inside_functional(router: _FusedKernels) -> Iterator[None]:
    """G1 inside ``torch.nn.functional``'s own composites: ``multi_head_attention_forward``
    (``nn.MultiheadAttention``, torchvision's ViT) calls ``scaled_dot_product_attention`` by its module-level
    name from inside its own torch-function dispatch, where the mode is off and sees nothing; for the trace
    that name is the router's. G1 and G2 in backward: a checkpoint's recompute runs with the mode off, and
    reaches attention and dropout by these names too."""

    def routed(*args: Any, **kwargs: Any) -> Any:
        return router._attention(*args, **kwargs)

    def dropout(*args: Any, **kwargs: Any) -> Any:
        return router._dropout(*args, **kwargs)

    F = torch.nn.functional
    F.scaled_dot_product_attention = routed  # type: ignore[assignment]
    F.dropout = dropout
    try:
        yield
    finally:
        F.scaled_dot_product_attention = _SDPA
        F.dropout = _DROPOUT


CUBLAS_HANDLES = 2  # G6: the Python thread's (forward) and autograd's device thread's (backward)


def cublas_workspace_bytes(compute_capability: tuple[int, int] | None, config: str | None = None) -> int:
    """One cuBLAS workspace as PyTorch sizes it (NOTE [ GPU-faithful fake traces ] G6): ``config`` is
    ``CUBLAS_WORKSPACE_CONFIG`` (None: unset)."""
    if config:
        pairs = re.findall(r":([0-9]+):([0-9]+)", config)
        if pairs:
            return sum(int(kib) * int(n) for kib, n in pairs) * 1024
    if compute_capability is not None and 9 <= compute_capability[0] <= 12:
        return 4096 * 8 * 1024
    return 4096 * 1024 * 2 + 16 * 1024 * 8


def add_library_workspaces(w: Any, compute_capability: tuple[int, int] | None) -> None:
    """G6: the cuBLAS workspaces a training process on that GPU holds, as persistent tensors of ``w`` (a
    runtime.workload.Workload; not part of its shape fingerprint, which is the model's)."""
    from runtime.workload import TensorInfo, TensorKind

    size = cublas_workspace_bytes(compute_capability, os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
    if size <= 0:
        return
    for _ in range(CUBLAS_HANDLES):
        w.tensors.append(TensorInfo(len(w.tensors), size, (size,), "uint8", TensorKind.LIBRARY, -1, None))


_ALLOCATED: set[torch.device] = set()


def allocate_library_workspaces(device: torch.device) -> None:
    """G6 at run time (runtime R15): on a CUDA ``device``, once per process, have cuBLAS allocate the
    workspaces of the handles training uses, the calling thread's (a product in forward) and autograd's device
    thread's (its backward), before any step's tensors, so that they take segments of their own as the plan
    places them. Anything else: nothing."""
    if device.type != "cuda":
        return
    device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    if device in _ALLOCATED:
        return
    with torch.enable_grad():
        x = torch.ones(8, 8, device=device, requires_grad=True)
        (x @ x).sum().backward()
    _ALLOCATED.add(device)


def trace_key(target: HardwareProfile | None) -> tuple[bool, tuple[int, int] | None, int | None]:
    """What a fake trace depends on in its target: profiles with the same key get the same trace."""
    if target is None or not target.is_gpu:
        return (False, None, None)
    return (True, target.compute_capability, target.multiprocessors)


_REDUCTIONS = {"sum", "mean"}  # G7: reductions through Reduce.cuh's gpu_reduce_kernel
_ATTENTION_TILE = 64  # G8: the fp32 kernel's query block and gradient tile
_WARP = 32
_MAX_BLOCK_THREADS = 512  # Reduce.cuh's mnt_wrapper<T>::MAX_NUM_THREADS (256 for complex<double> only)


def _threads_per_multiprocessor(capability: tuple[int, int] | None) -> int:
    """``maxThreadsPerMultiProcessor`` by compute capability (NVIDIA's CUDA programming guide, table of
    technical specifications): 1024 on 7.5, 1536 on 8.6, 8.9 and 12.x, 2048 on the others."""
    if capability == (7, 5):
        return 1024
    if capability in ((8, 6), (8, 9)) or (capability is not None and capability[0] == 12):
        return 1536
    return 2048


def _last_pow2(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def op_workspace_bytes(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], target: HardwareProfile | None) -> int:
    """What an op on ``target`` allocates inside itself and frees before it returns, for a fake trace
    (G7, G8; 0 for the rest and for a target that is no GPU)."""
    if target is None or not target.is_gpu:
        return 0
    return reduction_workspace_bytes(func, args, kwargs, target) + attention_workspace_bytes(func, args, target)


def attention_workspace_bytes(func: Any, args: tuple[Any, ...], target: HardwareProfile | None) -> int:
    """G8: the memory-efficient attention backward's workspace (fp32, head dimension at most 64, compute
    capability 8.0 or more; else 0)."""
    cc = target.compute_capability if target is not None else None
    if cc is None or cc < (8, 0) or func is not torch.ops.aten._scaled_dot_product_efficient_attention_backward.default:
        return 0
    query = args[1] if len(args) > 1 else None
    if not isinstance(query, torch.Tensor) or query.dtype != torch.float32 or query.dim() != 4:
        return 0
    batch, heads, length, dim = (int(s) for s in query.shape)
    if dim > _ATTENTION_TILE:
        return 0
    gq = -(-length // _ATTENTION_TILE) * -(-dim // _ATTENTION_TILE) * (_ATTENTION_TILE * _ATTENTION_TILE + 4)
    return batch * heads * (-(-gq // 4) * 4) * 4


def reduction_workspace_bytes(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], target: HardwareProfile | None
) -> int:
    """G7: the staging buffer a CUDA reduction on ``target`` allocates inside the op (0: none, or a case not
    modelled): ``setReduceConfig``'s choice for a contiguous input reduced over its leading dimensions
    ("vectorize along output"), step for step."""
    if target is None or not target.multiprocessors or func.overloadpacket.__name__ not in _REDUCTIONS:
        return 0
    x = args[0] if args else None
    dims = args[1] if len(args) > 1 else kwargs.get("dim")
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < 2 or not x.is_contiguous():
        return 0
    if dims is None or isinstance(dims, int):
        dims = [dims] if isinstance(dims, int) else []
    reduced = sorted({d % x.dim() for d in dims})
    if not reduced or reduced != list(range(len(reduced))) or len(reduced) == x.dim():
        return 0  # not the leading dimensions (or all of them: few outputs, a small buffer)
    inputs = int(torch.Size(x.shape[: len(reduced)]).numel())
    outputs = int(torch.Size(x.shape[len(reduced) :]).numel())
    if inputs <= 1 or outputs <= 0:
        return 0
    arg_bytes = 8 if x.dtype == torch.float64 else 4  # the accumulation type: double, else float
    vec = 4 if outputs % 4 == 0 else 2 if outputs % 2 == 0 else 1  # get_output_vec_size (aligned storage)
    max_threads = _MAX_BLOCK_THREADS // vec
    dim0, dim1 = outputs // vec, inputs
    pow0 = _last_pow2(dim0) if dim0 < max_threads else max_threads
    pow1 = _last_pow2(dim1) if dim1 < max_threads else max_threads
    width = min(pow0, _WARP)
    height = min(pow1, max_threads // width)
    width = min(pow0, max_threads // height)
    if inputs < min(height * 16, 256):
        return 0  # each warp its own outputs (split_output): no split across blocks
    values_per_thread = -(-inputs // height)  # split_input(block_height): a block's warps share the inputs
    grid = -(-(outputs // vec) // width)  # split_output(block_width): a warp's lanes take outputs
    target_grid = target.multiprocessors * (_threads_per_multiprocessor(target.compute_capability) // (width * height))
    if values_per_thread < 256 or grid > target_grid:
        return 0
    ctas = max(-(-values_per_thread // 256), min(-(-target_grid // grid), -(-values_per_thread // 16)))
    return arg_bytes * outputs * ctas * width * vec if ctas > 1 else 0
