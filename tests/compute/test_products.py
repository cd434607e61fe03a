"""What the package's compiled products share: the route variable, the library loaded and the variant a
CPU runs picked, or why it cannot run."""

from __future__ import annotations

import pytest

from skippy_zmq.compute import products, q6k
from skippy_zmq.errors import ModelLoadError

TOY = {"wide": products.Variant(1, "a wide unit", max_rows=8), "narrow": products.Variant(2, "a narrow unit", max_rows=4),
       "portable": products.Variant(3, "nothing", max_rows=1 << 30, automatic=False)}


def test_a_route_variable_reads_auto_when_unset_and_refuses_other_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SKIPPY_ZMQ_TEST_ROUTE", raising=False)
    assert products.route_from("SKIPPY_ZMQ_TEST_ROUTE", ("auto", "ggml")) == "auto"
    monkeypatch.setenv("SKIPPY_ZMQ_TEST_ROUTE", " ggml ")
    assert products.route_from("SKIPPY_ZMQ_TEST_ROUTE", ("auto", "ggml")) == "ggml"
    monkeypatch.setenv("SKIPPY_ZMQ_TEST_ROUTE", "fastest")
    with pytest.raises(ModelLoadError, match=r"^\$SKIPPY_ZMQ_TEST_ROUTE = 'fastest'; expected one of \['auto', 'ggml'\]$"):
        products.route_from("SKIPPY_ZMQ_TEST_ROUTE", ("auto", "ggml"))


def test_a_module_that_was_not_built_says_so() -> None:
    why = products.load_native("skippy_zmq.compute._no_such_product", "skippy_none", TOY, "auto", "Toy")
    assert why == "the package's Toy product was not built (setup.py builds it where a C compiler is installed)"


def _built() -> products.Native:
    found = products.load_native("skippy_zmq.compute._q6k", "skippy_q6k", q6k.VARIANTS, "scalar", "Q6_K")
    if isinstance(found, str):
        pytest.skip(found)
    return found


def test_the_variant_is_the_best_the_cpu_runs_or_the_one_named() -> None:
    built = _built()
    best = int(built.library.skippy_q6k_best_route())
    assert built.variant == "scalar" and built.variants is q6k.VARIANTS
    assert built.userdata == q6k.VARIANTS["scalar"].number and built.max_rows == q6k.VARIANTS["scalar"].max_rows
    auto = products.load_native("skippy_zmq.compute._q6k", "skippy_q6k", q6k.VARIANTS, "auto", "Q6_K")
    expected = next(name for name, v in q6k.VARIANTS.items() if v.number == best)
    if q6k.VARIANTS[expected].automatic:
        assert isinstance(auto, products.Native) and auto.variant == expected
    else:
        assert isinstance(auto, str) and "instructions" in auto


def test_a_named_variant_above_the_cpus_best_is_refused_naming_what_it_needs() -> None:
    built = _built()
    best = int(built.library.skippy_q6k_best_route())
    above = [name for name, v in q6k.VARIANTS.items() if v.number < best]
    if not above:
        pytest.skip("this CPU runs the best variant")
    why = products.load_native("skippy_zmq.compute._q6k", "skippy_q6k", q6k.VARIANTS, above[0], "Q6_K")
    assert isinstance(why, str) and why.startswith(f"variant {above[0]!r} needs {q6k.VARIANTS[above[0]].needs}")
