"""Per-candidate features shared by heuristics, searchers and the RL environment.

Everything here is derived from the workload and the simulator's own numbers (op times, copy times,
recompute closures), so a heuristic ranks tensors by the same costs the simulator will charge.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from envs.simulator import Simulator
from runtime.workload import Phase

# Op classes by aten name (the part after "aten."), in match order.
_CLASSES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("conv", re.compile(r"^(convolution|_convolution|cudnn_convolution|conv\w*|_slow_conv2d\w*|mkldnn_conv\w*)\.")),
    ("attention", re.compile(r"^(_scaled_dot_product\w*|_flash_attention\w*|_efficient_attention\w*)\.")),
    ("matmul", re.compile(r"^(mm|addmm|bmm|baddbmm|matmul|linear|_addmm_activation)\.")),
    (
        "norm",
        re.compile(
            r"^(native_batch_norm|_native_batch_norm_legit\w*|cudnn_batch_norm|native_layer_norm"
            r"|native_group_norm|_batch_norm\w*)\."
        ),
    ),
    (
        "activation",
        re.compile(
            r"^(relu_?|gelu_?|tanh_?|sigmoid_?|silu_?|threshold_?|hardtanh_?|leaky_relu_?"
            r"|elu_?|clamp_?|clamp_min_?|hardswish_?|hardsigmoid_?|mish_?|_softmax|softmax)\."
        ),
    ),
    ("pool", re.compile(r"^(max_pool\w*|avg_pool\w*|adaptive_\w*pool\w*|_adaptive_avg_pool\w*)\.")),
    ("dropout", re.compile(r"^(native_dropout|bernoulli_?|dropout)\.")),
    ("loss", re.compile(r"^(_log_softmax|log_softmax|nll_loss\w*|cross_entropy\w*|mse_loss)\.")),
    (
        "elementwise",
        re.compile(
            r"^(add_?|sub_?|mul_?|div_?|pow_?|exp_?|sqrt_?|rsqrt_?|neg_?|where|masked_fill_?|cat"
            r"|embedding|_to_copy|copy_|clone|mean|sum|view|_unsafe_view|expand)\."
        ),
    ),
)
OP_CLASSES = (*(name for name, _ in _CLASSES), "other")


def op_class(op_name: str) -> str:
    """``"aten.convolution.default"`` -> ``"conv"``; see ``OP_CLASSES``."""
    short = op_name.removeprefix("aten.") + ("" if op_name.count(".") >= 2 else ".")
    for name, pattern in _CLASSES:
        if pattern.match(short):
            return name
    return "other"


@dataclass
class CandidateFeatures:
    """Arrays of length k (one entry per ``workload.candidates``) unless noted. Times in seconds."""

    nbytes: np.ndarray  # int64
    producer_class: list[str]  # op class of the op that allocated the storage
    consumer_classes: list[frozenset[str]]  # op classes of the forward ops that read it
    recompute_s: np.ndarray  # Rule 7 closure time, candidate inputs assumed resident
    recompute_deps: list[tuple[int, ...]]  # candidates the closure needs resident
    swap_out_s: np.ndarray  # D2H copy time
    swap_in_s: np.ndarray  # H2D copy time
    idle_s: np.ndarray  # no-policy time from the end of save_op to the start of the first backward use
    save_s: np.ndarray  # no-policy time at which save_op ends
    first_use_s: np.ndarray  # no-policy start time of the first backward use (iteration end if none)
    fwd_position: np.ndarray  # producer op index / number of forward ops, in [0, 1)
    block: list[str]
    block_input: np.ndarray  # bool

    @property
    def k(self) -> int:
        return len(self.nbytes)


def compute_features(sim: Simulator) -> CandidateFeatures:
    """Features of every candidate of ``sim.w``, computed (:attr:`~envs.simulator.Simulator.features` caches
    them: read them there)."""
    w = sim.w
    cands = w.candidates
    cand_of = {c.tensor: i for i, c in enumerate(cands)}
    consumers: list[set[str]] = [set() for _ in cands]
    n_fwd = 0
    for op in w.ops:
        if op.phase != Phase.FORWARD:
            continue
        n_fwd += 1
        cls = op_class(op.name)
        for tid in op.inputs:
            if tid in cand_of:
                consumers[cand_of[tid]].add(cls)
    end_s = sim.op_start_s + sim.op_s
    save_s = end_s[sim.save_op]
    first_use_s = np.where(
        sim.first_use < sim.n_ops, np.append(sim.op_start_s, sim.compute_s)[sim.first_use], sim.compute_s
    )
    feats = CandidateFeatures(
        nbytes=np.array([c.nbytes for c in cands], dtype=np.int64),
        producer_class=[op_class(w.ops[c.producer].name) for c in cands],
        consumer_classes=[frozenset(s) for s in consumers],
        recompute_s=np.array([cl[0] for cl in sim.closures]),
        recompute_deps=[cl[2] for cl in sim.closures],
        swap_out_s=sim.d2h_s.copy(),
        swap_in_s=sim.h2d_s.copy(),
        idle_s=np.maximum(0.0, first_use_s - save_s),
        save_s=save_s,
        first_use_s=first_use_s,
        fwd_position=np.array([c.producer / max(1, n_fwd) for c in cands]),
        block=[c.block for c in cands],
        block_input=np.array([c.block_input for c in cands], dtype=bool),
    )
    return feats
