"""The ``Policy``: one action per saved activation, and the versioned JSON file it is stored in.

A policy says, for every candidate of a :class:`~runtime.workload.Workload` (an activation saved for
backward, named by its stable key), what the runtime does with it between forward and backward:

- ``keep``: leave it in device memory (what PyTorch does anyway);
- ``swap``: copy it to host memory after its last forward use and back before its first backward use,
  ``options.prefetch_lookahead`` unpack points ahead (0: on demand, stalling backward);
- ``recompute``: free it and re-run its producer chain in backward;
- ``compress``: keep it in ``options.compress_dtype``; lossy, so only with ``options.lossy: true``.

and, for the whole policy, ``partitions``: submodules that run on slices of the batch (NOTE [ Partition ] in
runtime/partition.py), which change the gradients' summation order, so only with
``options.allow_partition: true``; the keys are then those of the partitioned trace.

File format ``autotune.policy/v1`` (JSON, sorted keys; schema in ``runtime/policy.schema.json``; every
field is explained in docs/policy-format.md)::

    {
      "actions": {"1#0.0:Relu": "swap", "<loss>#0.0:LogSoftmax": "recompute", "<loss>#0.2:nograd": "keep"},
      "batch_size": 3,
      "budget_bytes": 900,
      "fingerprint": "1fc92ed67127c1cd",
      "format": "autotune.policy/v1",
      "hardware": "a100-40gb",
      "measured": null,
      "model": "mlp",
      "options": {"compress_dtype": "bfloat16", "lossy": false, "prefetch_lookahead": 2},
      "precision": "fp32",
      "predicted": {"iter_s": 0.0012, "peak_bytes": 808, "samples_per_s": 2500.0},
      "provenance": {"autotune_version": "0.1.0", "created": "2025-01-31T12:00:00Z",
                     "searcher": "optuna-tpe", "trials": 200, "wall_s": 41.5},
      "seq_len": null,
      "shape_fingerprint": "29c1c92f175b5575"
    }

NOTE [ Policies are tied to a shape ]
    A policy is refused for a workload whose ``fingerprint`` (structure: the modules that run and the
    parameter shapes, the same on every device) differs: its keys would name other tensors. Keys that
    differ across devices are tolerated within limits (NOTE [ Keys across devices ]). One whose
    ``shape_fingerprint`` differs (same model, other batch size, sequence length or image size) is refused too unless
    ``allow_other_shapes=True``: which tensors must leave the device to fit a budget depends on their sizes,
    so a plan for batch 64 is not a plan for batch 128.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import importlib.resources
import json
import math
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from runtime.errors import AutotuneError
from runtime.fileio import atomic_write
from runtime.keys import canonical_key
from runtime.partition import Partition, parse_partitions
from runtime.plan import Region, as_run, closures_of, held_outside, reads_csr, regions_for, replay_inputs_kept
from runtime.precision import check_grad_accum, check_precision
from runtime.vocab import ACTIONS, COMPRESS, KEEP, RECOMPUTE, Action
from runtime.workload import Workload

FORMAT = "autotune.policy/v1"
COMPRESS_DTYPES: tuple[str, ...] = ("bfloat16", "float8_e4m3fn")


@dataclass
class PolicyOptions:
    """Global settings the runtime applies a policy with."""

    prefetch_lookahead: int = 2  # unpack points ahead of first backward use a swap-in starts; 0: on demand
    compress_dtype: str = "bfloat16"  # one of COMPRESS_DTYPES
    lossy: bool = False  # the user's consent to `compress`, which changes the gradients
    # Pack points after its own at which a swapped tensor's device bytes are let go, the compute stream
    # waiting for its copy there (simulator Rule 4, runtime R3): more holds memory longer, fewer may stall.
    release_after: int = 4
    # The user's consent to partitions (runtime/partition.py), which change the order gradients are summed in.
    allow_partition: bool = False
    # Regions (runtime R10, simulator Rule 11) as one autograd node each (runtime/regions.py: no Python per
    # saved tensor; holds the outputs' gradients and the re-made outputs through the call's backward), or under
    # torch.utils.checkpoint (Python hooks per saved tensor; stops its recompute at the last save): the search
    # picks the one that runs fastest within the budget.
    region_nodes: bool = True

    def __post_init__(self) -> None:
        if self.compress_dtype not in COMPRESS_DTYPES:
            raise AutotuneError(
                f"compress_dtype={self.compress_dtype!r} is not supported: expected one of {list(COMPRESS_DTYPES)}"
            )
        if self.prefetch_lookahead < 0:
            raise AutotuneError(
                f"prefetch_lookahead={self.prefetch_lookahead} is negative: expected 0 (fetch on demand) or more"
            )
        if self.release_after < 1:
            raise AutotuneError(
                f"release_after={self.release_after}: expected 1 or more pack points (the first pack point after a "
                "swapped tensor's own is the earliest its device bytes can go)"
            )


@dataclass
class Prediction:
    """Peak memory and speed of one iteration under the policy (simulated, or measured on real runs)."""

    peak_bytes: int
    iter_s: float
    samples_per_s: float

    def __post_init__(self) -> None:
        # JSON's schema takes NaN and Infinity for numbers (Python writes and reads them): refused here.
        for name in ("peak_bytes", "iter_s", "samples_per_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise AutotuneError(
                    f"{name}={value!r}: expected a finite number, 0 or more (a file's predicted or measured "
                    "figures; remove the field, or simulate the policy again with --save-policy)"
                )


@dataclass
class Provenance:
    """Who made the policy, how, and when."""

    searcher: str
    trials: int  # policies evaluated to find this one; 0 for policies made by hand (uniform, vector)
    autotune_version: str
    created: str  # ISO 8601, UTC
    wall_s: float | None = None  # search wall time

    @classmethod
    def now(cls, searcher: str, trials: int = 0, wall_s: float | None = None) -> Provenance:
        created = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        return cls(searcher, trials, _autotune_version(), created, wall_s)


@dataclass
class Schedule:
    """What the runtime needs besides the actions, derived from the workload the policy was made for.

    ``unpack_rank``: each candidate's position among the unpack points (the distinct first-backward-use
    ops, in order): the runtime issues a swapped tensor's copy back when backward first unpacks a tensor of
    rank ``unpack_rank[key] - prefetch_lookahead`` (envs/simulator.py, Rule 5; ranks among the tensors no
    region serves). ``ignored_keys``: saved tensors that are not candidates (the batch, the targets): kept
    without being reported as unknown. ``regions``: the module calls recomputed with
    ``torch.utils.checkpoint`` (NOTE [ Recompute mechanisms ] in runtime/plan.py), which depend on the
    actions too: :meth:`Policy.from_vector` plans them.
    """

    unpack_rank: dict[str, int]
    ignored_keys: list[str] = field(default_factory=list)
    regions: list[Region] = field(default_factory=list)

    @classmethod
    def of(cls, workload: Workload, codes: Sequence[int] | np.ndarray | None = None, nodes: bool = True) -> Schedule:
        """The schedule of ``workload``; with action ``codes``, its regions too (run as nodes or not: P10)."""
        n = len(workload.ops)
        firsts = [c.first_use(n) for c in workload.candidates]
        points = sorted(set(firsts))
        rank = {u: i for i, u in enumerate(points)}
        return cls(
            {c.key: rank[u] for c, u in zip(workload.candidates, firsts, strict=True)},
            list(workload.meta.get("ignored_keys", [])),
            regions_for(workload, np.asarray(codes), nodes) if codes is not None and len(codes) else [],
        )


@dataclass(kw_only=True)
class Policy:
    """One action per candidate key of one workload, and what it was made for (see module docstring)."""

    actions: dict[str, Action]  # every candidate of the workload, keep included
    options: PolicyOptions = field(default_factory=PolicyOptions)
    model: str
    batch_size: int
    seq_len: int | None = None
    # Image height and width where the trace was asked for another than the model's default (written only
    # then: files without it are at the default, 224 px for torchvision models).
    image_size: int | None = None
    fingerprint: str
    shape_fingerprint: str
    # The model's parameters by name and shape (runtime.keys.parameter_fingerprint): checked when the policy
    # is applied, before anything runs (runtime R12); None in files from before it was recorded.
    parameter_fingerprint: str | None = None
    budget_bytes: int | None = None
    # What the search kept back of budget_bytes (autotune/budget.py: the libraries' workspaces, and a reserved-
    # budget search's margin for the caching allocator): it planned for the difference. None in files from
    # before it was recorded, and where there was no budget.
    reserve_bytes: int | None = None
    hardware: str  # hardware profile name, e.g. "a100-40gb"
    precision: str = "fp32"
    grad_accum: int = 1  # micro-batches per optimizer step it was planned for
    # The optimizer it was traced with (its state and step temporaries are in the plan); None in files from
    # before it was recorded, which were traced with the default, sgd.
    optimizer: str | None = None
    predicted: Prediction | None = None
    measured: Prediction | None = None
    provenance: Provenance
    schedule: Schedule | None = None
    # Submodules run on slices of the batch (runtime/partition.py); the workload was traced with them.
    partitions: tuple[Partition, ...] = ()
    # The torch.compile backend it was planned for (``search --compile``: simulator Rule 16, the twin of a compiled
    # step), None for the eager runtime; files without it were planned for the eager runtime.
    compile_backend: str | None = None

    def __post_init__(self) -> None:
        self.precision = check_precision(self.precision)
        self.grad_accum = check_grad_accum(self.grad_accum)
        self.partitions = parse_partitions(self.partitions)
        if self.partitions and not self.options.allow_partition:
            raise AutotuneError(
                f"options.allow_partition is false but the policy partitions "
                f"{', '.join(str(p) for p in self.partitions)}: partition changes the order gradients are "
                "summed in (NOTE [ Partition ] Q4 in runtime/partition.py), so it must be allowed with "
                '"allow_partition": true in the file\'s options (PolicyOptions(allow_partition=True) in code)'
            )
        compressed = [k for k, a in self.actions.items() if a == Action.COMPRESS]
        if compressed and not self.options.lossy:
            raise AutotuneError(
                f"options.lossy is false but {_n(len(compressed), 'tensor')} would be compressed "
                f"({some_keys(compressed)}): compression changes the gradients, so it must be allowed with "
                '"lossy": true in the file\'s options (PolicyOptions(lossy=True) in code)'
            )

    def applied(self, model: Any, *, strict: bool = True) -> Any:
        """``with policy.applied(model):`` one forward and backward under this policy (runtime.apply). A model
        whose parameters are not those the policy was made for is refused unless ``strict=False`` (R12)."""
        from runtime.apply import applied

        return applied(self, model, strict=strict)

    def compiled(self, model: Any, *, backend: Any = "inductor", strict: bool = True, **compile_kwargs: Any) -> Any:
        """``torch.compile`` of ``model`` under this policy: keep and recompute through selective activation
        checkpointing, decided when the compiler traces (runtime.compiled, NOTE [ Compiled policies ]). Swap,
        compression and partitions are refused unless ``strict=False`` (then kept, and reported)."""
        from runtime.compiled import CompiledModel

        return CompiledModel(self, model, backend=backend, strict=strict, **compile_kwargs)

    # -- construction ------------------------------------------------------------------------------------
    @classmethod
    def from_vector(
        cls,
        workload: Workload,
        vector: Sequence[int] | np.ndarray,
        *,
        hardware: str,
        budget_bytes: int | None = None,
        options: PolicyOptions | None = None,
        searcher: str = "vector",
        trials: int = 0,
        precision: str | None = None,
        predicted: Prediction | None = None,
        wall_s: float | None = None,
    ) -> Policy:
        """A policy from action codes (``Action.code``) indexed like ``workload.candidates``."""
        codes = np.asarray(vector).reshape(-1)
        if len(codes) != len(workload.candidates):
            raise ValueError(
                f"action vector has {len(codes)} entries but {workload.model} has "
                f"{len(workload.candidates)} candidates: expected one code per candidate"
            )
        if len(codes) and not (np.issubdtype(codes.dtype, np.integer) and 0 <= codes.min() <= codes.max() < 4):
            raise ValueError(f"action codes {np.unique(codes).tolist()} are not all integers in 0..3 (keep..compress)")
        options = options if options is not None else PolicyOptions()
        compressed = codes == COMPRESS
        if compressed.any() and (codes == RECOMPUTE).any():  # P12 (runtime/plan.py): what a replay reads is kept
            run = replay_inputs_kept(as_run(codes, held_outside(workload)), *reads_csr(closures_of(workload)))
            codes = np.where(compressed & (run == KEEP), KEEP, codes).astype(codes.dtype)
        return cls(
            actions={c.key: ACTIONS[int(a)] for c, a in zip(workload.candidates, codes, strict=True)},
            options=options,
            model=workload.model,
            batch_size=workload.batch_size,
            seq_len=workload.seq_len,
            image_size=workload.image_size,
            fingerprint=workload.fingerprint,
            shape_fingerprint=workload.shape_fingerprint,
            parameter_fingerprint=workload.meta.get("parameter_fingerprint"),
            budget_bytes=budget_bytes,
            hardware=hardware,
            precision=precision or workload.precision,
            grad_accum=workload.grad_accum,
            optimizer=workload.optimizer,
            predicted=predicted,
            provenance=Provenance.now(searcher, trials, wall_s),
            schedule=Schedule.of(workload, codes, options.region_nodes),
            partitions=parse_partitions(workload.meta.get("partitions")),
            compile_backend=workload.meta.get("compiled"),
        )

    @classmethod
    def uniform(
        cls,
        workload: Workload,
        action: Action,
        *,
        hardware: str,
        budget_bytes: int | None = None,
        options: PolicyOptions | None = None,
        searcher: str = "uniform",
    ) -> Policy:
        """The same action for every candidate (``keep`` everywhere is PyTorch's default behaviour)."""
        vector = np.full(len(workload.candidates), Action(action).code, dtype=np.int8)
        return cls.from_vector(
            workload, vector, hardware=hardware, budget_bytes=budget_bytes, options=options, searcher=searcher
        )

    # -- views ---------------------------------------------------------------------------------------------
    def to_vector(self, workload: Workload) -> np.ndarray:
        """Action codes in ``workload.candidates`` order, shape (n_candidates,), int8; keep for a candidate
        the policy does not name (tolerated as in :meth:`check_against`)."""
        self._check_keys(workload, "policy", warn=False)
        keep = Action.KEEP
        return np.array([self.actions.get(c.key, keep).code for c in workload.candidates], dtype=np.int8)

    def counts(self, workload: Workload | None = None) -> dict[Action, int]:
        """Number of candidates per action, every action present (zero included): the file's, or with
        ``workload`` its candidates' as applied (a key it does not save left out, one the file does not name kept)."""
        out = dict.fromkeys(ACTIONS, 0)
        if workload is not None:
            for code in self.to_vector(workload).tolist():
                out[ACTIONS[code]] += 1
            return out
        for a in self.actions.values():
            out[a] += 1
        return out

    def bytes_by_action(self, workload: Workload) -> dict[Action, int]:
        """Candidate bytes per action (each candidate's full size: before compression)."""
        self._check_keys(workload, "policy", warn=False)
        out = dict.fromkeys(ACTIONS, 0)
        for c in workload.candidates:
            out[self.actions.get(c.key, Action.KEEP)] += c.nbytes
        return out

    # -- checks against a workload ----------------------------------------------------------------------
    def check_against(self, workload: Workload, *, allow_other_shapes: bool = False, source: str = "policy") -> None:
        """Raise :class:`AutotuneError` unless this policy fits ``workload``.

        See NOTE [ Policies are tied to a shape ]. ``source`` (the file name) starts every message.
        """
        traced = parse_partitions(workload.meta.get("partitions"))
        if self.partitions != traced:
            raise AutotuneError(
                f"{source}: policy was made for {self.model} with {_partitions(self.partitions)} but the workload "
                f"was traced with {_partitions(traced)} (runtime/partition.py): its keys name other tensors; trace "
                "the workload with the policy's partitions"
            )
        if self.fingerprint != workload.fingerprint:
            same = (
                " (same name, other structure: the model changed after the search)"
                if self.model == workload.model
                else ""
            )
            raise AutotuneError(
                f"{source}: policy was made for {self.model} (fingerprint {self.fingerprint}) but the "
                f"workload is {workload.model} (fingerprint {workload.fingerprint}){same}; search a policy "
                f"for this model with `autotune search --model {workload.model} ...`"
            )
        self._check_setting(workload.precision, workload.grad_accum, workload.optimizer, workload.model, source)
        self._check_keys(workload, source)
        if self.shape_fingerprint != workload.shape_fingerprint and not allow_other_shapes:
            mine = _shape(self.batch_size, self.seq_len, self.image_size)
            theirs = _shape(workload.batch_size, workload.seq_len, workload.image_size)
            seq = _flags(workload.seq_len, workload.image_size)
            if mine == theirs:  # the file's batch size and its shape fingerprint disagree (an edited file)
                raise AutotuneError(
                    f"{source}: policy was made for {self.model} at {mine} (its batch_size, seq_len and image_size "
                    f"fields; with {self.optimizer or 'sgd'} and {_n(self.grad_accum, 'micro-batch')} a step, whose "
                    "state and gradients the fingerprint counts too) "
                    f"but its shape fingerprint {self.shape_fingerprint} is not that of such a run "
                    f"({workload.shape_fingerprint}): the file's fields disagree (edited by hand?); search again "
                    f"with `autotune search --model {workload.model} --batch-size {workload.batch_size}{seq} ...`"
                )
            raise AutotuneError(
                f"{source}: policy was made for {self.model} at {mine} but the workload is at {theirs} "
                f"(shape fingerprint {self.shape_fingerprint} vs {workload.shape_fingerprint}): a plan for "
                "one shape is not a plan for another; search again with `autotune search --model "
                f"{workload.model} --batch-size {workload.batch_size}{seq} ...` (in Python, "
                "allow_other_shapes=True applies it anyway)"
            )

    def check_settings(
        self,
        *,
        batch_size: int,
        seq_len: int | None,
        precision: str,
        grad_accum: int,
        optimizer: str,
        image_size: int | None = None,
        source: str = "policy",
    ) -> None:
        """Before any trace: refuse the settings that :meth:`check_against` would refuse after it (another
        shape, precision, accumulation or optimizer than the file's). ``image_size`` as the trace records it
        (None at the model's default: autotune.models.given_image_size)."""
        self._check_setting(precision, grad_accum, optimizer, self.model, source, cli=True)
        if (batch_size, seq_len, image_size) != (self.batch_size, self.seq_len, self.image_size):
            mine = _shape(self.batch_size, self.seq_len, self.image_size)
            theirs = _shape(batch_size, seq_len, image_size)
            seq = _flags(seq_len, image_size)
            raise AutotuneError(
                f"{source}: policy was made for {self.model} at {mine}, not {theirs}: a plan for one shape is not "
                f"a plan for another; drop --batch-size/--seq-len/--image-size to use the file's, or search again with "
                f"`autotune search --model {self.model} --batch-size {batch_size}{seq} ...`"
            )

    def _check_setting(
        self, precision: str, grad_accum: int, optimizer: str, model: str, source: str, cli: bool = False
    ) -> None:
        """The precision, accumulation and optimizer of a run against the file's (``cli``: before the trace,
        the run's come from the command line's flags)."""
        drop = "drop {flag} to use the file's, or " if cli else ""
        if self.precision != precision:
            raise AutotuneError(
                f"{source}: policy was made for {self.precision} training but the workload trains in {precision}: "
                "the saved tensors, their sizes and the op times differ (NOTE [ Precision ] in runtime.precision); "
                + drop.format(flag="--precision")
                + f"search a policy for it with `autotune search --model {model} --precision {precision} ...`"
            )
        if self.grad_accum != grad_accum:
            raise AutotuneError(
                f"{source}: policy was made for {_n(self.grad_accum, 'micro-batch')} per optimizer step but the "
                f"workload accumulates {_n(grad_accum, 'micro-batch')}: the gradients live through other parts of "
                "the iteration (NOTE [ Gradient accumulation ] in runtime.trace); "
                + drop.format(flag="--grad-accum")
                + f"search a policy for it with `autotune search --model {model} --grad-accum {grad_accum} ...`"
            )
        if self.optimizer is not None and self.optimizer != optimizer:
            raise AutotuneError(
                f"{source}: policy was made for training with {self.optimizer} but the workload was traced with "
                f"{optimizer}: its state and step temporaries are in the plan; "
                + drop.format(flag="--optimizer")
                + f"search a policy for it with `autotune search --model {model} --optimizer {optimizer} ...` "
                "(`autotune train` and `autotune simulate --policy` take the file's by default)"
            )

    def _check_keys(self, workload: Workload, source: str, *, warn: bool = True) -> None:
        """NOTE [ Keys across devices ]: a trace on another device can save a few other tensors (CUDA's
        fused attention where the CPU runs the math path). When most keys agree (at least half of the
        policy's and half of the workload's), the rest is tolerated: a candidate without an action is kept,
        an action for a tensor this workload does not save is ignored, and one warning says how many.
        Otherwise the policy is for another model: an error."""
        wanted = [c.key for c in workload.candidates]
        extra = sorted(set(self.actions) - set(wanted))
        missing = [k for k in wanted if k not in self.actions]
        if not extra and not missing:
            return
        matched = len(wanted) - len(missing)
        if matched * 2 >= len(wanted) and matched * 2 >= len(self.actions):
            if warn:
                parts = []
                if missing:
                    parts.append(f"{_n(len(missing), 'candidate')} of {workload.model} without an action (kept: "
                                 f"{some_keys(missing)})")  # fmt: skip
                if extra:
                    parts.append(
                        f"{_n(len(extra), 'action')} for tensors it does not save (ignored: {some_keys(extra)})"
                    )
                warnings.warn(
                    f"{source}: {' and '.join(parts)}; expected when the policy was searched on another device's "
                    "trace (otherwise the file was edited)",
                    stacklevel=3,
                )
            return
        if extra:
            raise AutotuneError(
                f"{source}: actions name {_n(len(extra), 'tensor')} that {workload.model} does not save "
                f"({some_keys(extra)}); remove them or {_fix(workload.model)}"
            )
        raise AutotuneError(
            f"{source}: no action for {_n(len(missing), 'candidate')} of {workload.model} "
            f"({some_keys(missing)}); "
            f"every candidate needs one (keep is explicit): add them or {_fix(workload.model)}"
        )

    # -- persistence ---------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)  # Action is a str enum: json writes its value
        d["actions"] = {k: a.value for k, a in self.actions.items()}
        if not self.partitions:
            del d["partitions"]  # files without partitions stay as they were
        if self.optimizer is None:
            del d["optimizer"]
        if self.reserve_bytes is None:
            del d["reserve_bytes"]  # files without a budget stay as they were
        if self.image_size is None:
            del d["image_size"]  # files at the model's default image size stay as they were
        if self.compile_backend is None:
            del d["compile_backend"]  # files for the eager runtime stay as they were
        d["format"] = FORMAT
        return d

    @classmethod
    def from_dict(cls, d: Any, source: str = "<dict>") -> Policy:
        """Validate ``d`` against the format and the schema, then build the policy."""
        if not isinstance(d, dict):
            raise AutotuneError(
                f"{source}: the file holds a JSON {type(d).__name__}, not an object: expected a policy "
                f"(format {FORMAT!r}); {_fix()}"
            )
        fmt = d.get("format")
        if fmt is None:
            raise AutotuneError(f'{source}: no "format" field: expected "format": "{FORMAT}"; {_fix()}')
        if fmt != FORMAT:
            raise AutotuneError(f"{source}: format {fmt!r} is not supported: expected {FORMAT!r}; {_fix()}")
        _validate(d, source)
        for name in ("batch_size", "seq_len", "image_size", "grad_accum", "budget_bytes", "reserve_bytes"):
            if isinstance(d.get(name), float):  # JSON Schema's integers include 2.0; Python's do not
                raise AutotuneError(f"{source}: {name}: {d[name]!r} is not an integer: write it {int(d[name])}")
        if not d["actions"]:  # every training step saves tensors for backward: an empty list names none of them
            raise AutotuneError(
                f'{source}: "actions" is empty: a policy has one action per tensor its model saves for backward '
                f"(edited by hand?); {_fix(d['model'])}"
            )
        pred, meas = d.get("predicted"), d.get("measured")
        try:
            return cls(
                actions={canonical_key(k): Action(a) for k, a in d["actions"].items()},
                # A file from before regions ran as nodes was planned with them under checkpoint: so they run.
                options=PolicyOptions(**{"region_nodes": False, **d.get("options", {})}),
                model=d["model"],
                batch_size=d["batch_size"],
                seq_len=d.get("seq_len"),
                image_size=d.get("image_size"),
                fingerprint=d["fingerprint"],
                shape_fingerprint=d["shape_fingerprint"],
                parameter_fingerprint=d.get("parameter_fingerprint"),
                budget_bytes=d.get("budget_bytes"),
                reserve_bytes=d.get("reserve_bytes"),
                hardware=d["hardware"],
                precision=d.get("precision", "fp32"),
                grad_accum=d.get("grad_accum", 1),
                optimizer=d.get("optimizer"),
                predicted=Prediction(**pred) if pred is not None else None,
                measured=Prediction(**meas) if meas is not None else None,
                provenance=Provenance(**d["provenance"]),
                schedule=_schedule(d["schedule"]) if d.get("schedule") is not None else None,
                partitions=parse_partitions(d.get("partitions")),
                compile_backend=d.get("compile_backend"),
            )
        except AutotuneError as e:  # the lossy check: say which file
            raise AutotuneError(f"{source}: {e}") from None

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write pretty JSON with sorted keys (for diffs), atomically: a temp file beside it, then rename."""
        path = Path(path)
        atomic_write(path, json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")


def load_policy(
    path: str | os.PathLike[str], workload: Workload | None = None, *, allow_other_shapes: bool = False
) -> Policy:
    """Read and validate a policy file; with ``workload``, also check that it was made for it."""
    if not isinstance(path, (str, os.PathLike)) or not (workload is None or isinstance(workload, Workload)):
        raise TypeError(
            f"load_policy(path, workload=None) takes a file's path and a traced Workload (or None), not "
            f"{type(path).__name__} and {type(workload).__name__}: e.g. load_policy('resnet18.policy.json')"
        )
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) else "not UTF-8 text"
        fix = (
            "; check the path (`autotune search` writes <model>.policy.json in the folder it runs in, or --out)"
            if isinstance(e, FileNotFoundError)
            else f"; {_fix()}"
            if isinstance(e, UnicodeDecodeError)
            else ""
        )
        if path.is_dir():  # a folder given for the file in it
            inside = sorted(p.name for p in path.glob("*.policy.json"))
            fix = f"; give a policy file, e.g. {path / inside[0]}" if inside else "; give a policy file, not a folder"
            if len(inside) > 1:
                fix += f" (it holds {len(inside)}: {', '.join(inside[:3])}{', ...' if len(inside) > 3 else ''})"
        raise AutotuneError(f"cannot read policy file '{path}': {why}{fix}") from None
    try:
        d = json.loads(text, object_pairs_hook=_unique_keys)
    except _DuplicateKey as e:
        raise AutotuneError(f"{path}: key {e} appears twice in one object: keep one of them") from None
    except ValueError as e:
        raise AutotuneError(f"'{path}' is not a policy file (not valid JSON: {e}); {_fix()}") from None
    policy = Policy.from_dict(d, source=str(path))
    if workload is not None:
        policy.check_against(workload, allow_other_shapes=allow_other_shapes, source=str(path))
    return policy


# -- helpers -------------------------------------------------------------------------------------------------
def _partitions(parts: Sequence[Partition]) -> str:
    return "partitions " + ", ".join(str(p) for p in parts) if parts else "no partition"


def _schedule(d: dict[str, Any]) -> Schedule:
    return Schedule(**{**d, "regions": [Region.from_dict(r) for r in d.get("regions", [])]})


@functools.cache
def schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of ``autotune.policy/v1``, shipped as package data."""
    return json.loads((importlib.resources.files("runtime") / "policy.schema.json").read_text("utf-8"))


def _validate(d: dict[str, Any], source: str) -> None:
    try:  # a declared dependency, imported here so that importing runtime stays light
        import jsonschema
        from jsonschema.exceptions import best_match
    except ImportError:
        raise AutotuneError("reading policy files needs jsonschema: pip install 'jsonschema>=4.18'") from None
    errors = list(jsonschema.Draft202012Validator(schema()).iter_errors(d))
    if errors:
        err = best_match(errors)
        while err.context:  # "not valid under any of the given schemas" (null or an object): the object's error
            inner = [e for e in err.context if not (e.validator == "type" and e.validator_value == "null")]
            if not inner:
                break
            err = best_match(inner)
        where = ".".join(str(p) for p in err.absolute_path) or "top level"
        more = f" (and {_n(len(errors) - 1, 'more problem')})" if len(errors) > 1 else ""
        message = err.message if len(err.message) <= 300 else err.message[:240] + " ... " + err.message[-40:]
        raise AutotuneError(f"{source}: {where}: {message}{more}")


class _DuplicateKey(ValueError):
    pass


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # json keeps the last of duplicate keys silently; in a hand-merged policy that hides a conflict.
    seen: set[str] = set()
    for k, _ in pairs:
        if k in seen:
            raise _DuplicateKey(repr(k))
        seen.add(k)
    return dict(pairs)


def some_keys(keys: Sequence[str], n: int = 3) -> str:
    """Up to ``n`` keys, quoted, and how many more."""
    shown = ", ".join(repr(k) for k in keys[:n])
    return shown + (f" and {len(keys) - n} more" if len(keys) > n else "")


def _fix(model: str = "M") -> str:
    return f"search a new one with `autotune search --model {model} --budget B`"


def _n(count: int, noun: str) -> str:
    plural = noun + ("es" if noun.endswith(("ch", "sh", "s", "x")) else "s")
    return f"{count} {noun if count == 1 else plural}"


def _shape(batch_size: int, seq_len: int | None, image_size: int | None = None) -> str:
    return (
        f"batch size {batch_size}"
        + (f", sequence length {seq_len}" if seq_len is not None else "")
        + (f", image size {image_size} px" if image_size is not None else "")
    )


def _flags(seq_len: int | None, image_size: int | None) -> str:
    """The search's flags for a shape beyond its batch size."""
    return (f" --seq-len {seq_len}" if seq_len is not None else "") + (
        f" --image-size {image_size}" if image_size is not None else ""
    )


def _autotune_version() -> str:
    # From the installed distribution's metadata: runtime must not import the autotune package.
    try:
        return importlib.metadata.version("autotune")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
