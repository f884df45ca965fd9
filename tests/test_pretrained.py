"""The pretrained agent (agents/pretrained.py): safe loading, masks honoured, the one pass's decoding steps on
hand-made networks with known answers, and determinism."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from agents.base import Problem, SearchContext, apply_until_fits, get_searcher
from agents.portfolio import Portfolio
from agents.pretrained import AGENT_PATH, Agent, load_agent, one_pass, save_agent
from agents.rule import LOOKAHEADS
from envs.memory_env import OBS_FIELDS, OBS_SIZE, MemoryPolicyEnv
from runtime.errors import AutotuneError
from runtime.hardware import get_profile
from runtime.synthetic import synthetic_workload
from runtime.trace import capture
from runtime.vocab import COMPRESS, KEEP, RECOMPUTE, SWAP
from runtime.workload import peak_report
from tests.test_trace import tiny_cnn_build

_W = capture(tiny_cnn_build(batch=4), name="cnn", batch_size=4)
_HW = get_profile("v100-16gb")
_PEAK = peak_report(_W, _HW.alloc_granularity_bytes).peak_bytes


def problem(fraction: float) -> Problem:
    return Problem(_W, _HW, budget_bytes=int(_PEAK * fraction))


def constant_agent(bias: list[float], hidden: int = 8) -> Agent:
    """A network whose logits are ``bias`` whatever it sees (zero weights): its choices are known."""
    w1 = np.zeros((hidden, OBS_SIZE), dtype=np.float32)
    b1 = np.zeros(hidden, dtype=np.float32)
    head = (np.zeros((4, hidden), dtype=np.float32), np.array(bias, dtype=np.float32))
    return Agent([(w1, b1)], head, OBS_FIELDS)


# -- loading ----------------------------------------------------------------------------------------------------
def test_the_shipped_agent_loads_with_weights_only_and_records_its_split() -> None:
    agent = load_agent()
    state = torch.load(AGENT_PATH, map_location="cpu", weights_only=True)  # no arbitrary objects in the file
    assert state["obs_fields"] == list(OBS_FIELDS)
    assert agent.logits(np.zeros(OBS_SIZE, dtype=np.float32)).shape == (4,)
    train, heldout = set(agent.meta["train"]), set(agent.meta["heldout"])
    assert train and heldout and not train & heldout
    assert not {k.split("-b")[0] for k in heldout} & {k.split("-b")[0] for k in train}  # whole models held out


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    hidden = [(rng.normal(size=(16, OBS_SIZE)).astype(np.float32), rng.normal(size=16).astype(np.float32))]
    agent = Agent(hidden, (rng.normal(size=(4, 16)).astype(np.float32), np.zeros(4, np.float32)), OBS_FIELDS)
    agent.meta = {"train": ["a"], "note": "x"}
    save_agent(agent, tmp_path / "a.pt")
    back = load_agent(tmp_path / "a.pt")
    obs = rng.uniform(size=(5, OBS_SIZE)).astype(np.float32)
    assert np.array_equal(back.logits(obs), agent.logits(obs)) and back.meta == agent.meta


class _Evil:
    """Unpickling this would run a shell command: what weights-only loading exists to refuse."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, (f"touch {self.marker}",))


def test_a_file_with_an_arbitrary_object_is_refused_without_running_it(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    state = constant_agent([0, 0, 0, 0]).state()
    state["meta"] = {"payload": _Evil(marker)}
    torch.save(state, tmp_path / "evil.pt")
    with pytest.raises(AutotuneError, match="weights-only"):
        load_agent(tmp_path / "evil.pt")
    assert not marker.exists()


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda s: s.update(obs_fields=list(OBS_FIELDS[:-1])), f"observations of {OBS_SIZE - 1} fields"),
        (lambda s: s.update(format=99), "format 99"),
        (lambda s: s["state_dict"].update({"head.weight": torch.zeros(3, 8)}), "do not chain|outputs"),
        (lambda s: s["state_dict"].pop("hidden.0.bias"), "missing"),
        (lambda s: s["state_dict"].update({"head.bias": torch.full((4,), float("nan"))}), "non-finite"),
        (lambda s: s.update(activation="gelu"), "activation"),
    ],
)
def test_a_malformed_agent_is_refused_with_how_to_retrain(tmp_path: Path, change, match: str) -> None:  # type: ignore[no-untyped-def]
    state = constant_agent([0, 0, 0, 0]).state()
    change(state)
    torch.save(state, tmp_path / "bad.pt")
    with pytest.raises(AutotuneError, match=match) as e:
        load_agent(tmp_path / "bad.pt")
    assert "train_agent.py" in str(e.value)


def test_a_missing_or_garbage_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(AutotuneError, match="cannot read"):
        load_agent(tmp_path / "none.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a torch file")
    with pytest.raises(AutotuneError, match="weights-only"):
        load_agent(tmp_path / "junk.pt")


# -- the one pass ----------------------------------------------------------------------------------------------
def test_masks_are_honoured_even_when_the_network_wants_an_illegal_action() -> None:
    wants_compress = constant_agent([0.0, 0.1, 0.2, 5.0])
    # Compression not allowed: the legal choice it likes best is recompute, everywhere.
    p = problem(0.7)
    env = MemoryPolicyEnv(p)
    r = one_pass(wants_compress, p)
    assert set(r.actions.tolist()) <= {KEEP, RECOMPUTE}  # the rollout recomputes all; fit and give-back keep
    # Allowed: compress exactly where the environment's mask allows it (floats wider than bf16; the synthetic
    # CNN's pooling indices are int64).
    sw = synthetic_workload()
    pc = Problem(sw, _HW, budget_bytes=int(peak_report(sw, _HW.alloc_granularity_bytes).peak_bytes * 0.7),
                 allow_compress=True)  # fmt: skip
    masks = MemoryPolicyEnv(pc)._masks
    env.close()
    rollout = MemoryPolicyEnv(pc)
    obs, _ = rollout.reset()
    for _ in range(rollout.k):
        mask = rollout.action_masks()
        action = int(np.argmax(np.where(mask, wants_compress.logits(obs), -np.inf)))
        assert mask[action] and action == (COMPRESS if mask[COMPRESS] else RECOMPUTE)
        obs, *_ = rollout.step(action)
    assert masks[:, COMPRESS].any() and not masks[:, COMPRESS].all()
    r = one_pass(wants_compress, pc)
    assert all(masks[i, a] for i, a in enumerate(r.actions))


def test_give_back_returns_every_needless_drop_to_keep() -> None:
    """At a budget above the no-policy peak, a network that recomputes everything is undone to keep-all."""
    p = problem(1.05)
    r = one_pass(constant_agent([0.0, 0.0, 1.0, 0.0]), p)
    assert r.rollout_feasible and r.given_back == p.n
    assert np.array_equal(r.actions, p.keep_all()) and r.result == p.evaluate(p.keep_all())


def test_the_fit_step_drops_in_the_networks_order_until_the_policy_fits() -> None:
    """A network that keeps everything misses a 95% budget; the fit step then drops candidates by its margin
    (all equal here, so in candidate order) with its preferred drop (swap over recompute), as
    apply_until_fits would, and gives back nothing it needed. The sweep then switches that swap to its second
    choice: on v100-16gb issuing a swap costs the host 132 us (as an H200 machine's host measured), more than
    recomputing this tiny CNN's first tensor."""
    p = problem(0.95)
    agent = constant_agent([1.0, 0.5, 0.2, 0.0])
    r = one_pass(agent, p)
    assert not r.rollout_feasible and r.result.feasible and r.fitted > 0
    expected, result = apply_until_fits(problem(0.95), ((i, SWAP) for i in range(p.n)))
    assert result.feasible
    # Give-back may then return some of those swaps to keep, or switch them; never drop anything else.
    assert set(np.flatnonzero(r.actions != KEEP)) <= set(np.flatnonzero(expected != KEEP))
    assert r.actions.tolist() == [RECOMPUTE] + [KEEP] * (p.n - 1) and (r.fitted, r.switched) == (1, 1)


def test_a_sweep_that_changed_something_is_followed_by_another(monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [ One pass ] step 4 on a network of random weights (seed 6) at 95%: one sweep leaves the first
    candidate recomputed and the eighth swapped (4,425 samples/s): the eighth could not go back to keep in
    that sweep; after it (the first switched from swap to recompute, the look-ahead chosen again) a second
    sweep gives it back (6,694 samples/s), and a third changes nothing."""
    import agents.pretrained as P

    rng = np.random.default_rng(6)
    agent = Agent(
        [(rng.normal(0, 1, (8, OBS_SIZE)).astype(np.float32), rng.normal(0, 1, 8).astype(np.float32))],
        (rng.normal(0, 1, (4, 8)).astype(np.float32), rng.normal(0, 1, 4).astype(np.float32)),
        OBS_FIELDS,
    )
    sweeps = ("fit", "lookahead", "give_back", "second_choice")  # step 5 would trade the eighth away too
    monkeypatch.setattr(P, "SWEEPS", 1)
    once = one_pass(agent, problem(0.95), stages=sweeps)
    monkeypatch.setattr(P, "SWEEPS", 4)
    more = one_pass(agent, problem(0.95), stages=sweeps)
    n = problem(0.95).n
    assert once.actions.tolist() == [RECOMPUTE] + [KEEP] * 6 + [SWAP] + [KEEP] * (n - 8)
    assert more.actions.tolist() == [RECOMPUTE] + [KEEP] * (n - 1) and more.result.feasible
    assert (once.given_back, once.switched, more.given_back, more.switched) == (8, 1, 9, 1)
    assert round(once.result.samples_per_s) == 4425 and round(more.result.samples_per_s) == 6694


def test_the_exchange_step_trades_a_drop_for_another_that_the_sweeps_cannot_reach() -> None:
    """NOTE [ One pass ] step 5 on a network of random weights (seed 10) at 85%: steps 1-4 end at the first
    candidate recomputed and the fourth and eighth swapped (3,331 samples/s): neither swap can go back to
    keep alone (the policy would not fit) and neither is faster recomputed. Giving the fourth back and
    fitting again from the network's order recomputes the fifth; then the eighth goes back as well. The
    answer is the fastest of all policies with at most two drops (brute force over every look-ahead)."""
    import itertools

    rng = np.random.default_rng(10)
    agent = Agent(
        [(rng.normal(0, 1, (8, OBS_SIZE)).astype(np.float32), rng.normal(0, 1, 8).astype(np.float32))],
        (rng.normal(0, 1, (4, 8)).astype(np.float32), rng.normal(0, 1, 4).astype(np.float32)),
        OBS_FIELDS,
    )
    p = problem(0.85)
    before = one_pass(agent, p, stages=("fit", "lookahead", "give_back", "second_choice"))
    after = one_pass(agent, p)
    n = p.n
    assert before.actions.tolist() == [RECOMPUTE, KEEP, KEEP, SWAP] + [KEEP] * 3 + [SWAP] + [KEEP] * (n - 8)
    assert after.actions.tolist() == [RECOMPUTE] + [KEEP] * 3 + [RECOMPUTE] + [KEEP] * (n - 5)
    assert after.exchanged == 2 and round(before.result.samples_per_s) == 3331
    best = 0.0
    for drops in (1, 2):
        for at in itertools.combinations(range(n), drops):
            for how in itertools.product((SWAP, RECOMPUTE), repeat=drops):
                acts = p.keep_all()
                acts[list(at)] = how
                for x in LOOKAHEADS:
                    r = p.evaluate(acts, dataclasses.replace(p.options, prefetch_lookahead=x))
                    best = max(best, r.samples_per_s if r.feasible else 0.0)
    assert after.result.feasible and after.result.samples_per_s == best


def test_the_consolidation_step_trades_several_drops_for_one() -> None:
    """NOTE [ One pass ] step 6 on a network of random weights (seed 7) at 95%: steps 1-5 end with three
    candidates recomputed (the first, sixth and seventh; 5,005 samples/s), none of which can go back alone.
    Recomputing the fifth, which the network ranks among its drops, lets all three go back (6,688): one
    drop for three, which step 5 (one drop for several) cannot trade."""
    rng = np.random.default_rng(7)
    agent = Agent(
        [(rng.normal(0, 1, (8, OBS_SIZE)).astype(np.float32), rng.normal(0, 1, 8).astype(np.float32))],
        (rng.normal(0, 1, (4, 8)).astype(np.float32), rng.normal(0, 1, 4).astype(np.float32)),
        OBS_FIELDS,
    )
    p = problem(0.95)
    n = p.n
    before = one_pass(agent, p, stages=("fit", "lookahead", "give_back", "second_choice", "exchange"))
    after = one_pass(agent, p)
    assert before.actions.tolist() == [RECOMPUTE] + [KEEP] * 4 + [RECOMPUTE] * 2 + [KEEP] * (n - 7)
    assert after.actions.tolist() == [KEEP] * 4 + [RECOMPUTE] + [KEEP] * (n - 5) and after.consolidated == 1
    assert round(before.result.samples_per_s) == 5005 and round(after.result.samples_per_s) == 6688
    assert after.result.feasible and after.result.samples_per_s > before.result.samples_per_s


def test_where_the_fits_fail_the_frugal_ends_fit_and_the_sweep_gives_back() -> None:
    """At 85% the network that keeps everything (swap its preferred drop) cannot be fitted by dropping one
    candidate at a time: no single swap lowers the peak (67,072 bytes against 63,974). The frugal end
    "every candidate dropped with its first drop" (swap all) fits, at its fastest look-ahead; the sweep then
    gives back 9 of the 11 and switches the other 2 to recompute (a swap's host cost, 132 us on v100-16gb, is
    more than recomputing them), and the pass runs faster than that start."""
    p = problem(0.85)
    r = one_pass(constant_agent([1.0, 0.5, 0.2, 0.0]), p)
    assert not r.rollout_feasible and r.result.feasible and r.fitted == p.n
    swap_all = np.full(p.n, SWAP, dtype=np.int8)
    start = max(
        (p.evaluate(swap_all, dataclasses.replace(p.options, prefetch_lookahead=x)) for x in LOOKAHEADS),
        key=lambda s: s.samples_per_s if s.feasible else 0.0,
    )
    assert start.feasible and r.result.samples_per_s > start.samples_per_s
    assert (r.given_back, r.switched) == (9, 2) and set(r.actions.tolist()) == {KEEP, RECOMPUTE}


def test_one_pass_is_deterministic_and_the_shipped_agent_fits() -> None:
    agent = load_agent()
    a, b = one_pass(agent, problem(0.95)), one_pass(agent, problem(0.95))  # no heuristic fits 70% here
    assert np.array_equal(a.actions, b.actions) and a.result == b.result and a.result.feasible


def test_ppo_pretrained_is_deterministic_under_a_seed_and_never_below_its_one_pass() -> None:
    ctx = SearchContext(seed=5, trials=20, time_limit_s=10)  # the exact phase takes half: the answer is the 60 s one
    runs = [get_searcher("ppo-pretrained").search(problem(0.95), ctx) for _ in range(2)]
    assert np.array_equal(runs[0].policy.to_vector(_W), runs[1].policy.to_vector(_W))
    first = get_searcher("ppo-onepass").search(problem(0.95))
    assert runs[0].feasible and runs[0].result.samples_per_s >= first.result.samples_per_s


def test_search_command_with_the_pretrained_agent(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from tests.test_cli import run

    out, db = tmp_path / "r18.policy.json", tmp_path / "s.db"
    args = ["search", "--model", "resnet18", "--batch-size", "4", "--gpu", "a100-40gb", "--budget", "200MB"]
    args += ["--reserve", "8MiB", "--searcher", "ppo-pretrained", "--trials", "6", "--timeout", "20"]
    # in tensor bytes: at this size no policy below the no-policy peak runs on the caching allocator's model
    args += ["--budget-kind", "allocated"]
    code, stdout, err = run(capsys, *args, "--out", str(out), "--storage", f"sqlite:///{db}", "--json")
    assert code == 0, err
    got = json.loads(stdout)
    assert got["feasible"] and got["samples_per_s"] >= got["best_heuristic_samples_per_s"]
    assert got["searcher"] == "ppo-pretrained" and out.exists()
    # where a baseline's policy won, the note names it, as the portfolio's does
    assert got["samples_per_s"] > got["best_heuristic_samples_per_s"] or got["note"].startswith("won by ")
    # --trials is its Optuna phase's total (it ran half of them: a QA run)
    import optuna

    (seeded,) = [n for n in optuna.get_all_study_names(f"sqlite:///{db}") if n.endswith(".seeded")]
    study = optuna.load_study(study_name=seeded, storage=f"sqlite:///{db}")
    assert len(study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))) == 6


def test_the_portfolio_takes_the_one_pass_among_its_seeds() -> None:
    p, ctx = problem(0.95), SearchContext(trials=6, time_limit_s=10)
    r = get_searcher("portfolio").search(p, ctx)
    given = Portfolio()._initial_seeds(p, ctx)  # the seeds that search started from
    seeds = [s.searcher for s in given]
    assert seeds.count("ppo-onepass") == 1 and len(seeds) > 1  # the baselines, then the agent's one pass
    onepass = next(s for s in given if s.searcher == "ppo-onepass")
    assert r.feasible and r.result.samples_per_s >= onepass.result.samples_per_s
