"""Engines on other hosts: the disk sync refuses a node-local directory, and the distributed
sync's rendezvous address defaults to one the engines can reach (weights/reach.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollouts.config import config_from_dict
from rollouts.weights.distributed_pool import distributed_sync_for
from rollouts.weights.reach import (
    choose_master_address,
    host_of,
    node_local_dir,
    remote_urls,
    resolve_reach,
    route_to,
)

OWN = frozenset({"trainer-0", "10.0.0.5"})  # this host's names and addresses, as own_names gives


def _config(method: str, urls: list[str], **sync: object) -> object:
    engines = {"kind": "sglang", "urls": urls}
    return config_from_dict({"engines": engines, "weight_sync": {"method": method, **sync}})


def _no_route(host: str) -> str:
    raise AssertionError(f"no route needed, asked for {host}")


def test_hosts_of_engine_urls_and_which_are_remote() -> None:
    assert host_of("http://[::1]:30000") == "::1"
    assert host_of("http://Engine-3.cluster:8000/v1") == "engine-3.cluster"
    urls = [
        "http://127.0.0.1:30000",
        "http://localhost:30001",
        "http://[::1]:30002",
        "http://127.0.1.1:30003",  # Debian's /etc/hosts name for this host
        "http://trainer-0:30004",
        "http://10.0.0.5:30005",
        "http://10.0.0.6:30006",
        "http://engine-1:30007",
    ]
    assert remote_urls(urls, OWN) == ["http://10.0.0.6:30006", "http://engine-1:30007"]


def test_node_local_directories() -> None:
    assert node_local_dir(Path("/dev/shm/rollouts-run-ab12")) == Path("/dev/shm")
    assert node_local_dir(Path("/tmp")) == Path("/tmp")
    assert node_local_dir(Path("/tmp/x/y")) == Path("/tmp")
    assert node_local_dir(Path("/shared/runs/weights")) is None
    assert node_local_dir(Path("/tmpfoo/weights")) is None


def test_disk_sync_to_a_remote_engine_through_dev_shm_is_refused_with_the_fix() -> None:
    config = _config("disk", ["http://127.0.0.1:30000", "http://10.0.0.6:30000"])
    with pytest.raises(ValueError) as info:
        resolve_reach(config, Path("/dev/shm/rollouts-run-ab12"), own=OWN, route=_no_route)
    text = str(info.value)
    assert "/dev/shm/rollouts-run-ab12" in text and "http://10.0.0.6:30000" in text
    assert "set weight_sync.dir" in text and "weight_sync.method = 'distributed'" in text
    with pytest.raises(ValueError, match="under /tmp"):
        resolve_reach(config, Path("/tmp/weights"), own=OWN, route=_no_route)


def test_disk_sync_is_fine_with_a_shared_dir_or_local_engines() -> None:
    remote = _config("disk", ["http://engine-1:30000"], dir="/shared/w")
    same, line = resolve_reach(remote, Path("/shared/w"), own=OWN, route=_no_route)
    assert same is remote and "1 of 1 engine(s) on other hosts" in line and "/shared/w" in line
    local = _config("disk", ["http://localhost:30000", "http://trainer-0:30001"])
    same, line = resolve_reach(local, Path("/dev/shm/r"), own=OWN, route=_no_route)
    assert same is local and "local engines" in line
    builtin = config_from_dict({})  # built-in engines: on this host
    assert resolve_reach(builtin, Path("/dev/shm/r"), own=OWN, route=_no_route)[0] is builtin


def test_master_address_defaults_to_loopback_with_local_engines() -> None:
    config = _config("distributed", ["http://127.0.0.1:30000"])
    assert config.weight_sync.distributed.master_address == ""  # automatic
    resolved, line = resolve_reach(config, Path("/dev/shm/r"), own=OWN, route=_no_route)
    assert resolved.weight_sync.distributed.master_address == "127.0.0.1"
    assert "rendezvous at 127.0.0.1" in line and "every engine is on this host" in line
    built = distributed_sync_for(resolved)
    assert built is not None and built.options.master_address == "127.0.0.1"


def test_master_address_defaults_to_the_route_towards_a_remote_engine() -> None:
    config = _config("distributed", ["http://127.0.0.1:30000", "http://engine-1:30000"])
    asked: list[str] = []

    def route(host: str) -> str:
        asked.append(host)
        return "10.0.0.5"

    resolved, line = resolve_reach(config, Path("/dev/shm/r"), own=OWN, route=route)
    assert asked == ["engine-1"]
    assert resolved.weight_sync.distributed.master_address == "10.0.0.5"
    assert "rendezvous at 10.0.0.5" in line and "towards engine http://engine-1:30000" in line
    assert distributed_sync_for(resolved).options.master_address == "10.0.0.5"


def test_a_configured_master_address_is_kept_and_no_route_is_an_error_naming_the_key() -> None:
    assert choose_master_address("10.9.9.9", ["http://e:1"], _no_route)[0] == "10.9.9.9"

    def unreachable(host: str) -> str:
        raise OSError(101, "Network is unreachable")

    with pytest.raises(ValueError) as info:
        choose_master_address("", ["http://engine-1:30000"], unreachable)
    assert "set weight_sync.distributed.master_address" in str(info.value)


def test_route_to_loopback_is_loopback() -> None:
    """The real UDP-connect route, on the one address every host has."""
    assert route_to("127.0.0.1") == "127.0.0.1"
