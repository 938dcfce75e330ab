"""A minimal reward server for the ``remote`` reward, serving a local reward (JPEG size by default).

It speaks the protocol of :mod:`leangrpo_mcore.rl.rewards.remote` (POST JSON ``{"images": [base64 PNG],
"prompts": [...]}`` -> ``{"rewards": [...]}``) over HTTP/1.1 with keep-alive, one thread per connection, and
bounds its work: request bodies over ``--max-body-mb`` are refused (413, 411 without a Content-Length), batches
over ``--max-images`` too (400), and so are batches of more than ``--max-pixels`` pixels in all (413), judged from
the PNG headers before any image is decoded; at most ``--max-concurrent`` batches are decoded and scored at once;
a stalled client is dropped after ``--client-timeout-s``; with ``--max-requests N`` it exits after N requests;
``--delay-s`` adds that many seconds to the scoring of every batch (a stand-in for a slow reward model).
It listens on ``--host`` (127.0.0.1 by default; it has no TLS or authentication of its own, so put a TLS proxy in
front of it before exposing it). Use it to test a training setup, or as the template of a real server (replace
the scoring function with PickScore, HPS, ...)::

    python tools/reward_server_example.py --port 8765
    leangrpo-train --config ... reward.name=remote reward.url=http://127.0.0.1:8765/
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, List, Optional, Sequence

import torch

from leangrpo_mcore.rl.rewards import build_reward
from leangrpo_mcore.rl.rewards.remote import PixelLimitError, decode_png_base64

HOST = "127.0.0.1"
DEFAULT_MAX_PIXELS = 1 << 25
"""Pixels per request: 32 images of 1024x1024 (about 400 MB as float32 RGB)."""
ScoreFn = Callable[[torch.Tensor, List[str]], torch.Tensor]


class _Refused(Exception):
    def __init__(self, status: int, message: str, *, unread_body: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.unread_body = unread_body


def make_handler(
    score: ScoreFn,
    *,
    max_body_bytes: int,
    max_images: int,
    client_timeout_s: float,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    max_concurrent: int = 2,
    delay_s: float = 0.0,
) -> type:
    """A request handler class that scores POSTed batches with ``score(images (B,3,H,W) [0,1], prompts)``;
    ``delay_s`` seconds are added to each batch's scoring (while it holds one of the ``max_concurrent`` slots)."""
    working = threading.BoundedSemaphore(max_concurrent)

    class RewardHandler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: a client reuses its connection
        timeout = client_timeout_s

        def _reply(self, status: int, payload: dict) -> None:
            body = json.dumps(payload).encode("utf-8")
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(body)

        def _body(self) -> bytes:
            if "chunked" in self.headers.get("Transfer-Encoding", "").lower() or "Content-Length" not in self.headers:
                raise _Refused(411, "needs a Content-Length header", unread_body=True)
            try:
                length = int(self.headers["Content-Length"])
            except ValueError:
                raise _Refused(400, "bad Content-Length header", unread_body=True) from None
            if length <= 0 or length > max_body_bytes:
                raise _Refused(413, f"body must be 1..{max_body_bytes} bytes, got {length}", unread_body=True)
            return self.rfile.read(length)

        def _batch(self, body: bytes) -> tuple[torch.Tensor, List[str]]:
            request = json.loads(body.decode("utf-8"))
            if not isinstance(request, dict):
                raise ValueError("needs a JSON object")
            images, prompts = request.get("images"), request.get("prompts")
            if not isinstance(images, list) or not isinstance(prompts, list) or len(images) != len(prompts):
                raise ValueError("needs 'images' and 'prompts' lists of equal length")
            if len(images) > max_images:
                raise ValueError(f"at most {max_images} images per request, got {len(images)}")
            if not all(isinstance(image, str) for image in images):
                raise ValueError("images must be base64 strings")
            pixels = torch.from_numpy(decode_png_base64(images, max_pixels=max_pixels)).permute(0, 3, 1, 2)
            return pixels.float() / 255.0, [str(p) for p in prompts]

        def _score(self) -> dict:
            body = self._body()
            with working:
                try:
                    images, prompts = self._batch(body)
                except PixelLimitError as exc:
                    raise _Refused(413, f"{exc} (--max-pixels)") from None
                except (ValueError, UnicodeDecodeError) as exc:
                    raise _Refused(400, str(exc)) from None
                try:
                    rewards = {"rewards": [float(r) for r in score(images, prompts)]}
                    if delay_s > 0:
                        time.sleep(delay_s)
                    return rewards
                except Exception as exc:  # noqa: BLE001 -- a scoring failure is the server's error, reported as 500
                    raise _Refused(500, f"{type(exc).__name__}: {exc}") from None

        def do_POST(self) -> None:  # noqa: N802 -- http.server's naming
            try:
                status, payload = 200, self._score()
            except _Refused as exc:
                status, payload = exc.status, {"error": str(exc)}
                if exc.unread_body:  # the rest of the stream is that body, not a next request
                    self.close_connection = True
            self._reply(status, payload)
            self.server.count_request()

        def log_message(self, format: str, *args: object) -> None:
            return

    return RewardHandler


class RewardServer(ThreadingHTTPServer):
    """A threading HTTP server that can stop itself after ``max_requests`` requests (0 = never)."""

    daemon_threads = True
    block_on_close = False

    def __init__(self, address: tuple, handler: type, *, max_requests: int = 0) -> None:
        super().__init__(address, handler)
        self.max_requests = max_requests
        self.requests_served = 0
        self._count_lock = threading.Lock()

    def count_request(self) -> None:
        with self._count_lock:
            self.requests_served += 1
            done = self.max_requests > 0 and self.requests_served == self.max_requests
        if done:
            threading.Thread(target=self.shutdown, daemon=True).start()


def make_server(
    port: int = 0,
    *,
    host: str = HOST,
    reward: str = "jpeg_compressibility",
    max_body_bytes: int = 64 << 20,
    max_images: int = 256,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    max_concurrent: int = 2,
    client_timeout_s: float = 30.0,
    max_requests: int = 0,
    delay_s: float = 0.0,
    handler: Optional[type] = None,
) -> RewardServer:
    """A threading server on ``host``:``port`` (0 = a free port, see ``server.server_port``) serving ``reward``."""
    handler = handler or make_handler(
        build_reward(reward), max_body_bytes=max_body_bytes, max_images=max_images, client_timeout_s=client_timeout_s,
        max_pixels=max_pixels, max_concurrent=max_concurrent, delay_s=delay_s,
    )
    server_class = RewardServer
    if ":" in host:  # an IPv6 address such as ::1
        server_class = type("RewardServer6", (RewardServer,), {"address_family": socket.AF_INET6})
    return server_class((host, port), handler, max_requests=max_requests)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Serve until interrupted (or for ``--max-requests`` requests)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default=HOST, help="address to listen on (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8765, help="port (0 = any free port)")
    parser.add_argument("--reward", default="jpeg_compressibility", help="registered reward to serve")
    parser.add_argument("--max-body-mb", type=float, default=64.0, help="largest accepted request body")
    parser.add_argument("--max-images", type=int, default=256, help="largest accepted batch")
    parser.add_argument("--max-pixels", type=int, default=DEFAULT_MAX_PIXELS,
                        help="most pixels per request, all images together, checked before decoding")
    parser.add_argument("--max-concurrent", type=int, default=2, help="batches decoded and scored at once")
    parser.add_argument("--client-timeout-s", type=float, default=30.0, help="drop clients idle this long")
    parser.add_argument("--max-requests", type=int, default=0, help="exit after this many requests (0 = never)")
    parser.add_argument("--delay-s", type=float, default=0.0,
                        help="seconds added to every batch's scoring: a slow reward model, for benchmarks")
    args = parser.parse_args(argv)
    if args.max_pixels < 1 or args.max_concurrent < 1 or args.max_images < 1 or not args.max_body_mb > 0:
        parser.error("--max-pixels, --max-concurrent, --max-images and --max-body-mb must be positive")
    if not 0 <= args.delay_s < float("inf"):
        parser.error("--delay-s must be a finite number >= 0")
    server = make_server(
        args.port, host=args.host, reward=args.reward, max_body_bytes=int(args.max_body_mb * (1 << 20)),
        max_images=args.max_images, max_pixels=args.max_pixels, max_concurrent=args.max_concurrent,
        client_timeout_s=args.client_timeout_s, max_requests=args.max_requests, delay_s=args.delay_s,
    )
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"serving reward '{args.reward}' on http://{host}:{server.server_port}/", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
