"""The gradients of a parameter used in several places, summed in place (runtime R14, simulator Rule 15).

NOTE [ Shared parameters' gradients ]
    A parameter that several ops use (GPT-2's tied word embedding: the embedding and the LM head) gets one
    gradient per use, and autograd's engine sums them in the input buffer of the parameter's AccumulateGrad
    node. PyTorch adds in place into the gradient that arrived first when nothing else holds it, and makes
    the sum in a new tensor otherwise. The LM head's gradient arrives first, at the start of backward, and
    is a view (TBackward of a matmul's output), so at the end of backward plain training holds three
    vocabulary-sized buffers at once: that gradient, the embedding's and their sum. On GPT-2 small (b2 x 256,
    CPU) that is where the floor of every activation policy lies: 1,718.6 MiB, where ``torch.compile``
    (whose graph adds the embedding's gradient into the LM head's) holds 1,671.0.

    S1. For each parameter that two module attributes share, forward hooks on the modules that hold it find,
        in each call made with gradients on and outside backward (a recompute in backward re-runs forwards),
        the graph edges from the nodes the call made to the parameter's AccumulateGrad node: a walk back
        from the call's outputs over the nodes whose sequence numbers are the call's (64 at most). An edge is
        counted once, however many of the holders' calls find it (BERT's masked-LM head holds its decoder's
        bias as its own ``bias`` too: both calls find the decoder's one edge, which then passes its gradient on
        as the only one; counted twice, it was held back to the end of backward, after DDP's hooks and
        post-accumulate hooks had run with none).
    S2. A post-hook on each such node takes the parameter's gradient out of what the node passes on and
        holds it, except at the last edge, which passes its gradient on to the engine's buffer; a pre-hook
        on AccumulateGrad adds what is held to it there, when the last node has let go of its own inputs
        (as PyTorch's sum is made; a sum inside the post-hook would hold them too). Each sum goes in place
        into the held gradient when nothing else holds its tensor or storage (what PyTorch does), else in
        place into the other when nothing else holds it and its layout, dtype and bytes are the parameter's
        (what PyTorch does not do: the runtime's gain), else into a new tensor. AccumulateGrad then runs as
        always (DDP's hooks, post-accumulate hooks; with gradients from an earlier micro-batch it adds into
        them). Floating-point addition is commutative and the terms are added in the engine's order of
        arrival, so the sum is PyTorch's, bit for bit.
    S3. The last edge is the last of those this backward runs (``torch._C._will_engine_execute_node``, as
        ``register_multi_grad_hook`` counts). Nothing is lost: what is still held when the backward ends
        (the last edge produced no gradient) is added to ``.grad`` by a callback queued with the engine;
        edges the walk did not find go through the engine's buffer as before (a use inside a region run as one
        node, whose call runs without a graph: simulator Rule 15 plans that sum as PyTorch makes it); under
        ``create_graph`` nothing is taken. Where a holder was called inside a region node's forward (such a use:
        :func:`graphless`) and a gradient is held, the last edge hands its gradient over too, so that the node's
        gradient, which reaches the engine's buffer after it, is added last, by AccumulateGrad's pre-hook, as
        PyTorch adds the terms in order of arrival (T5's shared embedding: the LM head's, the decoder's, then the
        encoder's run as one node; passed on, the decoder's was added to the encoder's first, and the gradient
        differed from plain training's by rounding, 2e-9). A node's gradient that arrives before the last edge's is
        still added out of PyTorch's order. A parameter with tensor hooks of its own is left alone: they run before
        node pre-hooks, and must see the whole gradient.
    S4. A trace (runtime/trace.py) runs the same hooks doing what PyTorch does (``in_place=False``) and
        marks each sum made in a new tensor that the runtime makes in place: ``OpInfo.in_place_into`` names
        the tensor written (only where the sum, too, has the parameter's layout, so that AccumulateGrad
        keeps either without a copy). Simulator Rule 15 reads it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from collections.abc import Set as AbstractSet
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from runtime.step_only import StepHook

_WALK = 64  # nodes at most per module call (S1)
_GRAPHLESS = [0]  # forwards of regions run as one node under way (runtime/regions.py): their calls make no graph

# In-place sums the trace records: (the tensor written, the sum PyTorch made instead); S4.
Marker = Callable[[torch.Tensor, torch.Tensor], None]


def shared_parameters(model: torch.nn.Module) -> dict[torch.nn.Parameter, list[torch.nn.Module]]:
    """Parameters held by more than one module attribute, with the modules that hold them (S1)."""
    holders: dict[int, tuple[torch.nn.Parameter, list[torch.nn.Module]]] = {}
    count: dict[int, int] = {}
    for mod in model.modules():
        for p in mod._parameters.values():
            if p is None or not p.requires_grad:
                continue
            entry = holders.setdefault(id(p), (p, []))
            count[id(p)] = count.get(id(p), 0) + 1
            if not any(m is mod for m in entry[1]):
                entry[1].append(mod)
    return {p: mods for pid, (p, mods) in holders.items() if count[pid] > 1}


def _storage_uses(t: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata) - 1  # less the handle asked for here


@contextlib.contextmanager
def graphless() -> Iterator[None]:
    """A region node's forward (runtime/regions.py): a holder called inside makes no edge to be found (S3)."""
    _GRAPHLESS[0] += 1
    try:
        yield
    finally:
        _GRAPHLESS[0] -= 1


def _alone(t: torch.Tensor, holders: int) -> bool:
    """Nothing but ``holders`` references to the tensor holds it or its storage."""
    return t._base is None and t._use_count() <= holders and _storage_uses(t) == 1  # type: ignore[attr-defined]


def _like(t: torch.Tensor, p: torch.Tensor) -> bool:
    """AccumulateGrad keeps ``t`` as the parameter's gradient without a copy; its bytes are a fresh sum's."""
    return (
        t.dtype == p.dtype
        and t.device == p.device
        and t.stride() == p.stride()
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    )


class _Sum:
    """One parameter's gradients in one backward (S2, S3)."""

    def __init__(
        self, param: torch.nn.Parameter, in_place: bool, mark: Marker | None, graphless: AbstractSet[int]
    ) -> None:
        # No reference to the AccumulateGrad node: its pre-hook holds this object, and a cycle would keep the
        # node (and every pre-hook of later steps) alive until the garbage collector runs.
        self.param = param
        self.in_place = in_place
        self.mark = mark
        self.graphless = graphless  # ids of the parameters a holder used inside a region node's call (S3)
        self.nodes: list[Any] = []  # the edges' nodes, until a backward begins (then let go: no cycle stays)
        self.found: set[tuple[Any, int]] = set()  # ... with their input index: an edge two holders find, once
        self.edges = 0
        self.left = 0  # edges still to arrive in the backward under way (0: none under way)
        self.held: torch.Tensor | None = None
        self.done = False  # a backward has ended: edges of a later forward make a new sum

    def _arrive(self) -> bool:
        """Count an arrival; True for the last edge this backward runs (S3)."""
        if self.left <= 0:  # a backward begins: how many of the edges it runs
            nodes, self.nodes = self.nodes, []
            self.found = set()
            self.left = sum(map(torch._C._will_engine_execute_node, nodes)) if nodes else self.edges
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        self.left -= 1
        return self.left <= 0

    def _finish(self) -> None:
        """S3: the end of the backward; what no edge passed on goes into the gradient."""
        self.left = 0
        self.done = True
        held, self.held = self.held, None
        if held is not None:
            p = self.param
            with torch.no_grad():
                p.grad = held if p.grad is None else p.grad.add_(held)

    def add(self, held: torch.Tensor, g: torch.Tensor, holders: int, others: tuple[Any, ...] = ()) -> torch.Tensor:
        """``held + g`` (S2): ``holders`` references to ``g`` are the engine's and this call's; ``others``:
        what the same node passes on elsewhere (an alias of ``g`` there must not change)."""
        if _alone(held, 1):  # PyTorch's own in-place sum: into the first
            return held.add_(g)
        aliased = any(o is g or (isinstance(o, torch.Tensor) and o.data_ptr() == g.data_ptr()) for o in others)
        mine = not aliased and _alone(g, holders) and _like(g, self.param)
        if mine and self.in_place:
            return g.add_(held)  # == held + g, bit for bit: addition is commutative
        out = held + g
        if mine and self.mark is not None and _like(out, self.param):
            self.mark(g, out)
        return out

    def edge_hook(self, j: int) -> Callable[[tuple[Any, ...], tuple[Any, ...]], tuple[Any, ...] | None]:
        """S2: every edge but the last this backward runs hands its gradient over."""

        def hook(grad_inputs: tuple[Any, ...], _grad_outputs: tuple[Any, ...]) -> tuple[Any, ...] | None:
            g = grad_inputs[j]
            last = self._arrive()
            if g is None or g.requires_grad:  # passed on (create_graph: summed as always)
                return None
            if last and (self.held is None or id(self.param) not in self.graphless):  # S3
                return None  # (with a gradient held and a region node's still to come, held as the others)
            others = grad_inputs[:j] + grad_inputs[j + 1 :]
            self.held = g if self.held is None else self.add(self.held, g, 2, others)  # the node's outputs hold g
            out = list(grad_inputs)
            out[j] = None
            return tuple(out)

        return hook

    def pre_hook(self, grad_outputs: tuple[Any, ...]) -> tuple[Any, ...] | None:
        """S2: AccumulateGrad is about to run; the sum is made here, once the last edge's node has let go of
        what it was given (a post-hook's node still holds it), as PyTorch makes it in the engine's buffer."""
        g = grad_outputs[0]
        if self.held is None or g is None:  # nothing held; or nothing to add it to: S3's callback will
            return None
        held, self.held = self.held, None
        return (self.add(held, g, 2),)  # the engine's inputs hold g too


class SharedGradients:
    """S1-S3 for one model; :meth:`installed` puts the module hooks on for a step."""

    def __init__(self, model: torch.nn.Module, *, in_place: bool = True, mark: Marker | None = None) -> None:
        self.shared = shared_parameters(model)
        self.in_place = in_place
        self.mark = mark
        by_module: dict[int, tuple[torch.nn.Module, list[torch.nn.Parameter]]] = {}
        for p, mods in self.shared.items():
            for m in mods:
                by_module.setdefault(id(m), (m, []))[1].append(p)
        self._modules = list(by_module.values())
        self._sums: dict[int, _Sum] = {}  # id(AccumulateGrad node) -> its sum, for the forward under way
        self._graphless: set[int] = set()  # parameters a holder used inside a region node's call, this step (S3)

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        if not self.shared:
            yield
            return
        handles = []
        for mod, params in self._modules:
            start: list[int] = []

            def pre(_m: torch.nn.Module, _args: Any, start: list[int] = start) -> None:
                start.append(torch.autograd._get_sequence_nr())

            def post(_m: torch.nn.Module, _args: Any, out: Any, start: list[int] = start,
                     params: list[torch.nn.Parameter] = params) -> None:  # fmt: skip
                first = start.pop() if start else None
                if first is not None and torch.is_grad_enabled() and torch._C._current_autograd_node() is None:
                    self._find(out, first, params)
                elif _GRAPHLESS[0] and torch._C._current_autograd_node() is None:
                    self._graphless.update(id(p) for p in params)

            handles.append(mod.register_forward_pre_hook(StepHook(pre)))
            handles.append(mod.register_forward_hook(StepHook(post)))
        self._sums = {}
        self._graphless.clear()
        try:
            yield
        finally:
            for h in handles:
                h.remove()
            for s in self._sums.values():
                s.nodes, s.found = [], set()  # a forward without its backward: its graph must not outlive it through us
            self._sums = {}

    def _find(self, out: Any, first: int, params: list[torch.nn.Parameter]) -> None:
        """S1: the edges into the parameters' AccumulateGrad nodes from the nodes this call made."""
        if isinstance(out, dict):  # Hugging Face's ModelOutput
            out = list(out.values())
        stack = [t.grad_fn for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        seen: set[Any] = set()
        while stack and len(seen) < _WALK:
            node = stack.pop()
            if node in seen or node._sequence_nr() < first:
                continue
            seen.add(node)
            for j, (nxt, _) in enumerate(node.next_functions):
                if nxt is None:
                    continue
                if type(nxt).__name__ == "AccumulateGrad":
                    var = nxt.variable  # type: ignore[attr-defined]
                    if any(var is p for p in params) and not var._backward_hooks:  # S3: hooks see it whole
                        self._edge(nxt, var, node, j)
                else:
                    stack.append(nxt)

    def _edge(self, acc: Any, param: torch.nn.Parameter, node: Any, j: int) -> None:
        s = self._sums.get(id(acc))
        if s is None or s.done or s.left > 0:  # this forward's first edge, or a backward has begun
            s = self._sums[id(acc)] = _Sum(param, self.in_place, self.mark, self._graphless)
            acc.register_prehook(s.pre_hook)
        if (node, j) in s.found:  # found again by another module that holds the parameter (S1)
            return
        s.found.add((node, j))
        s.edges += 1
        s.nodes.append(node)
        node.register_hook(s.edge_hook(j))
