"""What the package's compiled products share: the route variable, the library loaded and the variant a
CPU runs picked, or why it cannot run; and, through compute/ggml.py, a product named `ggml`, refused, wrong
or not built falling back to ggml's by name."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest

from skippy_zmq.compute import products, q6k, q80
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


# ---- what every product's route shares, through compute/ggml.py (Q6_K and Q8_0: the products with a scalar
# variant to stand in for a broken one; test_q4k.py has the Q4_K product's own)

SHARED = ["Q6_K", "Q8_0"]


def _route_of(type_name: str) -> tuple[Any, Any, Callable[[], products.Native | str], Callable[[], str]]:
    """The product's module, ggml, and ggml's `*_product` and `*_described` for it; skipped without ggml or
    without the product built."""
    ggml = pytest.importorskip("skippy_zmq.compute.ggml")
    if ggml.unavailable() is not None:
        pytest.skip(f"ggml kernel unavailable: {ggml.unavailable()}")
    module = {"Q6_K": q6k, "Q8_0": q80}[type_name]
    if isinstance(module.PRODUCT.load("scalar"), str):
        pytest.skip(f"the package's {type_name} product is not built")
    name = module.__name__.rpartition(".")[2]
    return module, ggml, getattr(ggml, f"{name}_product"), getattr(ggml, f"{name}_described")


@pytest.fixture(autouse=True)
def _fresh_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test checks the products anew, with the route variables unset."""
    for module in (q6k, q80):
        monkeypatch.delenv(module.PRODUCT.env, raising=False)
    monkeypatch.setattr("skippy_zmq.compute.ggml._native", {})


@pytest.mark.parametrize("type_name", SHARED)
def test_ggml_named_keeps_ggmls_and_a_bad_name_is_refused(type_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    module, _ggml, product, described = _route_of(type_name)
    env = module.PRODUCT.env
    monkeypatch.setenv(env, "ggml")
    assert product() == f"${env} = ggml"
    assert "ggml's" in described()
    monkeypatch.setenv(env, "fast")
    with pytest.raises(ModelLoadError, match=rf"\${env} = 'fast'; expected one of \['auto', 'ggml', "):
        product()


@pytest.mark.parametrize("type_name", SHARED)
def test_a_variant_this_cpu_cannot_run_is_refused_when_named(type_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    module, _ggml, product, _described = _route_of(type_name)
    missing = [v for v in module.VARIANTS if isinstance(module.PRODUCT.load(v), str)]
    if not missing:
        pytest.skip("this CPU runs every variant")
    monkeypatch.setenv(module.PRODUCT.env, missing[0])
    with pytest.raises(ModelLoadError, match=rf"= {missing[0]}, but that product cannot run here: .*needs"):
        product()


@pytest.mark.parametrize("type_name", SHARED)
def test_scalar_is_never_picked_by_auto(type_name: str) -> None:
    module, _ggml, _product, _described = _route_of(type_name)
    scalar = module.PRODUCT.load("scalar")
    assert isinstance(scalar, products.Native)
    best = int(getattr(scalar.library, f"{module.PRODUCT.prefix}_best_route")())
    found = module.PRODUCT.load("auto")
    if best == module.VARIANTS["scalar"].number:
        assert isinstance(found, str) and "instructions" in found
    else:
        assert isinstance(found, products.Native) and found.variant != "scalar"


@pytest.mark.parametrize("type_name", SHARED)
def test_a_product_that_disagrees_falls_back_to_ggmls_or_is_refused_when_named(
        type_name: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    module, ggml, product, _described = _route_of(type_name)
    compiled = module.PRODUCT
    scalar = compiled.load("scalar")
    assert isinstance(scalar, products.Native)
    # variant number 99: the op picks no variant and writes nothing, so its outputs are not ggml's
    variants = {**compiled.variants, "broken": products.Variant(99, "nothing", max_rows=8)}
    monkeypatch.setattr(compiled, "variants", variants)
    monkeypatch.setattr(compiled, "load", lambda asked: products.Native(scalar.library, scalar.function, "broken",
                                                                        variants))
    with caplog.at_level(logging.WARNING, logger=ggml.__name__):
        why = product()
    assert isinstance(why, str) and "the broken product differs from ggml's" in why
    assert f"{type_name} matrices multiply by ggml's product" in caplog.text
    monkeypatch.setattr(ggml, "_native", {})
    monkeypatch.setenv(compiled.env, "broken")
    with pytest.raises(ModelLoadError, match=r"= broken, but that product cannot run here: the broken product"):
        product()


@pytest.mark.parametrize("type_name", SHARED)
def test_a_package_built_without_the_product_uses_ggmls(type_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    module, ggml, product, _described = _route_of(type_name)
    monkeypatch.setattr(module.PRODUCT, "_loaded", {})
    monkeypatch.setattr("skippy_zmq.compute.products.importlib.util.find_spec", lambda name: None)
    why = product()
    assert isinstance(why, str) and "was not built" in why
    lib = ggml.Library.get()
    ctx = lib.ggml_init(ggml.InitParams(lib.ggml_tensor_overhead() * 8, None, True))
    weight = lib.ggml_new_tensor_2d(ctx, ggml.GGML_TYPES[type_name], 512, 16)
    x = lib.ggml_new_tensor_2d(ctx, ggml.GGML_TYPES["F32"], 512, 4)
    assert ggml.native_product(lib, weight, x) is None
    lib.ggml_free(ctx)


def test_a_compiled_products_routes_are_auto_ggml_and_its_variants(monkeypatch: pytest.MonkeyPatch) -> None:
    compiled = products.Compiled("Toy", "SKIPPY_ZMQ_TEST_ROUTE", "skippy_zmq.compute._no_such_product", "skippy_none",
                                 TOY)
    assert compiled.routes == ("auto", "ggml", "wide", "narrow", "portable")
    monkeypatch.setenv("SKIPPY_ZMQ_TEST_ROUTE", "narrow")
    assert compiled.route() == "narrow"
    assert compiled.load("auto") == compiled.load("auto")  # kept: one load per route
    assert "was not built" in str(compiled.load("auto")) and list(compiled._loaded) == ["auto"]
