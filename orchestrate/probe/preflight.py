"""PURE: preflight's rules on what the probe observed: a host's clock skew and its warning, and the table of the
hosts' reports. The read of a host (one exec of probe.sh) is the backend's (backends/docker_ssh/hostprobe.py,
through Daemons.probe_host); the verdicts are plan/verdicts.py's, the run over every host pipeline/preflight.py's."""

from __future__ import annotations

from collections.abc import Sequence

from rich.table import Table
from rich.text import Text

from orchestrate.probe.observations import HostReport

COLUMNS = ("ssh", "docker", "gpus", "disk", "port", "master", "iface", "net", "image", "job")


# torch's rendezvous (c10d keep-alives, the store's timeouts) compares timestamps across nodes; the order of
# failures does not depend on host clocks (watch/watcher.py, Watcher.exit_seen).
MAX_CLOCK_SKEW_S = 5.0


def clock_skew(facts: dict[str, str]) -> float:
    """PURE: how far the host's clock (`date` at the probe's start) lies outside the interval from sending the
    probe to its answer on this machine's clock: 0 when inside, so the SSH round trip is never taken for skew."""
    try:
        remote, sent, answered = float(facts["clock"]), float(facts["sent"]), float(facts["answered"])
    except (KeyError, ValueError):  # a `date` without %N support: no measurement, no warning
        return 0.0
    return remote - answered if remote > answered else remote - sent if remote < sent else 0.0


def clock_warnings(reports: Sequence[HostReport]) -> list[str]:
    """PURE: one warning per host whose clock is off by more than MAX_CLOCK_SKEW_S (the job may still run)."""
    return [f"warning: {r.label}'s clock is {abs(r.clock_skew):.0f} s {'ahead of' if r.clock_skew > 0 else 'behind'} "
            "this machine's; torch's rendezvous compares timestamps across nodes: sync the clocks (NTP, e.g. chrony)"
            for r in reports if abs(r.clock_skew) > MAX_CLOCK_SKEW_S]


def render_table(reports: Sequence[HostReport]) -> Table:
    """One row per node: what is not fine first, in full, one check a line (red: refused, yellow: a warning), then
    the fine checks folded into one paragraph. Three columns fit 100 (a column per check took 170) and rich wraps
    the paragraph between checks' words, never inside a word."""
    table = Table(title="preflight")
    table.add_column("node")
    table.add_column("host", overflow="fold")
    table.add_column("checks", ratio=1)
    for rank, report in enumerate(reports):
        table.add_row(str(rank), report.label, checks_cell(report))
    return table


def checks_cell(report: HostReport) -> Text:
    """PURE: the checks of one host as render_table shows them."""
    cell = Text()
    for col in COLUMNS:  # a check not made on this host (the port: node 0's alone) is not shown
        check = report.checks.get(col)
        if check is not None and (not check.ok or check.warn):
            cell.append(f"{col}: {check.text}\n", style="yellow" if check.ok else "red")
    fine = [(col, c.text) for col in COLUMNS if (c := report.checks.get(col)) is not None and c.ok and not c.warn]
    for i, (col, text) in enumerate(fine):
        cell.append(("; " if i else "") + col, style="green")
        cell.append(f" {text}")
    cell.rstrip()  # a host with every check fine or none: no empty line after the refused ones
    return cell
