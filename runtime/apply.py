"""Apply a policy to eager PyTorch training: keep, swap, recompute or compress each saved activation.

Usage::

    policy = load_policy("resnet101.policy.json")
    with policy.applied(model):              # one forward and its backward
        loss = criterion(model(x), y)
        loss.backward()

or, to reuse pinned buffers, streams and what the first step learned, one :class:`PolicyRuntime` and
``rt.step()``.

NOTE [ Runtime mechanics ] -- the twin of envs/simulator.py; "Rule n" cites its NOTE [ Simulator semantics ].
    R1. Recognition. In the first step a :class:`~runtime.keys.SavedTensorKeyer` on the model names every
        storage autograd packs, as the tracer did; the policy's action for that key decides. A key the
        policy does not know is kept, counted and reported once (the saved batch and targets are listed in
        the policy's schedule and kept silently). All packs of one storage share one handle, so views come
        back as views. Later steps look each pack up instead (R11).
    R2. Keep: the pack hook returns a detached alias (a saved output holding its own grad_fn would
        otherwise never be freed).
    R3. Swap out (Rule 4): at the first pack, the storage's bytes are copied to host memory: on CUDA into a
        pinned buffer (one per key, reused across iterations) on a dedicated device-to-host stream that
        first waits for the compute stream. The handle holds the device bytes until its release point, the
        ``release_after``-th pack point after its own (a pack point is the first pack of a candidate that
        the step observes, R11), or the first unpack of a swapped, recomputed or compressed tensor in
        backward, whichever comes first. There the compute stream waits for the copy's event (no host
        synchronisation) and the handle lets go, so the block is released at that point of the program,
        as the simulator plans. On the CPU the host store is the same memory: the copy is counted like any
        storage (runtime.measure), from the pack hook (inside the op where an op saves its own output: Rule 4),
        unpacks return views of it, and it goes after the last one (R9).
        Tensors on another device than the model's (attention's RNG seed on the host) are kept. A later pack
        of the storage after a write into it (its version moved, or it is a part of its storage that is no
        view: ``unsafe_chunk``'s, as in the CPU's GRU cell) copies it again, so that the copy holds its
        final bytes, as Rule 4 copies after ``save_op`` (the second copy's time is not in the plan).
    R4. Prefetch (Rule 5): when backward first unpacks a tensor of unpack rank r, the copies back of every
        swapped tensor of rank <= r + L are issued, in rank order, on a host-to-device stream that waits
        for the compute stream (so the copy starts where the GPU is, not where Python is) and for the
        tensor's own copy out. Ranks count the unpack points of the tensors that no checkpointed region
        serves; the tensors whose unpacks are due triggers (Rule 5's carriers) are observed for that. The
        device buffer is allocated on the compute stream at issue (no ``record_stream``).
    R5. Stall (Rule 6): before a swapped tensor is used, the compute stream waits for its copy: by backward,
        and by a replay (R6) that reads it as an input, also where the replay finds its buffer alive (a
        prefetched copy still on its way; Rule 7 materializes such inputs first).
    R6. Replay (Rule 7): while the forward runs, a dispatch mode records every op, views and queries included (Rule
        12 charges those too; runtime.replay: name, arguments as storage references with their layout and version,
        random-number state for random ops); it is off the stack while ``torch.autograd.backward`` and ``grad`` run
        (some backward formulas take another path under any mode). At the first unpack, the tensor's producer chain
        is replayed from resident storages: alive ones are used as they are, candidates that are swapped, recomputed
        or compressed and still to be unpacked are brought back first (and kept for their own use; a recomputed
        one's chain from what is alive now, not at its own unpack: Rule 7's nested closures), other missing
        inputs (a kept tensor or a handled one past its last unpack, that backward freed, among them) are replayed
        recursively, once per replay however many of its ops read them (Rule 7 counts them once), and dropped
        afterwards, before backward unpacks the next tensor (Rule 7: replays at one op hold theirs in turn).
        Arguments an op would mutate that are not being regenerated (BatchNorm's running statistics) are
        passed as copies, so replay changes no module state. An input that a later forward op wrote in place (the
        recording's writers of its storage) is re-made as it was when read, from its producer and the writers before
        the read, where the recording holds its producer (Rule 7); one made before the recording (a buffer updated
        after its use, an EMA) is read from the copy the recorder took before that write, kept until no replay is
        left (its bytes are not in the simulator's count); so are the constants the forward lifts from Python data
        (``torch.tensor(0.1)``, ``t[..., 0] = 0``: ``aten.lift_fresh``), which no op makes again. Each op is
        replayed in the grad mode it ran in (backward runs with it off; the CPU's oneDNN LSTM returns its workspace
        and rounds as in training only with it on) and with autocast off: the recording holds what autocast
        dispatched, its casts included, and an autocast still on in backward would cast an op it had left in fp32
        (the CPU's math attention) again. The recorder records the forward and the loss, never backward. The
        random-number states (the CPU generator's is 5,056 bytes, held in memory on a CPU) are let go once every
        replayed storage has had its last unpack (R9): no replay can need them after that, and one that did would
        fail loudly. A random op whose arguments make its draws irrelevant (dropout at p=0, the CPU's attention at
        ``dropout_p`` 0) keeps no state and is replayed with the random state forked, so a second backward
        (``retain_graph=True``) replays it too. The simulator counts none of the states (at most a few per block).
    R7. Compress (Rule 8): at the first pack, a cast to the policy's dtype (inside the op where an op saves its
        own output); at the first unpack, a cast back, after which the cast copy goes (Rule 8: held at that
        unpack only). Lossy, allowed only by the policy's ``lossy`` option.
    R8. Compress and swap apply to what the simulator says they do: compress only to floating-point
        tensors wider than the target dtype (others are kept, as envs.simulator treats them).
    R9. A handle drops its device copy after the last unpack of its storage (the pack count of the
        forward), so the memory lives until the last backward node that needs it is done, as when kept (on the
        CPU a swap's copy, the only one, goes with it). A later replay that reads the storage after that re-makes
        it as a temporary (R6).
    R10. Regions (Rule 11; NOTE [ Recompute mechanisms ] in runtime/plan.py): a module call that the policy's
        schedule lists as a region runs as one autograd node (runtime/regions.py, NOTE [ Regions without a graph ]):
        its forward records no graph, its backward re-runs the call (the RNG state preserved only where it draws
        random numbers) and differentiates it, with no Python per op or per saved tensor. The call's first step runs
        under ``torch.utils.checkpoint`` (non-reentrant, no determinism check), which learns the leaves the call
        reads (N4); a call the node cannot carry stays there. So does the call in any step that learns (R11): the
        keys of the call's outputs where later modules save them name the op that made them, which a node would
        stand in for. Under checkpoint a tensor passed at several places of the call is one object in the
        recompute, as in the forward (:func:`_aliased`; the node does the same, N1). The runtime's own hooks are
        suspended during the call, so the node's saved inputs are kept
        (they are, by P4). During the recompute BatchNorm runs with momentum 0, which rewrites its running
        statistics with their own values, exactly, and its step count is taken back in place where the recompute ran it
        in training mode (a frozen BatchNorm counts nothing; its mode may change between steps or inside the
        forward): they are updated once, as in plain training, and nothing is allocated. In a first step the keyer
        names the call's inputs and outputs that the trace first saw packed inside it. A call whose modules hold
        other tensors in their parameters' places than the leaves it learnt (``torch.func.functional_call``) runs
        under checkpoint, and the recompute, in backward, after functional_call has put the module's own back,
        reads the tensors the forward read: they are put in those places for it (:func:`_as_in_forward`).
    R11. Scope. The first step runs as R1 says, with hooks on every pack, the keyer's module hooks and, when
        anything is replayed, the recorder over the whole forward; it learns each pack's module call (frame) and
        key. From the second step on, saved-tensor hooks are entered only in the module calls that hold a pack of a
        tensor swapped, compressed or replayed, or of a prefetch trigger (R4), and stay on inside them; ``<loss>``
        is what runs after the model's forward; module calls count from the step's start (NOTE [ Key format ]), so a
        model called again before backward (a siamese or contrastive loss) has calls of its own, and ``<loss>``'s
        hooks are set aside while such a later call runs. What a step learns is kept per signature of the model's
        first call (the shapes, dtypes and devices of its tensor arguments, its flags, the model's training mode;
        the last 16 signatures; a call without grad, a forward for pseudo-labels inside the step, saves nothing and
        is not the step's: not its first call, and not counted among its module calls or its regions'): a step
        starts with the last step's tables and, at that call, if its inputs differ and nothing was packed yet, goes
        on with the tables learnt for them or learns from there (the keyer's hooks and the recorder entered inside
        the call, the hooks of the model's own call entered by hand; the hooks of the mode it leaves, which PyTorch
        gathered for that call already, do nothing). A DataLoader's smaller last batch, or a sequence length that
        changes with padding, so learns once and then applies the policy as a step of the planned shape does (inputs
        larger than the policy's batch, sequence length or image size, read from the model's first tensor argument,
        warn once: the plan's memory does not hold them). Each
        pack is looked up in its call's table by its ordinal there and checked by shape and dtype (and, for a later
        pack of a handled tensor, by storage); a mismatch keeps that tensor and every later one of the step, warns
        once, and the next step with these inputs learns again. A step is learnt from only when it saved something
        for backward and its backward unpacked it inside the step: a forward under ``torch.no_grad`` (a validation
        pass) or one whose backward is skipped (a loss not used) leaves the learning to the next step; a replayed
        tensor that it never unpacked (a branch whose output the loss does not use), or whose storage was still
        alive at its first unpack (held by other than autograd: a custom Function's ``ctx`` attribute; plan P11), is
        learnt as kept, since no replay re-ran its producers for later steps to record. The recorder is entered only
        in the calls whose ops a replay re-ran. Entered for ``<loss>``, it leaves at the first pack there after the
        last op a replay re-ran (the first step tells which), still in forward, so that backward's ops do not pass
        through it (a Python call each); without such a pack, at the step's end. It is also entered in the calls
        that write in place, after a replayed op read it, a storage that op read (a buffer updated after its use, an
        EMA), so that the replay reads it as it was (R6). Never inside backward: backward runs each node under the
        thread-local state captured when it began, so a mode popped inside it is back on the stack when it returns.
        An all-keep policy, or one that only recomputes through regions, installs no saved-tensor hooks at all.
    R12. The model. A policy records its model's parameters by name and shape
        (runtime.keys.parameter_fingerprint); a model with other ones is refused when the runtime is made,
        before anything runs, unless ``strict=False`` (the keys that still match are then applied, the
        others kept and reported, R1).
    R13. Partition (Rule 14; NOTE [ Partition ] in runtime/partition.py). For the step, each submodule the
        policy partitions runs its forward once per slice of the batch, outputs concatenated, as when its
        workload was traced: the keys, ops and backward order are the trace's. Only with the policy's
        ``allow_partition`` option (runtime.policy refuses the file otherwise).
    R14. Shared parameters (Rule 15; NOTE [ Shared parameters' gradients ] in runtime/shared_grads.py). For
        the step, the gradients of a parameter that several modules hold (a tied embedding) are summed where
        PyTorch would make their sum in a new tensor, in place into the one that arrives last, when nothing
        else holds it: the same bits, one buffer of the parameter's size less at that op. With any policy,
        keep-all included; nothing per op.
    R15. Library workspaces (NOTE [ GPU-faithful fake traces ] G6 in runtime/target.py, which the simulator's
        plan holds as two persistent tensors). On CUDA, before its first step in the process, the runtime has
        cuBLAS allocate the workspaces of both handles training uses (a product of 8 x 8 matrices, forward
        and backward): a persistent block allocated mid-step lands in a cached block of the step's own tensors
        and splits it for good, so a later step's large tensor (GPT-2's logits) needs a segment more.
    R16. A model that checkpoints its own layers (Hugging Face's ``gradient_checkpointing``) is refused at its
        first step under a policy that hooks or has regions: the model's recompute would re-run them. So is one
        whose code calls ``torch.utils.checkpoint`` itself, when its recompute runs a module's forward in that
        step's backward outside the policy's regions (reentrant, it had left BatchNorm's statistics other than
        plain training's, without a word).
    R17. Autocast around forward and backward (``loss.backward()`` inside it). Its cache of the parameters'
        casts would hold them through backward, where the trace's autocast (runtime.precision: around the
        forward, as PyTorch's recipes put it) let go of it after the forward: a swapped or recomputed cast
        freed nothing, and a recomputed one was still alive at its unpack, so the step that learnt never
        replayed it and later steps did not record where it is made (R11: they kept and learnt again every
        other step). At the step's first unpack the runtime clears the cache: the casts live as saved tensors
        only, as traced, and a later use casts again (the same bits).
    R18. What a step installs on the model's modules (forward hooks, the forwards of regions and partitions:
        runtime/step_only.py) is the step's alone: a copy made inside the step (``copy.deepcopy``, an EMA
        model made at the first step) gets none of it, and pickling the model there is refused with the way
        out. A deep copy had kept them, bound to the original: it computed with the original's weights.
    R19. Entered again inside its own step (a ``train_step`` helper that applies the policy, called inside a
        loop that applies it too), a runtime does nothing more: the outer step is the step. Another policy's
        runtime on the same model inside a step is refused, and so is one on another model in the same thread
        (saved-tensor hooks are the thread's: each runtime would see the other model's packs as its own).
    R20. Accumulation. A policy is planned for ``grad_accum`` micro-batches per optimizer step (the gradients
        held through the later ones' forwards). A plain loop does not say how many it runs, so the runtime counts
        them: a step that starts with the first trainable parameter's gradient unset (``zero_grad()``'s default)
        begins an optimizer step's run. When two runs in a row have the same length and it is not the policy's,
        it warns once (one short run is a loader's last batches). A loop that zeroes in place
        (``set_to_none=False``) is not counted. The integrations check the trainer's setting instead.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode, _pop_mode_temporarily
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint
from torch.utils.weak import WeakIdKeyDictionary

from runtime.errors import AutotuneError
from runtime.keys import OUTSIDE, ROOT, SavedTensorKeyer, parameter_fingerprint
from runtime.partition import partitioned
from runtime.plan import Region
from runtime.policy import Action, Policy, some_keys
from runtime.precision import check_active
from runtime.regions import Learning, parameter_places, sequence_mark, substituted
from runtime.regions import run as run_region
from runtime.replay import Frame, Recorder, Replayer, view_of
from runtime.shared_grads import SharedGradients
from runtime.step_only import StepHook, step_forward
from runtime.target import allocate_library_workspaces
from runtime.vocab import compressible

_COMPRESS_DTYPES = {"bfloat16": torch.bfloat16, "float8_e4m3fn": getattr(torch, "float8_e4m3fn", torch.bfloat16)}
_LOSS: Frame = (OUTSIDE, 0)  # what runs outside the model after its forward (R11)
_BEFORE: Frame = ("<before>", 0)  # ... and before it (rare: a loss function's work on the batch)
_PUSH_HOOKS = torch._C._autograd._push_saved_tensors_default_hooks
_POP_HOOKS = torch._C._autograd._pop_saved_tensors_default_hooks


# -- handles -------------------------------------------------------------------------------------------------
@dataclass
class _Handle:
    """One storage packed under a non-keep action (R3-R9)."""

    key: str
    action: Action
    nbytes: int
    rank: int
    ref: weakref.ref[torch.UntypedStorage]  # the storage packed (R11's check)
    sid: int | None = None  # recorder storage id (replay)
    packs: int = 0
    unpacks: int = 0
    host: torch.Tensor | None = None  # swap: bytes in host memory
    d2h_done: Any = None
    h2d_done: Any = None
    packed: torch.Tensor | None = None  # compress: the cast copy
    device: torch.UntypedStorage | None = None  # the storage back on the device
    issued: bool = False
    leaving: torch.Tensor | None = None  # swap on CUDA: the device bytes until the release point (R3)
    release_at: int = 0  # the pack point at which it lets them go
    version: int = 0  # the storage's version when copied (swap) or cast (compress): R3, R7
    views: list[tuple[torch.dtype, tuple[int, ...], tuple[int, ...], int]] = field(default_factory=list)
    unpacked: bool = False  # unpacked once in this step
    held_outside: bool = False  # recompute: alive at its first unpack, held by other than autograd (R11, P11)


@dataclass
class _Packed:
    handle: _Handle
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@dataclass
class _Kept:
    """A kept tensor whose unpack is a prefetch trigger (R4)."""

    tensor: torch.Tensor
    rank: int


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),), (1,))


@dataclass
class RuntimeStats:
    """What one step did, for reports and tests."""

    packs: int = 0  # packs the runtime's hooks saw (every pack in a first step, R11)
    hooked_calls: int = 0  # module calls whose hooks ran (later steps, R11)
    swapped_bytes: int = 0
    swaps: int = 0
    recorded_ops: int = 0  # forward ops the recorder ran under (R6)
    recomputed_ops: int = 0  # ops replayed (R6)
    regions: int = 0  # module calls run as regions (R10)
    checkpointed: int = 0  # ... of which under torch.utils.checkpoint (a region's first step, or for good: N4)
    compressed_bytes: int = 0
    unknown_keys: list[str] = field(default_factory=list)


# -- what the first step learns (R11) ------------------------------------------------------------------------
@dataclass
class _Logged:
    """One pack of the first step."""

    stack: tuple[Frame, ...]  # module calls running, outermost first; () outside the model
    after_root: bool  # outside the model: after its forward (the only ``<loss>`` later steps observe)
    key: str | None
    action: Action | None  # what the pack did: None for keep
    point: bool  # the first pack of a candidate: a pack point (R3)
    trigger: bool  # a kept tensor whose unpack triggers prefetches (R4)
    shape: torch.Size
    dtype: torch.dtype
    recorded: int  # ops the recorder had recorded when this pack came (0 without one)


@dataclass(frozen=True)
class _Entry:
    """What a later step does with one pack of one module call (R11)."""

    key: str | None
    action: Action | None
    point: bool
    trigger: bool
    shape: torch.Size
    dtype: torch.dtype


@dataclass
class _Learned:
    tables: dict[Frame, list[_Entry]]  # the hooked module calls and their packs in order
    record: set[Frame]  # the module calls the recorder runs in
    modules: list[str]  # module paths that need hooks
    forced: bool
    loss_done: int | None = None  # the ``<loss>`` pack after which the recorder has recorded all a replay needs


_LEARNT_INPUTS = 16  # R11: tables kept for this many input signatures, the least recently used dropped


def signature(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """What the saved tensors of a step depend on, as far as the model's first call shows it (R11): each
    tensor argument's shape, dtype and device, each flag's value (bool, str, None), other values' types
    (a step counter passed as an int does not make every step new), the keyword names."""
    out: list[Any] = [tuple(kwargs)]

    def add(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            out.append((tuple(value.shape), value.dtype, value.device, value.requires_grad))
        elif value is None or isinstance(value, (bool, str)):
            out.append(value)
        elif isinstance(value, Mapping):  # what pytree leaves whole (transformers' BatchEncoding)
            out.append(tuple(value))
            for v in value.values():
                add(v)
        else:
            out.append(type(value))

    for leaf in tree_leaves((args, kwargs)):
        add(leaf)
    return tuple(out)


@dataclass
class _Table:
    entries: list[_Entry]
    pos: int = 0
    done_at: int | None = None  # after this pack, ``on_done`` (``<loss>``: the recorder leaves, R11)
    on_done: Callable[[], None] | None = None


class PolicyRuntime:
    """Applies one policy to one model, step after step (NOTE [ Runtime mechanics ])."""

    def __init__(self, policy: Policy, model: torch.nn.Module, *, strict: bool = True) -> None:
        if strict:
            check_model(policy, model)
        self.policy = policy
        self.model = model
        self.device = next(iter(model.parameters())).device
        self.keyer = SavedTensorKeyer(model)
        schedule = policy.schedule
        self.ignored = set(schedule.ignored_keys) if schedule else set()
        self.lookahead = policy.options.prefetch_lookahead
        self.release_after = policy.options.release_after
        self.compress_dtype = _COMPRESS_DTYPES[policy.options.compress_dtype]
        self.regions = self._usable_regions(schedule.regions if schedule else [])
        self.shared = SharedGradients(model)  # R14
        served = {k for r in self.regions.values() for k in r.keys}
        per_tensor = {k: a for k, a in policy.actions.items() if a != Action.KEEP and k not in served}
        self.needs_hooks = bool(per_tensor)
        self.needs_recorder = any(a == Action.RECOMPUTE for a in per_tensor.values())
        # R4: ranks among the unpack points of the tensors no region serves.
        ranks = {k: r for k, r in (schedule.unpack_rank if schedule else {}).items() if k not in served}
        dense = {r: i for i, r in enumerate(sorted(set(ranks.values())))}
        self.ranks = {k: dense[r] for k, r in ranks.items()}
        swapped = [k for k, a in per_tensor.items() if a == Action.SWAP]
        # No copy back on the CPU (R3): nothing to prefetch.
        self.needs_triggers = bool(swapped) and self.lookahead > 0 and self.device.type == "cuda"
        due = {max(0, self.ranks[k] - self.lookahead) for k in swapped if k in self.ranks}
        self.carriers = {k for k, r in self.ranks.items() if r in due} if self.needs_triggers else set()
        self.observed = set(per_tensor) | self.carriers  # keys whose packs later steps must see (R11)
        self._learned: collections.OrderedDict[tuple[Any, ...] | None, _Learned] = collections.OrderedDict()
        self._inputs: tuple[Any, ...] | None = None  # the signature of the last step's inputs (R11)
        self._own_checkpointing_checked = False  # R16
        self._pinned: dict[str, torch.Tensor] = {}  # R3: one pinned buffer per key, reused
        self._cuda = self.device.type == "cuda"
        if self._cuda:
            self._d2h = torch.cuda.Stream(self.device)
            self._h2d = torch.cuda.Stream(self.device)
        self._reported: set[str] = set()
        self._warned_no_backward = False
        self._recorder: Recorder | None = None
        self._suspended = 0
        self._keying = False  # a first step is running (R11)
        self._wrappers: list[tuple[torch.nn.Module, Callable[..., Any]]] | None = None  # R10, made at first use
        self._region_calls: dict[str, int] = {}
        self._leaves: dict[Frame, list[torch.Tensor] | None] = {}  # R10: learnt in a region's first step
        self._places: dict[Frame, list[list[tuple[dict[str, Any], str]]]] = {}  # R10: where the leaves are held
        # R10: per region call, its output views (a weakref, the version, its node, the node it was taken from), and
        # the sequence number the nodes made after the call start from
        self._views: list[tuple[Frame, list[tuple[weakref.ref[torch.Tensor], int, Any, Any]], int]] = []
        self._views_hook: torch.utils.hooks.RemovableHandle | None = None
        self._double = False  # a backward with create_graph=True reached a node (R10: checkpoint from then on)
        self._parameters: frozenset[int] = frozenset()  # the trainable parameters the leaves were learnt with
        self._step_thread = -1  # the thread of its step (R19)
        self._micro = 0  # R20: steps since gradients were last unset (0: not counted)
        self._runs: list[int] = []  # R20: the last runs' lengths
        self._said_accum = False
        self._said_size = False  # R11: inputs larger than planned, said once
        self._recomputing = 0  # regions recomputing in backward now (R16)
        self.stats = RuntimeStats()
        self._ran: set[Frame] = set()  # the regions this step ran: their keys are served (said in _say_unknown)

    def _usable_regions(self, regions: list[Region]) -> dict[Frame, Region]:
        """The schedule's regions whose keys the actions still recompute (a hand-edited file may not)."""
        modules = dict(self.model.named_modules())
        out: dict[Frame, Region] = {}
        for r in regions:
            if r.module in modules and all(self.policy.actions.get(k) == Action.RECOMPUTE for k in r.keys):
                out[(r.module, r.call)] = r
            else:
                warnings.warn(
                    f"autotune: region {r.module}#{r.call} of the policy does not match its actions or the model; "
                    "its tensors are replayed instead (R6)",
                    stacklevel=3,
                )
        return out

    # -- the step ------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def step(self, force_hooks: bool = False) -> Iterator[RuntimeStats]:
        """One forward and its backward under the policy. ``force_hooks`` observes every pack from the
        second step on, keep included (to measure the hooks' cost)."""
        active = _active.get(self.model)
        if active is self:  # R19: entered again inside its own step
            yield self.stats
            return
        if active is not None:
            raise AutotuneError(
                f"another policy ({active.policy.provenance.searcher}, for {active.policy.model}) is already applied "
                "to this model in this step: apply one policy per step"
            )
        here = threading.get_ident()
        other = next((rt for rt in list(_active.values()) if rt._step_thread == here), None)
        if other is not None:
            raise AutotuneError(
                f"a policy (for {other.policy.model}) is already applied to another model in this step, and this "
                f"one (for {self.policy.model}) cannot apply inside it (each would see the other's saved tensors): run "
                "each model's forward and backward in a step of its own (a GAN's discriminator step, then its "
                "generator step), or wrap both models in one nn.Module and search one policy for it"
            )
        self._step_thread = here
        _active[self.model] = self
        self._count_micro_batch()
        try:
            with self._step(force_hooks) as stats:
                yield stats
        finally:
            del _active[self.model]

    def _check_planned_size(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """R11: inputs larger than the policy's (a larger batch, longer sequences, larger images: read from the
        model's first tensor argument) learn and apply it as any, but its memory plan does not hold them; said
        once (it ran without a word, a QA run). Smaller ones (a loader's last batch) are within the plan."""
        if self._said_size:
            return
        x = next((t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.dim() > 0), None)
        if x is None:
            return
        p, shape = self.policy, tuple(x.shape)
        larger = [f"batch {shape[0]} (planned {p.batch_size})"] if shape[0] > p.batch_size else []
        if p.seq_len is not None and len(shape) == 2 and shape[1] > p.seq_len:
            larger.append(f"sequence length {shape[1]} (planned {p.seq_len})")
        if p.image_size is not None and len(shape) == 4 and max(shape[2:]) > p.image_size:
            larger.append(f"images of {shape[2]} x {shape[3]} (planned {p.image_size})")
        if larger:
            self._said_size = True
            warnings.warn(
                f"autotune: the policy for {p.model} applied to larger inputs than it was planned for: "
                f"{', '.join(larger)}; it applies, but the step holds more memory than its plan (R11): search one "
                "for these sizes",
                stacklevel=2,
            )

    def _count_micro_batch(self) -> None:
        """R20: count this step in its optimizer step's run, and warn once where the loop accumulates another
        number of micro-batches than the policy was planned for."""
        if self._said_accum or not torch.is_grad_enabled():
            return
        first = next((p for p in self.model.parameters() if p.requires_grad), None)
        if first is None:
            return
        if first.grad is not None:  # a later micro-batch of the run being counted (none before the first reset)
            if self._micro:
                self._micro += 1
            return
        if self._micro:
            self._runs = [*self._runs[-1:], self._micro]
        self._micro = 1
        k = self.policy.grad_accum
        if len(self._runs) == 2 and self._runs[0] == self._runs[1] != k:
            self._said_accum = True
            n = self._runs[1]
            warnings.warn(
                f"autotune: the policy for {self.policy.model} was planned for {k} micro-batch"
                f"{'es' if k != 1 else ''} per optimizer step, and this loop runs {n} between gradient resets: "
                "its memory plan holds the gradients through another number of forwards (R20); search one for "
                f"this loop, `autotune search --grad-accum {n}`",
                stacklevel=4,
            )

    @contextlib.contextmanager
    def _step(self, force_hooks: bool) -> Iterator[RuntimeStats]:
        self.stats = RuntimeStats()
        self._ran = set()
        allocate_library_workspaces(self.device)  # R15
        with self._precision_checked(), partitioned(self.model, self.policy.partitions), self.shared.installed():
            hooks = self.needs_hooks or force_hooks
            if not (hooks or self.regions):
                yield self.stats
                return
            self._check_own_checkpointing()
            # Parameters replaced (load_state_dict(assign=True)), frozen or unfrozen: learn again, the regions'
            # leaves (N5) and the tables (R11: a frozen layer saves other tensors, and a replayed chain reads
            # what it no longer keeps; the tables of before failed in backward, "no recorded producer").
            trainable = frozenset(id(p) for p in self.model.parameters() if p.requires_grad)
            if trainable != self._parameters:
                if self._parameters:
                    self._learned.clear()
                self._leaves.clear()
                self._places.clear()
                self._parameters = trainable
            with self._regions_installed():
                if not hooks:
                    yield self.stats
                else:
                    with self._backward_without_recorder(), self._hooked(force_hooks):
                        yield self.stats

    @contextlib.contextmanager
    def _backward_without_recorder(self) -> Iterator[None]:
        """R6: ``torch.autograd.backward`` and ``torch.autograd.grad`` (``loss.backward()`` calls the former)
        called during the step run with the recorder off the dispatch-mode stack, put back when they return.
        Backward runs with the modes that were on the stack at the call, and some of PyTorch's backward formulas
        take another path while any dispatch mode is on (``prod``'s, ``areAnyTensorSubclassLike``): gradients
        differed from plain training in the last bits (3.7e-9) under any policy that recomputed. As in
        ``_without_recorder``, only where the recorder is the innermost mode."""
        if not self.needs_recorder:
            yield
            return
        originals = torch.autograd.backward, torch.autograd.grad

        def outside(f: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(f)
            def run(*args: Any, **kwargs: Any) -> Any:
                rec = self._recorder
                if rec is not None and _get_current_dispatch_mode() is rec:
                    with _pop_mode_temporarily():
                        return f(*args, **kwargs)
                return f(*args, **kwargs)

            return run

        torch.autograd.backward, torch.autograd.grad = (outside(f) for f in originals)  # type: ignore[assignment]
        try:
            yield
        finally:
            torch.autograd.backward, torch.autograd.grad = originals  # type: ignore[assignment]

    def _check_own_checkpointing(self) -> None:
        """R16: refuse a model that checkpoints its own layers (Hugging Face's ``gradient_checkpointing_enable``,
        ``TrainingArguments(gradient_checkpointing=True)``): its recompute re-runs the policy's regions and
        hooks, which count calls and packs per step, so the recompute saves other tensors than its forward did
        and torch's checkpoint fails in backward."""
        if not self._own_checkpointing_checked:  # at the first step: enabled before training, as the Trainer does
            self._own_checkpointing_checked = True
            if any(getattr(m, "gradient_checkpointing", False) is True for m in self.model.modules()):
                raise AutotuneError(
                    "the model checkpoints its own layers (gradient_checkpointing_enable(), or the Trainer's "
                    "gradient_checkpointing=True): turn that off, the policy decides what to recompute (search "
                    "with it off too); a policy and the model's own checkpointing cannot both recompute its layers"
                )

    def _called_in_backward(self, path: str) -> None:
        """R16: a module of the model runs its forward with grad inside backward, and not in one of the policy's
        regions: the model's own checkpoint (``torch.utils.checkpoint`` in its code) recomputes it."""
        if self._recomputing:
            return
        raise AutotuneError(
            f"the model checkpoints part of its own forward: module '{path}' ran again in backward (torch.utils."
            "checkpoint in the model's code); remove that checkpoint, the policy decides what to recompute (search "
            "without it too): a policy and the model's own checkpointing cannot both recompute its layers"
        )

    def _learnt(self, inputs: tuple[Any, ...] | None, force: bool) -> _Learned | None:
        learned = self._learned.get(inputs)
        if learned is None or learned.forced != force:
            return None
        self._learned.move_to_end(inputs)
        return learned

    def _latest(self, force: bool) -> _Learned | None:
        """The tables learnt for the last step's inputs, else the ones used last (a validation pass of another
        shape ran in between), else none: the step learns. ``_inputs`` names the ones returned."""
        learned = self._learnt(self._inputs, force)
        if learned is None:
            self._inputs = next((i for i, v in reversed(self._learned.items()) if v.forced == force), self._inputs)
            learned = self._learnt(self._inputs, force)
        return learned

    @contextlib.contextmanager
    def _hooked(self, force: bool) -> Iterator[None]:
        """R11: the step applies what a step with the same inputs learnt, or learns. Which inputs is known at
        the model's first call: the step starts as for the last step's inputs (so it sees a pack before that
        call) and, when the call's inputs differ and nothing was packed yet, goes on from there with the tables
        learnt for them, or learns."""
        mode = contextlib.ExitStack()
        steady = self._latest(force)
        seen = False

        def first_call(_m: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            nonlocal seen
            if self._without_grad():  # a forward without grad (pseudo-labels, a teacher) saves nothing
                return
            if seen:
                if self._unpacked and torch.is_grad_enabled():
                    # One step is one forward and its backward: a forward after the step's backward (several
                    # micro-batches inside one ``applied``) packs against what the first has used up, and its
                    # backward failed ("cannot recompute a saved tensor").
                    raise AutotuneError(
                        "policy.applied(model) covers one forward and its backward: the model was called again "
                        "after this step's backward; enter it once per step (for gradient accumulation, once per "
                        "micro-batch)"
                    )
                return
            seen = True
            inputs = (self.model.training, *signature(args, kwargs))  # eval-mode steps with backward (PGD) save others
            if inputs == self._inputs:
                return
            self._inputs = inputs
            self._check_planned_size(args, kwargs)
            if steady is not None and self.stats.packs == 0:
                mode.close()
                other = self._learnt(inputs, force)
                mode.enter_context(self._steady(other, started=True) if other else self._learning(force, True))

        hook = self.model.register_forward_pre_hook(StepHook(first_call), with_kwargs=True, prepend=True)
        try:
            with mode:
                mode.enter_context(self._steady(steady) if steady is not None else self._learning(force))
                yield
        finally:
            hook.remove()

    @contextlib.contextmanager
    def _precision_checked(self) -> Iterator[None]:
        """At the step's first call of one of the model's submodules (the model itself when it has none),
        refuse a forward in another precision than the policy's (NOTE [ Precision ] in runtime.precision):
        one global pre-hook that removes itself. Not at the model's own call: accelerate's ``prepare`` (and
        so the Hugging Face Trainer) puts a forward on the model that enters autocast, which runs after the
        model's pre-hooks, before its submodules'."""
        handle: torch.utils.hooks.RemovableHandle | None = None
        below = {id(m) for m in self.model.modules() if m is not self.model} or {id(self.model)}

        def hook(module: torch.nn.Module, _args: Any) -> None:
            if id(module) not in below:
                return
            assert handle is not None
            handle.remove()
            check_active(self.policy.precision, self.device.type)

        handle = torch.nn.modules.module.register_module_forward_pre_hook(hook)
        try:
            yield
        finally:
            handle.remove()

    def _begin_step(self) -> None:
        self._by_storage: WeakIdKeyDictionary = WeakIdKeyDictionary()  # storage -> _Handle (first step)
        self._by_key: dict[str, _Handle] = {}  # key -> _Handle (later steps)
        self._handles: list[_Handle] = []  # every handle of this step
        self._by_sid: dict[int, _Handle] = {}  # recorder storage id -> handle (replay)
        self._swapped: list[_Handle] = []  # in rank order once sorted (R4)
        self._next_fetch = 0
        self._leaving: collections.deque[_Handle] = collections.deque()  # device bytes held to a release point
        self._points = 0  # pack points so far (R3)
        self._suspended = 0
        self._mismatch: str | None = None
        self._unpacked = False  # backward unpacked something (R11: a step without backward teaches nothing)
        self._replays_open = 0  # replayed handles not yet past their last unpack (R6: then the RNG states go)
        self._region_saves: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor -> its one detached copy (R10)

    def _end_step(self) -> None:
        self._views_checked()  # a forward that raised before its end: not known, so under checkpoint
        for h in self._leaving:  # a forward without backward: nothing waits for these any more
            h.leaving = None
        self._leaving.clear()
        if self._recorder is not None:
            self.stats.recorded_ops = len(self._recorder.ops)
        self._recorder = None
        self._handles = []
        self._by_sid = {}
        self._by_key = {}
        self._swapped = []

    # -- R10: regions --------------------------------------------------------------------------------------
    def _module(self, path: str) -> torch.nn.Module:
        return self.model if path == ROOT else self.model.get_submodule(path)

    @contextlib.contextmanager
    def _regions_installed(self) -> Iterator[None]:
        """For this step, the forward of each region's module goes through :meth:`_region_forward` (the
        wrappers are made once; installing one is a dict entry, not ``nn.Module.__setattr__``)."""
        if self._wrappers is None:
            self._wrappers = []
            for path in sorted({path for path, _ in self.regions}):
                mod = self._module(path)
                self._wrappers.append((mod, self._region_forward(mod, path, mod.forward)))
        self._region_calls.clear()
        installed: list[tuple[torch.nn.Module, Any]] = []
        for mod, wrapper in self._wrappers:
            own = mod.__dict__.get("forward")  # an instance attribute already there stays
            installed.append((mod, own))
            mod.__dict__["forward"] = step_forward(wrapper, mod, own)  # R18
        try:
            yield
        finally:
            for mod, own in installed:
                if own is None:
                    del mod.__dict__["forward"]
                else:
                    mod.__dict__["forward"] = own

    def _region_forward(self, mod: torch.nn.Module, path: str, forward: Callable[..., Any]) -> Callable[..., Any]:
        # Every BatchNorm that tracks statistics, in training mode or not: the mode can change between steps, or
        # inside a forward (a frozen BatchNorm), and only the recompute's own run says whether it counted a step.
        norm = [
            m.__dict__
            for m in mod.modules()
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.track_running_stats
        ]
        tables = [m._parameters for m in mod.modules() if m._parameters]  # R10: what the call reads as parameters
        calls = self._region_calls

        def recomputable(*args: Any, **kwargs: Any) -> Any:
            if torch._C._current_graph_task_id() == -1:
                return forward(*args, **kwargs)  # the forward itself
            self._recomputing += 1  # R16: the module calls it makes in backward are the runtime's
            try:
                return recompute(*args, **kwargs)
            finally:
                self._recomputing -= 1

        def recompute(*args: Any, **kwargs: Any) -> Any:
            if not norm:
                return forward(*args, **kwargs)
            # The recompute, in backward: with momentum 0 BatchNorm rewrites its running statistics with
            # their own values (x (1 - 0) + 0 m = x, exactly), and its step count is taken back in place where
            # the recompute ran it in training mode (it counted one; in eval mode it updates nothing). Nothing
            # is allocated, so the recompute holds no more memory than checkpoint's own.
            momenta = [m["momentum"] for m in norm]
            for m in norm:
                m["momentum"] = 0.0
            try:
                return forward(*args, **kwargs)
            finally:
                for m, momentum in zip(norm, momenta, strict=True):
                    m["momentum"] = momentum
                    count = m["_buffers"].get("num_batches_tracked")
                    if count is not None and m["training"]:
                        count.sub_(1)  # a buffer: no autograd

        def region_forward(*args: Any, **kwargs: Any) -> Any:
            if self._without_grad():  # a forward without grad (pseudo-labels) is not the step's: not counted
                return forward(*args, **kwargs)
            call = calls.get(path, 0)
            calls[path] = call + 1
            region = self.regions.get((path, call))
            if region is None or not torch.is_grad_enabled():  # (no grad: inside a region run as a node)
                return forward(*args, **kwargs)
            self.stats.regions += 1
            self._suspended += 1
            frame = (path, call)
            self._ran.add(frame)
            try:
                # Once a backward that builds a graph (create_graph=True: a gradient penalty) has reached a node,
                # the regions run under checkpoint for good (N2: a node's double backward sums otherwise).
                nodes = self.policy.options.region_nodes and not self._double
                known = frame in self._leaves
                # None: under checkpoint (N4), as in any step that learns (R11): the keys of what the call's
                # outputs are saved as name the op that made them, which a node would stand in for.
                leaves = self._leaves[frame] if nodes and known and not self._keying else None
                if leaves is not None and not _held(leaves, self._places[frame]):
                    leaves = None  # another tensor in a parameter's place (torch.func.functional_call): checkpoint
                if leaves is not None:
                    out = run_region(recomputable, args, kwargs, leaves, region.rng, self.device.type,
                                     on_double=self._double_backward, places=self._places[frame])  # fmt: skip
                else:
                    learning = Learning(args, kwargs) if nodes and not known else None
                    self.stats.checkpointed += 1
                    out = checkpoint(
                        _aliased(_as_in_forward(recomputable, tables), args, kwargs),
                        *args,
                        use_reentrant=False,
                        preserve_rng_state=region.rng,
                        determinism_check="none",
                        **kwargs,
                    )
                    if learning is not None:
                        own = {id(p) for p in mod.parameters() if p.requires_grad}
                        self._leaves[frame] = leaves = learning.leaves(out, self._parameters, own)
                        self._places[frame] = parameter_places(self.model, leaves or [])
                        if leaves is not None:
                            self._watch_views(frame, out)
            finally:
                self._suspended -= 1
            if self._keying:  # the first step's keyer names what the trace saw packed inside
                self._name(region.inputs, (args, kwargs))
                self._name(region.outputs, out.values() if isinstance(out, dict) else out)
            return out

        return region_forward

    def _watch_views(self, frame: Frame, out: Any) -> None:
        """R10: the views a region's first step returned, checked when the model's forward ends: one written in
        place after the call keeps the call under checkpoint (regions N4, plan P10). A view still alive then says
        so by its version; one gone by then (nothing saved it: a Linear's output on a 3-D input, which dropout
        reads) by the graph: an in-place write into a view makes a node (``CopySlices``) that reads the node the
        view was taken from, which no later node reads otherwise (its other readers read the view's own node).
        The nodes are held to the check, not the view (their saved tensors are checkpoint's, in this step)."""
        views = [o for o in tree_leaves(out) if isinstance(o, torch.Tensor) and o._is_view()]
        if not views:
            return
        after = sequence_mark()  # the nodes the forward makes after the call are numbered from here
        watched = []
        for v in views:
            node = v.grad_fn
            base = node.next_functions[0][0] if node is not None and node.next_functions else None
            watched.append((weakref.ref(v), v._version, node, base))
        self._views.append((frame, watched, after))
        if self._views_hook is None:
            self._views_hook = self.model.register_forward_hook(StepHook(self._views_checked), always_call=True)

    def _views_checked(self, *hook: Any) -> None:
        output = hook[2] if len(hook) > 2 else None  # (module, args, output); none where the forward raised
        readers: dict[Any, list[Any]] | None = None  # the graph from the forward's outputs: node -> nodes reading it
        for frame, views, after in self._views:
            for ref, version, node, base in views:
                v = ref()
                if v is not None:
                    written = v._version != version
                elif base is None or output is None:
                    written = True  # gone, and no graph to tell: not known
                else:
                    readers = _readers_of(output) if readers is None else readers
                    # Not reached from the outputs: not known. Else a node made after the call reads its base.
                    written = base not in readers or any(
                        r is not node and r._sequence_nr() >= after for r in readers[base]
                    )
                if written:
                    self._leaves[frame] = None  # written in place after the call (or not known): under checkpoint
        self._views.clear()
        if self._views_hook is not None:
            self._views_hook.remove()
            self._views_hook = None

    def _without_grad(self) -> bool:
        """A module call the user made without grad (R11: not the step's). Inside a region run as one node the
        forward has no grad too (N1), the runtime's own doing: those calls are the step's."""
        return not torch.is_grad_enabled() and not self._suspended

    def _double_backward(self) -> None:
        """R10: a backward with create_graph=True reached a region run as one node. Its gradients are plain
        training's to rounding in this step (the node's second-order terms sum in another order); from the
        next step on the regions run under torch.utils.checkpoint, which gives plain training's bits."""
        if not self._double:
            self._double = True
            warnings.warn(
                "autotune: a backward with create_graph=True (a gradient penalty, a double backward) reached a "
                "region run as one autograd node: this step's gradients match plain training's to rounding; "
                "from the next step the regions run under torch.utils.checkpoint, bit for bit (set "
                '"region_nodes": false in the policy\'s options to start so)',
                stacklevel=2,
            )

    def _name(self, named: list[tuple[int, str]], values: Any) -> None:
        if not named:
            return
        tensors = [t for t in tree_leaves(values) if isinstance(t, torch.Tensor)]
        for pos, key in named:
            if pos < len(tensors):
                self.keyer.assign(tensors[pos], key)

    # -- R11: the first step -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _learning(self, force: bool, started: bool = False) -> Iterator[None]:
        """``started``: from inside the model's first call, whose pre-hooks have run (R11)."""
        self._begin_step()
        log: list[_Logged] = []
        self._log = log
        self._after_root = False
        keyer = self.keyer

        def frame_of() -> Frame:
            return keyer._stack[-1] if keyer._stack else _LOSS if self._after_root else _BEFORE

        def root_done(*_: Any) -> None:
            self._after_root = True

        rec = Recorder(self.device, frame_of) if self.needs_recorder else None
        self._recorder = rec
        self._keying = True
        try:
            with contextlib.ExitStack() as stack:
                stack.enter_context(keyer.attached(global_hooks=True))
                keyer.on_backward_call = self._called_in_backward
                stack.callback(setattr, keyer, "on_backward_call", None)
                if started:
                    keyer.enter_root()
                stack.callback(self.model.register_forward_hook(StepHook(root_done), always_call=True).remove)
                stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack_first, self._unpack))
                if rec is not None:
                    stack.enter_context(rec)
                yield
        finally:
            self._keying = False
            unpacked = self._unpacked
            # Replayed tensors whose backward never came (a branch whose output the loss does not use), or that
            # were alive when it came (held by other than autograd, P11): no replay re-ran their producers, so
            # later steps would not record them; they are learnt as kept.
            unneeded = {
                h.key
                for h in self._handles
                if h.action == Action.RECOMPUTE and (h.held_outside or (h.packs and not h.unpacks))
            }
            self._end_step()
            self._say_unknown()
        if not any(e.key is not None for e in log):
            return  # nothing was saved for backward (torch.no_grad, a validation pass): the next step learns
        if not unpacked:  # a forward whose backward did not run in the step (a skipped loss)
            if not self._warned_no_backward:
                self._warned_no_backward = True
                warnings.warn(
                    "autotune: a step under the policy ran a forward but no backward inside it; it is not "
                    "learnt from, the next step is (run loss.backward() inside `with policy.applied(model):`)",
                    stacklevel=3,
                )
            return
        if unneeded:
            log = [dataclasses.replace(e, action=None) if e.key in unneeded else e for e in log]
        self._learned[self._inputs] = self._learn(log, rec, force)
        self._learned.move_to_end(self._inputs)
        while len(self._learned) > _LEARNT_INPUTS:
            self._learned.popitem(last=False)

    def _say_unknown(self) -> None:
        """One warning for the saved tensors of this step that the policy does not name (each said once)."""
        keys = self.stats.unknown_keys
        if len(keys) == 1:
            what = f"saved tensor {keys[0]!r} is not in the policy for {self.policy.model}; it is kept"
        elif keys:
            named = some_keys(keys)
            what = f"{len(keys)} saved tensors are not in the policy for {self.policy.model} ({named}); they are kept"
        else:
            return
        # The policy's keys that no tensor of this step had: beside the tensors it does not name, most likely
        # the same tensors under keys edited by hand (or the policy of another version of the model). Those a
        # region served count as had (its saved tensors pass no hook of the runtime's), and a keep is no action
        # left unused (a region's input, which checkpoint saves: a model called twice listed them).
        seen = {e.key for e in self._log} | {k for f in self._ran for k in self.regions[f].keys}
        unmatched = sorted(
            k for k, a in self.policy.actions.items() if a != Action.KEEP and k not in seen and k not in self.ignored
        )
        if unmatched:
            n = len(unmatched)
            what += f"; the policy's actions for {n} key{'s' if n > 1 else ''} that this step did not save are unused "
            frozen = sum(1 for p in self.model.parameters() if not p.requires_grad)
            if self.policy.hardware != "cpu" and self.device.type == "cpu":
                why = f"planned for {self.policy.hardware}, whose kernels save other tensors than this CPU's"
            elif frozen:  # a frozen layer saves no input for its weights' gradient (freezing during training)
                why = (
                    f"{frozen} of the model's parameters are frozen (requires_grad=False), and a frozen layer saves "
                    "other tensors: search again with the model frozen as it trains"
                )
            else:
                why = "planned on another version of the model, or edited by hand?"
            what += f"({some_keys(unmatched)}: {why})"
        warnings.warn(f"autotune: {what}", stacklevel=4)

    def _learn(self, log: list[_Logged], rec: Recorder | None, force: bool) -> _Learned:
        """Which module calls later steps hook, and their tables (R11)."""

        def innermost(e: _Logged) -> Frame:
            return e.stack[-1] if e.stack else _LOSS if e.after_root else _BEFORE

        hooked = {innermost(e) for e in log if force or (e.key is not None and e.key in self.observed)}
        # The last op re-run by a replay after the model's forward: once it is recorded, so is all a replay needs.
        last = max((i for i in rec.replayed if rec.ops[i].frame == _LOSS), default=None) if rec is not None else None
        loss_done = None
        tables: dict[Frame, list[_Entry]] = {}
        for e in log:
            frame = next((f for f in reversed(e.stack) if f in hooked), None)
            if frame is None and not e.stack and innermost(e) in hooked:
                frame = innermost(e)
            if frame is not None:
                table = tables.setdefault(frame, [])
                if frame == _LOSS and last is not None and loss_done is None and e.recorded > last:
                    loss_done = len(table)
                table.append(_Entry(e.key, e.action, e.point, e.trigger, e.shape, e.dtype))
        record = {rec.ops[i].frame for i in rec.replayed} if rec is not None else set()
        if rec is not None:  # and the calls that write in place, after a replayed op read it, what it read (R6)
            record.update(rec.ops[j].frame for i in rec.replayed for j in rec.written_after(i))
        modules = sorted({f[0] for f in [*tables, *record] if f is not None and f not in (_LOSS, _BEFORE)})
        return _Learned(tables, {f for f in record if f is not None}, modules, force, loss_done)

    def _pack_first(self, t: torch.Tensor) -> Any:
        if self._suspended:
            return self._region_save(t)  # a region's saved inputs (R10)
        if self._recorder is None:
            return self._pack_keyed(t)
        with self._without_recorder():  # the runtime's own ops (copies, casts) are not the model's (R6)
            return self._pack_keyed(t)

    def _pack_keyed(self, t: torch.Tensor) -> Any:
        self.stats.packs += 1
        keyed = self.keyer.key_for(t)
        stack = tuple(self.keyer._stack)
        point = keyed.first_pack and keyed.key in self.policy.actions
        if point:
            self._pack_point()
        packed, action = self._pack_as(t, keyed.key)
        trigger = isinstance(packed, _Kept)
        recorded = len(self._recorder.ops) if self._recorder is not None else 0
        self._log.append(_Logged(stack, self._after_root, keyed.key, action, point, trigger, t.shape, t.dtype,
                                 recorded))  # fmt: skip
        return packed

    def _pack_as(self, t: torch.Tensor, key: str | None) -> tuple[Any, Action | None]:
        """R1-R8 for one pack of the first step: the packed object and the action taken (None: kept)."""
        if key is None:
            return t.detach(), None
        action = self.policy.actions.get(key)
        if action is None:
            if key not in self.ignored and key not in self._reported:
                self._reported.add(key)
                self.stats.unknown_keys.append(key)  # said once, at the step's end (_say_unknown)
            return t.detach(), None
        if action == Action.COMPRESS and not _compressible(t.dtype, self.compress_dtype):
            action = Action.KEEP  # R8
        if t.device != self.device:
            action = Action.KEEP  # R2: not device memory (attention's RNG seed and offset on the host)
        if action == Action.KEEP:  # R2
            if key in self.carriers:
                return _Kept(t.detach(), self.ranks[key]), None
            return t.detach(), None
        storage = t.untyped_storage()
        handle = self._by_storage.get(storage)
        if handle is None:
            handle = self._by_storage[storage] = self._new_handle(key, action, t)
        else:
            self._written_since(handle, t)
        handle.packs += 1
        return _Packed(handle, t.dtype, tuple(t.shape), tuple(t.stride()), int(t.storage_offset())), action

    # -- R11: later steps ----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _steady(self, learned: _Learned, started: bool = False) -> Iterator[None]:
        """``started``: from inside the model's first call, whose pre-hooks have run (R11)."""
        self._begin_step()
        rec = Recorder(self.device) if learned.record and self.needs_recorder else None
        self._recorder = rec
        tables: list[_Table] = []
        self._tables = tables
        tokens: list[int | None] = []  # per hooked call: 1 pushed the hooks, 2 entered the recorder (None: no grad)
        calls: dict[str, int] = {}
        outside: list[int] = []  # tokens of <before> (left at the model's forward) and <loss> (at the step's end)

        def loss_recorded() -> None:
            """Every op after the model's forward that a replay re-runs is recorded: the recorder leaves now,
            in forward (a pack hook runs outside any mode's handler), so that backward's ops do not pass
            through it. Popped inside backward, it would be back when backward returns (R11)."""
            for i, token in enumerate(outside):
                if token & 2 and rec is not None and rec.depth == 1 and _get_current_dispatch_mode() is rec:
                    rec.depth = 0
                    rec.__exit__(None, None, None)
                    outside[i] = token & ~2

        def enter(frame: Frame) -> int:
            self.stats.hooked_calls += 1
            token = 0
            entries = learned.tables.get(frame)
            if entries is not None:
                done_at = learned.loss_done if frame == _LOSS else None
                tables.append(_Table(entries, done_at=done_at, on_done=loss_recorded if done_at is not None else None))
                _PUSH_HOOKS(self._pack_later, self._unpack)
                token |= 1
            if rec is not None and frame in learned.record:
                if rec.depth == 0:
                    rec.__enter__()
                rec.depth += 1
                token |= 2
            return token

        def leave(token: int) -> None:
            if token & 2 and rec is not None:
                rec.depth -= 1
                if rec.depth == 0:
                    rec.__exit__(None, None, None)
            if token & 1:
                _POP_HOOKS()
                tables.pop()

        # False once this step has left the mode (R11: the model's first call went on with other tables): a call
        # already under way runs the hooks PyTorch gathered when it began, removed or not.
        live = True

        def make_hooks(path: str) -> tuple[Callable[..., None], Callable[..., None]]:
            # A call without grad (a forward for pseudo-labels inside the step) saves nothing and is not counted:
            # counted, it moved the step's calls along and none matched its tables (every other step learnt).
            def pre(_m: torch.nn.Module, _args: Any) -> None:
                if live:
                    if self._without_grad():
                        tokens.append(None)
                        return
                    call = calls.get(path, 0)
                    calls[path] = call + 1
                    tokens.append(enter((path, call)))

            def post(_m: torch.nn.Module, _args: Any, _out: Any) -> None:
                if live:
                    token = tokens.pop()
                    if token is not None:
                        leave(token)

            return pre, post

        # The model's calls with grad that began in this step; the ``<loss>`` table set aside while a later one
        # runs (a siamese or contrastive loss calls the model twice before backward): its packs are those of its
        # own module calls' tables, or of none, as in the step that learnt them.
        roots = [1 if started else 0]
        aside: list[_Table] = []

        def root_starts(*_: Any) -> None:
            if not live or self._without_grad():
                return
            roots[0] += 1
            if roots[0] == 1:
                while outside:  # <before>
                    leave(outside.pop())
            elif outside and outside[-1] & 1 and not aside:  # <loss>'s hooks are the innermost: no module runs
                _POP_HOOKS()
                aside.append(tables.pop())

        def resume() -> None:
            if aside:
                tables.append(aside.pop())
                _PUSH_HOOKS(self._pack_later, self._unpack)

        def root_done(*_: Any) -> None:
            if not live or self._without_grad():
                return
            if aside:
                resume()
            elif not outside:
                outside.append(enter(_LOSS))

        handles: list[torch.utils.hooks.RemovableHandle] = []
        try:
            for path in learned.modules:
                pre, post = make_hooks(path)
                mod = self._module(path)
                handles.append(mod.register_forward_pre_hook(StepHook(pre)))
                handles.append(mod.register_forward_hook(StepHook(post), always_call=True))
                if started and path == ROOT:  # its pre-hooks ran before this one was registered; its post will run
                    pre(self.model, ())
            if (_BEFORE in learned.tables or _BEFORE in learned.record) and not started:
                outside.append(enter(_BEFORE))
            loss = _LOSS in learned.tables or _LOSS in learned.record
            if outside or loss:
                handles.append(self.model.register_forward_pre_hook(StepHook(root_starts)))
            if loss:
                handles.append(self.model.register_forward_hook(StepHook(root_done), always_call=True))
            yield
        finally:
            live = False
            for handle in handles:
                handle.remove()
            resume()  # a later call of the model that raised: <loss>'s hooks are pushed, as leave() pops them
            while tokens:
                token = tokens.pop()
                if token is not None:
                    leave(token)
            while outside:
                leave(outside.pop())
            self._end_step()
            if self._mismatch is not None:  # learn again at the next step with these inputs
                for inputs in [i for i, v in self._learned.items() if v is learned]:
                    del self._learned[inputs]

    def _region_save(self, t: torch.Tensor) -> torch.Tensor:
        """What a checkpointed region saves, kept as it is (R10): one detached tensor per tensor, so that an
        argument passed several times is held once. (Autograd gives each saved argument back as an object of its
        own all the same where it has a gradient function: :func:`_aliased` makes them one again.)"""
        d = self._region_saves.get(t)
        if d is None:
            d = self._region_saves[t] = t.detach()
        return d

    def _pack_later(self, t: torch.Tensor) -> Any:
        if self._suspended:
            return self._region_save(t)  # a region's saved inputs (R10)
        table = self._tables[-1]
        i = table.pos
        table.pos = i + 1
        if self._mismatch is not None or i >= len(table.entries):
            return self._mismatched(t, i)
        e = table.entries[i]
        if t.dtype != e.dtype or t.shape != e.shape:
            return self._mismatched(t, i)
        self.stats.packs += 1
        if e.point:
            self._pack_point()
        if e.action is None:
            out = _Kept(t.detach(), self.ranks[e.key]) if e.trigger and e.key is not None else t.detach()
        elif self._recorder is None:
            out = self._pack_handle(t, e)
        else:
            with self._without_recorder():
                out = self._pack_handle(t, e)
        if i == table.done_at and table.on_done is not None:
            table.on_done()
        return out

    def _pack_handle(self, t: torch.Tensor, e: _Entry) -> Any:
        assert e.key is not None and e.action is not None
        handle = self._by_key.get(e.key)
        if handle is None:
            rec = self._recorder
            if e.action == Action.RECOMPUTE and rec is not None and not rec.writers.get(rec.sid(t.untyped_storage())):
                # R11: a tensor this step's recorder did not see made matches a replayed entry by shape alone
                # (layers frozen since the step the tables were learnt from, a branch taken): it is kept, and
                # the next step with these inputs learns again, rather than failing in backward.
                return self._mismatched(t, self._tables[-1].pos - 1)
            handle = self._by_key[e.key] = self._new_handle(e.key, e.action, t)
        elif handle.ref() is not t.untyped_storage():
            return self._mismatched(t, -1)
        else:
            self._written_since(handle, t)
        handle.packs += 1
        return _Packed(handle, t.dtype, tuple(t.shape), tuple(t.stride()), int(t.storage_offset()))

    def _mismatched(self, t: torch.Tensor, pos: int) -> torch.Tensor:
        if self._mismatch is None:
            self._mismatch = f"pack {pos}" if pos >= 0 else "a later pack of a handled tensor"
            warnings.warn(
                f"autotune: the saved tensors of this step differ from those of the step that learnt its inputs "
                f"({self._mismatch}: {tuple(t.shape)} {t.dtype}); from here on this step keeps them, so it holds "
                "more memory than the plan, and the next step with these inputs learns again (the model saves "
                "other tensors for the same input shapes: control flow that depends on the data, or a forward hook "
                "of yours that computes, whose tensors the runtime's hooks see first; README, known limits)",
                stacklevel=3,
            )
        return t.detach()

    # -- the actions -------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _without_recorder(self) -> Iterator[None]:
        """Take the recorder off the dispatch-mode stack while the runtime's own ops run (when it is on top;
        a mode entered inside the step stays, and the recorder's pause flag does the job). Other modes, the
        CPU memory tracker among them, still see every op."""
        rec = self._recorder
        assert rec is not None
        if _get_current_dispatch_mode() is rec:
            with _pop_mode_temporarily():
                yield
            return
        rec.paused = True
        try:
            yield
        finally:
            rec.paused = False

    def _pack_point(self) -> None:
        """R3: one more pack point; release the swapped tensors due here."""
        self._points += 1
        while self._leaving and self._leaving[0].release_at <= self._points:
            self._release(self._leaving.popleft())

    def _release(self, h: _Handle) -> None:
        torch.cuda.current_stream(self.device).wait_event(h.d2h_done)
        h.leaving = None

    def _new_handle(self, key: str, action: Action, t: torch.Tensor) -> _Handle:
        storage = t.untyped_storage()
        h = _Handle(key, action, storage.nbytes(), self.ranks.get(key, -1), weakref.ref(storage))
        h.version = t._version
        if self._recorder is not None:
            h.sid = self._recorder.sid(storage)
            self._by_sid[h.sid] = h
            if action == Action.RECOMPUTE:
                self._replays_open += 1
        self._handles.append(h)
        if action == Action.SWAP:  # R3
            self.stats.swapped_bytes += h.nbytes
            self.stats.swaps += 1
            self._copy_out(h, storage)
            self._swapped.append(h)
        elif action == Action.COMPRESS:  # R7
            self.stats.compressed_bytes += h.nbytes
            with torch.no_grad():
                h.packed = _bytes_of(storage).view(t.dtype).to(self.compress_dtype)
            h.views.append((t.dtype, (), (), 0))
        return h

    def _written_since(self, h: _Handle, t: torch.Tensor) -> None:
        """R3, R7 at a later pack of a swapped or compressed storage: where the step may have written into it
        since the copy, the copy is taken again, so that it holds the storage's final bytes as a kept tensor
        would (the simulator's Rules 4 and 8 copy after ``save_op``, the last forward write). Written: the
        version counter moved (views share their base's), or the tensor is a part of its storage that is no
        view (``unsafe_chunk``'s, whose siblings count their writes apart: the CPU's GRU cell runs
        ``sigmoid_`` on one chunk of its gates, packs it, then writes the next chunks and packs them)."""
        if h.action not in (Action.SWAP, Action.COMPRESS):
            return
        part = t._base is None and t.numel() * t.element_size() < h.nbytes
        if t._version == h.version and not part:
            return
        h.version = t._version
        storage = t.untyped_storage()
        if h.action == Action.SWAP:
            self._copy_out(h, storage, again=True)
        else:
            with torch.no_grad():
                h.packed = _bytes_of(storage).view(h.views[0][0]).to(self.compress_dtype)

    def _copy_out(self, h: _Handle, storage: torch.UntypedStorage, again: bool = False) -> None:
        """R3: the storage's bytes to host memory; ``again`` where it was written since the first copy (the
        same buffer, the copy after the first on the copy stream, the device bytes held as the first's)."""
        src = _bytes_of(storage)
        if not self._cuda:
            h.host = src.clone()  # on the CPU, host memory is the same memory: counted (R3)
            return
        buf = self._pinned.get(h.key)
        if buf is None or buf.numel() < h.nbytes:  # a smaller batch's copy reuses the larger buffer
            buf = self._pinned[h.key] = torch.empty(h.nbytes, dtype=torch.uint8, pin_memory=True)
        buf = buf[: h.nbytes]
        self._d2h.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._d2h):
            buf.copy_(src, non_blocking=True)
            h.d2h_done = torch.cuda.Event()
            h.d2h_done.record()
        h.host = buf
        if not again or h.leaving is None:  # held to the release point (again: released already), never
            h.leaving = src  # reused under the copy
            h.release_at = self._points + self.release_after
            self._leaving.append(h)

    # -- unpack --------------------------------------------------------------------------------------------
    def _unpack(self, p: Any) -> torch.Tensor:
        if not self._unpacked:
            self._unpacked = True
            if torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled(self.device.type):
                torch.clear_autocast_cache()  # R17: backward inside autocast; its casts live as saved tensors
        if isinstance(p, torch.Tensor):
            return p
        rec = self._recorder
        if rec is None:
            return self._unpack_now(p)
        rec.recording = False  # backward has started (R6): the recorder records nothing more
        with self._without_recorder():  # as in pack; replays record nothing either
            return self._unpack_now(p)

    def _unpack_now(self, p: Any) -> torch.Tensor:
        if isinstance(p, _Kept):
            self._prefetch_upto(p.rank)
            return p.tensor
        h: _Handle = p.handle
        while self._leaving:  # R3: the first unpack of a handled tensor releases what is still held
            self._release(self._leaving.popleft())
        if self.needs_triggers:
            self._prefetch_upto(h.rank)  # R4
        out = view_of(self._materialize(h), p.dtype, p.size, p.stride, p.offset)
        h.unpacks += 1
        h.unpacked = True
        if h.unpacks >= h.packs:  # R9: the last backward node that needs it holds it from here
            h.device = None
            h.unpacks = h.packs = 0
            if h.action == Action.RECOMPUTE and self._recorder is not None and self._replays_open > 0:
                self._replays_open -= 1
                if self._replays_open == 0:  # R6: no replay is left to need them
                    self._recorder.release_rng()
            if not self._cuda:
                h.host = None  # R3 on the CPU: a swap's copy was the tensor (the others hold none)
        return out

    def _prefetch_upto(self, rank: int) -> None:
        if self._next_fetch == 0 and self._swapped:
            self._swapped.sort(key=lambda x: x.rank)
        while self._next_fetch < len(self._swapped) and self._swapped[self._next_fetch].rank <= rank + self.lookahead:
            self._issue_fetch(self._swapped[self._next_fetch])
            self._next_fetch += 1

    def _issue_fetch(self, h: _Handle) -> None:
        if h.issued:
            return
        h.issued = True
        if h.host is None:
            raise RuntimeError(
                f"autotune: swapped tensor {h.key!r} was needed after its release: on the CPU its only copy goes at "
                "its last unpack, so a second backward through the same graph (retain_graph=True) cannot read it; "
                "keep it in the policy (or recompute it), or run one backward per forward"
            )
        if not self._cuda:
            self._hold(h, h.host.untyped_storage())  # R3 on the CPU: no copy back
            return
        dev = torch.empty(h.nbytes, dtype=torch.uint8, device=self.device)  # on the compute stream (R4)
        self._h2d.wait_stream(torch.cuda.current_stream(self.device))
        self._h2d.wait_event(h.d2h_done)
        with torch.cuda.stream(self._h2d):
            dev.copy_(h.host, non_blocking=True)
            h.h2d_done = torch.cuda.Event()
            h.h2d_done.record()
        self._hold(h, dev.untyped_storage())

    def _hold(self, h: _Handle, storage: torch.UntypedStorage) -> None:
        h.device = storage
        if self._recorder is not None and h.sid is not None:
            self._recorder.storage[h.sid] = weakref.ref(storage)  # replays find it while anything holds it

    def _materialize(self, h: _Handle) -> torch.UntypedStorage:
        """The storage back on the device (R5-R7), regenerated if it was released and is needed again."""
        if h.device is None and self._recorder is not None and h.sid is not None:
            alive = self._recorder.storage[h.sid]()
            if alive is not None:  # released by the handle but still held (by the node that unpacked it) ...
                h.device = alive
                # ... or, at its first unpack, by other than autograd (P11: a custom Function's ctx attribute)
                h.held_outside = h.action == Action.RECOMPUTE and not h.unpacked
        if h.action == Action.SWAP:
            if h.device is None:
                h.issued = False  # released and needed again: fetch anew
            self._issue_fetch(h)
            if self._cuda:
                torch.cuda.current_stream(self.device).wait_event(h.h2d_done)  # R5
        elif h.device is not None:
            return h.device
        elif h.action == Action.COMPRESS:
            if h.packed is None:
                raise RuntimeError(f"autotune: compressed tensor {h.key!r} was needed after its release")
            with torch.no_grad():
                self._hold(h, h.packed.to(h.views[0][0]).untyped_storage())
            h.packed = None
        elif h.action == Action.RECOMPUTE:
            rec = self._recorder
            if rec is None:  # the step has ended: its recording went with it (R11)
                raise AutotuneError(
                    f"backward needs saved tensor {h.key!r}, which the policy recomputes, after "
                    "`with policy.applied(model):` ended; the recording its recompute replays ended with the "
                    "block: call loss.backward() inside the block (under Lightning's automatic optimization, use "
                    "runtime.integrations.lightning.PolicyCallback rather than a block inside training_step)"
                )
            assert h.sid is not None
            # The recorded ops are autocast's outputs (its casts recorded as ops): an autocast still on in
            # backward (``loss.backward()`` inside it) must not cast them again (R6).
            with torch.no_grad(), _without_autocast(self.device):
                self._hold(h, Replayer(self, rec).storage(h.sid, len(rec.ops)))
        assert h.device is not None
        return h.device


@contextlib.contextmanager
def _without_autocast(device: torch.device) -> Iterator[None]:
    """Autocast off on the CPU and on ``device``'s type (R6: a replay runs the ops as dispatched in forward)."""
    with contextlib.ExitStack() as stack:
        for kind in {"cpu", device.type}:
            if torch.is_autocast_enabled(kind):
                stack.enter_context(torch.autocast(kind, enabled=False))
        yield


# R19: the runtime in a step, per model (weakly: a step's model is alive while its step is).
_active: WeakIdKeyDictionary = WeakIdKeyDictionary()


@functools.cache
def _compressible(dtype: torch.dtype, target: torch.dtype) -> bool:
    """R8: what the simulator compresses (Rule 8, ``runtime.vocab.compressible``), for torch dtypes."""
    return compressible(str(dtype).removeprefix("torch."), str(target).removeprefix("torch."))


# -- Policy.applied --------------------------------------------------------------------------------------------
# The runtimes of a model live on the model (a runtime holds its model: a weak-keyed table would never let
# go of either), under a name no nn.Module uses; they go with it.
_RUNTIMES_ATTR = "_autotune_runtimes"
#: A model's runtimes kept, the most recently applied: each holds its policy, its learnt tables and, on a GPU,
#: its streams and pinned buffers, and a loop that loads its policy again each epoch made one a load.
MAX_RUNTIMES = 4


class _Runtimes(dict):  # type: ignore[type-arg]
    """A model's runtimes by policy: not part of the model's state. ``torch.save(model)``, pickling and
    ``copy.deepcopy`` (an EMA copy) see an empty table, and a copy makes its own runtime when it first runs."""

    def __reduce__(self) -> tuple[type, tuple[()]]:
        return (_Runtimes, ())

    def __deepcopy__(self, memo: dict[int, Any]) -> _Runtimes:
        return _Runtimes()


def check_model(policy: Policy, model: torch.nn.Module) -> None:
    """R12: refuse a model whose parameters are not those of the model the policy was made for."""
    want = policy.parameter_fingerprint
    if want is None:
        return
    got = parameter_fingerprint(model)
    if got == want:
        return
    # The model held by the one given, whose parameter names have its path as prefix: said as what to apply the
    # policy to (it was "a model with other parameters", and strict=False then applied nothing, a QA run).
    inside = next((n for n, m in model.named_modules() if n and parameter_fingerprint(m) == want), None)
    wrapped = {
        "module": "apply it to the model the wrapper holds, policy.applied(wrapper.module), inside the wrapper's "
        "forward and backward",  # DistributedDataParallel, DataParallel
        "_orig_mod": "torch.compile's wrapper runs the model without autotune's hooks: compile under the policy "
        "with policy.compiled(model) on the model itself (NOTE [ Compiled policies ]), or train it eagerly with "
        "policy.applied(model)",  # torch.compile's OptimizedModule
        "model": "a model that policy.compiled returned applies its policy itself: call it as it is, without "
        "policy.applied",  # runtime.compiled.CompiledModel
    }
    if inside in wrapped:
        raise AutotuneError(
            f"policy for {policy.model} applied to a wrapper of that model ({type(model).__name__}, holding it "
            f"as .{inside}), whose parameter names have that prefix: {wrapped[inside]}"
        )
    if inside is not None:  # a LightningModule's network, a model held by another
        raise AutotuneError(
            f"policy for {policy.model} applied to {type(model).__name__}, which holds that model as {inside!r}: "
            f"apply it to that submodule (model.get_submodule({inside!r}); the integrations' module={inside!r})"
        )
    raise AutotuneError(
        f"policy for {policy.model} (parameters {want}) applied to a model with other parameters ({got}): its "
        f"keys would name other tensors; search a policy for this model (`autotune search --model ...`), or "
        f"in Python pass strict=False to apply what still matches (the rest is kept)"
    )


@contextlib.contextmanager
def applied(policy: Policy, model: torch.nn.Module, *, strict: bool = True) -> Iterator[RuntimeStats]:
    """``with applied(policy, model):`` one forward and backward under the policy (see the module docs)."""
    per_model: dict[int, PolicyRuntime] = model.__dict__.setdefault(_RUNTIMES_ATTR, _Runtimes())
    rt = per_model.pop(id(policy), None)
    if rt is not None and rt.policy is not policy:  # another object at that id: the one it was made for is gone
        rt = None
    if rt is None:  # the same policy loaded again (each epoch, in a helper): its runtime, tables learnt and all
        again = next((k for k, r in per_model.items() if r.policy == policy), None)
        if again is not None:
            if strict:
                check_model(policy, model)
            rt = per_model.pop(again)
            rt.policy = policy
    if rt is None:
        rt = PolicyRuntime(policy, model, strict=strict)
    per_model[id(policy)] = rt  # the most recent last
    while len(per_model) > MAX_RUNTIMES:
        del per_model[next(iter(per_model))]
    with rt.step() as stats:
        yield stats


def _readers_of(output: Any) -> dict[Any, list[Any]]:
    """R10: the autograd graph reached from ``output``'s tensors, as each node and the nodes that read it."""
    readers: dict[Any, list[Any]] = {}
    todo = [t.grad_fn for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    for node in todo:
        readers.setdefault(node, [])
    while todo:
        node = todo.pop()
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            if nxt not in readers:
                readers[nxt] = []
                todo.append(nxt)
            readers[nxt].append(node)
    return readers


def _held(leaves: Sequence[torch.Tensor], places: Sequence[Sequence[tuple[dict[str, Any], str]]]) -> bool:
    """Whether the parameter tables hold the leaves a region learnt (R10): ``torch.func.functional_call`` puts
    other tensors in their places for the call, and a node carrying the learnt leaves would differentiate the
    wrong ones."""
    return all(table[name] is leaf for leaf, where in zip(leaves, places, strict=True) for table, name in where)


def _as_in_forward(fn: Callable[..., Any], tables: Sequence[dict[str, Any]]) -> Callable[..., Any]:
    """``fn`` for ``torch.utils.checkpoint`` (R10) whose recompute reads the parameters the forward read. Under
    ``torch.func.functional_call`` the forward reads the tensors it was given in the parameters' places, and
    the recompute runs in backward, after functional_call has put the module's own back: it recomputed with
    those, and the gradients were wrong from the first step whose given tensors differed (PyTorch's checkpoint
    does the same). The tables as the forward saw them are put back for the recompute."""
    held = [(table, name, value) for table in tables for name, value in table.items()]

    def call(*args: Any, **kwargs: Any) -> Any:
        if torch._C._current_graph_task_id() == -1:
            return fn(*args, **kwargs)  # the forward itself
        put = [(table, name, value) for table, name, value in held if table[name] is not value]
        with substituted([[(table, name)] for table, name, _ in put], [value for _, _, value in put]):
            return fn(*args, **kwargs)

    return call


def _aliased(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Callable[..., Any]:
    """``fn`` for ``torch.utils.checkpoint`` (R10): in the recompute, a tensor passed to the call at several
    places is one object again, as in its forward. ``nn.MultiheadAttention`` tests ``query is key is value``
    and projects with one packed matrix product when so, three otherwise; checkpoint saves each argument apart,
    and autograd gives a saved tensor that has a gradient function back as a new object at each unpack, so the
    recompute took the other path and checkpoint matched the wrong saved tensors to its backward ("t() expects
    a tensor with <= 2 dimensions"). Keyword arguments are not saved (checkpoint passes them as they are), and
    count among the places too."""
    flat = [*args, *kwargs.values()]
    first: dict[int, int] = {}
    places = [first.setdefault(id(x), i) if isinstance(x, torch.Tensor) else i for i, x in enumerate(flat)]
    if places == list(range(len(flat))):
        return fn
    names = list(kwargs)

    def call(*a: Any, **kw: Any) -> Any:
        given = [*a, *(kw[n] for n in names)]
        given = [given[p] for p in places]
        return fn(*given[: len(a)], **dict(zip(names, given[len(a) :], strict=True)))

    return call
