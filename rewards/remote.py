"""Remote reward: scores through a reward served by ``mmgrpo serve-reward CONFIG`` in another process.

The server runs any registered reward with its own dependencies (and GPU); this client sends each batch as JSON over
HTTP (protocol in `mmgrpo.reward_server`), waits at most `timeout` seconds per attempt and retries a refused, dropped or
timed-out request, or one the server refused as busy (503: its queue of waiting requests is full), `retries` more
times, `retry_wait * 2^k` seconds apart. It then raises an error naming the address
and how to start the server. An error reported by the server (a bad request, a missing or wrong token, a body over the
server's ``--max-body-mb``, images decoding to more than its ``--max-decoded-mpixels``, the reward raising) is raised
at once, with what to change. These errors are `RemoteRewardError`s, a `mmgrpo.errors.RunError`: ``mmgrpo train``
ends with their one-line message and exit status 1.

Authentication: the server's shared secret is read from the environment variable `token_env` (default
``MMGRPO_REWARD_TOKEN``) or the file `token_file`, never from the config itself (configs are logged), and sent as
``Authorization: Bearer <token>``. A server off loopback requires one, so a non-loopback `url` without a token is
refused when the config is built.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Literal

from mmgrpo.errors import RunError
from mmgrpo.reward_codec import TOKEN_ENV, TOKEN_HINT, decode_result, encode_request, is_loopback, read_token
from mmgrpo.rewards._common import fixed_artifacts
from mmgrpo.types import PromptBatch, RewardResult


class RemoteRewardError(RunError):
    """The reward server could not be reached, timed out, or reported an error (``mmgrpo train`` prints it on one line
    and exits with status 1)."""


def _check_url(url: Any) -> str:
    """The address's host; raises `ValueError` naming reward.url unless `url` is an http(s) address with a host."""
    example = "e.g. http://127.0.0.1:8000, the address `mmgrpo serve-reward` prints"
    if not isinstance(url, str):
        raise ValueError(f"reward.url must be a string ({example}), got {url!r}.")
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 (raises on a port that is not a number in 0-65535)
    except ValueError as err:
        raise ValueError(f"reward.url {url!r} is not a valid address ({err}); {example}.") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        raise ValueError(f"reward.url must be http:// or https:// with a host and no query ({example}), got {url!r}.")
    return parts.hostname


def _number(key: str, value: Any, low: float, integer: bool = False) -> None:
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value) or value < low:
        kind = "an integer" if integer else "a finite number"
        raise ValueError(f"reward.{key} must be {kind} >= {low}, got {value!r}.")


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """Refuses redirects (they become errors), so the token is only ever sent to `url`."""

    def redirect_request(self, *args, **kwargs):
        return None


@dataclass
class RemoteConfig:
    """Configuration of [`RemoteReward`].

    Args:
        url (`str`, defaults to `"http://127.0.0.1:8000"`): the server's address (``mmgrpo serve-reward`` prints
            it).
        timeout (`float`, defaults to 120.0): seconds to wait for one attempt (connection and scoring).
        retries (`int`, defaults to 2): further attempts after a refused, dropped or timed-out one.
        retry_wait (`float`, defaults to 1.0): seconds before the first retry, doubled for each next one.
        encoding (`str`, defaults to `"png"`): images and videos as 8-bit PNG (small; scores as on saved images)
            or ``"float32"`` (exact, ~10x larger).
        modalities (`list[str]`, defaults to `["image"]`): what the served reward scores (checked against the
            pipeline).
        token_env (`str`, *optional*, defaults to `"MMGRPO_REWARD_TOKEN"`): environment variable holding the
            server's token (used when set and not empty); `None` reads no variable.
        token_file (`str`, *optional*): a file holding the token instead (takes precedence over `token_env`).
    """

    url: str = "http://127.0.0.1:8000"
    timeout: float = 120.0
    retries: int = 2
    retry_wait: float = 1.0
    encoding: Literal["png", "float32"] = "png"
    modalities: list[str] = field(default_factory=lambda: ["image"])
    token_env: str | None = TOKEN_ENV
    token_file: str | None = None

    def __post_init__(self):
        host = _check_url(self.url)
        _number("timeout", self.timeout, 0.001)
        _number("retries", self.retries, 0, integer=True)
        _number("retry_wait", self.retry_wait, 0)
        if self.timeout > 86400:
            raise ValueError(f"reward.timeout must be <= 86400 s (a day) per attempt, got {self.timeout}.")
        if self.retries > 100 or self.retry_wait > 3600:
            raise ValueError(f"reward.retries (<= 100) and reward.retry_wait (<= 3600 s) are bounded, got "
                             f"{self.retries} and {self.retry_wait}.")
        if self.encoding not in ("png", "float32"):
            raise ValueError(f"reward.encoding must be 'png' or 'float32', got {self.encoding!r}.")
        if (not isinstance(self.modalities, (list, tuple)) or not self.modalities
                or not all(isinstance(m, str) and m for m in self.modalities)):
            raise ValueError(f"reward.modalities must be a non-empty list of names (e.g. [image]), got "
                             f"{self.modalities!r}.")
        if self.token_env is not None and (not isinstance(self.token_env, str) or not self.token_env
                                           or "=" in self.token_env or "\0" in self.token_env):
            raise ValueError(f"reward.token_env must name an environment variable (e.g. {TOKEN_ENV}) or be null, "
                             f"got {self.token_env!r}.")
        if self.token_file is not None and not (isinstance(self.token_file, str)
                                                and os.path.isfile(self.token_file)):
            raise ValueError(f"reward.token_file: no file at {self.token_file!r}; {TOKEN_HINT}.")
        token = self.token()  # checks it (length, characters)
        if token is None and not is_loopback(host):
            raise ValueError(
                f"reward.url {self.url} is not on loopback, and a server there requires a token: set "
                f"${self.token_env or TOKEN_ENV} (or reward.token_file) to the server's token; {TOKEN_HINT}."
            )

    def token(self) -> str | None:
        """The token read from `token_file` or `token_env` (`None` if neither holds one)."""
        try:
            return read_token(self.token_file, self.token_env)
        except ValueError as err:
            raise ValueError(f"reward.token_file / reward.token_env: {err}") from None


class RemoteReward:
    """Sends ``outputs`` and the batch to a reward server and returns its scores."""

    Config = RemoteConfig
    modalities = frozenset()  # depends on the served reward; an instance holds its configured modalities
    group_stage = None  # the server scores per sample: serve a reward without a group stage
    artifacts = frozenset()  # the server returns scores and components only

    @classmethod
    def modalities_for(cls, config: RemoteConfig) -> frozenset[str]:
        return frozenset(config.modalities)  # the served reward's, as configured (see mmgrpo.protocols.RewardFn)

    artifacts_for = classmethod(fixed_artifacts)

    def __init__(self, config: RemoteConfig | None = None):
        self.config = config or RemoteConfig()
        self.modalities = self.modalities_for(self.config)
        self.url = self.config.url.rstrip("/")
        self._token = self.config.token()
        self._opener = urllib.request.build_opener(_NoRedirect)

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self._token is not None:
            headers["Authorization"] = f"Bearer {self._token}"
        return headers

    def _explain(self, err: urllib.error.HTTPError, body: bytes) -> RemoteRewardError:
        """A clear error for a 4xx / 5xx answer: what the server said and what to change."""
        detail, limit = err.read().decode("utf-8", "replace"), None
        try:
            answer = json.loads(detail)
            detail, limit = answer.get("error", detail), answer.get("limit")
        except (ValueError, AttributeError):
            pass
        detail = " ".join(str(detail).split())  # waitress's own plain-text answers span lines
        where = f"remote reward: the server at {self.url} answered {err.code}"
        cfg = self.config
        source = f"reward.token_file {cfg.token_file}" if cfg.token_file else f"${cfg.token_env or TOKEN_ENV}"
        if err.code == 401 and self._token is None:
            hint = f"it requires a token and none was sent: set {source} to the token the server was started with"
        elif err.code == 401:
            hint = f"the token from {source} is not the server's: use the token the server was started with"
        elif err.code == 413 and limit == "max_decoded_mpixels":  # the server's JSON refusal, before decoding
            return RemoteRewardError(
                f"{where}: the batch's images decode to more pixels than it accepts ({detail}). Restart the server "
                f"with a larger --max-decoded-mpixels, or send fewer images per request (fewer prompts per step or "
                f"per process, or smaller images)."
            )
        elif err.code == 413:  # waitress's plain-text refusal of the body
            return self._too_large(len(body), detail)
        else:
            return RemoteRewardError(f"{where}: {detail}")
        return RemoteRewardError(f"{where} ({detail}): {hint}.")

    def _too_large(self, size: int, detail: str) -> RemoteRewardError:
        return RemoteRewardError(
            f"remote reward: the batch ({size / 2**20:.1f} MiB) is too large for the server at {self.url} ({detail}): "
            f"restart it with a larger --max-body-mb, or send smaller batches (reward.encoding png is ~10x smaller "
            f"than float32)."
        )

    def _body_limit(self) -> int | None:
        """The server's body limit from ``GET /info`` (`None` if it cannot tell); raises on a token refusal."""
        request = urllib.request.Request(f"{self.url}/info", headers=self._headers(), method="GET")
        try:
            with self._opener.open(request, timeout=min(self.config.timeout, 10.0)) as response:
                limit = json.loads(response.read()).get("max_body_bytes")
        except urllib.error.HTTPError as err:
            if err.code == 401:
                raise self._explain(err, b"") from err
            return None
        except (OSError, http.client.HTTPException, ValueError, AttributeError):
            return None
        return limit if isinstance(limit, int) else None

    def _post(self, body: bytes) -> bytes:
        """One POST /score with bounded retries; raises [`RemoteRewardError`]."""
        cfg = self.config
        attempts, last_error, busy, started = cfg.retries + 1, None, None, time.monotonic()
        for attempt in range(attempts):
            if attempt:
                time.sleep(cfg.retry_wait * 2 ** (attempt - 1))
            request = urllib.request.Request(f"{self.url}/score", data=body, headers=self._headers(), method="POST")
            try:
                with self._opener.open(request, timeout=cfg.timeout) as response:
                    return response.read()
            except urllib.error.HTTPError as err:
                if err.code != 503:  # the server answered with an error: retrying will not help
                    raise self._explain(err, body) from err
                last_error = busy = self._explain(err, body)  # its queue is full (--max-queue): retried
                continue
            except (OSError, http.client.HTTPException) as err:  # refused, reset, timed out, cut short
                last_error, busy = getattr(err, "reason", err), None
                if isinstance(last_error, (BrokenPipeError, ConnectionResetError)):  # a 413 may have cut the upload
                    limit = self._body_limit()
                    if limit is not None and len(body) >= limit:
                        raise self._too_large(len(body), f"its limit is {limit / 2**20:.1f} MiB") from err
        if busy is not None:  # the last attempt found the server's queue full
            raise RemoteRewardError(f"{busy} (after {attempts} attempt(s); raise reward.retries or reward.retry_wait "
                                    f"to wait longer)")
        raise RemoteRewardError(
            f"remote reward: no answer from {self.url} after {attempts} attempt(s) in "
            f"{time.monotonic() - started:.1f} s (timeout {cfg.timeout} s each; last error: {last_error}). Is the "
            f"server running? Start it with `mmgrpo serve-reward REWARD_CONFIG --port PORT` and set reward.url to "
            f"the address it prints."
        )

    def __call__(self, outputs: dict[str, Any], batch: PromptBatch) -> RewardResult:
        """Returns the served reward's `scores` `[N]` and `components` (each `[N]`, NaN kept)."""
        result = decode_result(self._post(encode_request(outputs, batch, png=self.config.encoding == "png")))
        if result.scores.shape != (len(batch),):
            raise RemoteRewardError(
                f"remote reward: the server at {self.url} returned {tuple(result.scores.shape)} scores for a batch of "
                f"{len(batch)}."
            )
        return result


PLUGIN = RemoteReward
