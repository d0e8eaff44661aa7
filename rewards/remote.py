"""Remote reward: scores through a reward served by ``mmgrpo serve-reward CONFIG`` in another process.

The server runs any registered reward with its own dependencies (and GPU); this client sends each batch as JSON over
HTTP (protocol in `mmgrpo.reward_server`), waits at most `timeout` seconds per attempt and retries a refused, dropped or
timed-out request `retries` more times, `retry_wait * 2^k` seconds apart. It then raises an error naming the address
and how to start the server. An error reported by the server (a bad request, the reward raising) is raised at once.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Literal

from mmgrpo.reward_server import decode_result, encode_request
from mmgrpo.types import PromptBatch, RewardResult


class RemoteRewardError(RuntimeError):
    """The reward server could not be reached, timed out, or reported an error."""


class RemoteReward:
    """Sends ``outputs`` and the batch to a reward server and returns its scores."""

    @dataclass
    class Config:
        """Configuration of [`RemoteReward`].

        Args:
            url (`str`, defaults to `"http://127.0.0.1:8000"`): the server's address (``mmgrpo serve-reward`` prints it).
            timeout (`float`, defaults to 120.0): seconds to wait for one attempt (connection and scoring).
            retries (`int`, defaults to 2): further attempts after a refused, dropped or timed-out one.
            retry_wait (`float`, defaults to 1.0): seconds before the first retry, doubled for each next one.
            encoding (`str`, defaults to `"png"`): images and videos as 8-bit PNG (small; scores as on saved images)
                or ``"float32"`` (exact, ~10x larger).
            modalities (`list[str]`, defaults to `["image"]`): what the served reward scores (checked against the
                pipeline).
        """

        url: str = "http://127.0.0.1:8000"
        timeout: float = 120.0
        retries: int = 2
        retry_wait: float = 1.0
        encoding: Literal["png", "float32"] = "png"
        modalities: list[str] = field(default_factory=lambda: ["image"])

        def __post_init__(self):
            if not self.url.startswith(("http://", "https://")):
                raise ValueError(f"remote.url must start with http:// (e.g. http://127.0.0.1:8000), got {self.url!r}.")
            if self.timeout <= 0 or self.retries < 0 or self.retry_wait < 0:
                raise ValueError(
                    f"remote: timeout must be > 0 and retries, retry_wait >= 0; got {self.timeout}, {self.retries}, "
                    f"{self.retry_wait}."
                )

    modalities = frozenset()  # depends on the served reward; an instance holds its configured modalities

    def __init__(self, config: "RemoteReward.Config | None" = None):
        self.config = config or self.Config()
        self.modalities = frozenset(self.config.modalities)
        self.url = self.config.url.rstrip("/")

    def _post(self, body: bytes) -> bytes:
        """One POST /score with bounded retries; raises [`RemoteRewardError`]."""
        cfg = self.config
        attempts, last_error, started = cfg.retries + 1, None, time.monotonic()
        for attempt in range(attempts):
            if attempt:
                time.sleep(cfg.retry_wait * 2 ** (attempt - 1))
            request = urllib.request.Request(
                f"{self.url}/score", data=body, headers={"Content-Type": "application/json"}, method="POST"
            )
            try:
                with urllib.request.urlopen(request, timeout=cfg.timeout) as response:
                    return response.read()
            except urllib.error.HTTPError as err:  # the server answered with an error: retrying will not help
                detail = err.read().decode("utf-8", "replace")
                try:
                    detail = json.loads(detail).get("error", detail)
                except (ValueError, AttributeError):
                    pass
                raise RemoteRewardError(f"remote reward: the server at {self.url} answered {err.code}: {detail}") from err
            except (OSError, http.client.HTTPException) as err:  # refused, reset, timed out, cut short
                last_error = getattr(err, "reason", err)
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
