"""Serving a registered reward over HTTP, for ``mmgrpo serve-reward CONFIG`` and the `remote` reward (the client).

A reward model with heavy or conflicting dependencies (GenEval's detector, an OCR stack, a large VLM judge) runs in its
own process, as the diffusion-RL peers serve GenEval and OCR; training talks to it through `mmgrpo.rewards.remote`.
The HTTP layer is [waitress](https://docs.pylonsproject.org/projects/waitress/) (a pure-Python production WSGI server)
with the connection policy of `mmgrpo.reward_guard`. Requests are read on `threads` worker threads and scored on one
thread, which merges concurrent requests into one call of the reward (`mmgrpo.reward_batcher`: up to `max_batch`
samples, waiting at most `batch_wait` seconds for a partial batch, at most `max_queue` requests waiting; each request
gets exactly its own scores).

Limits ([`ServerLimits`], each a ``serve-reward`` flag):

- a request body is buffered up to `max_body_mb` (a larger ``Content-Length`` or body gets 413, a malformed one 400,
  before the reward sees it);
- the images and tensors of one request may decode to at most `max_decoded_mpixels` million pixels in total, read
  from the PNG headers and tensor shapes before anything is decoded (beyond: 413), and one PNG frame to at most
  `mmgrpo.reward_codec.MAX_PNG_PIXELS`;
- connections: at most `max_connections_per_client` per client and `connection_limit` in total, where a newcomer
  replaces the connection that has waited longest without a request being served; headers must arrive within
  `header_timeout` seconds, a connection between requests closes after `idle_timeout`, a body or an answer making no
  progress after `channel_timeout` (details in `mmgrpo.reward_guard`);
- at most `max_queue` requests wait to be scored; beyond it 503.

Authentication: with a token (see `mmgrpo.reward_codec.read_token`), every request needs
``Authorization: Bearer <token>`` (compared in constant time) or gets 401. Off loopback the server refuses to start
without one. The token travels in clear over HTTP: on an untrusted network, reach the server through an SSH tunnel or a
TLS-terminating proxy (the client accepts ``https://`` addresses).

Protocol (payload codec in `mmgrpo.reward_codec`):

- ``GET /info`` -> ``{"reward": name, "modalities": [...], "config": {...}, "max_body_bytes": n,
  "max_decoded_pixels": n, "batching": {"max_batch", "batch_wait", "max_queue"}, "stats": {"requests",
  "reward_calls", "samples", "largest_batch", "refused_busy", "waiting"}}`` (``stats`` counts since the start).
- ``POST /score`` with ``{"outputs": ..., "batch": {"prompts", "metadata", "group_ids", "member_ids", "conditions"}}``
  -> ``{"scores": [...], "components": {name: [...]}}`` (NaN written as null).
- Errors: ``{"error": message}`` with status 400 (undecodable request), 401 (missing or wrong token), 404 (unknown
  path), 405 (wrong method), 413 (decoded size over `max_decoded_mpixels`, with ``"limit": "max_decoded_mpixels"``),
  500 (the reward raised) or 503 (`max_queue` requests wait already, with ``"limit": "max_queue"``); waitress itself
  answers 400 (malformed HTTP, e.g. a bad ``Content-Length``) and 413 (body over the limit) in plain text.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import sys
import threading
import traceback
from http import HTTPStatus
from pathlib import Path
from typing import Any

from waitress import wasyncore
from waitress.adjustments import Adjustments

from . import registry
from .config import ConfigError, apply_overrides, plugin_spec
from .config_yaml import read_yaml
from .reward_batcher import QueueFull, RequestBatcher
from .reward_codec import (TOKEN_ENV, TOKEN_HINT, DecodedSizeError, check_token, decode_request, encode_result,
                           is_loopback, read_token)
from .reward_guard import ConnectionPolicy, GuardedServer
from .validation import check_fields, check_range

ROUTES = {"/info": "GET", "/score": "POST"}


def load_reward(path: str | Path, overrides: list[str] = ()) -> tuple[str, Any, Any]:
    """Reads a reward from YAML: an experiment config (its ``reward:`` section is used) or a mapping with ``name`` and
    the reward's options. ``key=value`` overrides apply to that file (``reward.x=...`` in an experiment config).

    Returns:
        `tuple`: the reward's registry name, an instance and its options (its `Config` instance).
    """
    raw = apply_overrides(read_yaml(path), list(overrides))  # YAML 1.2 scalars, duplicate keys refused
    section = raw.get("reward", raw) if isinstance(raw, dict) else raw
    spec = plugin_spec("reward", section)  # a mapping with a single-string name, options checked
    reward = registry.get("reward", spec.name)(spec.options)
    if reward.group_stage is not None:  # it scores a sample against its group, which one request may not hold
        raise ConfigError(
            f"reward {spec.name!r} scores each sample against its group (a group stage), which a server cannot do: "
            "a batch sent to it may hold part of a group. Serve it with normalize: none, and normalise in training "
            "with a local composite whose components are `remote` rewards."
        )
    return spec.name, reward, spec.options


def require_token_off_loopback(host: str, token: str | None) -> None:
    """Raises `ValueError` (saying how to set a token) if `host` is not loopback and there is no token."""
    if token is None and not is_loopback(host):
        raise ValueError(
            f"refusing to serve on {host!r} (not loopback) without a token: anyone who reaches the port could use the "
            f"reward. Set a shared secret in ${TOKEN_ENV} or a file passed with --token-file, {TOKEN_HINT}; the "
            f"`remote` reward reads the same variable (or reward.token_file) and sends it."
        )


# each limit's range: (low, high, low excluded); a real server stays well inside
LIMIT_RANGES = {"max_body_mb": (0, 2**20, True), "max_decoded_mpixels": (0, 4096, True),
                "channel_timeout": (1, 86400, False), "header_timeout": (1, 3600, False),
                "idle_timeout": (1, 86400, False), "threads": (1, 256, False), "connection_limit": (1, 1000, False),
                "max_connections_per_client": (1, 1000, False), "max_batch": (1, 65536, False),
                "batch_wait": (0, 10, False), "max_queue": (1, 1024, False)}


@dataclasses.dataclass
class ServerLimits:
    """What the server accepts; each field is a ``mmgrpo serve-reward`` flag (``--max-body-mb``...).

    Args:
        max_body_mb (`float`, defaults to 256): largest request body in MiB (about 120 PNG-encoded 1024x1024 images,
            ~2 MiB each in base64); beyond it, 413.
        max_decoded_mpixels (`float`, defaults to 64): millions of pixels the images and tensors of one request may
            decode to, together (64 images of 1024x1024; a raw tensor counts a third of its elements, as three values
            make an RGB pixel); read from PNG headers and tensor shapes before decoding, beyond it 413. At most 4096.
        channel_timeout (`int`, defaults to 60): seconds after which a request body, or an answer the client does not
            read, that makes no progress closes its connection. Not applied while a batch is being scored.
        header_timeout (`int`, defaults to 10): seconds a request's headers may take, however slowly they arrive
            (from the connection's start for its first request).
        idle_timeout (`int`, defaults to 30): seconds a connection may stay open between requests.
        threads (`int`, defaults to 16): worker threads reading requests and answering them, each waiting while its
            request is scored: at most this many requests are in the batcher at once (set it above the number of
            clients whose requests should merge); ``/info`` and refusals are answered while a thread is free, and
            further requests wait in waitress's queue (bounded by `connection_limit`) until one is.
        connection_limit (`int`, defaults to 32): open connections in total; a newcomer replaces the one that has
            waited longest without a request being served (see `mmgrpo.reward_guard`). At most 1000.
        max_connections_per_client (`int`, defaults to 16): open connections per client address (an IPv6 /64);
            beyond `connection_limit`, the total limit is the bound.
        max_batch (`int`, defaults to 64): most samples merged into one call of the reward (1: each request alone); a
            larger request is scored alone. At most 65536.
        batch_wait (`float`, defaults to 0.01): seconds a request arriving at an idle reward waits for others to merge
            with (0: merge only the requests that arrived while the reward was busy). At most 10.
        max_queue (`int`, defaults to 64): requests waiting to be scored (not counting those being scored); beyond
            it, 503. At most 1024.
    """

    max_body_mb: float = 256.0
    max_decoded_mpixels: float = 64.0
    channel_timeout: int = 60
    header_timeout: int = 10
    idle_timeout: int = 30
    threads: int = 16
    connection_limit: int = 32
    max_connections_per_client: int = 16
    max_batch: int = 64
    batch_wait: float = 0.01
    max_queue: int = 64

    def __post_init__(self):
        check_fields(self)
        values = dataclasses.asdict(self)  # field name -> value
        for key, (low, high, low_open) in LIMIT_RANGES.items():
            check_range(key, values[key], low, high, low_open=low_open,
                        fix=f"set --{key.replace('_', '-')} (mmgrpo serve-reward --help)")

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * 2**20)

    @property
    def max_decoded_pixels(self) -> int:
        return int(self.max_decoded_mpixels * 1e6)


class RewardServer:
    """An HTTP server scoring batches with one reward instance (see the module docstring for the protocol).

    Args:
        reward: any `RewardFn`.
        name (`str`): its registry name, reported by ``/info``.
        options (*optional*): its options (a `Config` dataclass instance), reported by ``/info`` (`{}` without).
        host (`str`, defaults to `"127.0.0.1"`), port (`int`, defaults to 0: a free port).
        token (`str`, *optional*): the shared secret every request must carry; required off loopback.
        limits ([`ServerLimits`], *optional*): body and decoded sizes, connections and their timeouts, threads.
    """

    def __init__(self, reward, name: str, host: str = "127.0.0.1", port: int = 0, token: str | None = None,
                 limits: ServerLimits | None = None, options=None):
        require_token_off_loopback(host, token)
        self.reward, self.name, self.limits = reward, name, limits or ServerLimits()
        self.options = dataclasses.asdict(options) if dataclasses.is_dataclass(options) else {}
        self._token = None if token is None else check_token(token, "the token argument").encode("ascii")
        self._map: dict = {}  # waitress's socket map: closing everything in it stops the server
        adjustments = Adjustments(
            host="127.0.0.1" if host == "localhost" else host, port=port, threads=self.limits.threads,
            channel_timeout=self.limits.channel_timeout, cleanup_interval=1,  # the deadlines are checked every second
            max_request_body_size=self.limits.max_body_bytes, connection_limit=self.limits.connection_limit,
            ident="mmgrpo-reward", expose_tracebacks=False,
        )
        if len(adjustments.listen) != 1:  # a name that resolves to several addresses: one socket each
            raise ValueError(f"host {host!r} resolves to several addresses; pass one address (e.g. 0.0.0.0 for every "
                             f"IPv4 interface, or this machine's address on the training network).")
        policy = ConnectionPolicy(self.limits.max_connections_per_client, self.limits.header_timeout,
                                  self.limits.idle_timeout, self._trusted)
        self.server = GuardedServer(self._app, policy, map=self._map, adj=adjustments, sockinfo=adjustments.listen[0])
        self.batcher = RequestBatcher(  # its scoring thread starts once the port is bound
            reward, self.limits.max_batch, self.limits.batch_wait, self.limits.max_queue)
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.server.effective_host, self.server.effective_port
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def info(self) -> dict:
        return {"reward": self.name, "modalities": sorted(self.reward.modalities), "config": self.options,
                "max_body_bytes": self.limits.max_body_bytes, "max_decoded_pixels": self.limits.max_decoded_pixels,
                "batching": {"max_batch": self.limits.max_batch, "batch_wait": self.limits.batch_wait,
                             "max_queue": self.limits.max_queue},
                "stats": self.batcher.stats()}

    def _authorized(self, header: str) -> bool:
        scheme, _, value = header.strip().partition(" ")
        given = value.strip().encode("latin-1")  # WSGI headers are latin-1 strings
        return scheme.lower() == "bearer" and hmac.compare_digest(given, self._token)

    def _trusted(self, headers: dict) -> bool:
        """Whether a request's headers (waitress's parsed mapping) carry the token (any request without a token)."""
        return self._token is None or self._authorized(headers.get("AUTHORIZATION", ""))

    def _respond(self, environ: dict) -> tuple[int, Any, list[tuple[str, str]]]:
        """Status, JSON-ready body and extra headers for one request."""
        if self._token is not None and not self._authorized(environ.get("HTTP_AUTHORIZATION", "")):
            error = "wrong token" if environ.get("HTTP_AUTHORIZATION") else "missing token"
            return 401, {"error": f"{error}: send the server's token as 'Authorization: Bearer <token>'"}, [
                ("WWW-Authenticate", 'Bearer realm="mmgrpo-reward"')]
        path, method = environ.get("PATH_INFO", "").rstrip("/"), environ["REQUEST_METHOD"]
        if path not in ROUTES:
            return 404, {"error": f"no such path {path or '/'!r}: GET /info or POST /score"}, []
        if method != ROUTES[path]:
            return 405, {"error": f"{path} takes {ROUTES[path]}, not {method}"}, [("Allow", ROUTES[path])]
        if path == "/info":
            return 200, self.info(), []
        body = environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))  # waitress checked the length
        try:
            outputs, batch = decode_request(body, self.limits.max_decoded_pixels)
        except DecodedSizeError as err:
            return 413, {"error": f"{err}, over this server's limit of {self.limits.max_decoded_mpixels:g} million "
                                  f"(--max-decoded-mpixels): restart it with a larger --max-decoded-mpixels, or send "
                                  f"fewer or smaller images per request", "limit": "max_decoded_mpixels"}, []
        except Exception as err:  # a malformed request: the client's fault
            return 400, {"error": f"undecodable request: {err!r}"}, []
        try:  # scored on the batcher's thread, merged with concurrent requests
            return 200, encode_result(self.batcher.score(outputs, batch)), []
        except QueueFull as err:
            return 503, {"error": str(err), "limit": "max_queue"}, [("Retry-After", "1")]
        except Exception as err:
            traceback.print_exc()
            return 500, {"error": f"reward {self.name!r} raised {err!r}"}, []

    def _app(self, environ: dict, start_response) -> list[bytes]:
        """The WSGI application."""
        status, payload, headers = self._respond(environ)
        body = payload if isinstance(payload, bytes) else json.dumps(payload, default=str).encode("utf-8")
        start_response(f"{status} {HTTPStatus(status).phrase}",
                       [("Content-Type", "application/json"), ("Content-Length", str(len(body))), *headers])
        return [body]

    def start(self) -> "RewardServer":
        """Serves in a background thread (for tests and notebooks); returns self."""
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        return self

    def run(self) -> None:
        """Serves in this thread until interrupted (Ctrl-C), then closes every socket and worker thread."""
        try:
            self.server.run()  # returns on KeyboardInterrupt
        finally:
            wasyncore.close_all(self._map)
            self.batcher.stop()
            self.server.task_dispatcher.shutdown(timeout=5)

    def stop(self) -> None:
        """Stops serving: closes the listening socket and every connection, then the worker threads."""
        if self.thread is not None and self.thread.is_alive():
            try:
                self.server.trigger.pull_trigger(lambda: wasyncore.close_all(self._map))  # runs in the serving thread
            except OSError:  # the wake-up pipe's descriptor was closed under the server: close everything from here;
                wasyncore.close_all(self._map, ignore_all=True)  # the loop sees the empty map after its 1 s poll
            self.thread.join(timeout=5)
        else:
            wasyncore.close_all(self._map)
        self.batcher.stop()
        self.server.task_dispatcher.shutdown(timeout=5)


def serve(config: str, overrides: list[str], host: str, port: int, token_file: str | None = None, **limits) -> int:
    """``mmgrpo serve-reward``: reads the token, loads the reward, prints its address and serves until interrupted.
    `limits` are [`ServerLimits`] fields."""
    try:
        server_limits = ServerLimits(**limits)
        token = read_token(token_file)
        require_token_off_loopback(host, token)  # before loading a (possibly large) reward model
        name, reward, options = load_reward(config, overrides)
    except (ConfigError, ValueError, RuntimeError) as err:  # RuntimeError: weights that cannot be loaded
        print(f"mmgrpo: config error: {err}", file=sys.stderr)
        return 2
    try:
        server = RewardServer(reward, name, host, port, token, server_limits, options)
    except (OSError, ValueError) as err:  # port taken, unknown interface, a name with several addresses
        print(f"mmgrpo: cannot listen on {host}:{port}: {err}", file=sys.stderr)
        return 1
    auth = "token required" if token else "no token (loopback only)"
    try:
        print(f"serving reward {name!r} on {server.url} (POST /score, GET /info; {auth}); Ctrl-C stops", flush=True)
        server.run()
    except KeyboardInterrupt:  # before the loop started
        server.stop()
    return 0
