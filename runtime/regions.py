"""A region's forward without an autograd graph, its backward recomputing it (runtime R10, simulator Rule 11).

NOTE [ Regions without a graph ]
    ``torch.utils.checkpoint(use_reentrant=False)`` runs a region's forward with autograd on and a Python
    pack hook per saved tensor, and recomputes at the first unpack with a Python pack hook and a Python
    unpack per saved tensor again: about 20 us of host time a saved tensor on an H200 machine's host, which
    made a ResNet-50 b64 forward under per-block checkpoint 22.8 ms against 10.9 ms plain (bench_runtime's
    phases). Here the region is one ``autograd.Function`` node instead:

    N1. Forward. The call runs inside ``Function.forward``, where autograd records nothing: no node, no saved
        tensor, no hook per op. The node saves the call's tensor arguments (the region's inputs, P4 of
        runtime/plan.py; a tensor passed several times is one input, so that the recompute gets one object
        where the forward did: ``nn.MultiheadAttention(x, x, x)`` projects otherwise when it is not) and
        takes the leaves the call reads (its parameters: N4) as inputs of its own, so that their gradients
        leave it as edges into their ``AccumulateGrad`` nodes, in the graph task that runs backward
        (DistributedDataParallel's hooks fire there, as without a policy).
    N2. Backward. When the engine reaches the node (every gradient of the call's outputs is in: the point where the
        call's own backward would begin), the call runs again with autograd on, under the RNG state of its forward where
        it draws random numbers and the autocast state of its forward, with no saved-tensor hooks (the runtime's own may
        be on through backward, R11); the recomputed outputs are dropped once their gradient edges are taken (what
        backward does not save goes at once), and ``torch.autograd.grad`` runs the call's backward from those edges to
        the inputs and the leaves. The recompute reads the leaves through aliases (detached views of the same
        storage, put in the modules' parameter tables that hold each leaf, tied ones included, and put back after),
        so that a hook the user registered on a parameter runs once, where the node's gradient reaches it, as in
        plain training (differentiated as themselves, the hooks ran there too: twice, the gradients doubled by a
        ``g * 2`` hook); a leaf read otherwise (a closure's reference, an RNN's flattened weights) is differentiated
        as itself, and where a leaf is read both ways its two parts are summed (plain training's to rounding).
        Otherwise the same kernels run on the same values in the same order as plain training, so the gradients are
        the same bits. A backward that builds a graph (``create_graph=True``: a gradient penalty) runs it
        on the inputs as saved, with their history, and builds the graph too: the second order terms are kept, summed
        otherwise (plain training's to rounding), and the runtime runs the regions under checkpoint from the next step
        on (runtime R10). Every saved tensor of the recompute is held natively, nothing in Python per tensor. It re-runs
        the whole call, not up to its last pack as checkpoint does. What it holds that checkpoint would not: the outputs
        it re-makes that nothing inside saves, until the recompute ends; the outputs' gradients until the call's
        backward is done (the node's caller holds its arguments); the gradients it returns (parameters' gradients that
        are added into existing ones: gradient accumulation) until then too. Rule 11 counts all three.
    N3. Autocast's cache of parameters' casts is off during the forward: a cast made there has no graph and
        must not serve a later use of the parameter in the step (torch 2.14 does not cache casts made without
        grad mode anyway; this guards the versions the project supports). The values are the same. Under
        autocast a parameter used both inside a region and after it gets the two gradients summed in float32
        (each use has its own cast), where plain training sums them in the cast dtype at the one cached cast:
        equal to rounding, not bit for bit. BatchNorm's running statistics: the caller passes a forward that
        runs the recompute with momentum 0 (runtime/apply.py R10), recognised by running inside a backward
        graph task.
    N4. The leaves are learnt in the call's first step, which runs under ``torch.utils.checkpoint``
        (non-reentrant): its graph, walked once from the outputs to the inputs, names every leaf that
        requires grad (``AccumulateGrad`` nodes). Where that walk finds what this node could not carry, the
        call stays under checkpoint for good: a leaf that is not a trainable parameter of the model (a tensor
        a closure holds, new each step), a node made before the call that is not one of its inputs' (a tensor that
        requires grad reaching the call other than as an argument), an output that shares storage with an
        input (a view of an argument, which a custom Function's output cannot be modified as in place), an
        argument the call writes into (the node saves its arguments for its backward), an argument or output
        that torch's pytree cannot open (an object that may hold tensors the node would not see), or a
        trainable parameter of the called module that the call did not read: control flow that differs
        between steps (a mixture of experts whose router skips an expert in this step) may read it in another
        step, whose gradient a node carrying the first call's leaves would drop. Nor, found when the model's
        forward ends, an output that is a view of a tensor the call made (InstanceNorm's) and that the forward
        wrote in place after the call (a ``ReLU(inplace=True)``; as a node's output, "Output 0 of _Region is a
        view and is being modified inplace", from the second step on): runtime/apply.py R10, plan P10. A view
        still alive then says so by its version; one gone by then (a Linear's output on a 3-D input, which only
        dropout or a sum read) by the graph reached from the forward's outputs, where a write into it is a node
        made after the call that reads the node the view was taken from; a view gone and not reached is not
        known, and the call stays under checkpoint.
    N5. When the model's trainable parameters change between steps (one replaced, as ``load_state_dict(...,
        assign=True)`` does, or frozen, or unfrozen as fine-tuning schedules do), every call learns its leaves
        again. Limit: the leaves are those of the first step; a later step whose call reads a parameter that is
        not the called module's own and that the first call did not read (control flow that differs between
        steps, outside the module's parameters, which N4 checks) would not carry its gradient. A call that
        reads fewer of its leaves than the first (an expert the router skips this time) returns no gradient
        for them: their ``.grad`` stays as it was, as in plain training, but their ``AccumulateGrad`` hooks
        run with no gradient where plain training runs none.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.graph import get_gradient_edge
from torch.utils._pytree import TreeSpec, tree_flatten, tree_leaves, tree_unflatten
from torch.utils.checkpoint import get_device_states, set_device_states

from runtime.shared_grads import graphless

_TENSOR = object()  # a tensor's place among a call's outputs
# What a call's arguments and outputs may hold besides tensors once pytree has opened them (N4).
_PLAIN = (torch.Tensor, type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)
_TOP_HOOKS = torch._C._autograd._top_saved_tensors_default_hooks
_PUSH_HOOKS = torch._C._autograd._push_saved_tensors_default_hooks
_POP_HOOKS = torch._C._autograd._pop_saved_tensors_default_hooks


@contextlib.contextmanager
def _native_saves() -> Iterator[None]:
    """No saved-tensor hooks for a while (N2: the runtime's own can still be on in backward, R11)."""
    stack = []
    while (top := _TOP_HOOKS(True)) is not None:
        stack.append(top)
        _POP_HOOKS()
    try:
        yield
    finally:
        for pack, unpack in reversed(stack):
            _PUSH_HOOKS(pack, unpack)


def _autocast_state(device_type: str) -> tuple[bool, torch.dtype]:
    return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


@dataclass
class _Call:
    """One call of a region: what its backward needs besides the saved inputs."""

    forward: Callable[..., Any]
    flat: list[Any]  # the call's flattened (args, kwargs), tensors as None (the node saves those)
    spec: TreeSpec
    positions: list[int]  # where the tensors go in ``flat``
    slots: list[int]  # which of the node's inputs goes at each position (a tensor passed twice is one input)
    leaves: Sequence[torch.Tensor]
    rng: bool
    device_type: str
    cpu_rng: torch.Tensor | None = None
    devices: list[int] | None = None
    device_rng: list[torch.Tensor] | None = None
    autocast: tuple[tuple[bool, torch.dtype], tuple[bool, torch.dtype], bool] | None = None
    out_flat: list[Any] | None = None  # the outputs' non-tensor leaves, tensors as _TENSOR
    out_spec: TreeSpec | None = None
    on_double: Callable[[], None] | None = None  # told when a backward with create_graph=True reaches the node
    places: Sequence[Sequence[tuple[dict[str, Any], str]]] = ()  # per leaf: the modules' parameter tables holding it

    @property
    def n_inputs(self) -> int:
        return max(self.slots, default=-1) + 1

    def arguments(self, tensors: Sequence[torch.Tensor]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        flat = list(self.flat)
        for i, slot in zip(self.positions, self.slots, strict=True):
            flat[i] = tensors[slot]
        args, kwargs = tree_unflatten(flat, self.spec)
        return args, kwargs

    @contextlib.contextmanager
    def replaying(self) -> Iterator[None]:
        """The forward's RNG and autocast states, for the recompute (N2)."""
        with contextlib.ExitStack() as stack:
            if self.rng:
                stack.enter_context(torch.random.fork_rng(devices=self.devices or [], device_type=self.device_type))
                assert self.cpu_rng is not None
                torch.set_rng_state(self.cpu_rng)
                if self.devices:
                    set_device_states(self.devices, self.device_rng, device_type=self.device_type)
            assert self.autocast is not None
            device_state, cpu_state, cache = self.autocast
            if device_state != _autocast_state(self.device_type) or cpu_state != _autocast_state("cpu"):
                states = [(self.device_type, device_state)]
                if self.device_type != "cpu":
                    states.append(("cpu", cpu_state))
                for device_type, (enabled, dtype) in states:
                    stack.enter_context(torch.autocast(device_type, enabled=enabled, dtype=dtype, cache_enabled=cache))
            yield


class _Region(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, call: _Call, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        n = call.n_inputs
        inputs = tensors[:n]
        ctx.call = call
        ctx.save_for_backward(*inputs)
        ctx.set_materialize_grads(False)
        if call.rng:
            call.cpu_rng = torch.get_rng_state()
            if call.device_type != "cpu":
                call.devices, call.device_rng = get_device_states(*inputs)
        call.autocast = (_autocast_state(call.device_type), _autocast_state("cpu"), torch.is_autocast_cache_enabled())
        args, kwargs = call.arguments(inputs)
        cache = call.autocast[2]
        if cache and (call.autocast[0][0] or call.autocast[1][0]):
            # Autocast caches its casts of parameters for the rest of the forward: made here, without a
            # graph, a later use of the same parameter outside the call would get no gradient through it.
            torch.set_autocast_cache_enabled(False)
        try:
            with graphless():  # autograd records nothing inside Function.forward (N1)
                out = call.forward(*args, **kwargs)
        finally:
            torch.set_autocast_cache_enabled(cache)
        flat, call.out_spec = tree_flatten(out)
        outs = tuple(x for x in flat if isinstance(x, torch.Tensor))
        call.out_flat = [_TENSOR if isinstance(x, torch.Tensor) else x for x in flat]
        plain = [t for t in outs if not (t.is_floating_point() or t.is_complex())]
        if plain:
            ctx.mark_non_differentiable(*plain)
        return outs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        call: _Call = ctx.call
        # A backward that builds a graph of its own (create_graph=True: a gradient penalty, a double backward)
        # runs in grad mode: then the recompute reads the inputs as saved, with their history, and the
        # gradients it returns are differentiable, to the inputs' history as to the leaves (N2). Detached,
        # the second-order terms through the region were lost (a penalty's gradients off by 0.9%).
        double = torch.is_grad_enabled()
        if double and call.on_double is not None:
            call.on_double()
        saved = list(ctx.saved_tensors)
        inputs = saved if double else [
            t.detach().requires_grad_(t.requires_grad) if t.is_floating_point() or t.is_complex() else t for t in saved
        ]  # fmt: skip
        # The leaves through aliases (N2): a hook on a parameter runs once, where the node's gradient reaches it.
        aliases = [] if double or not call.places else [p.detach().requires_grad_() for p in call.leaves]
        with call.replaying(), _native_saves(), torch.enable_grad(), substituted(call.places, aliases):
            args, kwargs = call.arguments(inputs)
            out = call.forward(*args, **kwargs)
        # Edges, not the outputs: no name may hold a recomputed output past this point (a loop variable did,
        # the call's last output, one output's size more than planned until the node returned).
        pairs = [
            (get_gradient_edge(o), g)
            for o, g in zip((x for x in tree_leaves(out) if isinstance(x, torch.Tensor)), grads, strict=True)
            if g is not None and o.requires_grad
        ]
        del out  # what backward does not save goes now (N2)
        roots = [edge for edge, _ in pairs]
        root_grads = [g for _, g in pairs]
        wanted = [t for t in inputs if t.requires_grad]
        wrt = [*wanted, *aliases, *call.leaves]
        got: list[torch.Tensor | None] = [None for _ in wrt]
        if roots and wrt:
            got = list(torch.autograd.grad(roots, wrt, root_grads, allow_unused=True, create_graph=double))
        it = iter(got)
        input_grads = [next(it) if t.requires_grad else None for t in inputs]
        through = [next(it) for _ in aliases]
        leaf_grads = list(it)  # a leaf the call read as itself, not through a module's table (N2)
        if aliases:
            leaf_grads = [_added(a, b) for a, b in zip(through, leaf_grads, strict=True)]
        return (None, *input_grads, *leaf_grads)


def run(forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], leaves: Sequence[torch.Tensor],
        rng: bool, device_type: str, on_double: Callable[[], None] | None = None,
        places: Sequence[Sequence[tuple[dict[str, Any], str]]] = ()) -> Any:  # fmt: skip
    """The call ``forward(*args, **kwargs)`` as one node (N1, N2); ``on_double`` is called when a backward that
    builds a graph (create_graph=True) reaches it; ``places``: for each leaf, the modules' parameter tables
    (``module._parameters`` and the name) that hold it (:func:`parameter_places`)."""
    flat, spec = tree_flatten((args, kwargs))
    positions = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]
    # A tensor passed several times is one input of the node, so that the recompute gets one object several
    # times, as the forward did (nn.MultiheadAttention's ``query is key is value`` picks its projection).
    slot_of: dict[int, int] = {}
    tensors: list[torch.Tensor] = []
    slots = []
    for i in positions:
        slot = slot_of.setdefault(id(flat[i]), len(tensors))
        if slot == len(tensors):
            tensors.append(flat[i])
        slots.append(slot)
        flat[i] = None
    call = _Call(forward, flat, spec, positions, slots, leaves, rng, device_type, on_double=on_double, places=places)
    outs = _Region.apply(call, *tensors, *leaves)
    assert call.out_flat is not None and call.out_spec is not None
    it = iter(outs)
    return tree_unflatten([next(it) if x is _TENSOR else x for x in call.out_flat], call.out_spec)


def parameter_places(model: torch.nn.Module, leaves: Sequence[torch.Tensor]) -> list[list[tuple[dict[str, Any], str]]]:
    """For each of ``leaves``, where ``model``'s modules hold it: (their ``_parameters``, the name), one per
    module that registers it (a tied weight: several)."""
    where: dict[int, list[tuple[dict[str, Any], str]]] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                where.setdefault(id(p), []).append((module._parameters, name))
    return [where.get(id(p), []) for p in leaves]


@contextlib.contextmanager
def substituted(
    places: Sequence[Sequence[tuple[dict[str, Any], str]]], aliases: Sequence[torch.Tensor]
) -> Iterator[None]:
    """Each leaf's alias in the parameter tables that hold the leaf, for the recompute (N2); put back after.
    (runtime/apply.py puts a checkpointed call's forward-time parameters back the same way, R10.)"""
    if not aliases:
        yield
        return
    held: list[tuple[dict[str, Any], str, Any]] = []
    try:
        for where, alias in zip(places, aliases, strict=True):
            for table, name in where:
                held.append((table, name, table[name]))
                table[name] = alias
        yield
    finally:
        for table, name, value in reversed(held):
            table[name] = value


def _added(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    return b if a is None else a if b is None else a + b


class Learning:
    """N4 for one call's first step: made just before the call runs under checkpoint (the arguments' versions,
    the first sequence number its nodes can have), then asked for its leaves with what it returned."""

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.arguments = tree_leaves((args, kwargs))
        self.inputs = [t for t in self.arguments if isinstance(t, torch.Tensor)]
        self.versions = [t._version for t in self.inputs]
        self.before = sequence_mark()

    def leaves(
        self, out: Any, parameters: AbstractSet[int], own: AbstractSet[int] = frozenset()
    ) -> list[torch.Tensor] | None:
        """The leaves the call read (its graph made under checkpoint), or None where this node could not carry
        the call. ``parameters``: the model's trainable parameters; ``own``: those of the called module, each
        of which the call must have read."""
        returned = tree_leaves(out)
        if any(not isinstance(x, _PLAIN) for x in (*self.arguments, *returned)):
            return None  # a container pytree cannot open, which may hold tensors the node would not see
        inputs, before = self.inputs, self.before
        if [t._version for t in inputs] != self.versions:
            return None  # it wrote into an argument, which the node saves for its backward
        outs = [t for t in returned if isinstance(t, torch.Tensor)]
        storages = {t.untyped_storage().data_ptr() for t in inputs if t.untyped_storage().nbytes()}
        if any(o.untyped_storage().nbytes() and o.untyped_storage().data_ptr() in storages for o in outs):
            return None  # an output shares storage with an argument
        stops = set()
        for t in inputs:
            if t.requires_grad:
                stops.add(get_gradient_edge(t).node)
        found: dict[int, torch.Tensor] = {}
        seen: set[Any] = set()
        todo: list[Any] = [o.grad_fn for o in outs if o.grad_fn is not None]
        while todo:
            node = todo.pop()
            if node is None or node in seen or node in stops:
                continue
            seen.add(node)
            variable = getattr(node, "variable", None)
            if variable is not None:  # AccumulateGrad
                if id(variable) not in parameters:
                    return None  # a leaf that is not a parameter
                found[id(variable)] = variable
                continue
            if node._sequence_nr() < before:
                return None  # made before the call, not by an input
            todo.extend(next_node for next_node, _ in node.next_functions)
        if not own <= found.keys():
            return None  # a parameter of its own it did not read: another step's control flow may read it
        return list(found.values())


def sequence_mark() -> int:
    """The sequence number the next autograd node will get (N4: the nodes of a call are numbered from it)."""
    with torch.enable_grad():
        probe = torch.zeros((), requires_grad=True).view(())
    assert probe.grad_fn is not None
    return int(probe.grad_fn._sequence_nr()) + 1
