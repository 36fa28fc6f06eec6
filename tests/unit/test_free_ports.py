"""specdec.cluster.processes.free_ports: ports outside the kernel's ephemeral range, so that a
starting cluster's own bind(0) sockets cannot be handed them."""

from __future__ import annotations

import socket

import pytest

from specdec.cluster import processes


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def test_ports_are_distinct_free_and_below_the_ephemeral_range():
    unassigned = processes._unassigned_port_range()
    if not unassigned:
        pytest.skip("no ephemeral port range to stay below (not Linux, or it starts low)")
    low = int(processes._EPHEMERAL_RANGE.read_text().split()[0])
    ports = processes.free_ports(6)
    assert len(set(ports)) == 6
    assert all(processes._PORT_FLOOR <= p < low for p in ports)
    assert all(_bindable(p) for p in ports)


def test_a_taken_port_is_skipped_and_a_full_range_falls_back_to_the_kernel(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        monkeypatch.setattr(processes, "_unassigned_port_range", lambda: range(taken, taken + 1))
        ports = processes.free_ports(2)
    assert taken not in ports and len(set(ports)) == 2
    assert all(_bindable(p) for p in ports)
