"""Reward ``remote``: score images on an HTTP reward server (FlowGRPO-style servers for PickScore, HPS, ...).

Protocol (JSON over HTTP, version 1)::

    POST <url>                    Content-Type: application/json
    {"images": ["<base64 PNG>", ...], "prompts": ["...", ...]}
    -> 200 application/json
    {"rewards": [<number>, ...]}  one finite number per image, in request order

Images are 8-bit RGB PNGs of the (B, 3, H, W) [0, 1] input, quantised as every local reward does
(``images_to_uint8``), so a server running a local reward returns exactly that reward.

The client keeps one pool of persistent (keep-alive) connections per reward object and is safe to call from
several threads; :meth:`RemoteReward.submit` scores a batch in the background and returns a ``Future``.
Each attempt is bounded as a whole by ``timeout_s``: connecting, sending, waiting and reading the reply
together, so a server that trickles bytes cannot stretch it. A reply larger than ``max_response_bytes`` is
abandoned as soon as it is known to be (from its Content-Length, or while it streams in). Redirects are refused,
same-origin ones included: a POST that is redirected is a misconfigured URL, and following it could send the
images and the token to another host. With ``auth_env`` the request carries ``Authorization: Bearer <token>``,
the token read from that environment variable (the config names the variable, never the secret); no error
message shows the token, even when the server echoes the request's headers in its reply.
``ca_bundle`` verifies an https server against that CA file instead of the default trust store. Plain http to
a host other than this machine warns once. Loopback servers are reached directly; others through an http://
proxy named by the environment (``HTTP_PROXY`` / ``HTTPS_PROXY``) unless ``NO_PROXY`` lists them.

Connection failures, timeouts, HTTP 429 and 5xx are retried ``retries`` times with exponential backoff
(``backoff_s · 2^k`` seconds, at most ``max_backoff_s``): scoring the same images again is harmless. Other HTTP
errors, redirects, oversized and malformed replies fail at once, since repeating the request cannot fix them.
Every failure is one ``RewardError`` line naming the URL.
"""

from __future__ import annotations

import base64
import contextlib
import io
import ipaddress
import json
import os
import ssl
import struct
import threading
import time
import urllib.parse
import urllib.request
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterator, List, Optional, Sequence

import httpcore
import httpx
import numpy as np
import torch
from PIL import Image
from torch import Tensor

from .base import RewardError, check_reward_inputs, check_reward_output, images_to_uint8
from .registry import register_reward

_RETRY_STATUS = {429, 500, 502, 503, 504}
DEFAULT_MAX_RESPONSE_BYTES = 16 << 20
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_WARNED_PLAIN_HTTP: set = set()
_WARN_LOCK = threading.Lock()


# ----------------------------------------------------------------------------------------------- the PNG protocol


class PixelLimitError(ValueError):
    """The images of a request hold more pixels than the server accepts."""


def _encode_uint8(pixels: np.ndarray) -> List[str]:
    encoded = []
    for image in pixels:
        buffer = io.BytesIO()
        Image.fromarray(image).save(buffer, format="PNG")
        encoded.append(base64.b64encode(buffer.getvalue()).decode("ascii"))
    return encoded


def encode_png_base64(images: Tensor) -> List[str]:
    """(B, 3, H, W) float in [0, 1] -> B base64 (ASCII) PNG strings of the uint8-quantised images."""
    return _encode_uint8(images_to_uint8(images))


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR header, reading 24 bytes and decoding nothing; ValueError if not a PNG."""
    if len(data) < 24 or data[:8] != _PNG_SIGNATURE or data[12:16] != b"IHDR":
        raise ValueError("not a PNG (no PNG signature and IHDR header)")
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def decode_png_base64(items: Sequence[str], max_pixels: Optional[int] = None) -> np.ndarray:
    """B base64 PNG strings (same size) -> (B, H, W, 3) uint8 RGB; ValueError for bad data or mixed sizes.

    With ``max_pixels``, the images' sizes are read from their PNG headers first and a batch of more than
    ``max_pixels`` pixels in all raises :class:`PixelLimitError` before any image is decoded.
    """
    raw, sizes = [], []
    for index, item in enumerate(items):
        try:
            data = base64.b64decode(item, validate=True)
            sizes.append(png_size(data))
        except Exception as exc:  # noqa: BLE001 -- any decoding failure is a bad request
            raise ValueError(f"image {index} is not a base64 PNG: {type(exc).__name__}") from None
        raw.append(data)
    if not sizes or any(size != sizes[0] for size in sizes):
        raise ValueError("images must be a non-empty list of equally sized PNGs")
    total = len(sizes) * sizes[0][0] * sizes[0][1]
    if max_pixels is not None and total > max_pixels:
        width, height = sizes[0]
        raise PixelLimitError(f"{len(sizes)} images of {width}x{height} are {total} pixels, more than {max_pixels}")
    arrays = []
    for index, data in enumerate(raw):
        try:
            arrays.append(np.array(Image.open(io.BytesIO(data)).convert("RGB")))
        except Exception as exc:  # noqa: BLE001
            raise ValueError(f"image {index} is not a base64 PNG: {type(exc).__name__}") from None
    if any(a.shape != arrays[0].shape for a in arrays):
        raise ValueError("images must be a non-empty list of equally sized PNGs")
    return np.stack(arrays)


# ------------------------------------------------------------------ a connection pool whose requests have deadlines


class _Deadline(threading.local):
    """The monotonic time by which the current thread's request must be done (None: no deadline)."""

    at: Optional[float] = None
    budget_s: float = 0.0


class _DeadlineStream(httpcore.NetworkStream):
    """A network stream whose every blocking operation waits at most until the calling thread's deadline."""

    def __init__(self, stream: httpcore.NetworkStream, deadline: _Deadline) -> None:
        self._stream = stream
        self._deadline = deadline

    def _timeout(self, timeout: Optional[float], error: type) -> Optional[float]:
        return _bounded(timeout, self._deadline, error)

    def read(self, max_bytes: int, timeout: Optional[float] = None) -> bytes:
        return self._stream.read(max_bytes, self._timeout(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: Optional[float] = None) -> None:
        self._stream.write(buffer, self._timeout(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self._stream.close()

    def start_tls(self, ssl_context: ssl.SSLContext, server_hostname: Optional[str] = None,
                  timeout: Optional[float] = None) -> httpcore.NetworkStream:
        stream = self._stream.start_tls(ssl_context, server_hostname, self._timeout(timeout, httpcore.ConnectTimeout))
        return _DeadlineStream(stream, self._deadline)

    def get_extra_info(self, info: str) -> Any:
        return self._stream.get_extra_info(info)


def _bounded(timeout: Optional[float], deadline: _Deadline, error: type) -> Optional[float]:
    if deadline.at is None:
        return timeout
    left = deadline.at - time.monotonic()
    if left <= 0:
        raise error(f"timed out after {deadline.budget_s:g} s")
    return left if timeout is None else min(timeout, left)


class _DeadlineBackend(httpcore.NetworkBackend):
    def __init__(self, deadline: _Deadline) -> None:
        self._backend = httpcore.SyncBackend()
        self._deadline = deadline

    def connect_tcp(self, host: str, port: int, timeout: Optional[float] = None, local_address: Optional[str] = None,
                    socket_options: Any = None) -> httpcore.NetworkStream:
        timeout = _bounded(timeout, self._deadline, httpcore.ConnectTimeout)
        stream = self._backend.connect_tcp(host, port, timeout, local_address, socket_options)
        return _DeadlineStream(stream, self._deadline)

    def connect_unix_socket(self, path: str, timeout: Optional[float] = None,
                            socket_options: Any = None) -> httpcore.NetworkStream:  # pragma: no cover
        raise NotImplementedError("unix sockets are not used")

    def sleep(self, seconds: float) -> None:  # pragma: no cover
        self._backend.sleep(seconds)


_CORE_TO_HTTPX = (  # most specific first
    (httpcore.ConnectTimeout, httpx.ConnectTimeout), (httpcore.ReadTimeout, httpx.ReadTimeout),
    (httpcore.WriteTimeout, httpx.WriteTimeout), (httpcore.PoolTimeout, httpx.PoolTimeout),
    (httpcore.ConnectError, httpx.ConnectError), (httpcore.ReadError, httpx.ReadError),
    (httpcore.WriteError, httpx.WriteError), (httpcore.RemoteProtocolError, httpx.RemoteProtocolError),
    (httpcore.LocalProtocolError, httpx.LocalProtocolError), (httpcore.ProxyError, httpx.ProxyError),
    (httpcore.UnsupportedProtocol, httpx.UnsupportedProtocol), (httpcore.TimeoutException, httpx.TimeoutException),
    (httpcore.NetworkError, httpx.NetworkError), (httpcore.ProtocolError, httpx.ProtocolError),
)


@contextlib.contextmanager
def _httpx_errors() -> Iterator[None]:
    try:
        yield
    except Exception as exc:
        for core, mapped in _CORE_TO_HTTPX:
            if isinstance(exc, core):
                raise mapped(str(exc)) from exc
        raise


class _ResponseBody(httpx.SyncByteStream):
    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def __iter__(self) -> Iterator[bytes]:
        with _httpx_errors():
            yield from self._stream

    def close(self) -> None:
        if hasattr(self._stream, "close"):
            self._stream.close()


class _DeadlineTransport(httpx.BaseTransport):
    """An httpx transport over an httpcore pool (or proxy) built on :class:`_DeadlineBackend`."""

    def __init__(self, pool: httpcore.ConnectionPool) -> None:
        self._pool = pool

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        core_request = httpcore.Request(
            method=request.method,
            url=httpcore.URL(scheme=url.raw_scheme, host=url.raw_host, port=url.port, target=url.raw_path),
            headers=request.headers.raw,
            content=request.stream,
            extensions=request.extensions,
        )
        with _httpx_errors():
            response = self._pool.handle_request(core_request)
        return httpx.Response(status_code=response.status, headers=response.headers,
                              stream=_ResponseBody(response.stream), extensions=response.extensions)

    def close(self) -> None:
        self._pool.close()


# --------------------------------------------------------------------------------------------------- the reward


class _Retry(Exception):
    """A failed attempt that another attempt may fix."""


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _certificate_error(exc: BaseException) -> Optional[ssl.SSLCertVerificationError]:
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, ssl.SSLCertVerificationError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def _is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


REDACTED = "[redacted]"
"""What replaces a secret in a message."""


def redact(text: str, secrets: Sequence[str]) -> str:
    """``text`` with every occurrence of each secret replaced by :data:`REDACTED`."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, REDACTED)
    return text


def _error_detail(response: httpx.Response, secrets: Sequence[str] = (), limit: int = 512) -> str:
    """At most ``limit`` bytes of an error reply, as one short line (its JSON "error" field when it has one), with
    the ``secrets`` redacted before it is shortened (so that no part of one survives the cut)."""
    data = b""
    with contextlib.suppress(httpx.HTTPError):
        for chunk in response.iter_bytes():
            data += chunk
            if len(data) >= limit:
                break
    text = data[:limit].decode("utf-8", "replace")
    with contextlib.suppress(ValueError, AttributeError):
        text = str(json.loads(text).get("error", text))
    text = " ".join(redact(text, secrets).split())[:200]
    return f": {text}" if text else ""


@register_reward("remote")
class RemoteReward:
    """Sends each batch to a reward server (protocol in the module docstring) and returns its rewards."""

    def __init__(
        self,
        url: str | None = None,
        *,
        timeout_s: float = 60.0,
        retries: int = 3,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
        auth_env: Optional[str] = None,
        ca_bundle: Optional[str] = None,
        backoff_s: float = 0.5,
        max_backoff_s: float = 8.0,
        max_in_flight: int = 2,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        """``url``: http(s) endpoint; ``timeout_s`` bounds each attempt; ``retries`` after the first failed one.

        ``max_response_bytes`` caps the reply; ``auth_env`` names the environment variable holding a bearer token;
        ``ca_bundle`` is a CA file for https; ``max_in_flight`` bounds the concurrent :meth:`submit` requests.
        """
        if not url:
            raise ValueError("reward 'remote' needs a server URL (reward.url)")
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"reward 'remote': url must be http(s)://host[:port]/path, got {url!r}")
        if parsed.username is not None or parsed.password is not None:
            raise ValueError("reward 'remote': the url must not hold credentials; "
                             "put a bearer token in an environment variable and name it in reward.auth_env")
        if timeout_s <= 0 or retries < 0 or backoff_s < 0 or max_backoff_s < 0:
            raise ValueError("reward 'remote': timeout_s must be > 0 and retries, backoff_s, max_backoff_s >= 0")
        if max_response_bytes <= 0 or max_in_flight < 1:
            raise ValueError("reward 'remote': max_response_bytes must be > 0 and max_in_flight >= 1")
        self.url = url
        self.timeout_s = float(timeout_s)
        self.retries = int(retries)
        self.max_response_bytes = int(max_response_bytes)
        self.backoff_s = float(backoff_s)
        self.max_backoff_s = float(max_backoff_s)
        self.max_in_flight = int(max_in_flight)
        self._sleep = sleep
        headers = {"Content-Type": "application/json", "Accept": "application/json", "Accept-Encoding": "identity"}
        self._secrets: tuple[str, ...] = ()
        """What no message may show: the bearer token (a server may echo the request's headers in its error)."""
        if auth_env:
            token = os.environ.get(auth_env, "").strip()
            if not token:
                raise ValueError(f"reward 'remote': reward.auth_env names the environment variable {auth_env}, "
                                 "which is unset or empty")
            headers["Authorization"] = f"Bearer {token}"
            self._secrets = (token,)
        loopback = _is_loopback(parsed.hostname)
        if parsed.scheme == "http" and not loopback:
            self._warn_plain_http(parsed, bool(auth_env))
        ssl_context = self._ssl_context(ca_bundle, parsed.scheme)
        self._deadline = _Deadline()
        pool_options = dict(ssl_context=ssl_context, max_connections=self.max_in_flight + 2,
                            max_keepalive_connections=self.max_in_flight + 2, keepalive_expiry=5.0,
                            network_backend=_DeadlineBackend(self._deadline))
        # Loopback servers are reached directly even when the environment names an HTTP proxy.
        proxy = None if loopback else self._environment_proxy(parsed)
        pool = httpcore.HTTPProxy(proxy_url=proxy, **pool_options) if proxy else httpcore.ConnectionPool(**pool_options)
        self._client = httpx.Client(transport=_DeadlineTransport(pool), headers=headers, follow_redirects=False,
                                    timeout=httpx.Timeout(self.timeout_s), trust_env=False)
        self._executor: Optional[ThreadPoolExecutor] = None
        self._lock = threading.Lock()

    # ---- construction helpers

    @staticmethod
    def _ssl_context(ca_bundle: Optional[str], scheme: str) -> Optional[ssl.SSLContext]:
        if not ca_bundle:
            return httpx.create_ssl_context() if scheme == "https" else None
        if scheme != "https":
            raise ValueError("reward 'remote': reward.ca_bundle verifies https servers, but reward.url is http")
        if not os.path.isfile(ca_bundle):
            raise ValueError(f"reward 'remote': reward.ca_bundle: no such file: {ca_bundle}")
        try:
            return ssl.create_default_context(cafile=ca_bundle)
        except (ssl.SSLError, OSError) as exc:
            message = f"reward 'remote': reward.ca_bundle {ca_bundle} is not a CA file: {_one_line(exc)}"
            raise ValueError(message) from None

    @staticmethod
    def _environment_proxy(parsed: urllib.parse.SplitResult) -> Optional[str]:
        proxy = urllib.request.getproxies().get(parsed.scheme)
        if not proxy or urllib.request.proxy_bypass(parsed.hostname):
            return None
        if urllib.parse.urlsplit(proxy).scheme != "http":
            raise ValueError(f"reward 'remote': only http:// proxies are supported, the environment names {proxy!r} "
                             f"(set NO_PROXY={parsed.hostname} to connect directly)")
        return proxy

    @staticmethod
    def _warn_plain_http(parsed: urllib.parse.SplitResult, token: bool) -> None:
        key = (parsed.hostname, parsed.port)
        with _WARN_LOCK:
            if key in _WARNED_PLAIN_HTTP:
                return
            _WARNED_PLAIN_HTTP.add(key)
        what = "the images and the bearer token" if token else "the images"
        warnings.warn(f"reward 'remote': {parsed.scheme}://{parsed.netloc} is plain HTTP to a non-loopback host; "
                      f"{what} travel unencrypted (use https)", RuntimeWarning, stacklevel=3)

    # ---- one request

    def _attempt(self, body: bytes) -> bytes:
        """One POST within ``timeout_s``; the reply body, or _Retry / RewardError."""
        self._deadline.at, self._deadline.budget_s = time.monotonic() + self.timeout_s, self.timeout_s
        try:
            with self._client.stream("POST", self.url, content=body) as response:
                status = response.status_code
                if 300 <= status < 400:
                    target = response.headers.get("Location", "?")
                    raise RewardError(f"reward server {self.url} redirected the request (HTTP {status} to {target}); "
                                      "redirects are not followed: set reward.url to the final address")
                if status != 200:
                    detail = f"HTTP {status} {response.reason_phrase}{_error_detail(response, self._secrets)}"
                    if status in _RETRY_STATUS:
                        raise _Retry(detail)
                    raise RewardError(f"reward server {self.url} refused the request: {detail}")
                return self._read_limited(response)
        except httpx.TimeoutException as exc:
            raise _Retry(f"{type(exc).__name__}: timed out after {self.timeout_s:g} s (reward.timeout_s)") from None
        except (httpx.TransportError, OSError) as exc:  # connection refused or reset, protocol errors, TLS
            cert_error = _certificate_error(exc)
            if cert_error is not None:  # the same certificate fails again: not worth a retry
                raise RewardError(f"reward server {self.url} failed TLS verification: {_one_line(cert_error)} "
                                  "(reward.ca_bundle names the CA file that signed its certificate)") from None
            raise _Retry(_one_line(exc)) from None
        finally:
            self._deadline.at = None

    def _too_large(self, size: str) -> RewardError:
        return RewardError(f"reward server {self.url} sent a reply of {size}, more than "
                           f"reward.max_response_bytes = {self.max_response_bytes}")

    def _read_limited(self, response: httpx.Response) -> bytes:
        declared = response.headers.get("Content-Length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_response_bytes:
            raise self._too_large(f"{int(declared)} bytes")
        chunks, size = [], 0
        for chunk in response.iter_bytes():
            size += len(chunk)
            if size > self.max_response_bytes:
                raise self._too_large(f"over {self.max_response_bytes} bytes")
            if time.monotonic() > (self._deadline.at or float("inf")):
                raise httpx.ReadTimeout("deadline passed")
            chunks.append(chunk)
        return b"".join(chunks)

    def _request(self, body: bytes) -> bytes:
        """POST with retries; RewardError when every attempt fails or the server refuses the request."""
        attempts = self.retries + 1
        for attempt in range(attempts):
            try:
                return self._attempt(body)
            except _Retry as exc:
                error = str(exc)
            if attempt + 1 < attempts:
                self._sleep(min(self.max_backoff_s, self.backoff_s * 2**attempt))
        raise RewardError(f"reward server {self.url} unreachable after {attempts} attempts: {error}")

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
        values = torch.tensor(rewards, dtype=torch.float32)
        # Python's JSON reader takes NaN and Infinity, and a number beyond float32's range becomes inf here.
        bad = int((~torch.isfinite(values)).sum())
        if bad:
            raise RewardError(f"reward server {self.url} returned {bad} non-finite values (NaN, inf or beyond "
                              f"float32) among {batch_size} rewards")
        return values

    def _score(self, pixels: np.ndarray, prompts: List[str]) -> Tensor:
        body = json.dumps({"images": _encode_uint8(pixels), "prompts": prompts}).encode("utf-8")
        try:
            return self._parse(self._request(body), len(pixels))
        except RewardError as err:
            # Every error leaves through here: the token never reaches a log line or torchrun's error file.
            redacted = redact(str(err), self._secrets)
            if redacted == str(err):
                raise
            raise RewardError(redacted) from None

    # ---- the reward API

    def __call__(self, images: Tensor, prompts: List[str]) -> Tensor:
        """Rewards (B,) float32 for images (B, 3, H, W) in [0, 1] and their prompts, scored by the server."""
        return self._score(images_to_uint8(images), list(prompts))

    def submit(self, images: Tensor, prompts: Sequence[str]) -> "Future[Tensor]":
        """Score in the background: a Future of the checked (B,) float32 rewards, or of a RewardError.

        The inputs are checked and the images copied (quantised to uint8 on the CPU) before this returns, so the
        caller may reuse their memory at once; at most ``max_in_flight`` requests run at a time, more wait.
        """
        check_reward_inputs(images, prompts)
        pixels, prompts = images_to_uint8(images), list(prompts)
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self.max_in_flight, thread_name_prefix="remote-reward")
            executor = self._executor
        return executor.submit(lambda: check_reward_output("remote", self._score(pixels, prompts), len(pixels)))

    def close(self) -> None:
        """Wait for submitted requests, then close the connections."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)
        self._client.close()

    def __enter__(self) -> "RemoteReward":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
