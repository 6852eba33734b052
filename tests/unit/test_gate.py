"""The gate's Host rules (DNS rebinding) as a pure function, over generated headers."""

from __future__ import annotations

import ipaddress

from hypothesis import given
from hypothesis import strategies as st

from service.api.gate import LOCAL, Hosts

LABEL = st.from_regex(r"[a-z0-9]([a-z0-9-]{0,10}[a-z0-9])?", fullmatch=True)
# a DNS name (a top-level label of digits would make it an address: never looked up)
NAME = (
    st.lists(LABEL, min_size=2, max_size=4)
    .map(".".join)
    .filter(lambda n: not n.rsplit(".", 1)[-1].isdigit())
)
PORT = st.one_of(st.just(""), st.integers(1, 65535).map(lambda p: f":{p}"))
IPV4 = st.ip_addresses(v=4).map(str)
IPV6 = st.ip_addresses(v=6).map(lambda a: f"[{a}]")

local = Hosts.parse(LOCAL)


@given(NAME.filter(lambda n: not n.endswith(".localhost")), PORT)
def test_under_up_a_dns_name_other_than_localhost_is_refused(name: str, port: str) -> None:
    # a rebinding page reaches 127.0.0.1 through a name of its own: it is never answered
    assert not local.allow(f"{name}{port}")
    assert not local.allow(f"{name.upper()}{port}")


@given(st.one_of(IPV4, IPV6), PORT)
def test_under_up_any_ip_address_is_answered(address: str, port: str) -> None:
    # (a page cannot rebind an address; a phone on the LAN uses one)
    assert local.allow(f"{address}{port}")


@given(PORT)
def test_localhost_is_answered_and_garbage_is_not(port: str) -> None:
    for host in ("localhost", "LOCALHOST", "app.localhost", "127.0.0.1", "[::1]"):
        assert local.allow(f"{host}{port}")
    for bad in ("", None, "[::1", "[::1]x", "localhost:http", "evil.example:80:80"):
        assert not local.allow(bad)


@given(NAME, NAME, PORT)
def test_exact_names_and_subdomains(allowed: str, other: str, port: str) -> None:
    hosts = Hosts.parse(f"{allowed},*.{other}")
    assert hosts.allow(f"{allowed}{port}")
    assert hosts.allow(f"api.{other}{port}")
    assert not hosts.allow(f"{other}x{port}") or f"{other}x" == allowed
    assert not hosts.allow(f"127.0.0.1{port}")  # no [ip]: addresses are not answered


@given(st.text(max_size=40))
def test_empty_or_star_answers_anything(host: str) -> None:
    assert Hosts.parse("").allow(host)
    assert Hosts.parse("a.example, *").allow(host)


def test_an_ipv6_address_needs_its_brackets() -> None:
    assert ipaddress.ip_address("::1")
    assert not Hosts.parse("[ip]").allow("::1")  # unbracketed: the port cannot be told
