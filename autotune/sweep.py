"""`autotune sweep`: many models x budgets x profiles in one Optuna storage, resumable, with a report.

NOTE [ Sweep storage ]
    Each cell (model, batch, precision, profile, budget) is one Optuna study named
    ``sweep.<model>.b<batch>[.<precision>].<profile>.<budget bytes>`` in the sweep's storage (SQLite file
    by default, any RDB URL Optuna accepts). The study's trials are the ``optuna`` method's (TPE over the
    parametric rule, seeded with the heuristics, ``--trials`` in all); its user attributes hold the rest:
    ``baselines`` (every published heuristic's status, peak and samples/s), ``no_policy``, ``ppo`` (the RL
    agent's best episode), ``per_method`` (each method's best fitting samples/s), ``best`` (the fastest
    fitting policy of the cell and which method found it, as an action vector), ``done`` (baselines and
    ppo, once finished) and ``optuna_trials`` (the ``--trials`` of the last Optuna search that ran to its end,
    by its trials or its ``--timeout``). Running the sweep again with the same storage skips what is done: a
    study is searched again only where it holds fewer than ``--trials`` completed trials and no search for
    that many or more ran to its end (so a larger ``--trials`` goes on; the same command recomputes nothing,
    where a cell stopped by its ``--timeout`` was searched again on every run, with another answer). With
    ``--heartbeat``, a killed worker's trial is failed and retried (NOTE [ Distributed search ] in
    agents/optuna_search.py), so several `autotune sweep` processes can share one PostgreSQL storage.
    Ctrl-C stops the whole sweep: the cell being searched keeps what its study stored (its Optuna trials,
    its best policy so far, but not ``ppo`` in ``done``), no later cell starts, and the command exits 130
    after the table of the cells it reached; the same command resumes.
    On a GPU profile a cell plans the tensors' bytes (``--budget-kind allocated`` in `autotune search`'s terms),
    and its chosen policy is then run three iterations on the model of PyTorch's caching allocator with the
    device capped at the planned budget (NOTE [ Reserved budget ] in autotune/reserved.py): the table, the
    JSON and the report say where it runs out there; it is not stored (a resumed cell checks again).
    A cell where keeping everything fits (a heuristic's policy that keeps every saved tensor fits the budget)
    is answered by it, as `autotune search` answers at once there (the fastest policy there is: every other
    action adds work): its ``best`` is method ``keep all``, ``keeps_all`` is set, and neither Optuna nor the
    RL agent runs there (each spent its whole ``--timeout`` to find it again), now or when resumed.
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from agents.base import Problem, RunState, SearchContext, SearchResult, baseline_names, best_of, get_searcher
from agents.optuna_search import create_study, storage_for
from agents.rl import DEFAULT_EPISODES
from autotune.budget import budget_of, record_budget
from autotune.partitions import partition_tag
from autotune.reserved import reserved_stats
from autotune.search import budget_floor, format_bytes, plain_no_policy
from envs.simulator import SimResult
from runtime.errors import AutotuneError
from runtime.hardware import HardwareProfile
from runtime.policy import Policy, PolicyOptions, Prediction
from runtime.workload import Workload

METHODS = ("baselines", "optuna", "ppo")
DEFAULT_TRIALS = 60


def check_methods(value: str) -> list[str]:
    names = [m.strip() for m in value.split(",") if m.strip()]
    unknown = [m for m in names if m not in METHODS]
    if unknown or not names:
        what = f"unknown method {unknown[0]!r} in --methods {value!r}" if unknown else f"--methods {value!r} names none"
        raise AutotuneError(f"{what}: expected a comma-separated list of {', '.join(METHODS)}, e.g. --methods "
                            "baselines,optuna")  # fmt: skip
    return list(dict.fromkeys(names))  # each once


def cell_study_name(w: Workload, hw: HardwareProfile, budget_bytes: int) -> str:
    """One study per workload, profile and planned budget: everything that makes another problem is in the
    name (a sweep again with another --optimizer or --seq-len on the same storage resumed the first one's
    studies and answered with their policies)."""
    return f"sweep.{w.model}.{problem_tag(w)}.{hw.name}.{budget_bytes}"


def problem_tag(w: Workload) -> str:
    """What tells one traced problem of a model from another: batch size, then sequence length, precision,
    optimizer, accumulation and partitions where not the defaults (``b8.s1024.bf16.adamw``, ``b64.i32``)."""
    seq = f".s{w.seq_len}" if w.seq_len is not None else ""
    seq += f".i{w.image_size}" if w.image_size is not None else ""
    precision = f".{w.precision}" if w.precision != "fp32" else ""
    optimizer = f".{w.optimizer}" if w.optimizer != "sgd" else ""
    accum = f".ga{w.grad_accum}" if w.grad_accum > 1 else ""
    # A partitioned trace's candidates are the slices' tensors: a study of its own (--allow-partition).
    return f"b{w.batch_size}{seq}{precision}{optimizer}{accum}{partition_tag(w)}"


@dataclass
class CellResult:
    """One cell as stored (NOTE [ Sweep storage ])."""

    model: str
    batch_size: int
    profile: str
    budget_bytes: int  # planned for: the budget as typed less reserve_bytes (NOTE [ Budget and reserve ])
    study_name: str
    no_policy: dict[str, Any]
    baselines: dict[str, dict[str, Any]] = field(default_factory=dict)
    ppo: dict[str, Any] | None = None
    best: dict[str, Any] | None = None  # the fastest fitting policy (None: nothing fits)
    per_method: dict[str, float] = field(default_factory=dict)  # each method's best fitting samples/s
    below_floor: bool = False
    floor_bytes: int | None = None  # below_floor: what no policy's peak goes below (envs.simulator.peak_floor)
    resumed: list[str] = field(default_factory=list)  # methods found done in the storage
    wall_s: float = 0.0
    reserve_bytes: int = 0
    partitions: list[dict[str, Any]] = field(default_factory=list)  # --allow-partition: the slices searched
    interrupted: bool = False  # Ctrl-C stopped this cell's search: it holds what was found until then
    # the chosen policy's reserved peak on the caching allocator's model, capped at the planned budget (NOTE
    # [ Sweep storage ]): None where it runs out there; absent (``reserved_checked`` False) off a GPU profile
    reserved_bytes: int | None = None
    reserved_checked: bool = False

    def floor_text(self) -> str:
        """A cell below its floor, with the floor as a budget to type (the reserve added back)."""
        if self.floor_bytes is None:
            return "below the floor"
        return f"below the floor: no policy under {format_bytes(self.floor_bytes + self.reserve_bytes)}"

    def reserved_text(self) -> str:
        """What the chosen policy does on the caching allocator's model, where checked."""
        if not self.reserved_checked:
            return ""
        if self.reserved_bytes is None:
            return "runs out on the caching allocator's model"
        return f"{format_bytes(self.reserved_bytes)} reserved on the caching allocator's model"

    @property
    def slices(self) -> str:
        """The partitions the cell planned on, ``features/4`` (empty: none)."""
        return ", ".join(f"{p['module']}/{p['chunks']}" for p in self.partitions)

    def to_json(self) -> dict[str, Any]:
        best_h = self.best_heuristic()
        return {
            "model": self.model,
            "batch_size": self.batch_size,
            "gpu": self.profile,
            "budget_bytes": self.budget_bytes + self.reserve_bytes,  # as typed, as search and maxbatch say it
            "planned_budget_bytes": self.budget_bytes,
            "reserve_bytes": self.reserve_bytes,
            "study": self.study_name,
            "below_floor": self.below_floor,
            "floor_bytes": self.floor_bytes,  # planned, as planned_budget_bytes; the least budget to type:
            "floor_budget_bytes": None if self.floor_bytes is None else self.floor_bytes + self.reserve_bytes,
            "no_policy_samples_per_s": self.no_policy["samples_per_s"],
            "no_policy_peak_bytes": self.no_policy["peak_bytes"],
            "best_heuristic": best_h[0] if best_h else None,
            "best_heuristic_samples_per_s": best_h[1]["samples_per_s"] if best_h else None,
            "optuna_samples_per_s": self.best_of("optuna"),
            "ppo_samples_per_s": self.ppo["samples_per_s"] if self.ppo and self.ppo["feasible"] else None,
            "best_method": self.best["method"] if self.best else None,
            "samples_per_s": self.best["samples_per_s"] if self.best else None,
            "peak_bytes": self.best["peak_bytes"] if self.best else None,
            "resumed": self.resumed,
            "wall_s": self.wall_s,
            "partitions": self.partitions,
            "interrupted": self.interrupted,
            "reserved_peak_bytes": self.reserved_bytes,
            "runs_on_allocator_model": (self.reserved_bytes is not None) if self.reserved_checked else None,
        }

    def best_heuristic(self) -> tuple[str, dict[str, Any]] | None:
        fits = [(n, r) for n, r in self.baselines.items() if r["feasible"]]
        return max(fits, key=lambda nr: nr[1]["samples_per_s"]) if fits else None

    def best_of(self, method: str) -> float | None:
        return self.per_method.get(method)


def _sim_json(r: SimResult) -> dict[str, Any]:
    return {"feasible": r.feasible, "peak_bytes": r.peak_bytes, "samples_per_s": r.samples_per_s, "iter_s": r.iter_s}


def run_cell(
    w: Workload,
    hw: HardwareProfile,
    budget_bytes: int,
    *,
    methods: Sequence[str],
    storage: str,
    trials: int,
    timeout_s: float,
    seed: int = 0,
    heartbeat_s: float | None = None,
    progress: Callable[[str], None] | None = None,
    reserve_bytes: int = 0,
    plain: Workload | None = None,
    state: RunState | None = None,
) -> CellResult:
    """Run (or resume) one cell; everything it finds is written to its study before it returns. ``plain``:
    the model without the partitions ``w`` was traced with, whose no-policy row the cell's is. ``state``: the
    sweep's run state, shared by its cells' searches (a Ctrl-C in one of them stops the cell and says so)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    say = progress or (lambda _m: None)
    started = time.perf_counter()
    name = cell_study_name(w, hw, budget_bytes)
    study = create_study(
        storage=storage_for(storage, heartbeat_s), study_name=name, direction="maximize", load_if_exists=True
    )
    attrs = study.user_attrs
    done: list[str] = list(attrs.get("done", []))
    problem = Problem(w, hw, budget_bytes)
    ctx = SearchContext(
        time_limit_s=timeout_s,
        seed=seed,
        trials=trials,
        storage=storage,
        study_name=name,
        heartbeat_s=heartbeat_s,
        state=state if state is not None else RunState(),
    )
    # A resumed cell's no-policy row is the one stored with its figures: on the cpu profile, which this run
    # calibrated again, one simulated now can be slower than the stored heuristics it is the ceiling of.
    no_policy = attrs.get("no_policy") or _sim_json(plain_no_policy(problem, plain))
    cell = CellResult(
        w.model, w.batch_size, hw.name, budget_bytes, name, no_policy, reserve_bytes=reserve_bytes,
        partitions=list(w.meta.get("partitions", [])),
    )  # fmt: skip
    cell.resumed = [m for m in methods if m in done and m != "optuna"]
    if "meta" not in attrs:
        study.set_user_attr(
            "meta",
            {
                "model": w.model,
                "batch_size": w.batch_size,
                "gpu": hw.name,
                "budget_bytes": budget_bytes,
                "precision": w.precision,
                "grad_accum": w.grad_accum,
                "partitions": cell.partitions,
            },
        )
        study.set_user_attr("no_policy", cell.no_policy)
    floor = budget_floor(problem)
    if floor > budget_bytes:
        cell.floor_bytes = floor
        cell.resumed = list(methods) if attrs.get("below_floor") else []
        cell.below_floor = True
        study.set_user_attr("below_floor", True)
        _mark_done(study, done, methods)
        cell.wall_s = time.perf_counter() - started
        return cell
    # The optuna method is done when its study holds --trials completed trials, or a search for at least as
    # many ran to its end (its --timeout): raise --trials to go on. The heuristics are cheap and seed the
    # search: re-run them when it still has work, even if their summary is stored (their policies are not).
    complete = len(study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)))
    keeps_all = bool(attrs.get("keeps_all"))
    need_optuna = (
        "optuna" in methods and complete < trials and int(attrs.get("optuna_trials", 0)) < trials and not keeps_all
    )
    if "optuna" in methods and not need_optuna:
        cell.resumed.append("optuna")
    need_ppo = "ppo" in methods and "ppo" not in done and not keeps_all
    seeds: list[SearchResult] = []
    if ("baselines" in methods and "baselines" not in done) or need_optuna or need_ppo:
        say("baselines")
        seeds = [get_searcher(n).search(problem, ctx) for n in baseline_names()]
        kept_all = best_of(s for s in seeds if s.feasible and not s.policy.to_vector(w).any())
        if kept_all is not None and not ctx.interrupted:  # NOTE [ Sweep storage ]: the answer, no search
            _offer(study, "keep all", kept_all, w)
            study.set_user_attr("keeps_all", True)
            need_optuna = need_ppo = False
            _mark_done(study, done, [m for m in methods if m != "baselines"])
        if "baselines" in methods and "baselines" not in done:
            summary = {r.searcher: {**_sim_json(r.result), "status": r.status.value} for r in seeds}
            study.set_user_attr("baselines", summary)
            _offer(study, "baselines", best_of(seeds), w)
            done.append("baselines")
            study.set_user_attr("done", done)
    if need_optuna:
        say("optuna")
        found = get_searcher("optuna-tpe").search(problem, ctx.derive(seeds=tuple(seeds)))
        try:
            _offer(study, "optuna", found, w)
            if not ctx.interrupted:
                study.set_user_attr("optuna_trials", trials)
        except Exception:
            if not ctx.interrupted:
                raise  # after a Ctrl-C the storage's connection may be broken: the cell keeps what it stored
    if need_ppo and not ctx.interrupted:
        say("ppo")
        agent = SearchContext(time_limit_s=timeout_s, seed=seed, state=ctx.state, trials=DEFAULT_EPISODES)
        found = get_searcher("ppo").search(problem, agent)
        before = study.user_attrs.get("ppo")  # a resumed agent's episode does not replace a better one
        if (
            before is None
            or not before["feasible"]
            or (found.result.feasible and found.result.samples_per_s > before["samples_per_s"])
        ):
            study.set_user_attr("ppo", _sim_json(found.result))
        _offer(study, "ppo", found, w)
        if not ctx.interrupted:  # an interrupted agent trains again when the sweep resumes
            done.append("ppo")
            study.set_user_attr("done", done)
    cell.interrupted = ctx.interrupted
    attrs = study.user_attrs  # re-read: what this run and any earlier one stored
    cell.baselines = attrs.get("baselines", {})
    cell.ppo = attrs.get("ppo")
    cell.best = attrs.get("best")
    cell.per_method = attrs.get("per_method", {})
    chosen = best_policy(cell, w, hw) if hw.is_gpu else None
    if chosen is not None:
        st = reserved_stats(problem, chosen.to_vector(w), chosen.options, budget_bytes)
        cell.reserved_bytes, cell.reserved_checked = (None if st is None else st.peak_reserved), True
    cell.wall_s = time.perf_counter() - started
    return cell


TIE = 1e-9  # relative: faster by less than this is a tie (_offer)


def _offer(study: Any, method: str, found: SearchResult | None, w: Workload) -> None:
    """Keep each method's best samples/s in ``per_method`` and the cell's fastest fitting policy in ``best``."""
    if found is None or not found.feasible:
        return
    per_method = dict(study.user_attrs.get("per_method") or {})
    per_method[method] = max(per_method.get(method, 0.0), found.result.samples_per_s)
    study.set_user_attr("per_method", per_method)
    best = study.user_attrs.get("best")
    # A method that ties the stored best to rounding (the same policy, its time summed in another order) does
    # not take the cell's "chosen" from the one found first.
    if best is None or found.result.samples_per_s > best["samples_per_s"] * (1 + TIE):
        best = {
            "method": method,
            "searcher": found.searcher,
            "actions": [int(a) for a in found.policy.to_vector(w)],
            # Every option the policy was scored with (release_after and region_nodes were dropped, and the
            # file --out-dir wrote ran otherwise than the sweep said); partition consent comes from the trace.
            "options": {k: v for k, v in asdict(found.policy.options).items() if k != "allow_partition"},
            "evaluations": found.evaluations,
            "search_s": found.wall_s,
            **_sim_json(found.result),
        }
        study.set_user_attr("best", best)


def _mark_done(study: Any, done: list[str], methods: Sequence[str]) -> None:
    done[:] = sorted(set(done) | set(methods))  # (the caller's list too: it stores what it adds after)
    study.set_user_attr("done", done)


def best_policy(cell: CellResult, w: Workload, hw: HardwareProfile) -> Policy | None:
    """The cell's stored best policy, for this workload."""
    b = cell.best
    if b is None or b.get("actions") is None:
        return None
    # A partitioned cell's workload carries the consent (envs.problem.Problem does the same).
    options = PolicyOptions(**b["options"], allow_partition=bool(w.meta.get("partitions")))
    predicted = Prediction(peak_bytes=b["peak_bytes"], iter_s=b["iter_s"], samples_per_s=b["samples_per_s"])
    policy = Policy.from_vector(w, b["actions"], hardware=hw.name, options=options, searcher=f"sweep:{b['method']}",
                                trials=int(b.get("evaluations", 0)), predicted=predicted,
                                wall_s=b.get("search_s"))  # fmt: skip
    return record_budget(policy, cell.budget_bytes + cell.reserve_bytes, cell.reserve_bytes)


def describe(cell: CellResult) -> str:
    if cell.below_floor:
        return f"{cell.model} {cell.profile} {format_bytes(cell.budget_bytes)}: below what any policy needs"
    got = cell.best["samples_per_s"] if cell.best else None
    sliced = f", {cell.slices}" if cell.partitions else ""
    return (  # the budget as typed, as the cell's steps said it (the planned one after them read as another cell)
        f"{cell.model} {cell.profile} {format_bytes(cell.budget_bytes + cell.reserve_bytes)}: "
        + (f"{got:,.1f} samples/s ({cell.best['method']}{sliced})" if got and cell.best else "no fitting policy")
        + (" (interrupted)" if cell.interrupted else "")
    )


# A cell's workloads: (the model as traced, what the cell planned on: the same, or its partitioned trace).
WorkloadOf = Callable[[CellResult], tuple[Workload, Workload]]


@dataclass
class SweepOutcome:
    cells: list[CellResult]
    workloads: dict[tuple[str, int, str], Workload]  # (model, batch size, profile): each model as traced
    profiles: dict[str, HardwareProfile]
    wall_s: float
    sliced: dict[str, Workload] = field(default_factory=dict)  # study name -> a partitioned cell's workload
    interrupted: bool = False  # Ctrl-C stopped the sweep: ``cells`` are those it reached
    total: int = 0  # the cells asked for

    def workload_of(self, cell: CellResult) -> tuple[Workload, Workload]:
        plain = self.workloads[(cell.model, cell.batch_size, cell.profile)]
        return plain, self.sliced.get(cell.study_name, plain)


def run_sweep(
    workloads: Mapping[str, Sequence[Workload]],
    profiles: Sequence[HardwareProfile],
    budgets: Sequence[int],
    *,
    methods: Sequence[str],
    storage: str,
    trials: int,
    timeout_s: float,
    seed: int = 0,
    heartbeat_s: float | None = None,
    progress: Callable[[int, int, str], None] | None = None,
    reserve: str | None = None,
    partition: Callable[[int, Workload, HardwareProfile, int], list[Workload]] | None = None,
) -> SweepOutcome:
    """Every (workload, profile, budget) cell, in that order; ``progress(done, total, what)``. ``workloads``
    per profile name: each a trace taken for that profile (NOTE [ GPU-faithful fake traces ] in
    runtime/target.py), one model per position, in the same order for every profile. Each budget is planned
    for less ``reserve`` on GPU profiles (``--reserve``; NOTE [ Budget and reserve ] in autotune.budget).
    ``partition(i, w, hw, budget)``: the workloads to plan cell (model i, profile, budget) on, partitioned or
    ``w`` itself (``--allow-partition``: NOTE [ Choosing a partition ] in autotune/partitions.py); with more
    than one (each candidate's partition, C4, and ``w`` where the budget is above the unpartitioned floor too),
    each is searched in a study of its own, with its share of the cell's time and trials, and the cell is the
    fastest, as search answers.
    (A sweep that planned the partition alone there answered a GroupNorm CNN at 60 MiB with 2,357 samples/s
    on slices, where search answered 3,146 without them.)
    Ctrl-C stops the sweep (NOTE [ Sweep storage ]): the outcome holds the cells reached and says so."""
    started = time.perf_counter()
    models = len(workloads[profiles[0].name]) if profiles else 0
    order = [(i, hw, given) for i in range(models) for hw in profiles for given in budgets]
    cells: list[CellResult] = []
    planned = {(w.model, w.batch_size, hw.name): w for hw in profiles for w in workloads[hw.name][:models]}
    sliced: dict[str, Workload] = {}
    state = RunState()
    with SearchContext(state=state).noting_sigint():
        for i, hw, given in order:
            w = workloads[hw.name][i]
            plan = budget_of(given, reserve, hw)
            budget = plan.planned_bytes
            label = f"{w.model} {hw.name} {format_bytes(given)}"

            def say(method: str, label: str = label) -> None:
                if progress is not None:
                    progress(len(cells), len(order), f"{label}: {method}")

            try:
                say("choosing a partition" if partition is not None else "starting")
                rivals = partition(i, w, hw, budget) if partition is not None else [w]
                cell, wc = None, w
                for wr in rivals:
                    got = run_cell(
                        wr,
                        hw,
                        budget,
                        methods=methods,
                        storage=storage,
                        trials=max(1, trials // len(rivals)),
                        timeout_s=timeout_s / len(rivals),
                        seed=seed,
                        heartbeat_s=heartbeat_s,
                        progress=say,
                        # What is kept back: at most the budget (a 100 MiB budget on a GPU profile planned for 0
                        # B and its row read the planned bytes plus the whole 128 MiB reserve).
                        reserve_bytes=plan.given_bytes - plan.planned_bytes,
                        plain=w,
                        state=state,
                    )
                    if cell is None or _faster(got, cell):
                        cell, wc = got, wr
                    if state.interrupted or state.sigint_pending:
                        break
            except KeyboardInterrupt:  # outside a search (tracing slices, the heuristics): the cell is not reached
                state.interrupted = True
                break
            assert cell is not None
            cells.append(cell)
            if wc is not w:
                sliced[cell.study_name] = wc
            if progress is not None:
                progress(len(cells), len(order), describe(cell))
            if state.interrupted or state.sigint_pending:  # (pending: a Ctrl-C after the cell's last report)
                state.interrupted = True
                break
    return SweepOutcome(
        cells, planned, {hw.name: hw for hw in profiles}, time.perf_counter() - started, sliced,
        interrupted=state.interrupted, total=len(order),
    )  # fmt: skip


def _faster(a: CellResult, b: CellResult) -> bool:
    """Whether cell ``a``'s answer beats ``b``'s: one that fits over none, then the faster."""
    return (a.best["samples_per_s"] if a.best else -1.0) > (b.best["samples_per_s"] if b.best else -1.0)


def render(out: Console, outcome: SweepOutcome, storage: str, report: Path | None) -> None:
    """`autotune sweep`'s table: one row per cell, and where its studies and report are."""
    n = len(outcome.cells)
    t = Table(title=f"sweep: {n} cell{'' if n == 1 else 's'} in {storage}")
    cols = ["model", "profile", "budget", "no policy", "best heuristic", "optuna", "ppo", "chosen"]
    for col in cols:
        t.add_column(col, justify="left" if col in ("model", "profile") else "right")
    for cell in outcome.cells:
        j = cell.to_json()

        def f(v: float | None) -> str:
            return "—" if v is None else f"{v:,.1f}"

        t.add_row(
            cell.model,
            cell.profile,
            format_bytes(cell.budget_bytes + cell.reserve_bytes)
            + (f" (planned {format_bytes(cell.budget_bytes)})" if cell.reserve_bytes else ""),
            f(j["no_policy_samples_per_s"]),
            f"{f(j['best_heuristic_samples_per_s'])} {j['best_heuristic'] or ''}",
            f(j["optuna_samples_per_s"]),
            f(j["ppo_samples_per_s"]),
            cell.floor_text()
            if cell.below_floor
            else "none fits"
            if cell.best is None
            else f"{f(j['samples_per_s'])} {j['best_method'] or ''}"
            + (f" on {cell.slices}" if cell.partitions else "")
            + (" (interrupted)" if cell.interrupted else "")
            + (" (runs out on the allocator's model)" if cell.reserved_checked and cell.reserved_bytes is None else ""),
        )
    out.print(t)
    names = [cell.study_name for cell in outcome.cells]  # the budget in them is the planned bytes, not as typed
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more (--json names each cell's)" if len(names) > 3 else "")
    resumed = sum(1 for cell in outcome.cells if cell.resumed)  # a run that found its cells done says so
    again = f" ({resumed} of {n} resumed from the storage)" if resumed else ""
    unmet = [c for c in outcome.cells if c.best is None and not c.below_floor and not c.interrupted]
    if unmet:  # above the floor, yet no method of the sweep's found a policy that fits: say so, and what may
        out.print(  # (search's portfolio refines the heuristics' policies per tensor; the sweep's methods do not)
            f"{len(unmet)} cell{'' if len(unmet) == 1 else 's'} found no fitting policy ("
            + ", ".join(f"{c.model} {c.profile} {format_bytes(c.budget_bytes + c.reserve_bytes)}" for c in unmet[:3])
            + (f" and {len(unmet) - 3} more" if len(unmet) > 3 else "")
            + "), above what no policy can go below: `autotune search` at such a budget refines the heuristics'"
            " policies tensor by tensor, which the sweep's methods do not",
            highlight=False,
        )
    over = [c for c in outcome.cells if c.reserved_checked and c.reserved_bytes is None]
    if over:  # NOTE [ Sweep storage ]: the cells plan tensor bytes
        out.print(
            f"{len(over)} of the chosen policies run out on a model of PyTorch's CUDA caching allocator with the "
            "device capped at the budget (cached blocks and split ends; the sweep plans the tensors' bytes): "
            "`autotune search` at such a cell plans for what the allocator reserves (its default --budget-kind "
            "reserved)",
            highlight=False,
        )
    out.print(
        f"{outcome.wall_s:.0f} s{again}; one study per cell in {storage} ({shown}): "
        f"`autotune dashboard --storage {shlex.quote(storage)}` opens them" + (f"; report: {report}" if report else "")
    )
