"""The package's own Q6_K product (native/q6k.c, built as `skippy_zmq.runtime._q6k`), a ggml custom op
that unpacks each block once for all activation rows (docs/ARCHITECTURE.md, "The Q6_K product").

This module loads the compiled library and picks its variant; runtime/ggml.py puts the op in graphs
(`ggml.mul_mat`) and checks it against ggml's own product once per process before it does.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import threading
from collections.abc import Mapping, Sequence

import attrs

from skippy_zmq.errors import ModelLoadError

Q6K_ENV = "SKIPPY_ZMQ_Q6K"
"""Who multiplies Q6_K matrices with the ggml kernel: `auto` (the default: the package's product in the
best variant this CPU runs, where it is built), `ggml` (ggml's own), or one variant by name (refused where
this CPU cannot run it)."""


@attrs.frozen
class Variant:
    """One variant of the native product: its number in q6k.c, what the CPU needs for it, and the most
    activation rows it multiplies (more go to ggml's product, faster there: docs/BENCHMARKS.md, "The
    Q6_K product")."""

    number: int
    needs: str
    max_rows: int
    automatic: bool = True  # `auto` may pick it


VARIANTS: dict[str, Variant] = {
    # 7 rows: from 8 on ggml multiplies Q6_K with another kernel, in another order, and a prompt's tiny
    # differences grew into other greedy tokens on the llama3-8b file (docs/BENCHMARKS.md, "The Q4_K
    # product"); below 8 the products are llama.cpp's bits
    "avx512": Variant(1, "AVX-512 F, BW, VL and DQ", max_rows=7),
    "avx2": Variant(2, "AVX2, FMA and F16C", max_rows=7),
    # slower than ggml's own on every CPU ggml has SIMD for: tests, and only when named
    "scalar": Variant(3, "nothing: portable C", max_rows=1 << 30, automatic=False),
}
"""The variants q6k.c compiles, best first (`skippy_q6k_best_route` names the best one a CPU runs)."""
ROUTES = ("auto", "ggml", *VARIANTS)


@attrs.frozen
class Native:
    """The loaded library: the op's C function and the variant it runs (passed to it as user data)."""

    library: ctypes.CDLL
    function: int  # address of the op's C function (skippy_q6k_mul_mat), a ggml_custom_op_t
    variant: str
    variants: Mapping[str, Variant] = attrs.field(factory=lambda: VARIANTS, repr=False)  # the op's table

    @property
    def userdata(self) -> int:
        """The user data ggml passes to the op: the variant's number."""
        return self.variants[self.variant].number

    @property
    def max_rows(self) -> int:
        """The most activation rows this variant multiplies."""
        return self.variants[self.variant].max_rows


_lock = threading.Lock()
_loaded: dict[str, Native | str] = {}  # route -> the library, or why it cannot run


def route() -> str:
    """The route $SKIPPY_ZMQ_Q6K asks for; ModelLoadError naming the value when it is none of ROUTES."""
    return route_from(Q6K_ENV, ROUTES)


def route_from(env: str, routes: Sequence[str]) -> str:
    """The route environment variable `env` asks for (`auto` when unset or empty); ModelLoadError naming the
    value when it is none of `routes`."""
    value = os.environ.get(env, "").strip() or "auto"
    if value not in routes:
        raise ModelLoadError(f"${env} = {value!r}; expected one of {list(routes)}")
    return value


def load(asked: str) -> Native | str:
    """The native product for route `asked` (not `ggml`), or why it cannot run here (once per route)."""
    with _lock:
        if asked not in _loaded:
            _loaded[asked] = _load(asked)
        return _loaded[asked]


def _load(asked: str) -> Native | str:
    return load_native("skippy_zmq.runtime._q6k", "skippy_q6k", VARIANTS, asked, "Q6_K")


def load_native(module: str, prefix: str, variants: Mapping[str, Variant], asked: str, what: str) -> Native | str:
    """The op `{prefix}_mul_mat` of compiled module `module` in the variant `asked` names (`auto`: the best
    `{prefix}_best_route` says this CPU runs), or why it cannot run here; `what` names the product."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return f"the package's {what} product was not built (setup.py builds it where a C compiler is installed)"
    try:
        library = ctypes.CDLL(spec.origin)
    except OSError as exc:
        return f"cannot load {spec.origin}: {exc}"
    best_route = getattr(library, f"{prefix}_best_route")
    best_route.restype, best_route.argtypes = ctypes.c_int, []
    best_number = int(best_route())
    best = next((name for name, variant in variants.items() if variant.number == best_number), None)
    if best is None:
        return f"this CPU has none of the instructions the {what} product needs ({_needs(variants)})"
    variant = best if asked == "auto" else asked
    if not variants[variant].automatic and asked == "auto":
        return f"this CPU has none of {[name for name, v in variants.items() if v.automatic]}'s instructions"
    if variants[variant].number < best_number:
        return f"variant {variant!r} needs {variants[variant].needs}, which this CPU lacks (its best is {best!r})"
    address = ctypes.cast(getattr(library, f"{prefix}_mul_mat"), ctypes.c_void_p).value
    if address is None:  # pragma: no cover - a loaded symbol has an address
        return f"{spec.origin} has no {prefix}_mul_mat"
    return Native(library, int(address), variant, variants)


def _needs(variants: Mapping[str, Variant]) -> str:
    return "; ".join(f"{name}: {variant.needs}" for name, variant in variants.items())
