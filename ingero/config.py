"""Configuration file: discovery, validation, typed sections.

One YAML file (``configs/ingero.yaml`` is the commented example) carries an ``agent`` section (what
a node's agent uses: identity, database, listen address, server TLS) and a ``fleet`` section (what the
laptop-side client uses: node list, client TLS, token, timeouts, fan-out width, skew threshold).

Discovery, first hit wins: ``--config PATH`` > ``$INGERO_CONFIG`` > ``./ingero.yaml`` >
``~/.config/ingero/ingero.yaml`` > ``/etc/ingero/ingero.yaml``. A path given explicitly (flag or
variable) must exist. Every problem is a :class:`~ingero.errors.ConfigError` naming file and key.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ingero.errors import ConfigError, IngeroError, UsageError
from ingero.timeutil import NS_PER_MS, NS_PER_S, parse_duration

DEFAULT_PORT = 8080


def search_paths() -> list[Path]:
    return [
        Path("ingero.yaml"),
        Path.home() / ".config" / "ingero" / "ingero.yaml",
        Path("/etc/ingero/ingero.yaml"),
    ]


# --- node addresses ----------------------------------------------------------------------------

_HOST_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]{0,252})$")


@dataclass(frozen=True)
class NodeSpec:
    """One fleet member: where to reach it and, optionally, the name the operator gave it."""

    host: str
    port: int
    name: str | None = None

    @property
    def addr(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def label(self) -> str:
        return self.name or self.addr


def parse_addr(text: str) -> tuple[str, int]:
    """``host:port``, ``host`` (port 8080), ``[v6]:port`` → (host, port). Raises ValueError."""
    s = text.strip()
    if not s:
        raise ValueError("empty address")
    if s.startswith("["):
        end = s.find("]")
        if end < 0:
            raise ValueError(f"unclosed '[' in {text!r}")
        host, rest = s[1:end], s[end + 1 :]
        ipaddress.IPv6Address(host)  # raises ValueError
        if rest and not rest.startswith(":"):
            raise ValueError(f"junk after ']' in {text!r}")
        port_s = rest[1:] if rest else ""
    elif s.count(":") == 1:
        host, port_s = s.split(":")
    elif s.count(":") > 1:
        raise ValueError(f"IPv6 addresses need brackets: [{s}]:{DEFAULT_PORT}")
    else:
        host, port_s = s, ""
    if not host.startswith("[") and ":" not in host and not _HOST_RE.match(host):
        raise ValueError(f"bad host name {host!r}")
    if port_s == "":
        return host, DEFAULT_PORT
    if not port_s.isdigit() or not 0 < int(port_s) < 65536:
        raise ValueError(f"bad port {port_s!r} (1-65535)")
    return host, int(port_s)


LOOPBACK_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost")


def is_loopback(host: str) -> bool:
    """True for loopback addresses (``127.0.0.0/8``, ``::1``, bracketed or not) and localhost names."""
    h = host.strip().strip("[]").lower()
    if h in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def parse_node_list(text: str) -> list[NodeSpec]:
    """The ``--nodes a:8080,b:8080`` flag. Entries may be ``name=host:port``."""
    nodes: list[NodeSpec] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        name: str | None = None
        if "=" in part:
            name, part = (p.strip() for p in part.split("=", 1))
        try:
            host, port = parse_addr(part)
        except ValueError as e:
            raise UsageError(f"--nodes: {e}", hint="use host:port,host:port") from None
        nodes.append(NodeSpec(host, port, name or None))
    if not nodes:
        raise UsageError("--nodes is empty", hint="use host:port,host:port")
    return nodes


# --- typed sections ----------------------------------------------------------------------------


@dataclass
class AgentConfig:
    node: str | None = None
    db: str | None = None
    listen: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    client_ca: str | None = None
    token: str | None = None
    token_file: str | None = None  # a file holding the token (keeps it out of the config file)
    max_db: str | None = None
    stack: bool = True


@dataclass(frozen=True)
class GpuRates:
    """``fleet.gpu_hourly_usd``: dollars per GPU-hour — a default, overridden by GPU model (a
    case-insensitive substring of the node's GPU model) and by node name (see :mod:`ingero.fleet.cost`)."""

    default: float | None = None
    models: dict[str, float] = field(default_factory=dict)
    nodes: dict[str, float] = field(default_factory=dict)


@dataclass
class FleetConfig:
    nodes: list[NodeSpec] = field(default_factory=list)
    ca_cert: str | None = None
    client_cert: str | None = None
    client_key: str | None = None
    token: str | None = None
    timeout_s: float = 5.0
    fanout: int = 64
    skew_threshold_ms: float = 10.0
    skew_samples: int = 4
    plaintext: bool = False
    allow_plaintext: bool = False
    insecure_skip_verify: bool = False
    gpu_hourly_usd: GpuRates = field(default_factory=GpuRates)


@dataclass
class Config:
    path: Path | None = None
    agent: AgentConfig = field(default_factory=AgentConfig)
    fleet: FleetConfig = field(default_factory=FleetConfig)


# --- validation --------------------------------------------------------------------------------

Checker = Callable[[Any, str], Any]


def _str(v: Any, _key: str) -> str:
    if not isinstance(v, str | int) or isinstance(v, bool):
        raise ValueError(f"expected a string, got {type(v).__name__}")
    return str(v)


def _bool(v: Any, _key: str) -> bool:
    if not isinstance(v, bool):
        raise ValueError(f"expected true or false, got {v!r}")
    return v


def _posint(v: Any, _key: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ValueError(f"expected a positive integer, got {v!r}")
    return v


def _duration_s(v: Any, _key: str) -> float:
    if isinstance(v, int | float) and not isinstance(v, bool):
        if v <= 0:
            raise ValueError(f"expected a positive duration, got {v!r}")
        return float(v)
    try:
        ns = parse_duration(str(v))
    except IngeroError:
        raise ValueError(f"expected a duration like 5s or 500ms, got {v!r}") from None
    if ns <= 0:
        raise ValueError(f"expected a positive duration, got {v!r}")
    return ns / NS_PER_S


def _duration_ms(v: Any, key: str) -> float:
    if isinstance(v, int | float) and not isinstance(v, bool):
        return float(v)  # bare numbers are milliseconds for thresholds
    return _duration_s(v, key) * NS_PER_S / NS_PER_MS


def _nodes(v: Any, key: str) -> list[NodeSpec]:
    if not isinstance(v, list):
        raise ValueError("expected a list of host:port strings or {name, addr} mappings")
    out: list[NodeSpec] = []
    for i, entry in enumerate(v):
        where = f"{key}[{i}]"
        name: str | None = None
        if isinstance(entry, str):
            addr = entry
        elif isinstance(entry, Mapping):
            unknown = set(entry) - {"name", "addr"}
            if unknown:
                raise ValueError(f"{where}: unknown key {sorted(unknown)[0]!r} (known: name, addr)")
            if "addr" not in entry:
                raise ValueError(f"{where}: missing 'addr'")
            addr = str(entry["addr"])
            name = str(entry["name"]) if entry.get("name") is not None else None
        else:
            raise ValueError(f"{where}: expected host:port or {{name, addr}}, got {entry!r}")
        try:
            host, port = parse_addr(addr)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        out.append(NodeSpec(host, port, name))
    return out


def _usd(v: Any, key: str) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v < float("inf"):
        raise ValueError(f"{key}: expected dollars per GPU-hour (a number >= 0), got {v!r}")
    return float(v)


def _rates(v: Any, key: str) -> GpuRates:
    """A number (every GPU) or {default, models: {MODEL: usd}, nodes: {NODE: usd}}."""
    if not isinstance(v, Mapping):
        return GpuRates(default=_usd(v, key))
    unknown = set(v) - {"default", "models", "nodes"}
    if unknown:
        raise ValueError(f"unknown key {sorted(unknown)[0]!r} (known: default, models, nodes)")
    tables: dict[str, dict[str, float]] = {}
    for sub in ("models", "nodes"):
        table = v.get(sub) or {}
        if not isinstance(table, Mapping):
            raise ValueError(f"{sub}: expected a mapping of name to dollars per GPU-hour")
        tables[sub] = {str(k): _usd(x, f"{sub}.{k}") for k, x in table.items()}
    default = None if v.get("default") is None else _usd(v["default"], "default")
    return GpuRates(default, tables["models"], tables["nodes"])


_AGENT_KEYS: dict[str, tuple[str, Checker]] = {
    "node": ("node", _str),
    "db": ("db", _str),
    "listen": ("listen", _str),
    "tls_cert": ("tls_cert", _str),
    "tls_key": ("tls_key", _str),
    "client_ca": ("client_ca", _str),
    "token": ("token", _str),
    "token_file": ("token_file", _str),
    "max_db": ("max_db", _str),
    "stack": ("stack", _bool),
}
_FLEET_KEYS: dict[str, tuple[str, Checker]] = {
    "nodes": ("nodes", _nodes),
    "ca_cert": ("ca_cert", _str),
    "client_cert": ("client_cert", _str),
    "client_key": ("client_key", _str),
    "token": ("token", _str),
    "timeout": ("timeout_s", _duration_s),
    "fanout": ("fanout", _posint),
    "skew_threshold": ("skew_threshold_ms", _duration_ms),
    "skew_samples": ("skew_samples", _posint),
    "plaintext": ("plaintext", _bool),
    "allow_plaintext": ("allow_plaintext", _bool),
    "insecure_skip_verify": ("insecure_skip_verify", _bool),
    "gpu_hourly_usd": ("gpu_hourly_usd", _rates),
}
_PATH_KEYS = {"db", "tls_cert", "tls_key", "client_ca", "token_file", "ca_cert", "client_cert", "client_key"}


def find_config(explicit: str | None = None, env: Mapping[str, str] | None = None) -> Path | None:
    env = os.environ if env is None else env
    if explicit:
        p = Path(explicit).expanduser()
        if not p.is_file():
            raise UsageError(f"--config {explicit}: no such file")
        return p
    if env.get("INGERO_CONFIG"):
        p = Path(env["INGERO_CONFIG"]).expanduser()
        if not p.is_file():
            raise UsageError(f"$INGERO_CONFIG={env['INGERO_CONFIG']}: no such file")
        return p
    for p in search_paths():
        if p.is_file():
            return p
    return None


def load_config(explicit: str | None = None, env: Mapping[str, str] | None = None) -> Config:
    path = find_config(explicit, env)
    if path is None:
        return Config()
    return parse_config_file(path)


def parse_config_file(path: Path) -> Config:
    where = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(where, "(file)", f"cannot read: {e}") from None
    import yaml  # ~30 ms of imports: only when there is a config file to read

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f"line {mark.line + 1}" if mark is not None else "(file)"
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(where, line, f"invalid YAML: {problem}") from None
    cfg = Config(path=path)
    if data is None:
        return cfg
    if not isinstance(data, Mapping):
        raise ConfigError(where, "(top level)", "expected a mapping with 'agent' and/or 'fleet'")
    for section in data:
        if section not in ("agent", "fleet"):
            raise ConfigError(where, str(section), "unknown key", hint="known top-level keys: agent, fleet")

    # agent paths may not exist yet (the database) or are checked when the server loads them;
    # the fleet client's certificates must be readable now
    _apply_section(cfg.agent, "agent", data.get("agent"), _AGENT_KEYS, where, path.parent, must_read=False)
    _apply_section(cfg.fleet, "fleet", data.get("fleet"), _FLEET_KEYS, where, path.parent, must_read=True)
    return cfg


def _apply_section(
    target: AgentConfig | FleetConfig,
    name: str,
    section: Any,
    keys: Mapping[str, tuple[str, Checker]],
    where: str,
    base: Path,
    *,
    must_read: bool,
) -> None:
    """Validate one section's keys and set them on ``target``; paths resolve against the file's folder."""
    if section is None:
        return
    if not isinstance(section, Mapping):
        raise ConfigError(where, name, "expected a mapping")
    for key, value in section.items():
        if key not in keys:
            raise ConfigError(where, f"{name}.{key}", "unknown key", hint="known: " + ", ".join(keys))
        if value is None:
            continue
        attr, check = keys[key]
        try:
            checked = check(value, f"{name}.{key}")
        except ValueError as e:
            raise ConfigError(where, f"{name}.{key}", str(e)) from None
        if key in _PATH_KEYS:
            checked = _resolve_path(checked, base)
            if must_read and not os.access(checked, os.R_OK):
                raise ConfigError(where, f"{name}.{key}", f"cannot read {checked}")
        setattr(target, attr, checked)


def _resolve_path(value: str, base: Path) -> str:
    p = Path(value).expanduser()
    if not p.is_absolute():
        p = base / p
    return str(p)
