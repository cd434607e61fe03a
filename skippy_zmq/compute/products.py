"""The package's own compiled products (native/, built by setup.py): one `Variant` row per instruction set
a product compiles, the library loaded and its variant picked (`load_native`), the route variable read
(`route_from`), and `Compiled`, one product's route and loaded libraries. q6k.py, q4k.py and q80.py each
hold one product's table (docs/ARCHITECTURE.md, "Kernels")."""

from __future__ import annotations

import ctypes
import importlib.util
import os
import threading
from collections.abc import Mapping, Sequence

import attrs

from skippy_zmq.errors import ModelLoadError

GGML_SWITCH_ROWS = 8
"""From this many activation rows ggml multiplies K-quant matrices with another kernel, in another order."""


@attrs.frozen
class Variant:
    """One variant of a native product: its number in the C file, what the CPU needs for it, and the range of
    activation rows it multiplies (others go to ggml's product)."""

    number: int
    needs: str
    max_rows: int
    automatic: bool = True  # `auto` may pick it
    min_rows: int = 1  # the fewest activation rows it multiplies (fewer go to ggml's product)
    # Matrices of at least this many inputs (None: no such rule) it multiplies by single rows only, shorter ones
    # from 2 rows: below ggml's own switch to another kernel (GGML_SWITCH_ROWS) the two routes sum in one order,
    # so which runs is a matter of speed only (docs/BENCHMARKS.md, "The Q6_K product")
    long_k: int | None = None
    # A single row only of matrices of fewer inputs than this (None: of any): ggml's one-row product of longer
    # rows is the faster, and the two give the same bits (docs/BENCHMARKS.md, "The Q8_0 product")
    single_k_below: int | None = None

    def takes(self, rows: int, k: int) -> bool:
        """Whether it multiplies `rows` activation rows by a matrix of `k` inputs, within its row range."""
        if rows == 1 and self.single_k_below is not None and k >= self.single_k_below:
            return False
        if self.long_k is None or rows >= GGML_SWITCH_ROWS:
            return True
        return (rows == 1) == (k >= self.long_k)


@attrs.frozen
class Native:
    """The loaded library: the op's C function and the variant it runs (passed to it as user data)."""

    library: ctypes.CDLL
    function: int  # address of the op's C function (skippy_q6k_mul_mat, ...), a ggml_custom_op_t
    variant: str
    variants: Mapping[str, Variant] = attrs.field(repr=False)  # the op's table

    @property
    def userdata(self) -> int:
        """The user data ggml passes to the op: the variant's number."""
        return self.variants[self.variant].number

    @property
    def max_rows(self) -> int:
        """The most activation rows this variant multiplies."""
        return self.variants[self.variant].max_rows

    @property
    def min_rows(self) -> int:
        """The fewest activation rows this variant multiplies."""
        return self.variants[self.variant].min_rows

    def takes(self, rows: int, k: int) -> bool:
        """Whether this variant multiplies `rows` rows by a matrix of `k` inputs (Variant.takes)."""
        return self.variants[self.variant].takes(rows, k)


def route_from(env: str, routes: Sequence[str]) -> str:
    """The route environment variable `env` asks for (`auto` when unset or empty); ModelLoadError naming the
    value when it is none of `routes`."""
    value = os.environ.get(env, "").strip() or "auto"
    if value not in routes:
        raise ModelLoadError(f"${env} = {value!r}; expected one of {list(routes)}")
    return value


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


class Compiled:
    """One compiled product: its route variable `env`, its `variants` (best first), the module setup.py builds
    and its C functions' `prefix`; each route's library is loaded once, or why it cannot run kept."""

    def __init__(self, type_name: str, env: str, module: str, prefix: str, variants: Mapping[str, Variant]) -> None:
        self.type_name, self.env, self.module, self.prefix = type_name, env, module, prefix
        self.variants = variants
        self._lock = threading.Lock()
        self._loaded: dict[str, Native | str] = {}  # route -> the library, or why it cannot run

    @property
    def routes(self) -> tuple[str, ...]:
        """What the route variable takes: auto, ggml, and the variants by name."""
        return ("auto", "ggml", *self.variants)

    def route(self) -> str:
        """The route the variable asks for; ModelLoadError naming the value when it is none of `routes`."""
        return route_from(self.env, self.routes)

    def load(self, asked: str) -> Native | str:
        """The native product for route `asked` (not `ggml`), or why it cannot run here (once per route)."""
        with self._lock:
            if asked not in self._loaded:
                self._loaded[asked] = load_native(self.module, self.prefix, self.variants, asked, self.type_name)
            return self._loaded[asked]


def _needs(variants: Mapping[str, Variant]) -> str:
    return "; ".join(f"{name}: {variant.needs}" for name, variant in variants.items())
