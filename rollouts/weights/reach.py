"""Can the engines reach what the weight sync offers them? Checked once at start.

Engines on other hosts see neither this machine's /dev/shm nor its 127.0.0.1:
- the disk sync hands each engine a path; with a remote engine that path must be on a
  filesystem both sides mount at the same place, so a node-local weight directory (the /dev/shm
  default, anything under /dev/shm or /tmp) is refused, with the fix in the message;
- the distributed sync hands each engine the trainer's rendezvous address: left empty
  (`weight_sync.distributed.master_address = ""`, the default), it is 127.0.0.1 while every
  engine is on this host, else this host's address on the interface that routes to the first
  remote engine (a UDP socket's `connect` picks the route; nothing is sent).

The decisions are pure functions of the URLs, the path and this host's names; `resolve_reach`
wires them to the real host and says what it chose.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import socket
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from urllib.parse import urlsplit

from rollouts.config import Config
from rollouts.engine_kinds import engine_kind

LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})
NODE_LOCAL_DIRS = (Path("/dev/shm"), Path("/tmp"), Path("/var/tmp"))
LOCAL_MASTER = "127.0.0.1"


def host_of(url: str) -> str:
    """The host part of an engine URL, lower-case, without brackets ('' when it has none)."""
    return (urlsplit(url if "//" in url else f"//{url}").hostname or "").lower()


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or a loopback name."""
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def remote_urls(urls: Sequence[str], own: Collection[str]) -> list[str]:
    """The engine URLs whose host is neither loopback nor one of `own` (this host's names and
    addresses, lower-case)."""
    return [u for u in urls if not is_loopback(host_of(u)) and host_of(u) not in own]


def node_local_dir(path: Path) -> Path | None:
    """The node-local directory (/dev/shm, /tmp, /var/tmp) that `path` lies under, or None."""
    absolute = Path(path).absolute()
    for base in NODE_LOCAL_DIRS:
        if absolute == base or base in absolute.parents:
            return base
    return None


def disk_reach_problem(sync_root: Path, remote: Sequence[str]) -> str:
    """Why the disk sync cannot reach `remote` engines through `sync_root` ('' when it can)."""
    base = node_local_dir(sync_root)
    if not remote or base is None:
        return ""
    return (
        f"weight_sync.method = 'disk' writes the weights to {sync_root} (under {base}, which only "
        f"this host sees), but engine {remote[0]} is on another host: set weight_sync.dir to a "
        "directory on a filesystem both hosts mount at the same path (NFS, Lustre, ...), or use "
        "weight_sync.method = 'distributed'"
    )


def route_to(host: str, port: int = 9) -> str:
    """This host's address on the interface that routes to `host` (a UDP `connect` sends
    nothing); OSError when there is no route or the name does not resolve."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(address)
        return str(s.getsockname()[0])


def choose_master_address(
    configured: str, remote: Sequence[str], route: Callable[[str], str]
) -> tuple[str, str]:
    """(address, why): the configured one; else 127.0.0.1 with every engine local; else the
    address `route` gives towards the first remote engine."""
    key = "weight_sync.distributed.master_address"
    if configured:
        return configured, f"{key} = {configured!r}"
    if not remote:
        return LOCAL_MASTER, f"every engine is on this host ({key} = '' picks it)"
    host = host_of(remote[0])
    try:
        address = route(host)
    except OSError as e:
        raise ValueError(
            f"{key} = '' (automatic): no route from this host to engine {remote[0]} ({e}); set "
            f"{key} to this host's address as the engines reach it"
        ) from e
    return address, f"this host's address towards engine {remote[0]} ({key} = '' picks it)"


def own_names() -> frozenset[str]:
    """This host's names and the addresses they resolve to, lower-case (no network needed for
    names /etc/hosts knows; a name that does not resolve adds nothing)."""
    names = {socket.gethostname().lower(), socket.getfqdn().lower()}
    addresses: set[str] = set()
    for name in names:
        try:
            addresses |= {str(info[4][0]).lower() for info in socket.getaddrinfo(name, None)}
        except OSError:
            continue
    return frozenset(names | addresses)


def resolve_reach(
    config: Config,
    sync_root: Path,
    *,
    own: Collection[str] | None = None,
    route: Callable[[str], str] = route_to,
) -> tuple[Config, str]:
    """`config` with the distributed sync's master address resolved, and the start-up line that
    says where the engines are and what they reach; ValueError (naming the key and the fix)
    when the disk sync's directory is node-local and an engine is not."""
    e, ws = config.engines, config.weight_sync
    urls = [] if engine_kind(e.kind).started_here else list(e.urls)  # started: on this host
    if own is None:  # this host's names only when a URL is not loopback (no lookups otherwise)
        own = own_names() if any(not is_loopback(host_of(u)) for u in urls) else frozenset()
    remote = remote_urls(urls, own)
    where = f"{len(remote)} of {len(urls)} engine(s) on other hosts" if remote else "local engines"
    if ws.method == "disk":
        problem = disk_reach_problem(sync_root, remote)
        if problem:
            raise ValueError(problem)
        return config, f"[train] {where}; weights go through {sync_root}"
    address, why = choose_master_address(ws.distributed.master_address, remote, route)
    distributed = dataclasses.replace(ws.distributed, master_address=address)
    weight_sync = dataclasses.replace(ws, distributed=distributed)
    resolved = dataclasses.replace(config, weight_sync=weight_sync)
    return resolved, f"[train] {where}; weight-sync rendezvous at {address}: {why}"
