"""Stable keys for saved activations: the name a policy uses for a tensor, computed the same way at trace
time and at training time.

NOTE [ Key format ]
    ``<module path>#<call>.<ordinal>:<producer>``, e.g. ``layer1.0.conv2#0.0:Convolution`` or
    ``layer1.0.relu#2.0:Relu``.

    * ``module path`` is the innermost module whose forward is running when autograd packs the tensor
      (``<root>`` for the model itself, ``<loss>`` outside the model, e.g. the loss function);
    * ``call`` counts the calls of that module since the step started (torchvision's Bottleneck calls its
      one ``relu`` three times; a siamese or contrastive loss calls the model itself twice before its
      backward, and the second call's tensors are the model's calls 1, not 0 again);
    * ``ordinal`` counts the distinct storages first packed during that call;
    * ``producer`` is the autograd node of the packed tensor without its ``Backward<n>`` suffix, or
      ``nograd`` for a tensor without a grad_fn (an input, a non-differentiable output). It is
      descriptive, and it makes a key written
      for another model fail to match instead of matching the wrong tensor. Nodes that PyTorch versions
      name differently for the same tensor take one name (:data:`SAME_PRODUCER`): torch 2.14's
      ``F.multi_head_attention_forward`` reshapes its attention output (``_unsafe_view``: UnsafeView) where
      the H200's torch 2.11 made a ``view`` of it (View, tests/fixtures/gpu/h200_traces.json.gz), so a ViT-B/16
      plan made with one would have met the other's twelve attention outputs as unknown keys, kept; and a CPU
      ``reshape`` makes ``_reshape_alias`` (ReshapeAlias) where no dispatch mode is on, a ``view`` under one,
      so a real trace (under its mode) and a swap-only step (none) named ``nn.MultiheadAttention``'s reshaped
      tensors otherwise, and the swap kept them; and a view that an in-place op changed afterwards has its
      node made again by autograd, AsStrided on real tensors but the view op itself on fake ones (they
      record how to replay a view): EfficientNet's classifier flattens, drops out in place, and its linear
      layer saves that view (AsStrided, a view too, is named View). Keys
      read from a policy file are made canonical too (:func:`canonical_key`), so older files still match.

    Every storage but the model's parameters and buffers is named, the batch included (the runtime cannot
    tell the batch apart cheaply, so the trace names it too, keeping the ordinals equal). Only the first
    pack of a storage names it: later packs of the same storage (a ReLU output that the
    next convolution also saves, a view of it) get the same key, found through the live storage object
    (NOTE in PYTORCH-NOTES: never by ``data_ptr()``, addresses are reused within one forward).

    The keys depend only on the order of module calls and packs, which is the same in fake and real mode
    and from one iteration to the next, so the tracer and the runtime agree on them.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.utils.weak import WeakIdKeyDictionary

ROOT = "<root>"
OUTSIDE = "<loss>"
_BACKWARD_SUFFIX = re.compile(r"Backward\d*$")


def runs_in(module: str, path: str) -> bool:
    """Whether what runs in module ``module`` runs in a call of ``path``: the module itself or one inside it."""
    return module == path or module.startswith(path + ".")


@dataclass
class KeyedTensor:
    """What the keyer knows of a storage packed in this forward."""

    key: str | None  # None for parameters, buffers and other excluded storages
    first_pack: bool  # True the first time this storage is packed in this forward


class SavedTensorKeyer:
    """Tracks module calls on one model and names each packed storage (NOTE [ Key format ]).

    Use :meth:`attached` around a step (it starts counting afresh), :meth:`new_forward` at the start of each
    later step attached in the same block, and :meth:`key_for` inside a pack hook. A step is one forward and
    its backward: every call of the model before its backward counts on (NOTE [ Key format ]).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._stack: list[tuple[str, int]] = []  # (module path, call index) of running forwards
        self._idle: list[str] = []  # module calls made without grad, running (not counted: they save nothing)
        self._calls: dict[str, int] = {}
        self._ordinals: dict[tuple[str, int], int] = {}
        self._keys: WeakIdKeyDictionary = WeakIdKeyDictionary()  # storage -> key
        self._excluded: WeakIdKeyDictionary = WeakIdKeyDictionary()  # storage -> True
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._names: dict[int, str] | None = None  # id(module) -> path, for global hooks (built once)
        # Called with the module's path when a module's forward runs with grad inside a backward (a checkpoint's
        # recompute: runtime R16).
        self.on_backward_call: Callable[[str], None] | None = None

    # -- module tracking ---------------------------------------------------------------------------------
    @contextmanager
    def attached(self, global_hooks: bool = False) -> Iterator[SavedTensorKeyer]:
        """Track this model's module calls for the duration of the block: with forward pre/post hooks on
        every submodule, or (``global_hooks``, what the runtime uses every step) with one pair of global
        module hooks that look the module up by identity: two registrations per step instead of two per
        module. Global hooks run before per-module ones (the tracer's backward attribution relies on the
        per-module order, so it keeps those)."""
        self.exclude_model_state()
        self.new_forward()
        if global_hooks:
            if self._names is None:
                self._names = {id(mod): path or ROOT for path, mod in self.model.named_modules()}
            names = self._names

            def pre(mod: torch.nn.Module, _args: object) -> None:
                name = names.get(id(mod))
                if name is not None:
                    self._enter(name)

            def post(mod: torch.nn.Module, _args: object, _out: object) -> None:
                name = names.get(id(mod))
                if name is not None:
                    self._leave(name)

            self._handles.append(torch.nn.modules.module.register_module_forward_pre_hook(pre))
            self._handles.append(torch.nn.modules.module.register_module_forward_hook(post, always_call=True))
        else:
            for path, mod in self.model.named_modules():
                name = path or ROOT
                self._handles.append(mod.register_forward_pre_hook(self._make_pre(name)))
                self._handles.append(mod.register_forward_hook(self._make_post(name), always_call=True))
        try:
            yield self
        finally:
            for h in self._handles:
                h.remove()
            self._handles.clear()
            self._stack.clear()
            self._idle.clear()

    def _enter(self, name: str) -> None:
        """A module's forward starts: count the call and push it. A call without grad (a forward for pseudo-
        labels, a teacher's inside the step) saves nothing and is not counted, as the runtime's later steps do
        not count it (runtime R11)."""
        if not torch.is_grad_enabled():
            self._idle.append(name)
            return
        if self.on_backward_call is not None and torch._C._current_graph_task_id() != -1:
            self.on_backward_call(name)
        call = self._calls.get(name, 0)
        self._calls[name] = call + 1
        self._stack.append((name, call))

    def enter_root(self) -> None:
        """The root module's forward has already started: its pre-hooks ran before :meth:`attached`'s
        global ones were registered (the runtime learns from inside that call, R11). Its post-hook runs."""
        self._enter(ROOT)

    def _leave(self, name: str) -> None:
        # Hooks registered with always_call=True: this also runs when forward raised, so the stack stays
        # balanced.
        if self._idle and self._idle[-1] == name:
            self._idle.pop()
        elif self._stack and self._stack[-1][0] == name:
            self._stack.pop()

    def _make_pre(self, name: str):  # type: ignore[no-untyped-def]
        def pre(_mod: torch.nn.Module, _args: object) -> None:
            self._enter(name)

        return pre

    def _make_post(self, name: str):  # type: ignore[no-untyped-def]
        def post(_mod: torch.nn.Module, _args: object, _out: object) -> None:
            self._leave(name)

        return post

    def new_forward(self) -> None:
        """Forget the calls and keys of the previous step."""
        self._idle.clear()
        self._calls.clear()
        self._ordinals.clear()
        self._keys = WeakIdKeyDictionary()

    def exclude_model_state(self) -> None:
        """Parameters and buffers are never candidates (Linear saves its weight as a transposed view, so
        they are recognised by storage, not by type)."""
        for t in list(self.model.parameters()) + list(self.model.buffers()):
            self._excluded[t.untyped_storage()] = True

    def exclude(self, *tensors: torch.Tensor) -> None:
        """Exclude more storages (the input batch)."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._excluded[t.untyped_storage()] = True

    def assign(self, t: torch.Tensor, key: str) -> None:
        """Name a storage whose first pack this keyer did not see: a checkpointed region's input or output,
        packed inside the region, where the runtime's hooks are not (runtime R10)."""
        storage = t.untyped_storage()
        if storage not in self._keys and storage not in self._excluded:
            self._keys[storage] = key

    @property
    def current_module(self) -> str:
        return self._stack[-1][0] if self._stack else OUTSIDE

    # -- naming ------------------------------------------------------------------------------------------
    def key_for(self, t: torch.Tensor) -> KeyedTensor:
        """Name the storage of a tensor being packed (call from a pack hook)."""
        storage = t.untyped_storage()
        if storage.nbytes() == 0 or storage in self._excluded:
            # Empty storages (cuDNN BatchNorm's reserve on CUDA) hold no memory, and CPU traces never see
            # them: no key, so that keys agree across devices.
            return KeyedTensor(None, False)
        key = self._keys.get(storage)
        if key is not None:
            return KeyedTensor(key, False)
        frame = self._stack[-1] if self._stack else (OUTSIDE, 0)
        ordinal = self._ordinals.get(frame, 0)
        self._ordinals[frame] = ordinal + 1
        key = f"{frame[0]}#{frame[1]}.{ordinal}:{producer_name(t)}"
        self._keys[storage] = key
        return KeyedTensor(key, True)


# NOTE [ Key format ]: one name across PyTorch versions and dispatch modes.
SAME_PRODUCER = {"UnsafeView": "View", "ReshapeAlias": "View", "AsStrided": "View"}


def producer_name(t: torch.Tensor) -> str:
    """``ConvolutionBackward0`` -> ``Convolution``; ``nograd`` for tensors without a grad_fn."""
    fn = t.grad_fn
    if fn is None:
        return "nograd"
    name = _BACKWARD_SUFFIX.sub("", fn.name()) or fn.name()
    return SAME_PRODUCER.get(name, name)


def canonical_key(key: str) -> str:
    """``key`` with its producer's one name (:data:`SAME_PRODUCER`), as :func:`producer_name` gives it."""
    head, sep, producer = key.rpartition(":")
    return f"{head}:{SAME_PRODUCER[producer]}" if sep and producer in SAME_PRODUCER else key


_CONTAINERS = (torch.nn.Sequential, torch.nn.ModuleList, torch.nn.ModuleDict)


def block_paths(model: torch.nn.Module) -> dict[str, str]:
    """Module path -> the block it belongs to: the shortest prefix of the path that is an element of a
    container (``nn.Sequential``, ``nn.ModuleList``, ``nn.ModuleDict``), e.g. ``layer1.0`` for
    ``layer1.0.conv2`` in a ResNet or ``transformer.h.3`` for ``transformer.h.3.attn.c_attn`` in GPT-2; a
    module with no such prefix is its own block (``conv1``, ``transformer.ln_f``). Blocks are the regions that
    ``torch.utils.checkpoint`` users wrap, and a candidate saved in another block than the one that produced
    it is that block's input."""
    modules = dict(model.named_modules())
    out = {ROOT: ROOT, OUTSIDE: OUTSIDE}
    for path in modules:
        if not path:
            continue
        parts = path.split(".")
        block = path
        for i in range(1, len(parts) + 1):
            parent = ".".join(parts[: i - 1])
            if isinstance(modules.get(parent), _CONTAINERS):
                block = ".".join(parts[:i])
                break
        out[path] = block
    return out


def parameter_fingerprint(model: torch.nn.Module) -> str:
    """A hash of the model's parameters, by name and shape: its structure as read without running it. A
    policy records its model's (``Policy.parameter_fingerprint``) and the runtime checks it before anything
    runs (R12 in runtime/apply.py)."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(f"{name}:{tuple(p.shape)};".encode())
    return h.hexdigest()[:16]
