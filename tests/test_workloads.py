"""autotune.workloads: a model traced with the defaults a user types is the same workload as with those
defaults spelled out, so a policy made one way applies the other way."""

from __future__ import annotations

from pathlib import Path

from autotune.models import build_model
from autotune.workloads import TraceRequest, trace_model
from runtime.workload import Workload


def test_defaults_and_spelled_out_defaults_give_the_same_fingerprints() -> None:
    entry = build_model("resnet18")
    defaulted, _ = trace_model(TraceRequest(model="resnet18"))
    spelled, _ = trace_model(TraceRequest(model="resnet18", batch_size=entry.batch_size))
    assert defaulted.batch_size == entry.batch_size > 0
    assert (defaulted.fingerprint, defaulted.shape_fingerprint) == (spelled.fingerprint, spelled.shape_fingerprint)


def test_a_transformer_without_seq_len_gets_its_default_in_the_shape_fingerprint() -> None:
    defaulted, _ = trace_model(TraceRequest(model="gpt2", batch_size=1))
    spelled, _ = trace_model(TraceRequest(model="gpt2", batch_size=1, seq_len=defaulted.seq_len))
    assert defaulted.seq_len == build_model("gpt2", batch_size=1).seq_len is not None
    assert defaulted.shape_fingerprint == spelled.shape_fingerprint


def test_saved_workload_keeps_its_precision_and_accumulation(tmp_path: Path) -> None:
    w, _ = trace_model(TraceRequest(model="resnet18", batch_size=2, precision="bf16", grad_accum=2))
    w.save(tmp_path / "w.json.gz")
    back = Workload.load(tmp_path / "w.json.gz")
    assert (back.precision, back.grad_accum) == ("bf16", 2)
