"""The reward server's connection policy (`mmgrpo.reward_guard`), probed with raw sockets on loopback: idle and
trickling connections from one address and from many cannot keep out a request with the token, headers that trickle
are cut after the header timeout, idle keep-alive connections after the idle timeout, each client holds a bounded
number of connections, and an upload with the token is never cut for a newcomer. Other loopback addresses
(127.0.0.2, ...) act as distinct clients; every loop is bounded in count and time."""

import json
import select
import socket
import threading
import time

import pytest
import torch

from mmgrpo import cli
from mmgrpo.reward_codec import encode
from mmgrpo.reward_guard import client_of
from mmgrpo.reward_server import RewardServer, ServerLimits
from mmgrpo.rewards.jpeg import JpegReward
from mmgrpo.types import RewardResult
from mmgrpo.validation import ConfigError

TOKEN = "test-token-0123456789abcdef"
SCORE = json.dumps({"outputs": encode({"images": torch.rand(2, 3, 8, 8)}), "batch": {"prompts": ["a", "b"]}}).encode()


def request(method, path, body=b"", token=TOKEN, close=True):
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", *["Connection: close"] * close]
    lines += [f"Authorization: Bearer {token}"] * (token is not None) + [f"Content-Length: {len(body)}"] * bool(body)
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def connect(port, source="127.0.0.1", timeout=5.0):
    return socket.create_connection(("127.0.0.1", port), timeout=timeout, source_address=(source, 0))


def answer(conn, timeout=5.0):
    """The status and body of one answer on `conn` (`None` if it closed or said nothing within `timeout` s)."""
    received, deadline = b"", time.monotonic() + timeout
    for _ in range(200):
        head, _, body = received.partition(b"\r\n\r\n")
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(
            b"content-length:")), None)
        if length is not None and len(body) >= length:
            return int(head.split()[1]), body[:length]
        conn.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            chunk = conn.recv(65536)
        except (TimeoutError, ConnectionResetError):
            return None, b""
        if not chunk:
            return None, b""
        received += chunk
    return None, b""


def closed_within(conn, seconds) -> bool:
    """Whether the server closes `conn` within `seconds` (it reads as end of stream or a reset)."""
    if not select.select([conn], [], [], seconds)[0]:
        return False
    try:
        return conn.recv(1024) == b""
    except (ConnectionResetError, TimeoutError):
        return True


def port_of(server):
    return int(server.url.rsplit(":", 1)[1])


@pytest.fixture
def serve():
    """Starts `jpeg` servers with a token and the given limits; stops them after the test."""
    servers = []

    def start(reward=None, **limits):
        servers.append(RewardServer(reward or JpegReward(), "jpeg", token=TOKEN, limits=ServerLimits(**limits)).start())
        return servers[-1]

    yield start
    for server in servers:
        server.stop()


def test_idle_and_trickling_connections_cannot_keep_out_a_client_with_the_token(serve):
    # deadlines far away: only the connection policy can let the scored request in
    server = serve(connection_limit=24, max_connections_per_client=4, header_timeout=60, idle_timeout=60,
                   channel_timeout=60)
    port, attackers = port_of(server), []
    try:
        for i in range(40):  # one address: idle ones and half-sent headers
            attackers.append(connect(port))
            if i % 2:
                attackers[-1].sendall(b"POST /score HTTP/1.1\r\nHost: x\r\n")
        for i in range(30):  # thirty more addresses, one connection each
            attackers.append(connect(port, f"127.0.0.{i + 2}"))
            if i % 2:
                attackers[-1].sendall(b"GET /info HTTP/1.1\r\n")
        for source in ("127.0.0.200", "127.0.0.1"):  # a fresh address, and the attackers' own
            started = time.monotonic()
            with connect(port, source) as conn:
                conn.sendall(request("POST", "/score", SCORE))
                status, body = answer(conn, timeout=20.0)
            assert status == 200 and len(json.loads(body)["scores"]) == 2
            assert time.monotonic() - started < 5.0  # at once; the backlog would hold it until a timeout (60 s)
        channels = list(server.server.active_channels.values())
        assert len(channels) <= 24 and sum(c.client == "127.0.0.1" for c in channels) <= 4
    finally:
        for conn in attackers:
            conn.close()


@pytest.mark.parametrize("later", [False, True])
def test_headers_that_trickle_are_cut_after_the_header_timeout(serve, later):
    server = serve(header_timeout=2, idle_timeout=60, channel_timeout=60)
    with connect(port_of(server)) as conn:
        if later:  # a first request, answered; the next request's deadline counts from its first byte
            conn.sendall(request("GET", "/info", close=False))
            assert answer(conn)[0] == 200
            time.sleep(2.5)
        started, data = time.monotonic(), b"GET /info HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: " + b"a" * 100
        cut = None
        for byte in data:  # one byte every 0.2 s, far inside the 60 s inactivity timeout
            try:
                conn.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                cut = time.monotonic() - started
                break
            if closed_within(conn, 0.2):
                cut = time.monotonic() - started
                break
        assert cut is not None, "a header sent a byte at a time was never cut"
        assert (1.0 if later else 0.0) < cut < 8.0  # 2 s after its start (checked every second)


def test_idle_connections_close_after_their_timeouts(serve):
    server = serve(header_timeout=1, idle_timeout=1, channel_timeout=60)
    with connect(port_of(server)) as silent, connect(port_of(server)) as kept:
        kept.sendall(request("GET", "/info", close=False))  # keep-alive: stays open after its answer
        assert answer(kept)[0] == 200
        started = time.monotonic()
        assert closed_within(kept, 6.0) and closed_within(silent, 6.0)  # the 60 s inactivity timeout has not passed
        assert time.monotonic() - started < 6.0


def test_each_client_holds_a_bounded_number_of_connections(serve):
    server = serve(max_connections_per_client=3, header_timeout=60, idle_timeout=60)
    conns = []
    try:
        for _ in range(6):
            conns.append(connect(port_of(server), "127.0.0.5"))
            time.sleep(0.05)
        deadline = time.monotonic() + 5.0
        closed = set()
        while len(closed) < 3 and time.monotonic() < deadline:
            closed |= {i for i, conn in enumerate(conns) if i not in closed and closed_within(conn, 0.05)}
        assert closed == {0, 1, 2}  # the longest-waiting ones made room for the newest
        assert not any(closed_within(conn, 0.3) for conn in conns[3:])
        with connect(port_of(server), "127.0.0.6") as other:  # another client is not affected
            other.sendall(request("GET", "/info"))
            assert answer(other)[0] == 200
    finally:
        for conn in conns:
            conn.close()


class BlockingReward:
    """Scores 0 once `release` is set (a batch that is being served for as long as the test wants)."""

    modalities = frozenset({"image"})
    group_stage = None

    def __init__(self):
        self.release = threading.Event()

    def __call__(self, outputs, batch):
        self.release.wait(20.0)
        return RewardResult(scores=torch.zeros(len(batch)), components={})


def test_requests_being_served_are_never_cut_and_the_newcomer_is_refused(serve):
    reward = BlockingReward()
    server = serve(reward, max_connections_per_client=2, header_timeout=1, idle_timeout=1)
    port = port_of(server)
    busy = [connect(port, "127.0.0.7", timeout=20.0) for _ in range(2)]
    try:
        for conn in busy:
            conn.sendall(request("POST", "/score", SCORE))
        time.sleep(0.5)
        with connect(port, "127.0.0.7") as third:  # both of its connections are served: the newcomer is closed
            assert closed_within(third, 3.0)
        with connect(port, "127.0.0.8") as other:
            other.sendall(request("GET", "/info"))
            assert answer(other)[0] == 200
        time.sleep(2.5)  # past both timeouts: requests being scored stay
        reward.release.set()
        assert [answer(conn, timeout=10.0)[0] for conn in busy] == [200, 200]
    finally:
        reward.release.set()
        for conn in busy:
            conn.close()


def test_an_upload_with_the_token_is_not_cut_for_newcomers_one_without_it_is(serve):
    server = serve(connection_limit=4, header_timeout=60, idle_timeout=60)
    port = port_of(server)
    half = len(SCORE) // 2
    with connect(port, "127.0.0.9") as trusted, connect(port, "127.0.0.10") as anonymous:
        trusted.sendall(request("POST", "/score", SCORE)[:-half])
        anonymous.sendall(request("POST", "/score", SCORE, token=None)[:-half])
        time.sleep(0.3)
        newcomers = [connect(port, f"127.0.0.{20 + i}") for i in range(6)]
        try:
            assert closed_within(anonymous, 3.0)
            trusted.sendall(SCORE[-half:])
            assert answer(trusted)[0] == 200
        finally:
            for conn in newcomers:
                conn.close()


def test_clients_are_addresses_and_ipv6_networks():
    assert client_of(("127.0.0.1", 5)) == "127.0.0.1" and client_of(("::ffff:10.0.0.1", 5, 0, 0)) == "10.0.0.1"
    assert client_of(("2001:db8::1", 5, 0, 0)) == client_of(("2001:db8::ffff:1", 6, 0, 0)) == "2001:db8::/64"
    assert client_of(("2001:db8:0:1::1", 5, 0, 0)) != client_of(("2001:db8::1", 5, 0, 0))


@pytest.mark.parametrize("limits, flag", [
    ({"header_timeout": 0}, "--header-timeout"), ({"header_timeout": 7200}, "--header-timeout"),
    ({"idle_timeout": 10**6}, "--idle-timeout"), ({"connection_limit": 5000}, "--connection-limit"),
    ({"max_connections_per_client": 0}, "--max-connections-per-client"),
    ({"max_connections_per_client": 1001}, "--max-connections-per-client"),
    ({"max_decoded_mpixels": 0}, "--max-decoded-mpixels"), ({"max_decoded_mpixels": 1e5}, "--max-decoded-mpixels"),
    ({"threads": 1000}, "--threads"), ({"max_body_mb": float("nan")}, "max_body_mb"), ({"threads": 2.5}, "threads"),
])
def test_limits_are_range_checked(limits, flag):
    with pytest.raises(ConfigError, match=flag):
        ServerLimits(**limits)


def test_every_limit_is_a_flag_with_its_default(capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve-reward", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for key, value in vars(ServerLimits()).items():
        flag = "--" + key.replace("_", "-")
        assert flag in text and f"(default {value:g}" in text.split(flag)[-1].split("--")[0], flag
