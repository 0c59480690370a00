"""The network of a cluster: a bridge in the root namespace, one netns per host joined to it by a veth.

Traffic between hosts crosses the root namespace's FORWARD chain (br_netfilter), whose policy the root
dockerd sets to DROP; one ACCEPT rule per cluster, tagged with its name, lets the subnet through.
"""

from __future__ import annotations

import ipaddress
import json
import logging
from pathlib import Path

from .layout import RULE_COMMENT, ClusterState, HostLayout
from .proc import NETNS_DIR, run

log = logging.getLogger(__name__)

SUBNET_BASE = "10.231"


def used_networks() -> list[ipaddress.IPv4Network]:
    """Networks already routed or addressed in the root namespace (any table)."""
    nets: list[ipaddress.IPv4Network] = []
    routes = json.loads(run(["ip", "-j", "-4", "route", "show", "table", "all"]).stdout or "[]")
    for r in routes:
        dst = r.get("dst", "")
        if dst and dst != "default":
            nets.append(ipaddress.IPv4Network(dst if "/" in dst else f"{dst}/32", strict=False))
    for link in json.loads(run(["ip", "-j", "-4", "addr", "show"]).stdout or "[]"):
        for a in link.get("addr_info", []):
            nets.append(ipaddress.IPv4Network(f"{a['local']}/{a['prefixlen']}", strict=False))
    return nets


def pick_subnet_index(taken_by_clusters: set[int]) -> int | None:
    """Lowest X in 1..254 whose 10.231.X.0/24 overlaps no route, address or other cluster."""
    used = used_networks()
    for x in range(1, 255):
        if x in taken_by_clusters:
            continue
        net = ipaddress.ip_network(f"{SUBNET_BASE}.{x}.0/24")
        if not any(net.overlaps(u) for u in used):
            return x
    return None


def create_bridge(state: ClusterState) -> None:
    run(["ip", "link", "add", state.bridge, "type", "bridge"])
    run(["ip", "addr", "add", f"{state.gateway}/24", "dev", state.bridge])
    run(["ip", "link", "set", state.bridge, "up"])


def create_host_net(state: ClusterState, host: HostLayout, resolvers: list[str]) -> None:
    """netns with lo up, eth0 (peer of the bridge port) holding the host's address, and an
    `unreachable` route to each resolver so that DNS lookups fail at once instead of after ~10 s.
    No default route: anything off the subnet (a registry) fails fast too."""
    ns = host.netns
    run(["ip", "netns", "add", ns])
    run(["ip", "link", "add", host.veth, "type", "veth", "peer", "name", "eth0", "netns", ns])
    run(["ip", "link", "set", host.veth, "master", state.bridge])
    run(["ip", "link", "set", host.veth, "up"])
    run(["ip", "-n", ns, "link", "set", "lo", "up"])
    run(["ip", "-n", ns, "addr", "add", f"{host.addr}/24", "dev", "eth0"])
    run(["ip", "-n", ns, "link", "set", "eth0", "up"])
    for r in resolvers:
        run(["ip", "-n", ns, "route", "add", "unreachable", f"{r}/32"], check=False)


def resolvers(path: Path = Path("/etc/resolv.conf")) -> list[str]:
    """IPv4 nameserver addresses of the machine (empty if none)."""
    out: list[str] = []
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        parts = line.split()
        if len(parts) >= 2 and parts[0] == "nameserver":
            try:
                if ipaddress.ip_address(parts[1]).version == 4:
                    out.append(parts[1])
            except ValueError:
                continue
    return out


def set_link(host: HostLayout, up: bool) -> None:
    """The "network drops" fault: the bridge side of the host's veth goes down, so packets to and from
    the host vanish (TCP peers hang until their timeouts, as with a pulled cable)."""
    run(["ip", "link", "set", host.veth, "up" if up else "down"])


def tbf_args(rate: str) -> list[str]:
    """A token bucket filter at `rate`: a burst of a few packets, and at most 400 ms of queue."""
    return ["tbf", "rate", rate, "burst", "32kbit", "latency", "400ms"]


def set_rate(host: HostLayout, rate: str | None) -> None:
    """The bridge side of the host's veth shaped to `rate` (None: unshaped)."""
    run(["tc", "qdisc", "del", "dev", host.veth, "root"], check=False)
    if rate is not None:
        run(["tc", "qdisc", "add", "dev", host.veth, "root", *tbf_args(rate)])


def forward_chain() -> str:
    """DOCKER-USER when the root dockerd made it (it is consulted first), else FORWARD."""
    ok = run(["iptables", "-w", "5", "-S", "DOCKER-USER"], check=False).returncode == 0
    return "DOCKER-USER" if ok else "FORWARD"


def allow_forward(state: ClusterState) -> None:
    run(["iptables", "-w", "5", "-I", forward_chain(), "-s", state.subnet, "-d", state.subnet,
         "-m", "comment", "--comment", state.rule_comment, "-j", "ACCEPT"])


def tagged_rules(name: str | None = None) -> list[tuple[str, list[str]]]:
    """(chain, rule spec) of every devcluster rule (of one cluster when name is given)."""
    found = []
    for chain in ("DOCKER-USER", "FORWARD"):
        res = run(["iptables", "-w", "5", "-S", chain], check=False)
        for line in res.stdout.splitlines():
            parts = [p.strip('"') for p in line.split()]  # iptables -S quotes the comment
            if parts[:2] != ["-A", chain] or RULE_COMMENT not in line:
                continue
            tag = next((p for p in parts if p.startswith(RULE_COMMENT)), "")
            if name is None or tag == f"{RULE_COMMENT}{name}":
                found.append((chain, parts[2:]))
    return found


def remove_rules(name: str | None) -> None:
    for chain, spec in tagged_rules(name):
        run(["iptables", "-w", "5", "-D", chain, *spec], check=False)


def netns_names() -> list[str]:
    return sorted(p.name for p in NETNS_DIR.iterdir()) if NETNS_DIR.is_dir() else []


def link_names() -> list[str]:
    links = json.loads(run(["ip", "-j", "link", "show"]).stdout or "[]")
    return [link["ifname"] for link in links]


def delete_netns(ns: str) -> None:
    if (NETNS_DIR / ns).exists():
        run(["ip", "netns", "del", ns], check=False)


def delete_link(name: str) -> None:
    if name in link_names():
        run(["ip", "link", "del", name], check=False)
