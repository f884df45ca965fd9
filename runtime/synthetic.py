"""A small CNN training iteration built by hand, without torch: the environment's default workload and a
fixture for tests (tests/synthetic.py builds the hand-computed ones)."""

from __future__ import annotations

import numpy as np

from runtime.workload import Candidate, OpInfo, Phase, TensorInfo, TensorKind, Workload


def synthetic_workload(
    blocks: int = 3, batch: int = 32, channels: int = 64, size: int = 32, classes: int = 10
) -> Workload:
    """A small CNN iteration built by hand, without torch, in about a millisecond: ``blocks`` conv-BN-ReLU
    blocks (the first is the stem), 2x2 max pooling, a linear classifier, log-softmax and NLL loss, then
    their backward ops. Deterministic: the same arguments give the same workload.

    Candidates in save order, as a trace records them: per block its convolution's output (saved by
    BatchNorm) and its ReLU's output (saved by the ReLU and by the next block's convolution, or by the
    pooling: a block input); then the pooling's int64 indices (not compressible), the pooled features and
    the log-probabilities. BatchNorm outputs and logits are freed in forward, so recompute closures reach
    back more than one op, as in real traces. With the defaults: 26 ops, 9 candidates. Op times come from
    the hardware profile's roofline (``mode="fake"``) over the FLOPs and bytes given here."""
    if blocks < 1:
        raise ValueError(f"blocks={blocks}: expected at least one conv-BN-ReLU block")
    f4 = 4
    fmap = (batch, channels, size, size)
    act = batch * channels * size * size * f4  # one float32 feature map
    half = (batch, channels, size // 2, size // 2)
    pooled = int(np.prod(half)) * f4
    feat = channels * (size // 2) ** 2
    logits = batch * classes * f4
    K, fwd, bwd = TensorKind, Phase.FORWARD, Phase.BACKWARD
    tensors: list[TensorInfo] = []
    ops: list[OpInfo] = []

    def tensor(nbytes: int, shape: tuple[int, ...], kind: TensorKind, alloc: int, free: int | None,
               dtype: str = "float32") -> int:  # fmt: skip
        tensors.append(TensorInfo(len(tensors), nbytes, shape, dtype, kind, alloc, free))
        return len(tensors) - 1

    def op(
        name: str, phase: Phase, module: str, flops: float, inputs: tuple[int, ...], outputs: tuple[int, ...]
    ) -> None:
        moved = sum(tensors[t].nbytes for t in (*inputs, *outputs))
        ops.append(OpInfo(len(ops), f"aten.{name}", phase, module, flops, moved, inputs, outputs))

    # Op indices, fixed up front so that every tensor is created with its lifetime.
    n_fwd = 3 * blocks + 4  # conv, bn, relu per block; pool, fc, log_softmax, nll_loss
    nll_b, lsm_b, mm_b, pool_b = n_fwd, n_fwd + 1, n_fwd + 2, n_fwd + 3

    def relu_b(b: int) -> int:  # backward of block b: relu, bn, conv, last block first
        return n_fwd + 4 + 3 * (blocks - 1 - b)

    names = ["stem", *(f"layer{b}" for b in range(1, blocks))]
    c_in = [3, *([channels] * (blocks - 1))]
    x = tensor(batch * 3 * size * size * f4, (batch, 3, size, size), K.INPUT, -1, None)
    y = tensor(batch * 8, (batch,), K.INPUT, -1, None, "int64")
    w_conv = [tensor(channels * c * 9 * f4, (channels, c, 3, 3), K.PARAMETER, -1, None) for c in c_in]
    w_bn = [tensor(2 * channels * f4, (2, channels), K.PARAMETER, -1, None) for _ in range(blocks)]
    w_fc = tensor((feat + 1) * classes * f4, (classes, feat + 1), K.PARAMETER, -1, None)
    conv_out = [tensor(act, fmap, K.ACTIVATION, 3 * b, relu_b(b) + 1) for b in range(blocks)]
    bn_out = [tensor(act, fmap, K.TEMPORARY, 3 * b + 1, 3 * b + 2) for b in range(blocks)]
    relu_out = [tensor(act, fmap, K.ACTIVATION, 3 * b + 2, relu_b(b)) for b in range(blocks)]
    pool_at = 3 * blocks
    pool_out = tensor(pooled, half, K.ACTIVATION, pool_at, mm_b)
    indices = tensor(pooled * 2, half, K.ACTIVATION, pool_at, pool_b, "int64")
    fc_out = tensor(logits, (batch, classes), K.TEMPORARY, pool_at + 1, pool_at + 2)
    log_probs = tensor(logits, (batch, classes), K.ACTIVATION, pool_at + 2, lsm_b)
    loss = tensor(f4, (), K.TEMPORARY, pool_at + 3, nll_b)

    inputs = [x, *relu_out[:-1]]
    for b in range(blocks):
        conv_flops = 2.0 * batch * channels * c_in[b] * 9 * size * size
        op("convolution.default", fwd, f"{names[b]}.conv", conv_flops, (inputs[b], w_conv[b]), (conv_out[b],))
        op("native_batch_norm.default", fwd, f"{names[b]}.bn", 0.0, (conv_out[b], w_bn[b]), (bn_out[b],))
        op("relu.default", fwd, f"{names[b]}.relu", 0.0, (bn_out[b],), (relu_out[b],))
    fc_flops = 2.0 * batch * feat * classes
    op("max_pool2d_with_indices.default", fwd, "head.pool", 0.0, (relu_out[-1],), (pool_out, indices))
    op("addmm.default", fwd, "head.fc", fc_flops, (w_fc, pool_out), (fc_out,))
    op("_log_softmax.default", fwd, "<loss>", 0.0, (fc_out,), (log_probs,))
    op("nll_loss_forward.default", fwd, "<loss>", 0.0, (log_probs, y), (loss,))

    def grad(nbytes: int, shape: tuple[int, ...]) -> int:  # made by the next op, consumed by the one after
        return tensor(nbytes, shape, K.TEMPORARY, len(ops), len(ops) + 1)

    def param_grad(param: int) -> int:  # outlives the iteration (the optimizer reads it)
        return tensor(tensors[param].nbytes, tensors[param].shape, K.GRADIENT, len(ops), None)

    g = grad(logits, (batch, classes))
    op("nll_loss_backward.default", bwd, "<loss>", 0.0, (loss, y), (g,))
    g_next = grad(logits, (batch, classes))
    op("_log_softmax_backward_data.default", bwd, "<loss>", 0.0, (g, log_probs), (g_next,))
    g, g_next = g_next, grad(pooled, half)
    op("mm.default", bwd, "head.fc", 2 * fc_flops, (g, pool_out, w_fc), (g_next, param_grad(w_fc)))
    g, g_next = g_next, grad(act, fmap)
    op("max_pool2d_with_indices_backward.default", bwd, "head.pool", 0.0, (g, relu_out[-1], indices), (g_next,))
    for b in reversed(range(blocks)):
        g, g_next = g_next, grad(act, fmap)
        op("threshold_backward.default", bwd, f"{names[b]}.relu", 0.0, (g, relu_out[b]), (g_next,))
        g, g_next = g_next, grad(act, fmap)
        op("native_batch_norm_backward.default", bwd, f"{names[b]}.bn", 0.0, (g, conv_out[b], w_bn[b]),
           (g_next, param_grad(w_bn[b])))  # fmt: skip
        g = g_next
        conv_flops = 2.0 * batch * channels * c_in[b] * 9 * size * size
        if b > 0:
            g_next = grad(act, fmap)
            outs: tuple[int, ...] = (g_next, param_grad(w_conv[b]))
        else:  # the batch needs no gradient
            outs = (param_grad(w_conv[b]),)
        op("convolution_backward.default", bwd, f"{names[b]}.conv", 2 * conv_flops, (g, inputs[b], w_conv[b]), outs)
    assert len(ops) == relu_b(0) + 3

    candidates: list[Candidate] = []

    def cand(key: str, tid: int, save: int, last_fwd: int, uses: tuple[int, ...], inputs: tuple[int, ...],
             block: str, block_input: bool = False) -> None:  # fmt: skip
        t = tensors[tid]
        candidates.append(Candidate(key, tid, t.nbytes, t.alloc_op, (), save, last_fwd, uses, last_fwd, inputs,
                                    block, block_input))  # fmt: skip

    for b in range(blocks):
        name = names[b]
        cand(f"{name}.conv#0.0:Convolution", conv_out[b], 3 * b + 1, 3 * b + 1, (relu_b(b) + 1,),
             (inputs[b], w_conv[b]), name)  # fmt: skip
        reader = 3 * b + 3  # the next block's convolution, or the pooling
        first_use = relu_b(b + 1) + 2 if b + 1 < blocks else pool_b
        cand(f"{name}.relu#0.0:Relu", relu_out[b], 3 * b + 2, reader, (first_use, relu_b(b)), (bn_out[b],), name,
             block_input=True)  # fmt: skip
    cand("head.pool#0.1:MaxPool2DWithIndices", indices, pool_at, pool_at, (pool_b,), (relu_out[-1],), "head")
    cand("head.pool#0.0:MaxPool2DWithIndices", pool_out, pool_at + 1, pool_at + 1, (mm_b,), (relu_out[-1],), "head")
    cand("<loss>#0.0:LogSoftmax", log_probs, pool_at + 2, pool_at + 3, (lsm_b,), (fc_out,), "<loss>")
    w = Workload(
        model=f"synthetic-cnn{blocks}", batch_size=batch, seq_len=None, optimizer="sgd", device="synthetic",
        mode="fake", torch_version="", ops=ops, tensors=tensors, candidates=candidates,
    )  # fmt: skip
    w.compute_fingerprints()
    return w


__all__ = ["synthetic_workload"]
