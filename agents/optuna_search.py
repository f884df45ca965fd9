"""Optuna searchers over the parametric rule of agents/rule.py: TPE and NSGA-II.

Each trial samples the rule's knobs (prefetch look-ahead, how much of an idle window hides a copy, the
biases between swap and recompute, the size exponent of the ranking, a preference for early tensors, and
which actions each producer op class may take) and a ``start`` policy: keep-all or one of the warm-start
seeds (``SearchContext.seeds``, the baselines' policies). The rule turns them into a per-tensor policy that the
simulator scores.

- Objective: simulated samples/s (maximised). The budget is a constraint, ``(peak - budget) / budget <=
  0``, set with ``trial.set_constraint`` (Optuna 5; ``constraints_func`` on Optuna 4), so an over-budget
  trial is a completed, infeasible trial that still teaches the sampler. NSGA-II also minimises the peak
  (a Pareto front of memory against speed); its answer is the fastest feasible trial.
- Warm start: one enqueued trial per seed (``start`` = that seed, the rule at its defaults, which from a
  fitting start only gives back throughput the budget does not need), plus a swap-first and a
  recompute-first setting, before the sampler's own trials. A seed is also the answer's floor, offered as it
  is: its trial takes the nearest of the rule's look-aheads (``LOOKAHEADS``), which may not fit where the
  seed's own does (delta's 7 as 8: over the budget by 1%).
- Storage: any Optuna storage URL (``SearchContext.storage``; in memory when None). The study name defaults to
  ``<model>.b<batch>.<shape fingerprint>.<profile>.<budget bytes>.<searcher>``; a study that exists is
  resumed: its trials count, and its best trial is re-derived from its parameters.
- Many processes, one study (NOTE [ Distributed search ]): ``SearchContext.trials`` is the study's total of
  completed trials (Optuna's ``MaxTrialsCallback``), whoever ran them; workers send heartbeats, a dead
  worker's trial is marked failed by the next worker to start a trial and retried with the same parameters
  (``RetryHeartbeatStaleTrialCallback``); each worker's answer is the best over every worker's trials.
- Deterministic for a seed when ``SearchContext.trials`` (default ``DEFAULT_TRIALS``) ends the search before the
  time limit does; ``trials=0`` runs until the time limit.

NOTE [ Distributed search ]
    Optuna's RDB storage is the coordinator: each trial is a row, claimed by one worker (the enqueued warm
    starts too: ``skip_if_exists`` keeps two workers from enqueueing them twice). With ``heartbeat_s`` set
    (``SearchContext.heartbeat_s``, ``--heartbeat``), a worker's running trial records a heartbeat every
    ``heartbeat_s`` seconds; one that has not beaten for two periods is failed by any worker and a copy is
    enqueued (at most ``MAX_RETRY`` times). The objective is deterministic in its parameters, so a retried
    trial gives what the dead one would have given. Optuna starts a trial's heartbeat only after
    ``study.ask()`` has sampled it, so a worker killed while sampling leaves a RUNNING trial without any
    heartbeat, which Optuna never fails: a worker whose study has its trials adopts such trials (gives them
    a first heartbeat, ``adopt_orphans``), waits out the grace period, fails the stale ones and runs their
    retries before it answers (``_settle``). The heartbeat must therefore be longer than the sampler takes
    to propose one trial (well under a second for TPE here; 10 s in the README's recipe).
- Ctrl-C ends the optimisation; the best trial so far is the answer, and ``SearchContext.interrupted`` is
  set.
- Partitions (NOTE [ Choosing a partition ] C5 in autotune/partitions.py): where the problem has rivals (the
  same model traced with other partitions), each trial first draws a ``partition`` parameter (``blocks.0/4``,
  ``none``) and the rule runs on that partition's model, starting from that partition's seed of the name drawn
  (keep where it has none); the warm start enqueues every partition's seeds and keep's neighbours on each.
  The answer says which partition (``Proposal.rival``). A study of one model has no such parameter.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from agents.base import Problem, Proposal, SearchContext, Searcher, best_of, better, register
from agents.rule import CLASS_MODES, LOOKAHEADS, params_from_dict, present_classes, rule_actions
from envs.simulator import SimResult
from runtime.errors import AutotuneError, from_interrupt
from runtime.partition import partition_label
from runtime.policy import PolicyOptions

DEFAULT_TRIALS = 150
MAX_RETRY = 3


@contextlib.contextmanager
def _quiet_experimental() -> Iterator[None]:
    """Optuna's heartbeats, retries and stale-trial checks are marked experimental: say it once, here."""
    import optuna

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", category=optuna.exceptions.ExperimentalWarning)
        yield


class _NoInterruptTraceback(logging.Filter):
    """Drop Optuna's report of a trial stopped by Ctrl-C (a traceback of some forty lines, then "failed with
    value None"): the search handles the interrupt itself and says so in one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[0] is not None and issubclass(record.exc_info[0], KeyboardInterrupt):
            return False
        return not record.getMessage().endswith("failed with value None.")


_NO_INTERRUPT_TRACEBACK = _NoInterruptTraceback()


def _quiet_interrupts() -> None:
    """Install :class:`_NoInterruptTraceback` on Optuna's handlers (records of its modules reach those)."""
    import optuna

    optuna.logging.get_logger("optuna")  # makes Optuna's default handler, if it has none yet
    for handler in logging.getLogger("optuna").handlers:
        if _NO_INTERRUPT_TRACEBACK not in handler.filters:
            handler.addFilter(_NO_INTERRUPT_TRACEBACK)


def check_storage(url: str) -> None:
    """Open the Optuna storage at ``url`` once, before any tracing: a URL that does not parse, a SQLite file
    that cannot be written or a server that does not answer is the user's to fix, said in one line."""
    import optuna

    new = _new_sqlite_file(url)
    try:
        if new is not None:  # made by the search itself: a run refused before it leaves no empty database behind
            from runtime.fileio import write_problem

            problem = write_problem(Path(new).absolute().parent)
            if problem is not None:
                raise OSError(problem)
        else:
            optuna.storages.get_storage(url)  # RDB URLs: parse, connect, create the schema
    except Exception as e:  # SQLAlchemy's and the drivers' errors have no common base worth naming
        text = " ".join(str(e).split())
        cause = text.split("(Background on this error")[0].strip()[:240] or type(e).__name__
        raise AutotuneError(
            f"--storage {url}: cannot open it ({cause}); expected a writable SQLite file such as "
            "sqlite:///autotune.db or a reachable database such as postgresql://user:password@host/db"
        ) from None


def sqlite_file(url: str) -> str | None:
    """The file a SQLite URL names, as SQLAlchemy reads it (``%20`` decoded); None for another URL, one in
    memory or one SQLAlchemy does not read."""
    if not url.startswith("sqlite:"):
        return None
    try:
        from sqlalchemy.engine import make_url

        database = make_url(url).database
    except Exception:  # not a URL SQLAlchemy reads: get_storage says so
        return None
    if not database or database == ":memory:" or database.startswith("file:"):
        return None
    return database


def _new_sqlite_file(url: str) -> str | None:
    """The file of a SQLite URL that names one not there yet (None otherwise)."""
    database = sqlite_file(url)
    return None if database is None or os.path.exists(database) else database


def existing_trials(url: str, name: str) -> int:
    """Completed trials already in study ``name`` at ``url`` (0: no such study)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        study = optuna.load_study(study_name=name, storage=url)
    except Exception:  # no such study (KeyError), or a storage check_storage has vouched for: nothing to say
        return 0
    return len(study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)))


def storage_for(url: str | None, heartbeat_s: float | None) -> Any:
    """The Optuna storage for ``url``: None (in memory) stays None; an RDB URL with ``heartbeat_s`` gets
    heartbeats and retries of dead workers' trials (NOTE [ Distributed search ])."""
    if url is None or heartbeat_s is None:
        return url
    import optuna

    with _quiet_experimental():
        retry: dict[str, Any]
        if hasattr(optuna.storages, "RetryHeartbeatStaleTrialCallback"):  # Optuna >= 4.9
            retry = {"heartbeat_stale_trial_callback": optuna.storages.RetryHeartbeatStaleTrialCallback(MAX_RETRY)}
        else:
            retry = {"failed_trial_callback": optuna.storages.RetryFailedTrialCallback(max_retry=MAX_RETRY)}
        return optuna.storages.RDBStorage(
            url, heartbeat_interval=max(1, round(heartbeat_s)), grace_period=max(2, round(2 * heartbeat_s)), **retry
        )


def best_fitting_first(storage: Any) -> Any:
    """``storage`` (an Optuna storage object) with ``get_best_trial`` picking the best completed trial whose
    peak fits the budget (the trial's ``constraint`` user attribute, set with every objective value here), as
    ``Study.best_trial`` picks it under constraints; where none fits, the one nearest the budget. optuna-dashboard
    shows the storage's best trial, which the storage picks by value alone: a keep-everything trial 27 MiB over
    a sweep cell's budget was its "best" (a QA run). A study without the attribute is left as it is."""
    import optuna

    by_value = storage.get_best_trial

    def get_best_trial(study_id: int) -> Any:
        trials = storage.get_all_trials(study_id, deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
        if not trials or any("constraint" not in t.user_attrs for t in trials):
            return by_value(study_id)
        sign = 1 if storage.get_study_directions(study_id)[0] == optuna.study.StudyDirection.MAXIMIZE else -1
        excess = {t.number: max(t.user_attrs["constraint"]) for t in trials}
        fits = [t for t in trials if excess[t.number] <= 0]
        if not fits:
            return min(trials, key=lambda t: excess[t.number])
        return max(fits, key=lambda t: sign * t.value)

    storage.get_best_trial = get_best_trial
    return storage


def create_study(**kwargs: Any) -> Any:
    """``optuna.create_study(**kwargs)``, made again where another process made a new SQLite file's tables
    between Optuna's check and its own (two `autotune sweep` started at once on a new storage: "table studies
    already exists" in 3 of 8 pairs, a QA run)."""
    import optuna

    for attempt in range(3):
        try:
            return optuna.create_study(**kwargs)
        except Exception as e:
            if "already exists" not in str(e):
                raise
            time.sleep(0.1 * (attempt + 1))
    return optuna.create_study(**kwargs)  # the fourth try's error is the caller's


def retried_trial_number(trial: Any) -> int | None:
    """The number of the failed trial that ``trial`` retries (None: not a retry), on any Optuna version."""
    import optuna

    cls = getattr(optuna.storages, "RetryHeartbeatStaleTrialCallback", None) or optuna.storages.RetryFailedTrialCallback
    with _quiet_experimental():
        number: int | None = cls.retried_trial_number(trial)
    return number


def made_for(problem: Problem) -> str:
    """What a study is for, recorded in its ``problem`` user attribute when it is made: a study resumed for
    another problem (``--study`` given again with another model, batch, profile or budget) would count that
    problem's trials and teach the sampler values scored on it."""
    w = problem.workload
    accum = f" x {w.grad_accum} micro-batches" if w.grad_accum > 1 else ""
    swap = "" if problem.allow_swap or not problem.hardware.is_gpu else ", keep and recompute only"
    swap = f", under torch.compile ({problem.compiled})" if problem.compiled else swap
    return (
        f"{w.model} batch {w.batch_size} {w.precision}{accum} (shape {w.shape_fingerprint or 'unknown'}) on "
        f"{problem.hardware.name} within {problem.budget_bytes} bytes{swap}"
    )


def check_study(url: str | None, name: str, problem: Problem) -> None:
    """Refuse to resume study ``name`` at ``url`` where it was made for another problem (:func:`made_for`);
    a study that does not exist yet, or made before the attribute was recorded, passes."""
    if url is None:
        return
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        study = optuna.load_study(study_name=name, storage=url)
    except Exception:  # no such study (KeyError), or a storage check_storage has vouched for: nothing to say
        return
    _refuse_another(study, problem, f" in {url}")


def _refuse_another(study: Any, problem: Problem, where: str = "") -> bool:
    """:func:`check_study` on a study at hand (``where``: its storage, for the message); whether the study
    records what it was made for."""
    was = study.user_attrs.get("problem")
    if was is not None and was != made_for(problem):
        raise AutotuneError(
            f"study '{study.study_name}'{where} was made for {was}, not for {made_for(problem)}: pass another "
            "--study, or leave --study out for a name of this problem's own"
        )
    return was is not None


def study_name(problem: Problem, searcher: str) -> str:
    w = problem.workload
    fp = w.shape_fingerprint or "nofp"
    precision = f".{w.precision}" if w.precision != "fp32" else ""  # fp32 studies keep their old names
    precision += f".ga{w.grad_accum}" if w.grad_accum > 1 else ""
    # A search for torch.compile: its trials are scored on the compiled step's twin (simulator Rule 16).
    precision += f".compiled-{problem.compiled}" if problem.compiled else ""
    return f"{w.model}.b{w.batch_size}{precision}.{fp}.{problem.hardware.name}.{problem.budget_bytes}.{searcher}"


class _Best:
    """The fastest feasible policy seen (or, while none fits, the one with the lowest peak), and for which of
    the problem's partitions (``rival``: -1 the problem itself, else the index of one of its rivals)."""

    def __init__(self) -> None:
        self.actions: np.ndarray | None = None
        self.options: PolicyOptions | None = None
        self.result: SimResult | None = None
        self.rival = -1

    def offer(self, actions: np.ndarray, options: PolicyOptions, result: SimResult, rival: int = -1) -> bool:
        if not better(result, self.result):
            return False
        self.actions, self.options, self.result, self.rival = actions.copy(), options, result, rival
        return True


class OptunaSearcher(Searcher):
    composite = True
    chooses_partition = True  # a ``partition`` parameter where the problem has rivals (module docstring)
    multi_objective: ClassVar[bool] = False

    def study_names(self, name: str) -> list[str]:
        return [name]

    def _sampler(self, ctx: SearchContext) -> Any:
        raise NotImplementedError

    def _search(self, problem: Problem, ctx: SearchContext) -> Proposal:
        best = _Best()
        for seed in ctx.seeds:  # the floor (module docstring, warm start)
            if seed.feasible:
                w = problem.member(seed.rival).workload
                best.offer(seed.policy.to_vector(w), seed.policy.options, seed.result, seed.rival)
        self.optimize(problem, ctx, best, family=True)
        if best.actions is None:  # a Ctrl-C before the first trial's policy: the best seed, else keep-all
            top = best_of(ctx.seeds)
            if top is None:
                return Proposal(problem.keep_all(), options=problem.options, note="interrupted before its first trial")
            w = problem.member(top.rival).workload
            return Proposal(top.policy.to_vector(w), options=top.policy.options, rival=top.rival)
        return Proposal(best.actions, options=best.options, rival=best.rival)

    def optimize(
        self,
        problem: Problem,
        ctx: SearchContext,
        best: _Best,
        *,
        stop: Callable[[Any, Any], None] | None = None,
        family: bool = False,
    ) -> Any:
        """Run (or resume) the study of ``ctx`` (its name, storage, seeds, time limit and trials); every
        trial's policy is offered to ``best``. ``stop``: an Optuna callback, e.g. one that stops the study
        once it stagnates. ``family``: the problem's rivals too, a ``partition`` parameter choosing among
        them (module docstring). Returns the study."""
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        _quiet_interrupts()
        members = problem.members if family else (problem,)
        labels = [partition_label(m.workload.meta.get("partitions")) for m in members]
        member_classes = [present_classes(m) for m in members]
        classes = list(dict.fromkeys(c for cs in member_classes for c in cs))  # each member's, in order
        # Seeds by (member, searcher): the problem's are member 0, a rival's (SearchResult.rival) 1 + its index.
        seeds = {
            (r.rival + 1, r.searcher): r.policy.to_vector(problem.member(r.rival).workload)
            for r in ctx.seeds
            if r.feasible and r.rival + 1 < len(members)
        }
        seed_options = {(r.rival + 1, r.searcher): r.policy.options for r in ctx.seeds if r.feasible}
        starts = ["keep", *sorted({name for _, name in seeds})]
        directions: list[Any] = ["maximize", "minimize"] if self.multi_objective else ["maximize"]
        storage = storage_for(ctx.storage, ctx.heartbeat_s)
        study = create_study(
            storage=storage,
            study_name=ctx.study_name or study_name(problem, self.name),
            sampler=self._sampler(ctx),
            directions=directions,
            load_if_exists=True,
        )
        # A categorical parameter keeps its choices for the study's life (a TPE sampler given others raises
        # "CategoricalDistribution does not support dynamic value space"), and which seeds fit can change
        # between runs of one study (the ``cpu`` profile is calibrated per run): a resumed study keeps the
        # starts its trials were drawn from (one with no seed now starts from keep; a new seed is no start).
        drawn = next(
            (t.distributions["start"] for t in study.get_trials(deepcopy=False) if "start" in t.distributions), None
        )
        if isinstance(drawn, optuna.distributions.CategoricalDistribution):
            starts = [str(s) for s in drawn.choices]
        if not _refuse_another(study, problem):  # check_study, for a caller that did not check before
            study.set_user_attr("problem", made_for(problem))
        use_set_constraint = hasattr(optuna.trial.Trial, "set_constraint")
        seen: set[int] = set()

        def member_of(params: dict[str, Any]) -> int | None:
            """Which member a trial's parameters are for (None: a partition this search does not have)."""
            label = params.get("partition", labels[0])
            return labels.index(label) if label in labels else None

        def evaluate(i: int, values: dict[str, Any]) -> SimResult:
            return self._evaluate(members[i], values, member_classes[i], seeds, seed_options, best, member=i)

        def absorb() -> None:
            """Offer every completed trial not seen yet (a resumed study's, other workers') to ``best``."""
            for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
                i = member_of(t.params)
                if t.number not in seen and t.params.get("start", "keep") in starts and i is not None:
                    seen.add(t.number)
                    evaluate(i, t.params)

        def warm_start(trials: int) -> None:
            """A resumed study's trials offered, or a new study's first trials enqueued: the seeds, then three
            of keep's neighbours, no more than the study's ``trials`` (0: no limit; one enqueued beyond them
            would stay WAITING in the storage, never run)."""
            absorb()
            if study.trials:
                return
            warm: list[dict[str, Any]] = []
            for i, s in sorted(seeds):
                lookahead = min(LOOKAHEADS, key=lambda x: abs(x - seed_options[i, s].prefetch_lookahead))
                warm.append({"start": s, "lookahead": lookahead, "revert": 0.0, "partition": labels[i]})
            for label in labels:
                warm += [
                    {"start": "keep", "swap_bias": 0.1, "recompute_bias": 10.0, "lookahead": 8, "partition": label},
                    {"start": "keep", "swap_bias": 10.0, "recompute_bias": 0.1, "partition": label},
                    {"start": "keep", "partition": label},
                ]
            if len(members) == 1:  # no partition parameter: the studies of one model keep their parameters
                warm = [{k: v for k, v in params.items() if k != "partition"} for params in warm]
            for params in warm[:trials] if trials else warm:
                study.enqueue_trial(params, skip_if_exists=True)

        def objective(trial: Any) -> Any:
            i = labels.index(trial.suggest_categorical("partition", labels)) if len(members) > 1 else 0
            values: dict[str, Any] = {
                "start": trial.suggest_categorical("start", starts),
                "lookahead": trial.suggest_categorical("lookahead", LOOKAHEADS),
                "hide": trial.suggest_float("hide", 0.0, 2.0),
                "swap_bias": trial.suggest_float("swap_bias", 0.05, 20.0, log=True),
                "recompute_bias": trial.suggest_float("recompute_bias", 0.05, 20.0, log=True),
                "size_exp": trial.suggest_float("size_exp", 0.0, 2.0),
                "late_bias": trial.suggest_float("late_bias", 0.0, 4.0),
                "revert": trial.suggest_float("revert", 0.0, 1.0),
                "swap_share": trial.suggest_float("swap_share", 0.0, 3.0),
            }
            for c in classes:
                values[f"class_{c}"] = trial.suggest_categorical(f"class_{c}", CLASS_MODES)
            result = evaluate(i, values)
            seen.add(trial.number)
            excess = (result.peak_bytes - problem.budget_bytes) / problem.budget_bytes
            if use_set_constraint:
                with warnings.catch_warnings():  # a retried trial carries the dead one's (same) value
                    warnings.filterwarnings("ignore", message="The constraint value is ignored")
                    trial.set_constraint("memory", excess)
            trial.set_user_attr("constraint", [excess])
            trial.set_user_attr("peak_bytes", result.peak_bytes)
            trial.set_user_attr("samples_per_s", result.samples_per_s)
            ctx.report(self.name, best.result)
            if self.multi_objective:
                return result.samples_per_s, result.peak_bytes / 2**30
            return result.samples_per_s

        trials = DEFAULT_TRIALS if ctx.trials is None else ctx.trials
        # The study's total of completed trials, whoever runs them (0: until the time limit).
        complete = (optuna.trial.TrialState.COMPLETE,)
        callbacks: list[Any] = [] if trials == 0 else [optuna.study.MaxTrialsCallback(trials, states=complete)]
        if stop is not None:
            callbacks.append(stop)
        running = (optuna.trial.TrialState.RUNNING,)
        running_before = {t._trial_id for t in study.get_trials(deepcopy=False, states=running)}
        try:  # a Ctrl-C from the warm start on (its trials are stored at once) is the search's to take
            warm_start(trials)
            deadline = None if ctx.time_limit_s is None else time.monotonic() + ctx.time_limit_s
            with _quiet_experimental():
                while trials == 0 or len(study.get_trials(deepcopy=False, states=complete)) < trials:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        break
                    try:
                        study.optimize(objective, timeout=left, catch=(), callbacks=callbacks)
                        break
                    except ValueError as e:
                        # Two workers on a SQLite storage can both take one queued trial (no row lock there):
                        # the second to finish it cannot store its value. The trial is stored; go on (two sweeps
                        # at once on one new file: "Cannot tell a COMPLETE trial" in 3 of 8 pairs, a QA run).
                        if not str(e).startswith("Cannot tell a COMPLETE trial"):
                            raise
        except KeyboardInterrupt:
            ctx.interrupt()
        except Exception as e:  # a Ctrl-C inside Optuna's own bookkeeping comes out as another error
            # Its chain holds the KeyboardInterrupt, or not where the interrupt landed in a storage query whose
            # connection then failed otherwise (Optuna 5: AssertionError "Should not reach." from its trial
            # bookkeeping): a Ctrl-C noted and not yet taken says so then.
            if not (from_interrupt(e) or ctx.state.sigint_pending):
                raise
            ctx.interrupt()
        if ctx.interrupted and ctx.heartbeat_s is None:
            _fail_left_running(study, running_before)
        if isinstance(storage, optuna.storages.RDBStorage) and not ctx.interrupted:
            _settle(study, storage, objective)
        try:
            absorb()  # other workers' trials on a shared storage
        except Exception:
            if not ctx.interrupted:
                raise  # after a Ctrl-C the storage's connection may be broken: what was found stands
        return study

    @staticmethod
    def _evaluate(
        problem: Problem,
        values: dict[str, Any],
        classes: list[str],
        seeds: dict[tuple[int, str], np.ndarray],
        seed_options: dict[tuple[int, str], PolicyOptions],
        best: _Best,
        member: int = 0,
    ) -> SimResult:
        """The rule's policy for ``values`` on ``problem``, member ``member`` of the search (0: the problem
        itself, else its rival ``member - 1``); a start that member has no seed for starts from keep."""
        start = values.get("start", "keep")
        params = params_from_dict(values, classes)
        actions, options, result = rule_actions(problem, params, start=seeds.get((member, start)))
        best.offer(actions, options, result, member - 1)
        return result


def _fail_left_running(study: Any, before: set[int]) -> None:
    """After a Ctrl-C: the trial it left RUNNING (the interrupt landed in Optuna's own bookkeeping, after the
    trial was stored and before its end was) is marked FAIL, as Optuna marks an interrupted objective's, so
    that no dashboard shows it running for ever. Only without heartbeats, where nothing else would (with
    them, NOTE [ Distributed search ]: the next worker fails or retries it), and only the trials that were not
    running when this run began."""
    import optuna

    try:
        for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
            if t._trial_id not in before:
                study._storage.set_trial_state_values(t._trial_id, state=optuna.trial.TrialState.FAIL)
    except Exception:  # the storage's connection may be what the interrupt broke: leave it as it is
        return


def adopt_orphans(study: Any, storage: Any) -> int:
    """Give a first heartbeat to the study's running trials that have none (NOTE [ Distributed search ]).

    Optuna only fails a trial whose heartbeat went stale; one whose worker died inside ``study.ask()``
    (while the sampler ran, before its heartbeat thread started) has no heartbeat and would stay RUNNING
    forever. With one, it goes stale after the grace period unless its worker is alive and beating."""
    import sqlalchemy

    sql = sqlalchemy.text(
        "INSERT INTO trial_heartbeats (trial_id, heartbeat) SELECT t.trial_id, CURRENT_TIMESTAMP FROM trials t "
        "WHERE t.study_id = :sid AND t.state = 'RUNNING' "
        "AND NOT EXISTS (SELECT 1 FROM trial_heartbeats h WHERE h.trial_id = t.trial_id)"
    )
    try:
        with storage.engine.begin() as conn:
            return int(conn.execute(sql, {"sid": study._study_id}).rowcount or 0)
    except sqlalchemy.exc.IntegrityError:  # the trial's own worker beat first: it is alive
        return 0


def _settle(study: Any, storage: Any, objective: Any) -> None:
    """Leave no trial behind when the study has its trials: adopt running trials without a heartbeat, wait
    until a dead worker's trial is stale, fail it (the retry callback enqueues a copy) and run the copies.
    Trials of live workers keep beating and are left to them."""
    import optuna

    grace = 2 * (storage.get_heartbeat_interval() or 1)
    for _ in range(MAX_RETRY + 1):
        adopt_orphans(study, storage)
        running = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
        if running:
            time.sleep(grace + 1)
            with _quiet_experimental():
                optuna.storages.fail_stale_trials(study)
        waiting = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,))
        if not waiting:
            return
        with _quiet_experimental():
            study.optimize(objective, n_trials=len(waiting), catch=())


def _constraints_kwargs() -> dict[str, Any]:
    """Optuna 4 reads constraints through ``constraints_func``; Optuna 5 through ``trial.set_constraint``."""
    import optuna

    if hasattr(optuna.trial.Trial, "set_constraint"):
        return {}
    return {"constraints_func": lambda t: t.user_attrs.get("constraint", [1.0])}


@register
class OptunaTPE(OptunaSearcher):
    name = "optuna-tpe"
    summary = "Optuna TPE (multivariate) over the parametric rule's knobs, budget as a constraint"

    def _sampler(self, ctx: SearchContext) -> Any:
        import optuna

        return optuna.samplers.TPESampler(
            seed=ctx.seed, multivariate=True, n_startup_trials=10, **_constraints_kwargs()
        )


@register
class OptunaNSGA2(OptunaSearcher):
    name = "optuna-nsga2"
    summary = "Optuna NSGA-II over the parametric rule's knobs: samples/s against peak (Pareto), budget constraint"
    multi_objective = True

    def _sampler(self, ctx: SearchContext) -> Any:
        import optuna

        return optuna.samplers.NSGAIISampler(seed=ctx.seed, population_size=20, **_constraints_kwargs())


def remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.perf_counter())
