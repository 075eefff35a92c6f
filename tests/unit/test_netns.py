"""Test hosts as network namespaces (spanrl/infra/netns.py): the layout, then two real hosts
talking HTTP over their addresses, unreachable on each other's loopback."""
from __future__ import annotations

import subprocess
import sys
import time
import uuid

import pytest

from spanrl.infra import netns


def test_plan_names_and_addresses():
    layout = netns.plan(2, "srl", "10.77.0.0/24")
    assert (layout.bridge, layout.gateway, layout.prefix_len) == ("srl-br", "10.77.0.254", 24)
    assert layout.hosts == (netns.Host("srl-h1", "10.77.0.1", "srl-v1"), netns.Host("srl-h2", "10.77.0.2", "srl-v2"))
    assert netns.exec_argv(layout.hosts[1], ["true"]) == ["ip", "netns", "exec", "srl-h2", "true"]
    assert netns.down_commands(layout) == [["ip", "netns", "del", "srl-h1"], ["ip", "netns", "del", "srl-h2"],
                                           ["ip", "link", "del", "srl-br"]]
    assert netns.up_commands(layout)[3:6] == [
        ["ip", "netns", "add", "srl-h1"],
        ["ip", "link", "add", "srl-v1", "type", "veth", "peer", "name", "eth0", "netns", "srl-h1"],
        ["ip", "link", "set", "srl-v1", "master", "srl-br"]]


def test_plan_refuses_what_linux_would():
    with pytest.raises(ValueError, match="over 15 characters"):
        netns.plan(2, "a-very-long-prefix")
    with pytest.raises(ValueError, match="do not fit 10.0.0.0/30"):
        netns.plan(2, "srl", "10.0.0.0/30")  # 2 usable addresses: 2 hosts + a bridge need 3


def run_in(host, code: str, timeout: float = 10) -> subprocess.CompletedProcess:
    return subprocess.run(netns.exec_argv(host, [sys.executable, "-c", code]), capture_output=True, text=True,
                          timeout=timeout)


FETCH = "import urllib.request; print(urllib.request.urlopen('http://{}:{}/', timeout=3).status)"


def test_two_hosts_talk_over_their_addresses():
    """A web server in host 2 bound to 0.0.0.0 answers host 1 at host 2's address; host 1's
    own loopback has nothing on that port (each host has its own)."""
    tag = uuid.uuid4().hex[:4]
    layout = netns.plan(2, f"s{tag}", f"10.{200 + int(tag[:2], 16) % 50}.{int(tag[2:], 16)}.0/24")
    h1, h2 = layout.hosts
    netns.up(layout)
    server = None
    try:
        server = subprocess.Popen(netns.exec_argv(h2, [sys.executable, "-m", "http.server", "8765", "--bind",
                                                       "0.0.0.0"]),
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 15
        while (answer := run_in(h1, FETCH.format(h2.address, 8765))).returncode != 0:
            assert server.poll() is None and time.monotonic() < deadline, answer.stderr
            time.sleep(0.2)
        assert answer.stdout.strip() == "200"
        assert run_in(h1, FETCH.format("127.0.0.1", 8765)).returncode != 0  # not on host 1's loopback
    finally:
        if server is not None:
            server.terminate()
            server.wait(10)
        netns.down(layout)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert h1.name not in listed and h2.name not in listed
