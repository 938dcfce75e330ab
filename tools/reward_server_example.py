"""A minimal reward server for the ``remote`` reward, serving a local reward (JPEG size by default).

It speaks the protocol of :mod:`leangrpo_mcore.rl.rewards.remote` (POST JSON ``{"images": [base64 PNG],
"prompts": [...]}`` -> ``{"rewards": [...]}``), listens on 127.0.0.1 only, and bounds its work: request bodies
over ``--max-body-mb`` are refused (413), batches over ``--max-images`` too (400), a stalled client is dropped
after ``--client-timeout-s``, and with ``--max-requests N`` it exits after N requests. Use it to test a training
setup, or as the template of a real server (replace the scoring function with PickScore, HPS, ...)::

    python tools/reward_server_example.py --port 8765
    leangrpo-train --config ... reward.name=remote reward.url=http://127.0.0.1:8765/
"""

from __future__ import annotations

import argparse
import json
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Callable, List, Optional, Sequence

import torch

from leangrpo_mcore.rl.rewards import build_reward
from leangrpo_mcore.rl.rewards.remote import decode_png_base64

HOST = "127.0.0.1"
ScoreFn = Callable[[torch.Tensor, List[str]], torch.Tensor]


def make_handler(score: ScoreFn, *, max_body_bytes: int, max_images: int, client_timeout_s: float) -> type:
    """A request handler class that scores POSTed batches with ``score(images (B,3,H,W) [0,1], prompts)``."""

    class RewardHandler(BaseHTTPRequestHandler):
        timeout = client_timeout_s

        def _reply(self, status: int, payload: dict) -> None:
            body = json.dumps(payload).encode("utf-8")
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _batch(self) -> tuple[torch.Tensor, List[str]]:
            length = int(self.headers.get("Content-Length") or 0)
            if length <= 0 or length > max_body_bytes:
                raise OverflowError(f"body must be 1..{max_body_bytes} bytes, got {length}")
            request = json.loads(self.rfile.read(length).decode("utf-8"))
            images, prompts = request.get("images"), request.get("prompts")
            if not isinstance(images, list) or not isinstance(prompts, list) or len(images) != len(prompts):
                raise ValueError("needs 'images' and 'prompts' lists of equal length")
            if len(images) > max_images:
                raise ValueError(f"at most {max_images} images per request, got {len(images)}")
            pixels = torch.from_numpy(decode_png_base64(images)).permute(0, 3, 1, 2).float() / 255.0
            return pixels, [str(p) for p in prompts]

        def do_POST(self) -> None:  # noqa: N802 -- http.server's naming
            try:
                images, prompts = self._batch()
            except OverflowError as exc:
                self._reply(413, {"error": str(exc)})
                return
            except (ValueError, UnicodeDecodeError) as exc:
                self._reply(400, {"error": str(exc)})
                return
            try:
                rewards = [float(r) for r in score(images, prompts)]
            except Exception as exc:  # noqa: BLE001 -- a scoring failure is the server's error, reported as 500
                self._reply(500, {"error": f"{type(exc).__name__}: {exc}"})
                return
            self._reply(200, {"rewards": rewards})

        def log_message(self, format: str, *args: object) -> None:
            return

    return RewardHandler


def make_server(
    port: int = 0,
    *,
    reward: str = "jpeg_compressibility",
    max_body_bytes: int = 64 << 20,
    max_images: int = 256,
    client_timeout_s: float = 30.0,
    handler: Optional[type] = None,
) -> HTTPServer:
    """An HTTPServer on 127.0.0.1:``port`` (0 = a free port, see ``server.server_port``) serving ``reward``."""
    handler = handler or make_handler(
        build_reward(reward), max_body_bytes=max_body_bytes, max_images=max_images, client_timeout_s=client_timeout_s
    )
    return HTTPServer((HOST, port), handler)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Serve until interrupted (or for ``--max-requests`` requests)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8765, help="port on 127.0.0.1 (0 = any free port)")
    parser.add_argument("--reward", default="jpeg_compressibility", help="registered reward to serve")
    parser.add_argument("--max-body-mb", type=float, default=64.0, help="largest accepted request body")
    parser.add_argument("--max-images", type=int, default=256, help="largest accepted batch")
    parser.add_argument("--client-timeout-s", type=float, default=30.0, help="drop clients idle this long")
    parser.add_argument("--max-requests", type=int, default=0, help="exit after this many requests (0 = never)")
    args = parser.parse_args(argv)
    server = make_server(
        args.port, reward=args.reward, max_body_bytes=int(args.max_body_mb * (1 << 20)),
        max_images=args.max_images, client_timeout_s=args.client_timeout_s,
    )
    print(f"serving reward '{args.reward}' on http://{HOST}:{server.server_port}/", flush=True)
    try:
        if args.max_requests > 0:
            for _ in range(args.max_requests):
                server.handle_request()
        else:
            server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
