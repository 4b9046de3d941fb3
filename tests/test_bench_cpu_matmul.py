"""``benchmarks/bench_cpu_matmul.py``: each library's measurement covers every dtype and shape
with a positive rate, and the CPU flags it records are among those it looks for."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(
        "bench_cpu_matmul", ROOT / "benchmarks" / "bench_cpu_matmul.py"
    )
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, mod)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(mod, "SHAPES", {"tiny": (4, 8, 16), "wide": (2, 8, 64)})
    return mod


@pytest.mark.parametrize("lib", ["jax", "torch"])
def test_every_dtype_and_shape_is_measured(bench, lib):
    pytest.importorskip(lib)
    out = bench.measure(lib, reps=2)
    for dtype in ("float32", "bfloat16"):
        assert set(out[dtype]) == {"tiny", "wide"}
        for figure in out[dtype].values():
            assert figure["gflops"] > 0 and figure["calls"] in (1, 2)
    assert out[lib]  # the library's version


def test_cpu_flags_are_the_matrix_related_ones(bench):
    wanted = {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "amx_int8"}
    assert set(bench.cpu_flags()) <= wanted
