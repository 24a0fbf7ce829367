"""`bench.kv_transfer` runs every backend against a receiver in its own process and reports each
row next to its ceilings (what it measures is not asserted: speed lives in benchmarks)."""

from __future__ import annotations

import json

import pytest

import bench.common
from bench import kv_transfer as bench_kv_transfer

pytestmark = pytest.mark.slow


def test_every_backend_gets_a_row_with_its_ceilings(monkeypatch, tmp_path):
    monkeypatch.setattr(bench.common, "RESULTS_DIR", tmp_path)
    backends = ["inproc", "shm", "shm-staged", "grpc", "torch", "tcp"]
    argv = ["--backends", *backends, "--tokens", "32", "--layouts", "smollm2-135m", "--repeats", "1"]
    payload = bench_kv_transfer.main(argv)
    rows = {row["backend"]: row for row in payload["rows"]}
    assert list(rows) == backends
    for backend, row in rows.items():
        assert "note" not in row, f"{backend}: {row.get('note')}"
        assert row["GB/s"] > 0 and row["of ceiling"] > 0 and 0 <= row["hidden %"] <= 100
        assert 0 < row["first layer ms"] <= row["ms"] * 10  # a latency of this transfer, not a stray clock
        assert 0 <= row["hidden % bound"] < 100 and row["tail ms"] > 0
        if backend != "inproc":  # a short transfer is also set against the same bytes moved once, raw
            assert row["one-shot ms"] > 0 and row["of one-shot"] > 0
    assert ("of library" in rows["grpc"]) and ("of library" in rows["torch"]) and "of library" not in rows["shm"]
    assert "of library" not in rows["tcp"]  # its library is the socket: the ceiling itself
    assert payload["grpc_stream_bytes_per_s"] > 0 and payload["gloo_bytes_per_s"] > 0
    assert json.loads((tmp_path / "kv_transfer.json").read_text())["rows"] == json.loads(json.dumps(payload["rows"]))


def test_each_integrity_mode_gets_a_row_set_against_the_unchecked_one(monkeypatch, tmp_path):
    monkeypatch.setattr(bench.common, "RESULTS_DIR", tmp_path)
    argv = ["--backends", "inproc", "--tokens", "32", "--layouts", "smollm2-135m", "--repeats", "1"]
    payload = bench_kv_transfer.main([*argv, "--integrity", "none", "crc32", "mac"])
    rows = {row["integrity"]: row for row in payload["rows"]}
    assert list(rows) == ["none", "crc32", "mac"] and "vs none" not in rows["none"]
    for mode in ("crc32", "mac"):
        assert "note" not in rows[mode] and rows[mode]["vs none"] == rows[mode]["ms"] / rows["none"]["ms"]
