import contextlib
import importlib.util
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest
import torch

from leangrpo_mcore.rl.rewards import RewardError, available_rewards, build_reward
from leangrpo_mcore.rl.rewards.remote import decode_png_base64, encode_png_base64

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["a cat", "a dog", "the sea"]


def _server_tool():
    spec = importlib.util.spec_from_file_location("reward_server_example", ROOT / "tools" / "reward_server_example.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TOOL = _server_tool()


def _images():
    gen = torch.Generator().manual_seed(0)
    smooth = torch.linspace(0, 1, 32).view(1, 1, 1, 32).expand(1, 3, 32, 32)
    return torch.cat([torch.rand(2, 3, 32, 32, generator=gen), smooth])


@contextlib.contextmanager
def _serving(server):
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/score"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _reply_handler(payloads, calls):
    """A handler answering request k with payloads[min(k, last)]: (status, raw body bytes)."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            status, body = payloads[min(len(calls), len(payloads) - 1)]
            calls.append(status)
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            return

    return Handler


def _remote(url, sleeps, **options):
    return build_reward("remote", url=url, timeout_s=5.0, sleep=sleeps.append, **options)


def test_png_protocol_round_trip_is_lossless_after_quantisation():
    images = _images()
    decoded = decode_png_base64(encode_png_base64(images))
    assert decoded.shape == (3, 32, 32, 3) and decoded.dtype.name == "uint8"
    assert torch.equal(torch.from_numpy(decoded).permute(0, 3, 1, 2), (images * 255).round().to(torch.uint8))
    with pytest.raises(ValueError, match="image 0 is not a base64 PNG"):
        decode_png_base64(["@@@"])


def test_remote_equals_local_jpeg_reward():
    assert "remote" in available_rewards()
    images = _images()
    with _serving(TOOL.make_server(0)) as url:
        remote = _remote(url, [], retries=0)(images, PROMPTS)
    local = build_reward("jpeg_compressibility")(images, PROMPTS)
    assert remote.dtype == torch.float32 and torch.equal(remote, local)
    assert local[2] > local[0]  # the smooth image compresses better than noise


def test_unreachable_server_retries_with_backoff_then_names_the_url():
    url = f"http://127.0.0.1:{_free_port()}/score"
    sleeps = []
    with pytest.raises(RewardError, match=f"reward server {url} unreachable after 4 attempts: ") as info:
        _remote(url, sleeps, retries=3, backoff_s=0.25, max_backoff_s=0.6)(_images(), PROMPTS)
    assert "\n" not in str(info.value)
    assert sleeps == [0.25, 0.5, 0.6]  # exponential, capped


def test_retry_then_success():
    calls = []

    class Flaky(TOOL.make_handler(build_reward("jpeg_compressibility"), max_body_bytes=1 << 20, max_images=8,
                                  client_timeout_s=5)):
        def do_POST(self):  # noqa: N802
            calls.append(1)
            if len(calls) <= 2:
                self.rfile.read(int(self.headers["Content-Length"]))
                self._reply(503, {"error": "warming up"})
                return
            super().do_POST()

    sleeps = []
    images = _images()
    with _serving(TOOL.make_server(0, handler=Flaky)) as url:
        rewards = _remote(url, sleeps, retries=2, backoff_s=0.1)(images, PROMPTS)
    assert len(calls) == 3 and sleeps == [0.1, 0.2]
    assert torch.equal(rewards, build_reward("jpeg_compressibility")(images, PROMPTS))


@pytest.mark.parametrize(
    "body, message",
    [
        (b"<html>oops</html>", "returned a malformed reply \\(not JSON\\)"),
        (b'{"scores": [1, 2, 3]}', "returned a malformed reply \\(needs"),
        (b'{"rewards": [1, "2", 3]}', "returned a malformed reply \\(needs"),
        (b'{"rewards": [1.0, 2.0]}', "returned 2 rewards for 3 images"),
    ],
)
def test_malformed_replies_fail_at_once(body, message):
    calls, sleeps = [], []
    server = TOOL.make_server(0, handler=_reply_handler([(200, body)], calls))
    with _serving(server) as url:
        with pytest.raises(RewardError, match=f"reward server {url} {message}"):
            _remote(url, sleeps, retries=3)(_images(), PROMPTS)
    assert calls == [200] and sleeps == []


def test_client_errors_are_not_retried_and_nan_is_caught():
    calls = []
    server = TOOL.make_server(0, handler=_reply_handler([(400, b"{}")], calls))
    with _serving(server) as url:
        with pytest.raises(RewardError, match="refused the request: HTTP 400"):
            _remote(url, [], retries=3)(_images(), PROMPTS)
    assert calls == [400]
    server = TOOL.make_server(0, handler=_reply_handler([(200, b'{"rewards": [1.0, NaN, 2.0]}')], []))
    with _serving(server) as url:
        with pytest.raises(RewardError, match="reward 'remote' returned 1 non-finite values"):
            _remote(url, [], retries=0)(_images(), PROMPTS)


def test_timeout_counts_as_a_failed_attempt():
    class Slow(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            time.sleep(0.6)

        def log_message(self, *args):
            return

    with _serving(TOOL.make_server(0, handler=Slow)) as url:
        remote = build_reward("remote", url=url, timeout_s=0.2, retries=0)
        with pytest.raises(RewardError, match="unreachable after 1 attempts: .*timed out"):
            remote(_images(), PROMPTS)


def test_example_server_bounds_and_options():
    with _serving(TOOL.make_server(0, max_body_bytes=200, max_images=2)) as url:
        def post(payload):
            request = urllib.request.Request(url, data=json.dumps(payload).encode(), method="POST")
            opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
            with pytest.raises(urllib.error.HTTPError) as info:
                opener.open(request, timeout=5)
            return info.value.code

        assert post({"images": ["x" * 300], "prompts": ["a"]}) == 413
        assert post({"images": ["a", "b", "c"], "prompts": ["a", "b", "c"]}) == 400
        assert post({"images": ["a"], "prompts": []}) == 400
    with pytest.raises(ValueError, match="needs a server URL"):
        build_reward("remote")
    with pytest.raises(ValueError, match="url must be http"):
        build_reward("remote", url="ftp://example.org/score")
