"""The runtime's host cost and the simulator's fidelity, measured side by side in one process.

    python experiments/bench_runtime.py [--device cpu] [--models resnet50,gpt2] [--rounds 9] [--pairs] [--json FILE]

On the CPU the default models are host-bound proxies of a fast GPU (kernels of microseconds, so what the
runtime adds on the host shows): ResNet-50 at batch 2 and 64 px, and a 2-layer GPT-2 (vocabulary 512) at
batch 2 x 64 tokens. On CUDA (experiments/gpu_check.py) they are ResNet-50 at batch 64 and GPT-2 small at
batch 8 x 1024. For each, interleaved round by round (medians of per-round ratios, these machines are
shared and noisy), every variant of a section on one model instance (the runtime and the checkpoint wrappers
are installed for a step and gone after it):

1. Hooks: plain PyTorch against the runtime applying an all-keep policy as it is applied (it installs
   nothing per tensor) and with every pack observed (``force_hooks``: the per-pack cost). Target: <= +2%.
2. Per-block recompute against ``torch.utils.checkpoint`` on every block (as users call it: non-reentrant,
   its defaults otherwise): the policy that recomputes exactly what checkpointing does, which the runtime
   runs as regions (runtime R10), as one node each (its default) and checkpointed (``region_nodes`` off);
   time and measured peak. Target: ratio <= 1.00 at no higher peak, either way (the search picks).
3. Fidelity: predicted against measured peak and time for keep, swap, recompute (every block's inside,
   stem and loss included), per-block recompute and two random mixed policies, on the device's profile
   (the calibrated ``cpu`` profile, host costs included; the detected GPU's) with a real-mode trace.
   Targets: time within 10% for every policy; peaks within 3% on a GPU. By default every policy and plain
   training are interleaved in one round; ``--pairs`` measures each policy against plain training alone.
4. Phases (``--sections phases``, not in the default run): where a recompute step's time goes. Plain
   training, ``torch.utils.checkpoint`` per block and the runtime's per-block recompute, each step split into
   forward, backward and optimizer by events on the device's clock (CUDA events; the host's clock on a CPU),
   medians over interleaved rounds, beside the real trace's op times summed by phase (what the simulator
   plans with). Then one step of each under ``torch.profiler``: the kernels' summed time against the step's
   wall time (on a GPU: is the extra time more device work, or a device left idle?), the host's
   synchronisations and cudaMalloc/cudaFree calls, and the kernels (CPU: ops) whose time grows most.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint

from autotune.models import build_model
from autotune.train import _profile_for
from envs.simulator import Simulator, uniform_actions
from runtime.apply import PolicyRuntime
from runtime.hardware import op_times_s
from runtime.keys import block_paths
from runtime.measure import run_iterations
from runtime.policy import Action, Policy, PolicyOptions
from runtime.trace import capture, make_optimizer
from runtime.workload import Phase, Workload

T = TypeVar("T")


@dataclass(frozen=True)
class Case:
    name: str
    batch_size: int
    image_size: int | None = None
    seq_len: int | None = None
    overrides: tuple[tuple[str, Any], ...] = ()

    def build(self, device: str) -> Any:
        return build_model(
            self.name,
            batch_size=self.batch_size,
            image_size=self.image_size,
            seq_len=self.seq_len,
            config_overrides=dict(self.overrides) or None,
            device=device,
        )

    @property
    def label(self) -> str:
        size = f"{self.image_size} px" if self.image_size else f"{self.seq_len} tokens" if self.seq_len else ""
        extra = ", ".join(f"{k}={v}" for k, v in self.overrides)
        return f"{self.name} batch {self.batch_size}" + (f", {size}" if size else "") + (f" ({extra})" if extra else "")


CPU_CASES = {
    "resnet50": Case("resnet50", 2, image_size=64),
    "gpt2": Case("gpt2", 2, seq_len=64, overrides=(("n_layer", 2), ("vocab_size", 512), ("bos_token_id", 0),
                                                  ("eos_token_id", 0))),
}  # fmt: skip
CUDA_CASES = {"resnet50": Case("resnet50", 64), "gpt2": Case("gpt2", 8, seq_len=1024)}


class _Checkpointed(torch.nn.Module):
    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, *args: torch.Tensor, **kwargs: object) -> torch.Tensor:
        return checkpoint(self.block, *args, use_reentrant=False, **kwargs)  # type: ignore[no-any-return]


def _wrapped_blocks(model: torch.nn.Module) -> set[str]:
    """The blocks users wrap: elements of a Sequential or ModuleList (runtime.keys.block_paths)."""
    lists = (torch.nn.Sequential, torch.nn.ModuleList)
    return {
        b
        for p, b in block_paths(model).items()
        if p == b and "." in b and isinstance(model.get_submodule(b.rpartition(".")[0]), lists)
    }


def checkpoint_blocks(model: torch.nn.Module) -> torch.nn.Module:
    """Wrap every block in non-reentrant checkpoint, as a user would."""
    for path in sorted(_wrapped_blocks(model), key=len, reverse=True):
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        parent[int(name)] = _Checkpointed(parent[int(name)])  # type: ignore[index]
    return model


def block_recompute(w: Workload, model: torch.nn.Module) -> np.ndarray:
    """Recompute what checkpointing every block recomputes: the candidates made inside a wrapped block and
    saved nowhere else (block inputs and outputs kept), every other candidate kept."""
    blocks = _wrapped_blocks(model)
    return np.array([2 if c.block in blocks and not c.block_input else 0 for c in w.candidates], dtype=np.int8)


def trace(case: Case, device: str) -> Workload:
    """A real-mode trace on ``device``: its op times are measured there (runtime.hardware.op_times_s)."""

    def build():  # type: ignore[no-untyped-def]
        e = case.build(device)
        return e.module, e.batch, e.loss_fn

    w = capture(build, name=case.name, batch_size=case.batch_size, seq_len=case.seq_len, fake=False, device=device)
    w.meta["device_profile"] = _profile_for(device).name
    return w


@contextlib.contextmanager
def _checkpointed_step(blocks: list[torch.nn.Module]) -> Iterator[None]:
    """For one step, every block's forward under non-reentrant checkpoint, as a user's wrapper calls it
    (``checkpoint_blocks``), installed on the module itself so that other runners can share the model."""
    for block in blocks:
        forward = type(block).forward.__get__(block)
        block.__dict__["forward"] = functools.partial(checkpoint, forward, use_reentrant=False)
    try:
        yield
    finally:
        for block in blocks:
            del block.__dict__["forward"]


class Runner:
    """One way to train a model, optionally under a runtime or with every block checkpointed: one timed
    training step at a time. Runners of one section share one model and optimizer (``share``): two instances
    of the same model run several percent apart for no reason of theirs (plain against plain, 31 rounds:
    0.999 to 1.014), and resident copies slow each other down."""

    def __init__(self, case: Case, device: str, policy: Policy | None = None, *, wrap: bool = False,
                 force_hooks: bool = False, share: Runner | None = None) -> None:  # fmt: skip
        if share is not None:
            self.entry, self.opt = share.entry, share.opt
        else:
            self.entry = case.build(device)
            self.opt = make_optimizer("sgd", self.entry.module.parameters())
        model = self.entry.module
        self.blocks = [model.get_submodule(p) for p in sorted(_wrapped_blocks(model))] if wrap else []
        self.rt = PolicyRuntime(policy, model) if policy is not None else None
        self.force = force_hooks
        self.batch_size = case.batch_size
        self.step(measure_peak=False)  # the first step: warm-up, and the runtime's learning step

    def around(self) -> contextlib.AbstractContextManager[Any]:
        if self.rt is not None:
            return self.rt.step(force_hooks=self.force)
        return _checkpointed_step(self.blocks) if self.blocks else contextlib.nullcontext()

    def step(self, measure_peak: bool = False) -> tuple[float, int]:
        """(seconds, peak bytes: measured when asked, else 0) of one step."""
        runs = run_iterations(
            self.entry.module,
            self.entry.batch,
            self.entry.loss_fn,
            self.opt,
            steps=1,
            warmup=0,
            batch_size=self.batch_size,
            around_step=self.around,
        ) if measure_peak else None  # fmt: skip
        if runs is not None:
            return runs[0].iter_s, runs[0].peak_bytes
        return self._timed(), 0

    def _timed(self) -> float:
        e = self.entry
        cuda = next(e.module.parameters()).is_cuda
        self.opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        with self.around():
            e.loss_fn(e.module, e.batch).backward()
        self.opt.step()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start


def interleaved(
    runners: dict[str, Runner], rounds: int, measure: Callable[[Runner], T] = lambda r: r.step()[0]
) -> dict[str, list[T]]:
    """One step of each runner per round (``measure``: what a step gives, its seconds by default); which one
    goes first turns from round to round (a step run right after another can be several percent faster with
    the same work)."""
    times: dict[str, list[T]] = {k: [] for k in runners}
    keys = list(runners)
    for i in range(rounds):
        turn = i % len(keys)
        for k in keys[turn:] + keys[:turn]:
            times[k].append(measure(runners[k]))
    return times


def ratio(times: dict[str, list[float]], a: str, b: str) -> float:
    return float(statistics.median(x / y for x, y in zip(times[a], times[b], strict=True)))


def hooks(case: Case, device: str, w: Workload, rounds: int, out: dict[str, Any]) -> None:
    keep = Policy.uniform(w, Action.KEEP, hardware="measured")
    plain = Runner(case, device)
    runners = {
        "plain": plain,
        "keep": Runner(case, device, keep, share=plain),
        "hooks": Runner(case, device, keep, force_hooks=True, share=plain),
    }
    t = interleaved(runners, rounds)
    applied, forced = ratio(t, "keep", "plain"), ratio(t, "hooks", "plain")
    packs = runners["hooks"].rt.stats.packs if runners["hooks"].rt else 0  # type: ignore[union-attr]
    out["hooks"] = {"plain_s": statistics.median(t["plain"]), "all_keep": applied, "every_pack": forced,
                    "packs": packs}  # fmt: skip
    print(
        f"1. hooks: plain {statistics.median(t['plain']) * 1e3:.1f} ms; all-keep as applied x{applied:.3f} "
        f"({(applied - 1) * 100:+.1f}%, target <= +2%: {'met' if applied <= 1.02 else 'missed'}); every pack "
        f"observed ({packs} packs) x{forced:.3f} ({(forced - 1) * 100:+.1f}%)",
        flush=True,
    )


def recompute_vs_checkpoint(case: Case, device: str, w: Workload, rounds: int, out: dict[str, Any]) -> None:
    probe = case.build(device).module
    vec = block_recompute(w, probe)
    pol = Policy.from_vector(w, vec, hardware="measured")
    checkpointed = Policy.from_vector(w, vec, hardware="measured", options=PolicyOptions(region_nodes=False))
    regions = len(pol.schedule.regions) if pol.schedule else 0
    ours = Runner(case, device, pol)
    runners = {"ours": ours, "ours_checkpointed": Runner(case, device, checkpointed, share=ours),
               "checkpoint": Runner(case, device, wrap=True, share=ours)}  # fmt: skip
    t = interleaved(runners, rounds)
    r, r_ckpt = ratio(t, "ours", "checkpoint"), ratio(t, "ours_checkpointed", "checkpoint")
    peaks = {k: runner.step(True)[1] for k, runner in runners.items()}
    peak_ours, peak_ckpt = peaks["ours"], peaks["checkpoint"]
    met = (r <= 1.0 and peak_ours <= peak_ckpt) or (r_ckpt <= 1.0 and peaks["ours_checkpointed"] <= peak_ckpt)
    out["recompute_vs_checkpoint"] = {"ratio": r, "peak_bytes": peak_ours, "checkpoint_peak_bytes": peak_ckpt,
                                      "checkpointed_ratio": r_ckpt,
                                      "checkpointed_peak_bytes": peaks["ours_checkpointed"],
                                      "regions": regions, "blocks": len(_wrapped_blocks(probe))}  # fmt: skip
    print(
        f"2. per-block recompute ({regions} regions for {len(_wrapped_blocks(probe))} blocks) / "
        f"torch.utils.checkpoint per block ({peak_ckpt / 2**20:.1f} MiB): as nodes x{r:.3f} at "
        f"{peak_ours / 2**20:.1f} MiB, checkpointed x{r_ckpt:.3f} at {peaks['ours_checkpointed'] / 2**20:.1f} MiB; "
        f"target <= 1.00 at <= its peak (either way, the search picks): {'met' if met else 'missed'}",
        flush=True,
    )


def fidelity(case: Case, device: str, w: Workload, rounds: int, out: dict[str, Any], pairs: bool = False) -> None:
    hw = _profile_for(device)
    sim = Simulator(w, hw)
    rng = np.random.default_rng(0)
    k = len(w.candidates)
    probe = case.build(device).module
    vectors: dict[str, np.ndarray] = {
        "keep": uniform_actions(w, Action.KEEP),
        "swap": uniform_actions(w, Action.SWAP),
        "recompute": uniform_actions(w, Action.RECOMPUTE),
        "block-recompute": block_recompute(w, probe),
        "mixed-1": rng.integers(0, 3, k).astype(np.int8),
        "mixed-2": rng.integers(0, 3, k).astype(np.int8),
    }
    del probe  # its parameters would count in every policy's measured peak (an H200 run: +0.3 GiB on ResNet-50)
    policies = {
        label: Policy.from_vector(w, vec, hardware=hw.name, options=PolicyOptions(prefetch_lookahead=2))
        for label, vec in vectors.items()
    }
    peaks: dict[str, int] = {}
    if pairs:  # each policy against plain training alone
        times: dict[str, list[float]] = {}
        for label, p in policies.items():
            plain = Runner(case, device)
            pair = {"plain": plain, label: Runner(case, device, p, share=plain)}
            t = interleaved(pair, rounds)
            times[label], times[f"plain/{label}"] = t[label], t["plain"]
            peaks[label] = pair[label].step(True)[1]
            del pair
    else:
        plain = Runner(case, device)
        runners = {"plain": plain, **{label: Runner(case, device, p, share=plain) for label, p in policies.items()}}
        times = interleaved(runners, rounds)  # round by round: the machine's drift hits every policy alike
        peaks = {label: runners[label].step(True)[1] for label in policies}
    base = sim.run(policies["keep"]).iter_s
    print(f"3. fidelity on the {hw.name} profile (host costs: {hw.host.source}); time also relative to plain training "
          f"measured in the same rounds, which the machine's drift does not move"
          f"{' (each policy paired with plain training alone)' if pairs else ''}", flush=True)  # fmt: skip
    print(f"   {'policy':16s} {'peak pred':>10s} {'measured':>10s} {'err':>7s}   {'time pred':>10s} {'measured':>10s} "
          f"{'err':>7s}   {'x plain':>7s} {'measured':>8s} {'err':>7s}  regions overhead", flush=True)  # fmt: skip
    rows = []
    for label, policy in policies.items():
        pred = sim.run(policy)
        peak = peaks[label]
        mt = statistics.median(times[label])
        rel_pred, rel = pred.iter_s / base, ratio(times, label, f"plain/{label}" if pairs else "plain")
        row = {"policy": label, "peak_pred": pred.peak_bytes, "peak": peak, "time_pred": pred.iter_s, "time": mt,
               "relative_pred": rel_pred, "relative": rel, "regions": pred.regions,
               "overhead_s": pred.overhead_s}  # fmt: skip
        rows.append(row)
        peak_err, time_err, rel_err = (pred.peak_bytes - peak) / peak, (pred.iter_s - mt) / mt, (rel_pred - rel) / rel
        print(
            f"   {label:16s} {pred.peak_bytes / 2**20:8.1f}Mi {peak / 2**20:8.1f}Mi {peak_err:+7.1%}"
            f"   {pred.iter_s * 1e3:8.1f}ms {mt * 1e3:8.1f}ms {time_err:+7.1%}"
            f"   {rel_pred:7.3f} {rel:8.3f} {rel_err:+7.1%}  {pred.regions:3d} {pred.overhead_s * 1e3:7.1f} ms",
            flush=True,
        )
    worst = max(abs(r["time_pred"] - r["time"]) / r["time"] for r in rows)
    worst_rel = max(abs(r["relative_pred"] - r["relative"]) / r["relative"] for r in rows)
    out["fidelity"] = {"pairs": pairs, "rows": rows}
    print(
        f"   largest time error {worst:.1%}, relative to plain {worst_rel:.1%} (target <= 10%: "
        f"{'met' if worst <= 0.10 else 'missed'}; relative {'met' if worst_rel <= 0.10 else 'missed'})",
        flush=True,
    )


def _phased_step(r: Runner) -> tuple[float, float, float, float]:
    """(forward, backward, optimizer, wall) seconds of one step of ``r``, the phases on the device's clock."""
    e = r.entry
    cuda = next(e.module.parameters()).is_cuda

    def mark() -> Any:
        if not cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def span(a: Any, b: Any) -> float:
        return float(a.elapsed_time(b)) / 1e3 if cuda else float(b - a)

    r.opt.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    with r.around():
        m0 = mark()
        loss = e.loss_fn(e.module, e.batch)
        m1 = mark()
        loss.backward()
        m2 = mark()
    r.opt.step()
    m3 = mark()
    if cuda:
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    return span(m0, m1), span(m1, m2), span(m2, m3), wall


def _profiled_step(r: Runner, cuda: bool) -> dict[str, Any]:
    """One step of ``r`` under torch.profiler: summed kernel (CPU: op self) time by name, and host calls."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=acts) as prof:
        wall = r.step()[0]
    by_name: dict[str, float] = {}
    calls: dict[str, int] = {}
    for ev in prof.events():
        device = ev.device_type == torch.autograd.DeviceType.CUDA
        if cuda and device:
            by_name[ev.name] = by_name.get(ev.name, 0.0) + ev.time_range.elapsed_us() / 1e6
        elif not cuda and ev.name.startswith("aten::"):
            by_name[ev.name] = by_name.get(ev.name, 0.0) + ev.self_cpu_time_total / 1e6
        if (
            not device
            and ev.name.startswith("cuda")
            and any(s in ev.name for s in ("Synchronize", "Malloc", "Free", "Memcpy"))
        ):
            calls[ev.name] = calls.get(ev.name, 0) + 1
    return {"wall_s": wall, "busy_s": sum(by_name.values()), "by_name": by_name, "calls": calls}


def phases(case: Case, device: str, w: Workload, rounds: int, out: dict[str, Any]) -> None:
    hw = _profile_for(device)
    times = op_times_s(w, hw)
    traced = {ph: sum(t for op, t in zip(w.ops, times, strict=True) if op.phase == ph) for ph in Phase}
    probe = case.build(device).module
    pol = Policy.from_vector(w, block_recompute(w, probe), hardware=hw.name)
    del probe
    sim = Simulator(w, hw)
    plain = Runner(case, device)
    runners = {"plain": plain, "checkpoint": Runner(case, device, wrap=True, share=plain),
               "ours": Runner(case, device, pol, share=plain)}  # fmt: skip
    split = interleaved(runners, rounds, _phased_step)
    med = {k: [statistics.median(s[j] for s in v) for j in range(4)] for k, v in split.items()}
    keep, planned = sim.run(Policy.uniform(w, Action.KEEP, hardware=hw.name)), sim.run(pol)
    print(f"4. phases on the device's clock (ms, medians of {rounds}); the real trace's op times by phase: forward "
          f"{traced[Phase.FORWARD] * 1e3:.1f}, backward {traced[Phase.BACKWARD] * 1e3:.1f}, optimizer "
          f"{traced[Phase.OPTIMIZER] * 1e3:.1f}; planned: keep {keep.iter_s * 1e3:.1f}, per-block recompute "
          f"{planned.iter_s * 1e3:.1f}", flush=True)  # fmt: skip
    cuda = device.startswith("cuda")
    prof = {k: _profiled_step(r, cuda) for k, r in runners.items()}
    rows = {}
    for k in runners:
        f, b, o, wall = med[k]
        p = prof[k]
        rows[k] = {"forward_s": f, "backward_s": b, "optimizer_s": o, "wall_s": wall, "profiled_wall_s": p["wall_s"],
                   "busy_s": p["busy_s"], "calls": p["calls"]}  # fmt: skip
        print(f"   {k:10s} forward {f * 1e3:7.1f}  backward {b * 1e3:7.1f}  optimizer {o * 1e3:6.1f}  wall "
              f"{wall * 1e3:7.1f}; profiled: {'kernels' if cuda else 'ops'} {p['busy_s'] * 1e3:7.1f} of "
              f"{p['wall_s'] * 1e3:7.1f}; host calls {dict(sorted(p['calls'].items()))}", flush=True)  # fmt: skip
    for k in ("checkpoint", "ours"):
        grow = {n: t - prof["plain"]["by_name"].get(n, 0.0) for n, t in prof[k]["by_name"].items()}
        top = sorted(grow.items(), key=lambda kv: -kv[1])[:8]
        rows[k]["grown"] = top
        print(f"   grown most in {k} over plain: " + "; ".join(f"{n[:60]} +{t * 1e3:.2f} ms" for n, t in top),
              flush=True)  # fmt: skip
    out["phases"] = {"traced_s": {ph.value: t for ph, t in traced.items()}, "planned_keep_s": keep.iter_s,
                     "planned_block_recompute_s": planned.iter_s, "rows": rows}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--models", default="resnet50,gpt2", help="which proxies: resnet50, gpt2")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--sections", default="hooks,recompute_vs_checkpoint,fidelity")
    ap.add_argument("--json", default=None, help="write the figures here")
    ap.add_argument("--pairs", action="store_true", help="fidelity: each policy against plain training alone")
    args = ap.parse_args()
    cases = CUDA_CASES if args.device.startswith("cuda") else CPU_CASES
    results: dict[str, Any] = {"device": args.device, "torch": torch.__version__, "threads": torch.get_num_threads()}
    sections: dict[str, Callable[..., None]] = {
        "hooks": hooks, "recompute_vs_checkpoint": recompute_vs_checkpoint,
        "fidelity": functools.partial(fidelity, pairs=args.pairs), "phases": phases,
    }  # fmt: skip
    for name in args.models.split(","):
        case = cases[name]
        print(f"\n== {case.label} on {args.device} (torch {torch.__version__}, {torch.get_num_threads()} threads)",
              flush=True)  # fmt: skip
        out: dict[str, Any] = results.setdefault(name, {"case": case.label})
        w = trace(case, args.device)
        for section in args.sections.split(","):
            try:
                sections[section](case, args.device, w, args.rounds, out)
            except Exception:  # one broken section must not hide the others' figures
                print(f"{section} failed:\n{traceback.format_exc()}", flush=True)
                out[section] = {"error": traceback.format_exc().splitlines()[-1]}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
