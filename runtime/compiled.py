"""Apply a policy to a model trained under ``torch.compile``: keep and recompute decided when the compiler
traces, so nothing of autotune runs per op when the compiled code runs.

Usage::

    policy = load_policy("resnet18.policy.json")
    cmodel = policy.compiled(model)               # an nn.Module: torch.compile of the model under the policy
    loss = criterion(cmodel(x), y)
    loss.backward()
    print(cmodel.report.summary())                # which decisions the compiled graph applies

NOTE [ Compiled policies ] -- the eager twin is NOTE [ Runtime mechanics ] in runtime/apply.py
    C1. One region. The model's forward runs inside one non-reentrant ``torch.utils.checkpoint`` whose
        ``context_fn`` makes ``create_selective_checkpoint_contexts(policy_fn)``, compiled as one graph
        (``fullgraph=True``). Dynamo turns the checkpoint into a higher-order op; AOTAutograd traces its
        body and calls ``policy_fn`` once per aten op (twice over: each tracing pass makes a fresh context),
        tagging that op's nodes; the min-cut partitioner then saves MUST_SAVE nodes, recomputes
        MUST_RECOMPUTE ones in backward and decides the rest itself (PREFER_SAVE binds nothing). No hook or
        dispatch mode of autotune's runs when the compiled code runs.
    C2. Keys to ops. Before the first compile the forward runs once on a fake copy of the model and fake
        inputs (FakeTensorMode: no memory, no kernels) with the keyer of runtime/keys.py, which names the
        saved tensors as the tracer did, and a dispatch mode that numbers the aten ops SAC numbers (its
        ignored ops left out). A key's op is the last op that wrote its storage before its first pack (an
        in-place ReLU's key is the ReLU's, not the BatchNorm's that made the storage).
    C3. Decisions per op. An op whose keys are all kept: MUST_SAVE; all recomputed: MUST_RECOMPUTE. SAC
        decides per op, so an op with both (a GroupNorm whose output is recomputed and whose statistics are
        kept) goes the way of the larger bytes and the other keys are reported changed. Every op between a
        recomputed op and resident storage (kept keys, parameters, the inputs) whose output it reads is
        recomputed too: simulator Rule 7's producer chain, which the partitioner would save instead (it does
        not recompute a BatchNorm of its own accord). Where a chain runs through an op with
        kept keys, the op is recomputed and those keys are reported changed (a BatchNorm's saved statistics
        recomputed with its output, as the eager replay does). Random ops (dropout) are never recomputed:
        MUST_SAVE, their recomputed keys reported changed, and a chain stops at them. aot_eager replays them
        with the generator's state and gets the same mask, but inductor on the CPU drew another one (torch
        2.14.1: ResNet-like CNN with dropout, every candidate recomputed, gradients off by up to 1.08; PyTorch
        issue 186572 reports the same class of difference). Every other op: PREFER_SAVE.
    C4. Alignment. The compiler traces after pre-dispatch and names a few ops differently (BatchNorm in
        training is ``_native_batch_norm_legit`` there), so names are compared after folding those and the
        in-place suffix. ``policy_fn`` walks the mapped sequence in step: an op equal to the next expected
        one, or to one at most ``LOOKAHEAD`` further, takes that op's decision (the skipped ones are not
        met); any other op is the compiler's (PREFER_SAVE). Keys whose ops were not met are reported dropped.
    C5. What SAC cannot express. Swap and compress: ``CheckpointPolicy`` has ``*_CPU_OFFLOAD`` members, but
        the partitioner of torch 2.14.1 (read; 2.11 not checked) does not act on them; its activation offloading
        (``torch._functorch.config.enable_activation_offloading``) reads a node flag no public API sets.
        Partitions (R13 runs a submodule per slice in Python). With ``strict`` (the default) a policy that
        swaps, compresses or partitions inside the model is refused; with ``strict=False`` those tensors
        are kept and reported changed. Decisions on tensors saved outside the model (the loss's) are not
        the compiled graph's: autograd keeps them, reported changed where the policy said otherwise.
    C6. The report (``CompiledModel.report``, after the first call): per key, applied, changed (with why) or
        dropped. A search for compiled training proposes only keep and recompute (``--compile``); with
        ``--measure`` it trains its finalists compiled (NOTE [ Measured search ] in autotune/measured.py).
    C7. Training calls. The plan is made at the first call that trains (grad mode on, the model in training
        mode), and the report is settled by calls that train: a validation pass first (under ``torch.no_grad``
        or ``model.eval()``, Lightning's sanity check) saves nothing, so a plan made there named no op and
        training ran without the policy ("0 applied, 13 dropped"); a validation compiled later rewrote the
        report so. Before the first training call the model runs as it is (eagerly), after it compiled. A
        call in eval mode with gradients on before it (a model trained in eval mode) warns once that it runs so:
        it trained eagerly and without the policy, reporting "0 applied, 0 dropped" (a QA run).
    C8. The plan. A compiled step is simulated on the simulator's twin of it (envs/simulator.py Rule 16,
        ``compiled_twin``): no region (C1: one selective-checkpoint region whose recomputed ops the partitioner
        places before their first backward use), each replay's temporaries freed at their last reader in it,
        none of the runtime's host costs (nothing of autotune runs per op), and a shared parameter's
        gradients summed in a new tensor (R14 is the eager runtime's) unless inductor's buffer reuse sums them
        in place. ``search --compile`` scores its policies so, and ``train --compile`` predicts so. Under
        aot_eager on the CPU (``experiments/compiled_fidelity.py``) that is the compiled step's peak within
        0.004% for 6 of 6 keep/recompute policies on the GroupNorm CNN and 4 of 4 on GPT-2 (2 x 32 tokens),
        5 of 6 on ResNet-18 (everything recomputed: 0.37% over the plan). Not modelled: inductor's own
        buffers (on the CPU, channels-last copies of convolution weights: ``layout_optimization``) and its
        fused kernels' times (an op's time is the eager kernel's).
"""

from __future__ import annotations

import copy
import itertools
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.checkpoint import (
    SAC_IGNORED_OPS,
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)
from torch.utils.weak import WeakIdKeyDictionary

from runtime.errors import AutotuneError
from runtime.keys import OUTSIDE, SavedTensorKeyer
from runtime.precision import check_active
from runtime.vocab import Action

if TYPE_CHECKING:
    from runtime.policy import Policy

_SERIAL = itertools.count()
_PER_OP = "SAC decides per op, not per output, and"
_RANDOM = "a random op is not recomputed under torch.compile: inductor's recompute drew other numbers (C3)"
#: How far ahead of the expected op ``policy_fn`` looks for the op the compiler traces (C4).
LOOKAHEAD = 8
#: Ops the compiler traces under another name than eager dispatch does (C4), folded to the eager name.
_RENAMES = {
    "aten._native_batch_norm_legit": "aten.native_batch_norm",
    "aten._native_batch_norm_legit_functional": "aten.native_batch_norm",
    "aten.cudnn_batch_norm": "aten.native_batch_norm",
    "aten.miopen_batch_norm": "aten.native_batch_norm",
    "aten._unsafe_view": "aten.view",
}
#: Eager op sequences the compiler traces as one op (C4): dropout on the CPU decomposes into these four.
_COMPOSITES = {("aten.empty_like", "aten.bernoulli", "aten.div", "aten.mul"): "aten.native_dropout"}


def op_name(func: Any) -> str:
    """``aten.relu_.default`` -> ``aten.relu``: the packet, in-place suffix and renames folded (C4)."""
    parts = str(func).split(".")
    packet = ".".join(parts[:2]) if len(parts) >= 2 else str(func)
    packet = _RENAMES.get(packet, packet)
    return packet[:-1] if packet.endswith("_") and not packet.endswith("__") else packet


@dataclass
class CompiledReport:
    """Which of the policy's decisions the compiled graph carries (C6)."""

    applied: dict[str, Action] = field(default_factory=dict)
    changed: dict[str, tuple[Action, Action, str]] = field(default_factory=dict)  # key -> (asked, got, why)
    dropped: dict[str, str] = field(default_factory=dict)  # key -> why

    def summary(self) -> str:
        lines = [f"{len(self.applied)} decisions applied, {len(self.changed)} changed, {len(self.dropped)} dropped"]
        for key, (asked, got, why) in list(self.changed.items())[:8]:
            lines.append(f"  changed {key}: {asked.value} -> {got.value} ({why})")
        if len(self.changed) > 8:
            lines.append(f"  ... {len(self.changed) - 8} more changed")
        for key, why in list(self.dropped.items())[:8]:
            lines.append(f"  dropped {key}: {why}")
        if len(self.dropped) > 8:
            lines.append(f"  ... {len(self.dropped) - 8} more dropped")
        return "\n".join(lines)


class _OpLog(TorchDispatchMode):
    """Numbers the aten ops SAC's policy sees and remembers, per storage, the last op that wrote it (C2)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []
        self.seeded: list[bool] = []  # random ops (C3)
        self.inputs: list[list[tuple[int | None, torch.UntypedStorage]]] = []
        self.writer: WeakIdKeyDictionary = WeakIdKeyDictionary()  # storage -> op index

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in SAC_IGNORED_OPS:
            return func(*args, **kwargs)
        ins = [
            (self.writer.get(t.untyped_storage()), t.untyped_storage())
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        ]
        out = func(*args, **kwargs)
        i = len(self.names)
        self.names.append(op_name(func))
        self.seeded.append(torch.Tag.nondeterministic_seeded in func.tags)
        self.inputs.append(ins)
        # A view names no new data: its storage keeps the op that wrote it (C2).
        views = any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)
        written = [] if views else [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if func._schema.is_mutable:
            written += [
                t
                for a, t in zip(func._schema.arguments, args, strict=False)
                if isinstance(t, torch.Tensor) and a.alias_info is not None and a.alias_info.is_write
            ]
        for t in written:
            self.writer[t.untyped_storage()] = i
        return out


def _fold(
    names: list[str], inputs: list[list[tuple[int | None, torch.UntypedStorage]]]
) -> tuple[list[str], list[list[tuple[int | None, torch.UntypedStorage]]], list[int]]:
    """Fold :data:`_COMPOSITES` into one op each (C4): the folded names, their inputs from outside their
    group, and each raw op's folded index (a folded op is random where one of its ops is)."""
    new_of: list[int] = []
    out_names: list[str] = []
    groups: list[list[int]] = []
    i = 0
    while i < len(names):
        for pattern, folded in _COMPOSITES.items():
            if tuple(names[i : i + len(pattern)]) == pattern:
                groups.append(list(range(i, i + len(pattern))))
                out_names.append(folded)
                break
        else:
            groups.append([i])
            out_names.append(names[i])
        new_of.extend([len(groups) - 1] * len(groups[-1]))
        i += len(groups[-1])
    out_inputs = [
        [(None if w is None else new_of[w], s) for r in g for w, s in inputs[r] if w is None or w not in g]
        for g in groups
    ]
    return out_names, out_inputs, new_of


@dataclass
class OpPlan:
    """The policy as per-op decisions over the forward's aten ops (C2, C3)."""

    names: list[str]
    decisions: list[CheckpointPolicy]
    keys_of_op: dict[int, list[str]]
    report: CompiledReport  # changes known before compiling; drops are added after the first call


def plan_ops(policy: Policy, model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *,
             strict: bool = True) -> OpPlan:  # fmt: skip
    """Run the forward once on a fake copy of ``model`` and turn the policy's keys into op decisions."""
    from torch._subclasses.fake_tensor import FakeCopyMode, FakeTensorMode

    fake_mode = FakeTensorMode()
    try:
        with FakeCopyMode(fake_mode):
            fake_model = copy.deepcopy(model)
    except Exception as e:
        raise AutotuneError(
            f"policy.compiled could not make a fake copy of {type(model).__name__} to map the policy's keys to "
            f"the compiler's ops ({type(e).__name__}: {e}); apply the policy eagerly with policy.applied(model)"
        ) from e
    fake_args, fake_kwargs = tree_map(
        lambda v: fake_mode.from_tensor(v) if isinstance(v, torch.Tensor) else v, (args, kwargs)
    )
    keyer = SavedTensorKeyer(fake_model)
    log = _OpLog()
    op_of_key: dict[str, int | None] = {}
    key_of: WeakIdKeyDictionary = WeakIdKeyDictionary()  # storage -> key
    key_bytes: dict[str, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        named = keyer.key_for(t)
        if named.key is not None and named.first_pack:
            op_of_key[named.key] = log.writer.get(t.untyped_storage())
            key_of[t.untyped_storage()] = named.key
            key_bytes[named.key] = t.untyped_storage().nbytes()
        return t

    with fake_mode, keyer.attached(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), log:
        fake_model(*fake_args, **fake_kwargs)

    report = CompiledReport()
    actions = dict(policy.actions)
    names, inputs, new_of = _fold(log.names, log.inputs)
    seeded = [False] * len(names)
    for raw, folded in enumerate(new_of):
        seeded[folded] = seeded[folded] or log.seeded[raw]
    in_model = {k: new_of[i] for k, i in op_of_key.items() if i is not None}
    effective: dict[str, Action] = {}
    unexpressible = [k for k, a in actions.items() if k in in_model and a in (Action.SWAP, Action.COMPRESS)]
    if unexpressible and strict:
        raise AutotuneError(
            f"policy for {policy.model} swaps or compresses {len(unexpressible)} tensors inside the model (e.g. "
            f"{unexpressible[0]}): under torch.compile only keep and recompute can be applied (NOTE [ Compiled "
            "policies ] C5 in runtime/compiled.py); search with `autotune search --compile`, apply this policy "
            "eagerly with policy.applied(model), or pass strict=False to keep those tensors"
        )
    for k, a in actions.items():
        if k in in_model and a in (Action.SWAP, Action.COMPRESS):
            effective[k] = Action.KEEP
            report.changed[k] = (a, Action.KEEP, "not expressible under torch.compile (C5)")
        elif k in in_model:
            effective[k] = a
        elif k not in op_of_key and not k.startswith(OUTSIDE):
            report.dropped[k] = "no tensor of this name is saved in this model's forward"
        elif a != Action.KEEP:  # the loss's, or an input of the model
            why = "saved outside the compiled model" if k.startswith(OUTSIDE) else "an input of the model"
            report.changed[k] = (a, Action.KEEP, f"{why}: autograd keeps it")
    for k in in_model:
        effective.setdefault(k, Action.KEEP)  # a tensor the policy does not name is kept, as R1 keeps it

    n = len(names)
    decisions = [CheckpointPolicy.PREFER_SAVE] * n
    keys_of_op: dict[int, list[str]] = {}
    for k, i in in_model.items():
        keys_of_op.setdefault(i, []).append(k)
    for i, keys in keys_of_op.items():
        recomputed = [k for k in keys if effective[k] == Action.RECOMPUTE]
        kept = [k for k in keys if effective[k] == Action.KEEP]
        if seeded[i]:
            decisions[i] = CheckpointPolicy.MUST_SAVE
            for k in recomputed:
                report.changed[k] = (actions[k], Action.KEEP, _RANDOM)
        elif not recomputed:
            decisions[i] = CheckpointPolicy.MUST_SAVE
        elif not kept or sum(key_bytes[k] for k in recomputed) >= sum(key_bytes[k] for k in kept):
            decisions[i] = CheckpointPolicy.MUST_RECOMPUTE
            for k in kept:
                report.changed[k] = (actions[k], Action.RECOMPUTE, f"{_PER_OP} its larger outputs are recomputed")
        else:
            decisions[i] = CheckpointPolicy.MUST_SAVE
            for k in recomputed:
                report.changed[k] = (actions[k], Action.KEEP, f"{_PER_OP} its larger outputs are kept")
    # C3: the producer chain of each recomputed op, back to resident storage.
    todo = [i for i in range(n) if decisions[i] == CheckpointPolicy.MUST_RECOMPUTE]
    while todo:
        i = todo.pop()
        for w, storage in inputs[i]:
            if w is None:
                continue  # parameters, buffers, inputs: resident
            k = key_of.get(storage)
            if k is not None and effective.get(k) == Action.KEEP:
                continue
            if decisions[w] == CheckpointPolicy.MUST_RECOMPUTE:
                continue
            if seeded[w]:
                decisions[w] = CheckpointPolicy.MUST_SAVE  # its outputs stay resident
                continue
            if decisions[w] == CheckpointPolicy.MUST_SAVE:
                for kk in keys_of_op.get(w, []):
                    if effective.get(kk) == Action.KEEP:
                        report.changed[kk] = (
                            actions[kk],
                            Action.RECOMPUTE,
                            f"its op {names[w]} is recomputed: a recompute reads its other output",
                        )
            decisions[w] = CheckpointPolicy.MUST_RECOMPUTE
            todo.append(w)
    for k in in_model:
        if k in actions and k not in report.changed:
            report.applied[k] = actions[k]
    return OpPlan(names, decisions, keys_of_op, report)


class _Walk:
    """``policy_fn`` for one tracing pass: walks the planned op sequence in step with the compiler's (C4)."""

    def __init__(self, plan: OpPlan, passes: list[_Walk]) -> None:
        self.plan = plan
        self.pos = 0
        self.met: set[int] = set()
        passes.append(self)

    def __call__(self, ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if ctx.is_recompute:
            return CheckpointPolicy.PREFER_SAVE
        if not torch.compiler.is_compiling():
            raise AutotuneError(
                "policy.compiled ran its model outside torch.compile (a graph break or a backend that does not "
                "trace it): apply the policy eagerly with policy.applied(model) instead"
            )
        name = op_name(func)
        names = self.plan.names
        for j in range(self.pos, min(self.pos + LOOKAHEAD + 1, len(names))):
            if names[j] == name:
                self.pos = j + 1
                self.met.add(j)
                return self.plan.decisions[j]
        return CheckpointPolicy.PREFER_SAVE


def check_backend(backend: str | Callable[..., Any]) -> None:
    """A backend name torch.compile knows (a callable is taken as it is)."""
    if callable(backend):
        return
    known = sorted(torch._dynamo.list_backends(exclude_tags=()))
    if backend not in known:
        raise AutotuneError(
            f"unknown torch.compile backend {backend!r}: expected one of {', '.join(known)} (e.g. --backend inductor)"
        )


class CompiledModel(torch.nn.Module):
    """``torch.compile`` of a model under a policy (NOTE [ Compiled policies ]); made by
    :meth:`runtime.policy.Policy.compiled`. Its parameters are the model's."""

    def __init__(self, policy: Policy, model: torch.nn.Module, *, backend: str | Callable[..., Any] = "inductor",
                 strict: bool = True, **compile_kwargs: Any) -> None:  # fmt: skip
        super().__init__()
        from runtime.apply import check_model

        if policy.partitions:
            raise AutotuneError(
                f"policy for {policy.model} partitions {', '.join(str(p) for p in policy.partitions)}: partitions "
                "run per slice in Python and cannot be compiled (NOTE [ Compiled policies ] C5); apply it "
                "eagerly with policy.applied(model), or search without --allow-partition"
            )
        check_backend(backend)
        if strict:
            check_model(policy, model)
        if compile_kwargs.pop("fullgraph", True) is not True:
            raise AutotuneError("policy.compiled needs fullgraph=True: the policy covers one graph (C1)")
        self.model = model
        self.policy = policy
        self.strict = strict
        self._plan: OpPlan | None = None
        self._said_eval = False  # C7's warning, once
        self._passes: list[_Walk] = []
        passes = self._passes

        def context() -> Any:  # a plain function: dynamo calls context_fn unbound
            assert self._plan is not None
            return create_selective_checkpoint_contexts(_Walk(self._plan, passes))

        def region(*args: Any, **kwargs: Any) -> Any:
            return checkpoint(model, *args, use_reentrant=False, context_fn=context, determinism_check="none", **kwargs)

        # Dynamo caches compiled code on the function's code object and guards on the model's structure,
        # not on the policy: each CompiledModel gets a code object of its own, or a second policy for the
        # same model class would run the first one's graph (C1).
        unique = types.FunctionType(
            region.__code__.replace(co_name=f"autotune_policy_region_{next(_SERIAL)}"),
            region.__globals__,
            None,
            region.__defaults__,
            region.__closure__,
        )
        self._compiled = torch.compile(unique, backend=backend, fullgraph=True, **compile_kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        training = torch.is_grad_enabled() and self.model.training
        if training:  # the precision the policy was made for, as policy.applied checks it (NOTE [ Precision ])
            device = next((p.device for p in self.model.parameters()), torch.device("cpu"))
            check_active(self.policy.precision, device.type)
        if self._plan is None:
            if not training:  # C7: nothing is saved, nothing to plan; the first training call plans
                if torch.is_grad_enabled() and not self._said_eval:  # trained in eval mode: say it runs as it is
                    self._said_eval = True
                    warnings.warn(
                        f"policy.compiled: {type(self.model).__name__} is in eval mode with gradients on, so it runs "
                        "as it is, eagerly and without the policy, until a call in training mode (NOTE [ Compiled "
                        "policies ] C7: eval mode is a validation's); call model.train() before training (a "
                        "BatchNorm to freeze: its own .eval()), and run validation under torch.no_grad()",
                        stacklevel=2,
                    )
                return self.model(*args, **kwargs)
            self._plan = plan_ops(self.policy, self.model, args, kwargs, strict=self.strict)
        try:
            out = self._compiled(*args, **kwargs)
        except torch._dynamo.exc.Unsupported as e:
            reason = str(e).strip().splitlines()[0]
            raise AutotuneError(
                f"{type(self.model).__name__} does not compile as one graph ({reason}): policy.compiled needs "
                "fullgraph=True (NOTE [ Compiled policies ] C1); torch.compile(model, fullgraph=True) shows where "
                "it breaks, or apply the policy eagerly with policy.applied(model)"
            ) from e
        if training:
            self._settle()
        else:  # C7: an evaluation's trace meets no saved tensor's op, and says nothing of training's
            self._passes.clear()
        return out

    def _settle(self) -> None:
        """After a compile (a call that traced): keys whose ops the last tracing pass did not meet are
        dropped (C4)."""
        plan = self._plan
        if plan is None or not self._passes:
            return
        met = self._passes[-1].met
        self._passes.clear()
        for i, keys in plan.keys_of_op.items():
            if i in met:
                continue
            for k in keys:
                plan.report.applied.pop(k, None)
                plan.report.changed.pop(k, None)
                plan.report.dropped[k] = f"its op ({plan.names[i]}) was not found in the compiled trace"

    @property
    def report(self) -> CompiledReport:
        """What the compiled graph applies (C6); empty until the first call."""
        return self._plan.report if self._plan is not None else CompiledReport()


__all__ = ["CompiledModel", "CompiledReport", "OpPlan", "check_backend", "op_name", "plan_ops"]
