"""Test hosts as Linux network namespaces (root only): each has its own network stack, reached
from the root namespace through a veth pair on a private /30 of 10.213.0.0/16 that only these
tests use. Processes run in a host with ``ip netns exec``; they share nothing with the other
hosts but the addresses they are given (each also gets its own directories)."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path


def available() -> str | None:
    """None if namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "needs root"
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is missing"
    probe = f"quire-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@dataclass
class Host:
    name: str  # the namespace
    address: str  # this host's address
    gateway: str  # the root namespace's address on this host's link
    home: Path  # this host's own directories (var, work, uploads)

    def wrap(self) -> list[str]:
        return ["ip", "netns", "exec", self.name]


class Network:
    """Hosts on their own links to the root namespace; ``close`` removes them all."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.tag = f"{os.getpid() % 10000:04d}{random.randrange(100):02d}"
        self.subnet = random.randrange(256)
        self.hosts: list[Host] = []
        self.forwarder: subprocess.Popen[str] | None = None

    def host(self, label: str) -> Host:
        index = len(self.hosts)
        name = f"q{self.tag}{label}"
        outside, inside = f"qv{self.tag}{index}o", f"qv{self.tag}{index}i"
        gateway = f"10.213.{self.subnet}.{4 * index + 1}"
        address = f"10.213.{self.subnet}.{4 * index + 2}"
        _ip("netns", "add", name)
        host = Host(name=name, address=address, gateway=gateway, home=self.base / label)
        self.hosts.append(host)
        _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
        _ip("link", "set", inside, "netns", name)
        _ip("addr", "add", f"{gateway}/30", "dev", outside)
        _ip("link", "set", outside, "up")
        _ip("-n", name, "addr", "add", f"{address}/30", "dev", inside)
        _ip("-n", name, "link", "set", inside, "up")
        _ip("-n", name, "link", "set", "lo", "up")
        _ip("-n", name, "route", "add", "default", "via", gateway)
        host.home.mkdir(parents=True, mode=0o700)
        return host

    def forward(self, ports: list[int]) -> None:
        """Each host reaches 127.0.0.1:<port> of the root namespace at <its gateway>:<port>."""
        routes = [f"{h.gateway}:{p}=127.0.0.1:{p}" for h in self.hosts for p in ports]
        self.forwarder = subprocess.Popen(
            [sys.executable, "-m", "tests.e2e.tcpforward", *routes],
            stdout=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).resolve().parents[2],
        )
        assert self.forwarder.stdout is not None
        line = self.forwarder.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError(f"TCP forwarder failed to start: {line!r}")

    def close(self) -> None:
        if self.forwarder is not None:
            self.forwarder.kill()
            self.forwarder.wait(5)
        for host in self.hosts:
            # Deleting the namespace removes its end of the veth pair, and with it ours.
            subprocess.run(["ip", "netns", "del", host.name], capture_output=True)
