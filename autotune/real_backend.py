"""Real training iterations of one model under a policy, as the environment and ``--measure`` score them.

:func:`real_backend` builds a model from the zoo (autotune/models.py), traces it in real mode and returns a
:class:`RealBackend`: ``backend(actions) -> (peak_bytes, iter_s)``, the ``real`` callable of
:class:`envs.memory_env.MemoryPolicyEnv` and what ``autotune search --measure`` trains the finalists with.
It lives above ``envs`` because it builds models (the layers: ``runtime <- envs <- agents <- autotune``).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from autotune.workloads import device_profile
from runtime.policy import PolicyOptions
from runtime.vocab import COMPRESS
from runtime.workload import Workload


@dataclass
class RealBackend:
    """Real training iterations of one model under a policy: ``backend(actions) -> (peak_bytes, iter_s)``.

    Made by :func:`real_backend`. ``workload`` is the model traced (real mode, on ``device``): build the
    environment on it, so that the action vector's candidates are the ones the runtime sees. The model and
    its optimizer are built once; each call applies the policy with :class:`runtime.apply.PolicyRuntime`
    (``compile_backend``: through ``policy.compiled`` under that ``torch.compile`` backend instead, a compile
    per policy) and runs ``runtime.measure.run_iterations`` (one warm-up, then ``steps`` timed iterations): the peak is
    the largest measured, the time the median. With ``cap_bytes`` on CUDA the device is capped there as
    ``autotune train`` caps it under a policy's budget (the caching allocator's reserved bytes, its cached
    blocks and split ends, must stay within it: what runs out of memory), from an empty cache and with the
    optimizer's state made again in the first iteration, as in a training run's. An
    out-of-memory error is an infinite time; its peak is the allocated peak of the same policy run uncapped
    (the device's total memory when that runs out too)."""

    workload: Workload
    device: str
    steps: int
    options: PolicyOptions
    _entry: Any = field(repr=False)
    _optimizer: Any = field(repr=False)
    compile_backend: str | None = None  # search --compile: each policy trained under torch.compile

    def __call__(
        self, actions: np.ndarray, options: PolicyOptions | None = None, cap_bytes: int | None = None
    ) -> tuple[int, float]:
        """Measure ``actions`` applied with ``options`` (None: the backend's), on CUDA within ``cap_bytes``."""
        import torch

        from runtime.measure import capped_memory
        from runtime.target import allocate_library_workspaces

        if cap_bytes is None or not self.device.startswith("cuda"):
            return self._measure(actions, options)
        allocate_library_workspaces(torch.device(self.device))  # runtime R15 (the trace has, as a rule)
        # The optimizer's state made again in the first iteration, within the cap, as `autotune train` and a
        # training loop make it (NOTE [ The first iteration ] in envs/allocator.py): an earlier finalist's
        # state would sit in segments of its own iterations, a layout the training run never has.
        self._optimizer.state.clear()
        self._optimizer.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()  # what the search, the trace and earlier finalists left cached
        try:
            with capped_memory(self.device, cap_bytes):
                peak, iter_s = self._measure(actions, options)
        finally:
            torch.cuda.empty_cache()
        if math.isfinite(iter_s):
            return peak, iter_s
        return self._measure(actions, options)[0], math.inf  # how far over: the peak with the device uncapped

    def _measure(self, actions: np.ndarray, options: PolicyOptions | None) -> tuple[int, float]:
        import torch

        from runtime.apply import PolicyRuntime
        from runtime.measure import run_iterations
        from runtime.policy import Policy

        actions = np.asarray(actions, dtype=np.int8)
        options = options or self.options
        if np.any(actions == COMPRESS) and not options.lossy:
            # The environment proposes compress only when its problem allows it: that is the user's consent.
            options = dataclasses.replace(options, lossy=True)
        policy = Policy.from_vector(self.workload, actions, hardware=self.device, options=options)
        entry = self._entry
        loss_fn, around_step = entry.loss_fn, None
        if self.compile_backend is None:
            around_step = PolicyRuntime(policy, entry.module).step
        else:  # the compiled model shares the module's parameters: the optimizer steps them
            cm = policy.compiled(entry.module, backend=self.compile_backend)

            def loss_fn(_model: Any, b: Any) -> Any:
                return entry.loss_fn(cm, b)

        try:
            steps = run_iterations(
                entry.module,
                entry.batch,
                loss_fn,
                self._optimizer,
                steps=self.steps,
                batch_size=entry.batch_size,
                around_step=around_step,
                precision=self.workload.precision,
                grad_accum=self.workload.grad_accum,
                cpu_peak="tracker" if self.compile_backend is None else "profiler",
            )
        except torch.OutOfMemoryError:
            self._optimizer.zero_grad(set_to_none=True)
            total = torch.cuda.get_device_properties(torch.device(self.device)).total_memory
            return int(total), math.inf
        peak = max(s.peak_bytes for s in steps)
        if any(s.alloc_retries or s.segments_freed for s in steps):
            # Steady iterations that ran only by the allocator freeing its cache within the cap: each cudaFree
            # synchronises the device, and a run this close to the cap is one another process can lose (NOTE
            # [ Measured search ]): not a fit.
            return peak, math.inf
        return peak, statistics.median(s.iter_s for s in steps)


def real_backend(
    model_name: str,
    batch_size: int | None,
    device: str = "cpu",
    steps: int = 2,
    *,
    image_size: int | None = None,
    seq_len: int | None = None,
    config_overrides: dict[str, Any] | None = None,
    options: PolicyOptions | None = None,
    optimizer: str = "sgd",
    precision: str = "fp32",
    grad_accum: int = 1,
    partitions: tuple[Any, ...] = (),
    compile_backend: str | None = None,
) -> RealBackend:
    """A ``real`` callable for :class:`MemoryPolicyEnv` that trains ``model_name`` (any name
    :func:`autotune.models.build_model` accepts, with its ``image_size``, ``seq_len`` and
    ``config_overrides``) at ``batch_size`` (None: the model's default) on ``device``, ``steps`` timed
    iterations per policy, with ``optimizer``, ``precision`` and ``grad_accum`` as ``autotune train`` takes
    them; ``partitions`` (runtime.partition.Partition), submodules run on slices of the batch: traced so, and
    applied by every policy the backend makes (runtime R13); ``compile_backend``, each policy trained under
    ``torch.compile`` with that backend (``policy.compiled``, NOTE [ Compiled policies ]).

    The model is traced here in real mode on ``device`` (as ``autotune train`` does: some models, GPT-2's
    attention mask for one, take another path under fake tensors); pass ``backend.workload`` to the
    environment. ``options`` (prefetch look-ahead, compress dtype) should be the problem's options::

        backend = real_backend("resnet18", 2, image_size=32)
        problem = Problem(backend.workload, calibrate_cpu(), budget_bytes=...)
        env = MemoryPolicyEnv(problem, backend="real", real=backend)

    torch, the model zoo and the runtime are imported here, not with this module."""
    from autotune.models import build_model, given_image_size
    from runtime.trace import capture, make_optimizer

    if steps <= 0:
        raise ValueError(f"steps={steps}: expected a positive number of timed iterations")

    entry = build_model(
        model_name,
        batch_size=batch_size,
        image_size=image_size,
        seq_len=seq_len,
        device=device,
        config_overrides=config_overrides,
    )

    def build_for_trace() -> Any:
        return entry.module, entry.batch, entry.loss_fn

    w = capture(build_for_trace, name=model_name, batch_size=entry.batch_size, seq_len=entry.seq_len, fake=False,
                device=device, optimizer=optimizer, precision=precision, grad_accum=grad_accum,
                partitions=partitions)  # fmt: skip
    w.seq_len = entry.seq_len
    w.image_size = given_image_size(model_name, image_size)
    w.compute_fingerprints()  # with the image size: the policies it makes are for it
    w.meta["device_profile"] = device_profile(device)
    opt = make_optimizer(w.optimizer, entry.module.parameters())
    return RealBackend(w, device, steps, options or PolicyOptions(), entry, opt, compile_backend)


__all__ = ["RealBackend", "real_backend"]
