"""Config discovery and validation, node identity, time parsing."""

from __future__ import annotations

from pathlib import Path

import pytest

from ingero.config import NodeSpec, find_config, load_config, parse_addr, parse_node_list
from ingero.errors import ConfigError, InvalidNodeNameError, UsageError
from ingero.identity import resolve_identity
from ingero.timeutil import fmt_duration, parse_duration, parse_time
from tests.conftest import ROOT


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_shipped_example_config_is_valid() -> None:
    cfg = load_config(str(ROOT / "configs" / "ingero.yaml"))
    assert cfg.fleet.nodes and all(isinstance(n, NodeSpec) for n in cfg.fleet.nodes)
    assert cfg.fleet.timeout_s == 5.0 and cfg.fleet.fanout == 64 and cfg.fleet.skew_threshold_ms == 10.0


def test_discovery_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("INGERO_CONFIG", raising=False)
    assert find_config() is None or not str(find_config()).startswith(str(tmp_path))
    home_cfg = tmp_path / "home" / ".config" / "ingero" / "ingero.yaml"
    home_cfg.parent.mkdir(parents=True)
    _write(home_cfg, "agent: {node: from-home}\n")
    assert load_config().agent.node == "from-home"
    _write(tmp_path / "ingero.yaml", "agent: {node: from-cwd}\n")
    assert load_config().agent.node == "from-cwd"
    env_cfg = _write(tmp_path / "env.yaml", "agent: {node: from-env}\n")
    monkeypatch.setenv("INGERO_CONFIG", str(env_cfg))
    assert load_config().agent.node == "from-env"
    flag_cfg = _write(tmp_path / "flag.yaml", "agent: {node: from-flag}\n")
    assert load_config(str(flag_cfg)).agent.node == "from-flag"
    with pytest.raises(UsageError, match="no such file"):
        load_config(str(tmp_path / "missing.yaml"))
    monkeypatch.setenv("INGERO_CONFIG", str(tmp_path / "gone.yaml"))
    with pytest.raises(UsageError, match="INGERO_CONFIG"):
        load_config()


@pytest.mark.parametrize(
    ("text", "key", "problem"),
    [
        ("fleet: {nodez: []}\n", "fleet.nodez", "unknown key"),
        ("agentt: {}\n", "agentt", "unknown key"),
        ("fleet: {nodes: ['host:99999']}\n", "fleet.nodes", "bad port"),
        ("fleet: {nodes: ['a:1:2']}\n", "fleet.nodes", "brackets"),
        ("fleet: {nodes: [{name: x}]}\n", "fleet.nodes", "missing 'addr'"),
        ("fleet: {nodes: [{addr: 'h:1', port: 3}]}\n", "fleet.nodes", "unknown key 'port'"),
        ("fleet: {timeout: soon}\n", "fleet.timeout", "duration"),
        ("fleet: {fanout: 0}\n", "fleet.fanout", "positive integer"),
        ("fleet: {allow_plaintext: 'yes'}\n", "fleet.allow_plaintext", "true or false"),
        ("fleet: {ca_cert: /nonexistent/ca.pem}\n", "fleet.ca_cert", "cannot read"),
        ("agent: [1, 2]\n", "agent", "mapping"),
        ("agent: {node: [x]}\n", "agent.node", "string"),
        ("fleet: {nodes: [a\n", "line", "invalid YAML"),
    ],
)
def test_bad_config_names_file_and_key(tmp_path: Path, text: str, key: str, problem: str) -> None:
    path = _write(tmp_path / "bad.yaml", text)
    with pytest.raises(ConfigError) as info:
        load_config(str(path))
    msg = info.value.one_line()
    assert str(path) in msg and key in msg and problem in msg
    assert "\n" not in msg


def test_relative_cert_paths_resolve_against_config_dir(tmp_path: Path) -> None:
    (tmp_path / "tls").mkdir()
    (tmp_path / "tls" / "ca.pem").write_text("x")
    path = _write(tmp_path / "c.yaml", "fleet: {ca_cert: tls/ca.pem, timeout: 750ms, skew_threshold: 0.5s}\n")
    cfg = load_config(str(path))
    assert cfg.fleet.ca_cert == str(tmp_path / "tls" / "ca.pem")
    assert cfg.fleet.timeout_s == 0.75 and cfg.fleet.skew_threshold_ms == 500.0


def test_addresses() -> None:
    assert parse_addr("gpu-node-01:8081") == ("gpu-node-01", 8081)
    assert parse_addr("10.0.0.7") == ("10.0.0.7", 8080)
    assert parse_addr("[::1]:9000") == ("::1", 9000)
    assert NodeSpec("::1", 9000).addr == "[::1]:9000"
    nodes = parse_node_list("a:1, gpu-node-02=10.0.0.2:8080,")
    assert nodes == [NodeSpec("a", 1), NodeSpec("10.0.0.2", 8080, "gpu-node-02")]
    for bad in ["", ",", "a:0", "a:b", "a b:1", "[::1"]:
        with pytest.raises(UsageError):
            parse_node_list(bad)


def test_identity_precedence_and_ranks() -> None:
    env = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "8"}
    ident = resolve_identity("cli-node", "cfg-node", env)
    assert ident.as_dict() == {"node": "cli-node", "rank": 3, "local_rank": 1, "world_size": 8}
    assert resolve_identity(None, "cfg-node", {}).node == "cfg-node"
    host = resolve_identity(None, None, {"RANK": "junk"})
    assert host.node and ":" not in host.node and host.rank is None
    assert host.node == resolve_identity(None, None, {}).node
    with pytest.raises(InvalidNodeNameError, match="':'"):
        resolve_identity("a:b", None, {})


def test_time_parsing() -> None:
    assert parse_duration("5m") == 300 * 10**9
    assert parse_duration("1h30m") == 5400 * 10**9
    assert parse_duration("250ms") == 250 * 10**6
    assert parse_duration("2") == 2 * 10**9
    for bad in ["", "5x", "m5", "-3"]:
        with pytest.raises(UsageError):
            parse_duration(bad)
    assert parse_time("2026-04-03T12:18:35Z") == 1775218715 * 10**9
    assert parse_time("2026-04-03T12:18:35.5") == 1775218715 * 10**9 + 500_000_000
    assert parse_time("1775218715") == 1775218715 * 10**9
    assert parse_time("1775218715095237062") == 1775218715095237062
    with pytest.raises(UsageError):
        parse_time("yesterday-ish")
    assert fmt_duration(734_136) == "734.136µs"
    assert fmt_duration(1_052_216) == "1.052216ms"
    assert fmt_duration(51_501_448) == "51.501448ms"
    assert fmt_duration(4_206_000_000) == "4.206s"
