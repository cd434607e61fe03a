"""`bench products` on small matrices: both routes timed and checked equal, the table."""

from __future__ import annotations

import io
import json

import pytest

from skippy_zmq.bench import products as bench_products
from skippy_zmq.bench.products import PRODUCTS, ProductRow, products_table, run_products_bench
from skippy_zmq.bench.report import Machine, Report
from skippy_zmq.errors import BenchError


@pytest.fixture(autouse=True)
def _small(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench_products, "COPY_BYTES", 256 << 10)
    monkeypatch.setattr(bench_products, "ROUND_SECONDS", 0.001)


@pytest.mark.parametrize("type_name", list(PRODUCTS))
def test_both_routes_are_timed_on_equal_products(type_name: str) -> None:
    if isinstance(why := PRODUCTS[type_name].compiled.load("auto"), str):
        pytest.skip(f"the package's {type_name} product cannot run here: {why}")
    out = io.StringIO()
    report = Report("products", out, machine=Machine("CPU", 1, ()), clock=lambda: "D")
    said: list[str] = []
    rows = run_products_bench(type_name, "auto", [(512, 64)], [2, 4], [1], 2, report, said.append)
    assert [(r.type_name, r.k, r.n, r.threads, r.rows) for r in rows] == [(type_name, 512, 64, 1, 2),
                                                                          (type_name, 512, 64, 1, 4)]
    assert all(r.ggml_ms > 0 and r.ours_ms > 0 and r.variant != "auto" for r in rows)
    assert len(said) == 2 and said[0] == f"{type_name} 512x64, 1 thread(s), 2 row(s): 2 rounds"
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [(line["rows"], line["rounds"], line["type"]) for line in lines] == [(2, 2, type_name), (4, 2, type_name)]


def test_a_product_that_cannot_run_here_is_a_bench_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(PRODUCTS["Q4_K"].compiled, "load", lambda _route: "no such CPU")
    report = Report("products", None, machine=Machine("CPU", 1, ()), clock=lambda: "D")
    with pytest.raises(BenchError, match="the package's Q4_K product cannot run here: no such CPU"):
        run_products_bench("Q4_K", "auto", [(512, 64)], [2], [1], 1, report, lambda _text: None)


def test_a_shape_whose_inputs_are_not_whole_blocks_of_the_type_is_refused() -> None:
    report = Report("products", None, machine=Machine("CPU", 1, ()), clock=lambda: "D")
    with pytest.raises(BenchError, match=r"--shapes: a Q6_K matrix's K \(inputs\) must be a multiple of 256, its "
                                         r"block; got 640"):
        run_products_bench("Q6_K", "auto", [(640, 64)], [2], [1], 1, report, lambda _text: None)


@pytest.mark.parametrize("variant", ["ggml", "avx9", ""])
def test_a_variant_the_product_lacks_is_named(variant: str) -> None:
    report = Report("products", None, machine=Machine("CPU", 1, ()), clock=lambda: "D")
    with pytest.raises(BenchError, match=rf"--variant '{variant}': the Q4_K product's routes against ggml's are "
                                         r"\['auto', 'avx512vnni', 'avx2'\]"):
        run_products_bench("Q4_K", variant, [(512, 64)], [2], [1], 1, report, lambda _text: None)


def test_the_table_gives_the_ratio_and_the_variant() -> None:
    table = products_table([ProductRow("Q4_K", "avx2", 4096, 14336, 2, 4, 3.407, 2.340)])
    assert "| Q4_K | 4096 x 14336 | 2 | 4 | 3.407 | 2.340 (avx2) | 0.69 |" in table
