"""Reward ``remote``: score images on an HTTP reward server (FlowGRPO-style servers for PickScore, HPS, ...).

Protocol (JSON over HTTP, version 1)::

    POST <url>                    Content-Type: application/json
    {"images": ["<base64 PNG>", ...], "prompts": ["...", ...]}
    -> 200 application/json
    {"rewards": [<number>, ...]}  one finite number per image, in request order

Images are 8-bit RGB PNGs of the (B, 3, H, W) [0, 1] input, quantised as every local reward does
(``images_to_uint8``), so a server running a local reward returns exactly that reward.
Connection failures, timeouts, HTTP 429 and 5xx are retried ``retries`` times with exponential backoff
(``backoff_s · 2^k`` seconds, at most ``max_backoff_s``); other HTTP errors and malformed replies fail at once,
since repeating the request cannot fix them. Every failure is one ``RewardError`` line naming the URL.
"""

from __future__ import annotations

import base64
import http.client
import io
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Callable, List, Sequence

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from .base import RewardError, images_to_uint8
from .registry import register_reward

_LOOPBACK = {"localhost", "127.0.0.1", "::1"}
_RETRY_STATUS = {429, 500, 502, 503, 504}


def encode_png_base64(images: Tensor) -> List[str]:
    """(B, 3, H, W) float in [0, 1] -> B base64 (ASCII) PNG strings of the uint8-quantised images."""
    encoded = []
    for pixels in images_to_uint8(images):
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="PNG")
        encoded.append(base64.b64encode(buffer.getvalue()).decode("ascii"))
    return encoded


def decode_png_base64(items: Sequence[str]) -> np.ndarray:
    """B base64 PNG strings (same size) -> (B, H, W, 3) uint8 RGB; ValueError for bad data or mixed sizes."""
    arrays = []
    for index, item in enumerate(items):
        try:
            data = base64.b64decode(item, validate=True)
            arrays.append(np.array(Image.open(io.BytesIO(data)).convert("RGB")))
        except Exception as exc:  # noqa: BLE001 -- any decoding failure is a bad request
            raise ValueError(f"image {index} is not a base64 PNG: {type(exc).__name__}") from None
    if not arrays or any(a.shape != arrays[0].shape for a in arrays):
        raise ValueError("images must be a non-empty list of equally sized PNGs")
    return np.stack(arrays)


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, urllib.error.URLError) and not isinstance(exc, urllib.error.HTTPError):
        exc = exc.reason if isinstance(exc.reason, BaseException) else exc
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


@register_reward("remote")
class RemoteReward:
    """Sends each batch to a reward server (protocol in the module docstring) and returns its rewards."""

    def __init__(
        self,
        url: str | None = None,
        *,
        timeout_s: float = 60.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        max_backoff_s: float = 8.0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        """``url``: http(s) endpoint; ``timeout_s`` per request; ``retries`` after the first failed attempt."""
        if not url:
            raise ValueError("reward 'remote' needs a server URL (reward.url)")
        parsed = urllib.parse.urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"reward 'remote': url must be http(s)://host[:port]/path, got {url!r}")
        if timeout_s <= 0 or retries < 0 or backoff_s < 0 or max_backoff_s < 0:
            raise ValueError("reward 'remote': timeout_s must be > 0 and retries, backoff_s, max_backoff_s >= 0")
        self.url = url
        self.timeout_s = float(timeout_s)
        self.retries = int(retries)
        self.backoff_s = float(backoff_s)
        self.max_backoff_s = float(max_backoff_s)
        self._sleep = sleep
        # Loopback servers are reached directly even when the environment names an HTTP proxy.
        handlers = [urllib.request.ProxyHandler({})] if parsed.hostname in _LOOPBACK else []
        self._opener = urllib.request.build_opener(*handlers)

    def _post(self, body: bytes) -> bytes:
        request = urllib.request.Request(
            self.url, data=body, method="POST", headers={"Content-Type": "application/json"}
        )
        with self._opener.open(request, timeout=self.timeout_s) as response:
            return response.read()

    def _request(self, body: bytes) -> bytes:
        """POST with retries; RewardError when every attempt fails or the server refuses the request."""
        attempts = self.retries + 1
        for attempt in range(attempts):
            try:
                return self._post(body)
            except urllib.error.HTTPError as exc:
                if exc.code not in _RETRY_STATUS:
                    raise RewardError(
                        f"reward server {self.url} refused the request: HTTP {exc.code} {exc.reason}"
                    ) from None
                error: BaseException = exc
            except (http.client.HTTPException, OSError) as exc:  # URLError, timeouts, resets are OSErrors
                error = exc
            if attempt + 1 < attempts:
                self._sleep(min(self.max_backoff_s, self.backoff_s * 2**attempt))
        raise RewardError(f"reward server {self.url} unreachable after {attempts} attempts: {_one_line(error)}")

    def _parse(self, reply: bytes, batch_size: int) -> Tensor:
        try:
            payload = json.loads(reply.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise RewardError(f"reward server {self.url} returned a malformed reply (not JSON)") from None
        rewards: Any = payload.get("rewards") if isinstance(payload, dict) else None
        if not isinstance(rewards, list) or not all(
            isinstance(r, (int, float)) and not isinstance(r, bool) for r in rewards
        ):
            raise RewardError(f"reward server {self.url} returned a malformed reply (needs {{\"rewards\": [numbers]}})")
        if len(rewards) != batch_size:
            raise RewardError(f"reward server {self.url} returned {len(rewards)} rewards for {batch_size} images")
        return torch.tensor(rewards, dtype=torch.float32)

    def __call__(self, images: Tensor, prompts: List[str]) -> Tensor:
        """Rewards (B,) float32 for images (B, 3, H, W) in [0, 1] and their prompts, scored by the server."""
        body = json.dumps({"images": encode_png_base64(images), "prompts": list(prompts)}).encode("utf-8")
        return self._parse(self._request(body), images.shape[0])
