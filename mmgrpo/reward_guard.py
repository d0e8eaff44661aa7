"""The reward server's connection policy: waitress's HTTP server with bounds per client and on slow or idle connections,
so that connections which hold no request in progress cannot keep out a client that has the token.

Plain waitress closes a connection only after `channel_timeout` seconds without any activity, and once
`connection_limit` connections are open it leaves new ones in the kernel's backlog: idle connections, or headers sent
a byte at a time, would hold every slot. [`GuardedServer`] adds:

- **Per client** (a source IPv4 address, or an IPv6 /64 network) at most `max_connections_per_client` connections: a
  new one replaces that client's longest-waiting connection (below), or is closed at once when all of them are serving
  a request.
- **In total** at most `connection_limit`: a new connection replaces the longest-waiting connection of any client
  instead of waiting in the backlog (it waits there only while every connection is serving a request), so a client
  with the token gets in at once.
- **Deadlines**, checked every second: a request's headers must be complete within `header_timeout` seconds, counted
  from the connection's start for its first request and from the request's first byte for later ones, however slowly
  they trickle; a connection between requests (keep-alive) closes after `idle_timeout` seconds; a request body, or an
  answer the client does not read, that makes no progress for `channel_timeout` seconds closes it (waitress's rule).

A *waiting* connection serves no request: it is between requests, sending its headers, or sending the body of a
request without the server's token (when the server has one). The longest-waiting one is replaced first; a request
that is being served, an answer being sent, or a body arriving with the token is never cut.
"""

from __future__ import annotations

import ipaddress
import math
import time
from dataclasses import dataclass
from typing import Callable

from waitress.channel import HTTPChannel
from waitress.server import TcpWSGIServer


@dataclass(frozen=True)
class ConnectionPolicy:
    """The bounds [`GuardedServer`] applies beyond waitress's own (see the module docstring).

    Args:
        max_connections_per_client (`int`): open connections per source address (IPv6: per /64 network).
        header_timeout (`float`): seconds a request's headers may take.
        idle_timeout (`float`): seconds a connection may stay open between requests.
        trusted (`Callable[[dict], bool]`): whether a request's parsed headers (waitress's mapping, keys upper-case
            with ``_``) carry the server's token; such a request's body is never cut for a newcomer.
    """

    max_connections_per_client: int
    header_timeout: float
    idle_timeout: float
    trusted: Callable[[dict], bool]


def client_of(addr) -> str:
    """The client a connection from `addr` (a socket address) counts against: its IPv4 address, or its IPv6 /64
    network (one host commonly holds a whole /64); IPv4-mapped IPv6 addresses count as the IPv4 address."""
    host = str(addr[0] if isinstance(addr, tuple) else addr).split("%")[0]
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host
    if address.version == 6 and address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return str(ipaddress.ip_network(f"{address}/64", strict=False)) if address.version == 6 else str(address)


class GuardedChannel(HTTPChannel):
    """waitress's connection, with its client and the clock of its current request's headers."""

    def __init__(self, server, sock, addr, adj, map=None):
        super().__init__(server, sock, addr, adj, map=map)
        self.client = client_of(addr)
        self.began = False  # whether any byte arrived: before that, the first request's headers run from the start
        self.request_started = self.creation_time  # when the current request's headers began

    def received(self, data: bytes) -> bool:
        """waitress's parsing, noting when a request after the first begins (its header deadline counts from
        there)."""
        pending, now = self.request, time.time()
        result = super().received(data)
        if self.request is not None and self.request is not pending and self.began:
            self.request_started = now  # a later request began in these bytes and is not complete
        self.began = self.began or bool(data)
        return result

    def deadline(self, header_timeout: float, idle_timeout: float) -> float:
        """When this connection is due to close (`inf` while a request is served): see the module docstring."""
        request = self.request
        if self.requests:
            return math.inf
        if self.total_outbufs_len or (request is not None and request.headers_finished):
            return self.last_activity + self.adj.channel_timeout  # an answer or a body making no progress
        if request is None and self.began:
            return self.last_activity + idle_timeout  # between requests
        return self.request_started + header_timeout

    def waiting_since(self, trusted: Callable[[dict], bool]) -> float | None:
        """Since when this connection has been waiting (see the module docstring); `None` while it serves a request,
        sends an answer or receives a body with the token."""
        if self.requests or self.total_outbufs_len or self.close_when_flushed:
            return None
        if self.will_close:
            return -math.inf  # closing anyway
        request = self.request
        if request is None:
            return self.last_activity if self.began else self.creation_time
        if request.headers_finished and trusted(request.headers):
            return None
        return self.request_started


class GuardedServer(TcpWSGIServer):
    """waitress's TCP server with the [`ConnectionPolicy`] of the module docstring.

    Args:
        application: the WSGI application.
        policy ([`ConnectionPolicy`]): the bounds beyond waitress's adjustments.
        **kwargs: `TcpWSGIServer`'s arguments (``map``, ``adj``, ``sockinfo``...).
    """

    channel_class = GuardedChannel

    def __init__(self, application, policy: ConnectionPolicy, **kwargs):
        self.policy = policy  # before waitress's constructor starts accepting
        super().__init__(application, **kwargs)

    def longest_waiting(self, client: str | None = None) -> GuardedChannel | None:
        """The connection (of `client` if given) that has been waiting longest, or `None` if none waits."""
        found, oldest = None, math.inf
        for channel in list(self.active_channels.values()):
            if client is None or channel.client == client:
                since = channel.waiting_since(self.policy.trusted)
                if since is not None and since < oldest:
                    found, oldest = channel, since
        return found

    def readable(self) -> bool:
        """Runs the deadlines every `cleanup_interval` seconds; accepts while under the limit or while a waiting
        connection can make room (else new connections wait in the backlog)."""
        now = time.time()
        if now >= self.next_channel_cleanup:
            self.next_channel_cleanup = now + self.adj.cleanup_interval
            self.maintenance(now)
        if not self.accepting:
            return False
        return len(self.active_channels) < self.adj.connection_limit or self.longest_waiting() is not None

    def handle_accept(self) -> None:
        """Accepts a connection within the per-client and total bounds, closing the longest-waiting connection (of the
        same client when it is at its bound) to make room, or the new one when none waits."""
        try:
            accepted = self.accept()
            if accepted is None:
                return
            conn, addr = accepted
            self.set_socket_options(conn)
        except OSError:  # the peer went away before it was accepted: as waitress
            return
        addr = self.fix_addr(addr)
        client = client_of(addr)
        held = sum(channel.client == client for channel in list(self.active_channels.values()))
        if held >= self.policy.max_connections_per_client or len(self.active_channels) >= self.adj.connection_limit:
            victim = self.longest_waiting(client if held >= self.policy.max_connections_per_client else None)
            if victim is None:
                conn.close()
                return
            victim.handle_close()
        self.channel_class(self, conn, addr, self.adj, map=self._map)

    def maintenance(self, now: float) -> None:
        """Closes the connections past their deadline (replaces waitress's inactivity-only rule)."""
        for channel in list(self.active_channels.values()):
            if now > channel.deadline(self.policy.header_timeout, self.policy.idle_timeout):
                channel.will_close = True
