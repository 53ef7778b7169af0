"""qstream.channel without a daemon: the addresses a `server` names
(parse_servers) and the options of the channels opened to them."""

import re

import pytest

from qstream.channel import DEFAULT_OPTIONS, ROUND_ROBIN_SERVICE_CONFIG, open_channel, parse_servers


@pytest.mark.parametrize("server, expected", [
    ("127.0.0.1:50051", ["127.0.0.1:50051"]),
    ("rank-0:50051, rank-1:50052", ["rank-0:50051", "rank-1:50052"]),
    (["rank-0:50051", "rank-1:50051"], ["rank-0:50051", "rank-1:50051"]),
    (("[::1]:1", "localhost:65535"), ["[::1]:1", "localhost:65535"]),
    (["dns:///qstream-ranks.ns.svc:50051"], ["dns:///qstream-ranks.ns.svc:50051"]),
    # A target URI is one target, the commas of an ipv4: list included.
    ("dns:///qstream-ranks.ns.svc:50051", ["dns:///qstream-ranks.ns.svc:50051"]),
    ("ipv4:10.0.0.1:50051,10.0.0.2:50051", ["ipv4:10.0.0.1:50051,10.0.0.2:50051"]),
    ("unix:/run/qstream.sock", ["unix:/run/qstream.sock"]),
])
def test_one_address_a_list_or_a_target_uri(server, expected):
    assert parse_servers(server) == expected


@pytest.mark.parametrize("server, message", [
    ("", "server is empty"),
    ([], "server is empty"),
    ("a:1,,b:2", "server: entry 2 of 'a:1,,b:2' is empty"),
    (["a:1", " "], "server: entry 2 of ['a:1', ' '] is empty"),
    ("daemon", "server: 'daemon' is not host:port"),
    ("a:1,b", "server: 'b' is not host:port"),
    ("a:0", "'a:0' is not host:port"),
    ("a:65536", "'a:65536' is not host:port"),
    ("a:+1", "'a:+1' is not host:port"),
    (":50051", "':50051' is not host:port"),
    ("::1:50051", "an IPv6 host in brackets"),
    ("a:1, a:1", "server: 'a:1' is listed twice"),
    ("a:1,dns:///b:2", "server: 'dns:///b:2' is a target URI, which must be the only one"),
    ("dns:///a:1,b:2", "a dns: target names one host"),
    (["a:1", 2], "is neither a str nor a list of str"),
])
def test_errors_name_the_parameter_and_the_entry(server, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_servers(server)


def test_channels_balance_round_robin_and_take_one_target():
    assert ("grpc.service_config", ROUND_ROBIN_SERVICE_CONFIG) in DEFAULT_OPTIONS
    assert '"round_robin"' in ROUND_ROBIN_SERVICE_CONFIG
    open_channel("dns:///localhost:1").close()
    with pytest.raises(ValueError, match="names several daemons"):
        open_channel("127.0.0.1:1,127.0.0.1:2")
