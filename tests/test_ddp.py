"""A policy under DistributedDataParallel: applied per rank, to the module DDP wraps; gradients after the
all-reduce bit-identical to plain DDP's (two processes on the CPU, gloo)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from autotune.models import build_model
from envs.simulator import uniform_actions
from runtime.apply import PolicyRuntime
from runtime.policy import Action, Policy, load_policy
from runtime.trace import capture
from runtime.vocab import KEEP, RECOMPUTE, SWAP

MODEL = ("resnet18", {"batch_size": 2, "image_size": 64})


def _build() -> tuple[torch.nn.Module, object, object]:
    torch.manual_seed(0)  # every rank builds the same model (DDP also broadcasts rank 0's)
    e = build_model(MODEL[0], **MODEL[1])  # type: ignore[arg-type]
    return e.module, e.batch, e.loss_fn


def _step(rank: int, policy: Policy | None, steps: int = 1) -> tuple[list[torch.Tensor], dict[str, float]]:
    """The gradients of the last of ``steps`` backward passes (parameters unchanged between them) and what
    the runtime did in it; with more than one step, one runtime learns in the first (R11) and the others run
    as later steps do (regions as nodes, R10)."""
    model, batch, loss_fn = _build()
    x, y = batch  # type: ignore[misc]
    batch = (x + rank, y)  # each rank its own data: the all-reduce has something to average
    ddp = DistributedDataParallel(model)
    rt = PolicyRuntime(policy, model) if policy is not None else None  # on the inner module
    last = None
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        with rt.step() if rt is not None else contextlib.nullcontext() as stats:
            loss = loss_fn(ddp, batch)  # type: ignore[operator]
            loss.backward()
        last = stats
    stats = last
    done = {} if stats is None else {"swapped_bytes": stats.swapped_bytes, "regions": stats.regions,
                                     "recomputed_ops": stats.recomputed_ops,
                                     "checkpointed": stats.checkpointed}  # fmt: skip
    return [p.grad.detach().clone() for p in model.parameters()], done


def _worker(rank: int, world: int, port: int, policy_path: str, out: str, steps: int = 1) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        plain, _ = _step(rank, None)
        under, done = _step(rank, load_policy(policy_path), steps)
        same = all(torch.equal(a, b) for a, b in zip(plain, under, strict=True))
        mine = torch.cat([g.reshape(-1) for g in under])
        others = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(others, mine)  # after the all-reduce every rank holds the same gradients
        agreed = all(torch.equal(o, mine) for o in others)
        Path(out, f"rank{rank}.json").write_text(json.dumps({"same": same, "agreed": agreed, **done}))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_a_policy_under_ddp_keeps_the_gradients_bit_identical(tmp_path: Path) -> None:
    """resnet18 (b2, 64 px) on two gloo ranks: a mixed policy (a third each kept, swapped, recomputed)
    applied to the module DDP wraps; each rank's gradients after the all-reduce equal plain DDP's bit for
    bit, both ranks agree, and the runtime did what the policy says (bytes swapped, tensors recomputed)."""
    w = capture(_build, name=MODEL[0], batch_size=2, fake=True)  # type: ignore[arg-type]
    vec = np.random.default_rng(0).choice([KEEP, SWAP, RECOMPUTE], size=len(w.candidates)).astype(np.int8)
    policy_path = tmp_path / "p.json"
    Policy.from_vector(w, vec, hardware="cpu").save(policy_path)
    mp.spawn(_worker, args=(2, _free_port(), str(policy_path), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert r["same"] and r["agreed"], (rank, r)
        assert r["swapped_bytes"] > 0 and r["regions"] + r["recomputed_ops"] > 0, (rank, r)


@pytest.mark.slow
def test_regions_as_nodes_under_ddp_keep_the_gradients_bit_identical(tmp_path: Path) -> None:
    """Every block recomputed (regions, R10), two steps under one runtime on two gloo ranks: in the second
    the regions run as nodes, whose parameters' gradients reach DDP's hooks through their accumulators in
    the graph task backward runs; after the all-reduce each rank's gradients equal plain DDP's bit for bit."""
    w = capture(_build, name=MODEL[0], batch_size=2, fake=True)  # type: ignore[arg-type]
    policy_path = tmp_path / "p.json"
    Policy.from_vector(w, uniform_actions(w, Action.RECOMPUTE), hardware="cpu").save(policy_path)
    mp.spawn(_worker, args=(2, _free_port(), str(policy_path), str(tmp_path), 2), nprocs=2, join=True)
    for rank in range(2):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert r["same"] and r["agreed"], (rank, r)
        assert r["regions"] >= 8 and r["checkpointed"] == 0, (rank, r)
