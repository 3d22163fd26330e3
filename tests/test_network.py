"""The interface check at start-up (tpserve/ranks/network.py), on this host's loopback: it needs no root and
sends nothing. The two-host refusals (a master behind another interface) are in test_two_hosts.py."""

from __future__ import annotations

import os

import pytest

from tpserve.ranks.network import NetworkError, check_interface, interface_address, name_interface


def test_a_missing_interface_is_refused_naming_the_ones_there_are():
    with pytest.raises(
        NetworkError, match=r"interface 'tpserve-none0' does not exist on this host \(it has: .*lo"
    ):
        check_interface("tpserve-none0", "127.0.0.1", 29500, rank=1)


def test_loopback_leads_to_a_loopback_master_on_either_rank():
    assert interface_address("lo") == "127.0.0.1"
    assert check_interface("lo", "127.0.0.1", 29500, rank=0) == "127.0.0.1"
    assert check_interface("lo", "localhost", 29500, rank=1) == "127.0.0.1"


def test_rank_0_refuses_a_master_address_that_is_not_the_interfaces_own():
    with pytest.raises(
        NetworkError, match=r"rank 0: the master address 127\.0\.0\.2 .* is not interface 'lo''s"
    ):
        check_interface("lo", "127.0.0.2", 29500, rank=0)


def test_an_unresolvable_master_is_refused():
    with pytest.raises(NetworkError, match="does not resolve"):
        check_interface("lo", "no-such-host.invalid", 29500, rank=1)


def test_the_environment_may_not_name_another_interface(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth9")
    with pytest.raises(NetworkError, match="GLOO_SOCKET_IFNAME is 'eth9' in the environment"):
        name_interface("lo")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    name_interface("lo")
    assert os.environ["GLOO_SOCKET_IFNAME"] == os.environ["NCCL_SOCKET_IFNAME"] == "lo"
