"""runtime/plan.py: which module calls a policy recomputes with torch.utils.checkpoint (NOTE [ Recompute
mechanisms ]), each rule P1-P6 on a model where it decides."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from envs.simulator import uniform_actions
from runtime.host_costs import _loss, _network
from runtime.plan import RegionPlanner, regions_for
from runtime.policy import Action, Policy, load_policy
from runtime.trace import capture
from runtime.vocab import KEEP, RECOMPUTE, SWAP
from tests.test_apply import GPT2, RESNET, _build


def _trace(name: str, kwargs: dict):  # type: ignore[no-untyped-def,type-arg]
    return capture(_build(name, kwargs), name=name, batch_size=kwargs["batch_size"])


def test_every_resnet_block_is_a_region_of_block_recompute() -> None:
    """The uniform recompute policy keeps block inputs and recomputes the rest: every residual block
    qualifies, and each serves exactly the candidates made inside it (the block's input is kept, P4)."""
    w = _trace(*RESNET)
    vec = uniform_actions(w, Action.RECOMPUTE)
    regions = {r.module: r for r in regions_for(w, vec)}
    blocks = [f"layer{i}.{j}" for i in range(1, 5) for j in range(2)]
    assert set(blocks) <= set(regions)
    for path in blocks:
        made = {c.key for c in w.candidates if c.block == path and not c.block_input}
        assert set(regions[path].keys) == made and not regions[path].rng
    assert not regions_for(w, np.zeros(len(w.candidates), dtype=np.int8))  # nothing recomputed: no region


def test_gpt2_blocks_are_regions_that_replay_their_dropout() -> None:
    w = _trace(*GPT2)
    regions = {r.module: r for r in regions_for(w, uniform_actions(w, Action.RECOMPUTE))}
    assert {"transformer.h.0", "transformer.h.1"} <= set(regions)
    assert regions["transformer.h.0"].rng  # dropout inside: checkpoint preserves the RNG state


def test_a_swapped_block_input_disqualifies_the_block() -> None:
    """P4: checkpoint holds the block's input, so a policy that swaps it cannot run the block as a region."""
    w = _trace(*RESNET)
    vec = uniform_actions(w, Action.RECOMPUTE)
    frame = next(f for f in w.frames if f.path == "layer2.0")
    arg = next(i for i, c in enumerate(w.candidates) if c.tensor in frame.args)
    vec[arg] = SWAP
    assert "layer2.0" not in {r.module for r in regions_for(w, vec)}
    assert "layer2.1" in {r.module for r in regions_for(w, vec)}


class _Counting(torch.nn.Module):
    """A module that writes its own state in forward (a step counter): recomputing it would count twice."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return torch.relu(self.lin(x)).sin()


def test_a_module_that_writes_its_state_is_never_a_region() -> None:
    """P5: buffers other than BatchNorm's statistics are not put back after a recompute."""

    def build():  # type: ignore[no-untyped-def]
        model = torch.nn.Sequential(_Counting(), torch.nn.Linear(4, 4))
        return model, (torch.randn(2, 4),), lambda m, b: m(b[0]).sum()

    w = capture(build, name="counting", batch_size=2)
    every = np.full(len(w.candidates), RECOMPUTE, dtype=np.int8)
    planner = RegionPlanner(w)
    counting = next(f.index for f in w.frames if f.path == "0")
    assert not planner.static_ok[counting]
    assert "0" not in {r.module for r in regions_for(w, every)}


def test_regions_do_not_wait_on_each_other_but_on_replays() -> None:
    """P6 on a chain of modules of two relus (runtime/host_costs.py): each module's first relu reads the
    previous module's output, so recomputing everything makes every module a region (each regenerates
    from its own input, which its checkpoint holds) -- unless a reader is replayed."""
    w = capture(lambda: (*_network(2, torch.device("cpu")), _loss), name="relus", batch_size=1)
    every = np.full(len(w.candidates), RECOMPUTE, dtype=np.int8)
    assert len(regions_for(w, every)) == 24
    # Keep the second relu of module "6": it is no region (P2), its first relu is replayed, and that
    # replay reads module "5"'s last relu through the add (freed, not saved): "5" cannot be a region
    # either (P6), so its relus are replayed too, and so on back to the first module. After "6" the
    # regions stand: nothing there is read by a replay.
    planner = RegionPlanner(w)
    module = next(f for f in w.frames if f.path == "6")
    second = [i for i, c in enumerate(w.candidates) if module.first_op <= c.producer <= module.last_op][1]
    vec = every.copy()
    vec[second] = KEEP
    chosen = {w.frames[f].path for f in planner.select(vec)}
    assert chosen == {str(i) for i in range(7, 25)}


def test_regions_travel_in_the_policy_file(tmp_path: Path) -> None:
    w = _trace(*RESNET)
    policy = Policy.from_vector(w, uniform_actions(w, Action.RECOMPUTE), hardware="cpu")
    policy.save(tmp_path / "p.json")
    back = load_policy(tmp_path / "p.json", w)
    assert back.schedule is not None and policy.schedule is not None
    assert back.schedule.regions == policy.schedule.regions and back.schedule.regions
