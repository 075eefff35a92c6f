"""Test hosts on this machine: Linux network namespaces joined by a bridge (a prototype).

Each host is a network namespace with its own loopback and one interface (``eth0``, one end of
a veth pair) on a private subnet; the other ends hang on a bridge in the root namespace, which
also holds an address, so that the machine's own processes (a test, the stack's tools) reach
every host and the hosts reach each other, as machines on one switch do. A process started in
a host (``ip netns exec NAME ...``, :func:`exec_argv`) sees only that host's addresses: a
service binding ``0.0.0.0`` there is reachable at the host's address and nowhere else.

    python -m spanrl.infra.netns up --hosts 2 [--prefix srl --subnet 10.77.0.0/24]
    python -m spanrl.infra.netns down [--prefix srl]

Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and iproute2's ``ip``. Nothing of spanrl runs in
the hosts yet: docs/operations.md, "Several hosts", says what the stack would need.
"""
from __future__ import annotations

import argparse
import ipaddress
import subprocess
from dataclasses import dataclass

#: Linux's limit on an interface name (IFNAMSIZ - 1)
IFNAME_MAX = 15


@dataclass(frozen=True)
class Host:
    name: str  # the namespace
    address: str  # of its eth0, e.g. 10.77.0.1
    veth: str  # the root namespace's end of its veth pair


@dataclass(frozen=True)
class Layout:
    prefix: str
    bridge: str
    gateway: str  # the bridge's address in the root namespace
    prefix_len: int
    hosts: tuple[Host, ...]


def plan(n: int, prefix: str = "srl", subnet: str = "10.77.0.0/24") -> Layout:
    """``n`` hosts ``{prefix}-h1 ..`` at the subnet's first addresses, the bridge at its last
    usable one. Raises ValueError for names over :data:`IFNAME_MAX` or a subnet too small."""
    net = ipaddress.ip_network(subnet)
    usable = list(net.hosts())
    if n < 1 or n + 1 > len(usable):
        raise ValueError(f"{n} hosts and a bridge do not fit {subnet}")
    bridge = f"{prefix}-br"
    hosts = tuple(Host(f"{prefix}-h{i}", str(usable[i - 1]), f"{prefix}-v{i}") for i in range(1, n + 1))
    for name in [bridge, *(h.veth for h in hosts)]:
        if len(name) > IFNAME_MAX:
            raise ValueError(f"interface name {name!r} is over {IFNAME_MAX} characters: use a shorter prefix")
    return Layout(prefix, bridge, str(usable[-1]), net.prefixlen, hosts)


def up_commands(layout: Layout) -> list[list[str]]:
    """The ``ip`` commands that build ``layout`` (in order)."""
    cmds = [["ip", "link", "add", layout.bridge, "type", "bridge"],
            ["ip", "addr", "add", f"{layout.gateway}/{layout.prefix_len}", "dev", layout.bridge],
            ["ip", "link", "set", layout.bridge, "up"]]
    for h in layout.hosts:
        cmds += [["ip", "netns", "add", h.name],
                 ["ip", "link", "add", h.veth, "type", "veth", "peer", "name", "eth0", "netns", h.name],
                 ["ip", "link", "set", h.veth, "master", layout.bridge],
                 ["ip", "link", "set", h.veth, "up"],
                 ["ip", "-n", h.name, "addr", "add", f"{h.address}/{layout.prefix_len}", "dev", "eth0"],
                 ["ip", "-n", h.name, "link", "set", "eth0", "up"],
                 ["ip", "-n", h.name, "link", "set", "lo", "up"],
                 ["ip", "-n", h.name, "route", "add", "default", "via", layout.gateway]]
    return cmds


def down_commands(layout: Layout) -> list[list[str]]:
    """The ``ip`` commands that remove ``layout`` (a namespace's removal takes its veth pair)."""
    return [*(["ip", "netns", "del", h.name] for h in layout.hosts), ["ip", "link", "del", layout.bridge]]


def exec_argv(host: Host, argv: list[str]) -> list[str]:
    """``argv`` run inside ``host``'s network namespace."""
    return ["ip", "netns", "exec", host.name, *argv]


def up(layout: Layout) -> None:
    """Build ``layout``; on a failed command, remove what was built and raise CalledProcessError
    (its stderr says why: not root, a name taken, ...)."""
    try:
        for cmd in up_commands(layout):
            subprocess.run(cmd, check=True, capture_output=True, text=True)
    except subprocess.CalledProcessError:
        down(layout)
        raise


def down(layout: Layout) -> None:
    """Remove ``layout``, whatever of it exists."""
    for cmd in down_commands(layout):
        subprocess.run(cmd, capture_output=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("action", choices=["up", "down"])
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--prefix", default="srl")
    p.add_argument("--subnet", default="10.77.0.0/24")
    a = p.parse_args(argv)
    layout = plan(a.hosts, a.prefix, a.subnet)
    if a.action == "up":
        up(layout)
        for h in layout.hosts:
            print(f"{h.name} {h.address}")
    else:
        down(layout)


if __name__ == "__main__":
    main()
