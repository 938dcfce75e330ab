import base64
import contextlib
import importlib.util
import json
import resource
import shutil
import socket
import socketserver
import ssl
import struct
import subprocess
import threading
import time
import urllib.error
import urllib.request
import warnings
import zlib
from concurrent.futures import Future
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import httpx
import pytest
import torch

from leangrpo_mcore.rl.rewards import RemoteReward, RewardError, available_rewards, build_reward
from leangrpo_mcore.rl.rewards import remote as remote_module
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
        yield f"http://127.0.0.1:{server.server_address[1]}/score"
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
    for body, bad in ((b'{"rewards": [1.0, NaN, 2.0]}', 1), (b'{"rewards": [Infinity, 1e39, 2.0]}', 2)):
        server = TOOL.make_server(0, handler=_reply_handler([(200, body)], []))
        with _serving(server) as url:
            with pytest.raises(RewardError) as error:
                _remote(url, [], retries=0)(_images(), PROMPTS)
        assert str(error.value) == (f"reward server {url} returned {bad} non-finite values (NaN, inf or beyond "
                                    "float32) among 3 rewards")


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


# ------------------------------------------------------------------------- hardened client: real local servers


class _RawServer(socketserver.ThreadingTCPServer):
    allow_reuse_address = True
    daemon_threads = True
    block_on_close = False


@contextlib.contextmanager
def _raw_serving(respond):
    """A TCP server on 127.0.0.1 that reads one HTTP request per connection, then calls respond(wfile, log)."""
    log = {"connections": 0, "requests": 0, "sent": 0, "done": threading.Event()}

    class Handler(socketserver.StreamRequestHandler):
        def handle(self):
            log["connections"] += 1
            try:
                length = 0
                while (line := self.rfile.readline()) not in (b"\r\n", b""):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                self.rfile.read(length)
                log["requests"] += 1
                respond(self.wfile, log)
            except OSError:
                pass  # the client went away
            finally:
                log["done"].set()

    server = _RawServer(("127.0.0.1", 0), Handler)
    with _serving(server) as url:
        yield url, log


def _trickle_body(wfile, log):
    wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n")
    for _ in range(200):
        wfile.write(b" ")
        wfile.flush()
        time.sleep(0.05)


def _trickle_headers(wfile, log):
    for byte in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 200:
        wfile.write(bytes([byte]))
        wfile.flush()
        time.sleep(0.05)


@pytest.mark.parametrize("respond", [_trickle_body, _trickle_headers], ids=["body", "headers"])
def test_timeout_bounds_the_whole_request_against_a_trickling_server(respond):
    with _raw_serving(respond) as (url, log):
        remote = build_reward("remote", url=url, timeout_s=0.5, retries=0)
        start = time.monotonic()
        with pytest.raises(RewardError, match="unreachable after 1 attempts: ReadTimeout: timed out after 0.5 s"):
            remote(_images(), PROMPTS)
        elapsed = time.monotonic() - start
    assert elapsed < 0.5 + 0.4  # each byte arrives well within 0.5 s: a per-read timeout would wait ~10 s


def _declared_huge(wfile, log):
    wfile.write(b"HTTP/1.1 200 OK\r\nContent-Length: 314572800\r\n\r\n" + b"{" * 1024)
    wfile.flush()
    time.sleep(1.0)


def _endless(wfile, log):
    wfile.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n")
    chunk = b"7" * (64 << 10)
    for _ in range(1024):  # 64 MiB at most
        wfile.write(chunk)
        log["sent"] += len(chunk)


def test_oversized_reply_fails_without_being_read():
    with _raw_serving(_declared_huge) as (url, log):
        start = time.monotonic()
        with pytest.raises(RewardError, match=f"reward server {url} sent a reply of 314572800 bytes, more than "
                                              "reward.max_response_bytes = 65536"):
            _remote(url, [], retries=2, max_response_bytes=65536)(_images(), PROMPTS)
        assert time.monotonic() - start < 0.8 and log["requests"] == 1  # at once, not retried
    with _raw_serving(_endless) as (url, log):
        with pytest.raises(RewardError, match="sent a reply of over 65536 bytes, more than reward.max_response_bytes"):
            _remote(url, [], retries=2, max_response_bytes=65536)(_images(), PROMPTS)
        assert log["done"].wait(5)
    assert log["requests"] == 1 and log["sent"] < (24 << 20)  # the client hung up long before 64 MiB


def test_redirects_are_refused():
    other_calls = []
    target = TOOL.make_server(0, handler=_reply_handler([(200, b'{"rewards": [1, 2, 3]}')], other_calls))
    with _serving(target) as other:
        def redirect(wfile, log):
            wfile.write(f"HTTP/1.1 307 Temporary Redirect\r\nLocation: {other}\r\nContent-Length: 0\r\n\r\n".encode())

        with _raw_serving(redirect) as (url, log):
            with pytest.raises(RewardError, match=f"redirected the request \\(HTTP 307 to {other}\\); redirects are "
                                                  "not followed"):
                _remote(url, [], retries=2)(_images(), PROMPTS)
    assert log["requests"] == 1 and other_calls == []


class _Recording(BaseHTTPRequestHandler):
    """Records (connection id, Authorization header) per request and answers three rewards, over keep-alive."""

    protocol_version = "HTTP/1.1"
    seen: list = []

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers["Content-Length"]))
        self.seen.append((id(self.connection), self.headers.get("Authorization")))
        status, body = (401, b'{"error": "bad token"}') if self.path == "/deny" else (200, b'{"rewards": [1, 2, 3]}')
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        return


def test_bearer_token_comes_from_the_named_environment_variable(monkeypatch):
    seen = []
    handler = type("Handler", (_Recording,), {"seen": seen})
    monkeypatch.setenv("LEANGRPO_TEST_REWARD_TOKEN", "s3cret-token")
    with _serving(TOOL.make_server(0, handler=handler)) as url:
        assert _remote(url, [], auth_env="LEANGRPO_TEST_REWARD_TOKEN")(_images(), PROMPTS).tolist() == [1, 2, 3]
        deny = url.replace("/score", "/deny")
        with pytest.raises(RewardError, match="refused the request: HTTP 401 Unauthorized: bad token") as info:
            _remote(deny, [], auth_env="LEANGRPO_TEST_REWARD_TOKEN")(_images(), PROMPTS)
        assert "s3cret" not in str(info.value)
        _remote(url, [])(_images(), PROMPTS)
    assert [auth for _, auth in seen] == ["Bearer s3cret-token", "Bearer s3cret-token", None]
    monkeypatch.delenv("LEANGRPO_TEST_REWARD_TOKEN")
    with pytest.raises(ValueError, match="environment variable LEANGRPO_TEST_REWARD_TOKEN, which is unset or empty"):
        _remote(url, [], auth_env="LEANGRPO_TEST_REWARD_TOKEN")
    with pytest.raises(ValueError, match="must not hold credentials"):
        _remote("http://user:pw@127.0.0.1:1/score", [])


def test_one_connection_serves_many_requests_and_submit_is_concurrent():
    seen = []
    handler = type("Handler", (_Recording,), {"seen": seen})
    with _serving(TOOL.make_server(0, handler=handler)) as url:
        remote = RemoteReward(url, timeout_s=5.0, retries=0, max_in_flight=2)
        for _ in range(4):
            assert remote(_images(), PROMPTS).tolist() == [1, 2, 3]
        assert len(seen) == 4 and len({conn for conn, _ in seen}) == 1
        futures = [remote.submit(_images(), PROMPTS) for _ in range(6)]
        assert all(isinstance(f, Future) for f in futures)
        assert [f.result(timeout=10).tolist() for f in futures] == [[1, 2, 3]] * 6
        assert len(seen) == 10 and len({conn for conn, _ in seen}) <= 3  # two workers, one pooled connection each
        with pytest.raises(ValueError, match="prompts must be a list of 3 strings"):
            remote.submit(_images(), PROMPTS[:2])  # checked at once, not in the future
        remote.close()


def test_submit_future_carries_the_reward_checks():
    server = TOOL.make_server(0, handler=_reply_handler([(200, b'{"rewards": [1.0, NaN, 2.0]}')], []))
    with _serving(server) as url:
        with RemoteReward(url, timeout_s=5.0, retries=0) as remote:
            future = remote.submit(_images(), PROMPTS)
            with pytest.raises(RewardError, match=f"^reward server {url} returned 1 non-finite values"):
                future.result(timeout=10)


def test_plain_http_to_another_host_warns_once(monkeypatch):
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
    with pytest.warns(RuntimeWarning, match="http://reward-warn.example:8000 is plain HTTP to a non-loopback host"):
        RemoteReward("http://reward-warn.example:8000/score").close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        RemoteReward("http://reward-warn.example:8000/other").close()  # once per host
        RemoteReward("http://127.0.0.1:8000/score").close()  # loopback: no warning
        RemoteReward("https://reward-warn.example/score").close()


def _self_signed(tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"], check=True, capture_output=True)
    return key, cert


def test_ca_bundle_verifies_a_tls_server(tmp_path):
    key, cert = _self_signed(tmp_path)
    server = TOOL.make_server(0, handler=_reply_handler([(200, b'{"rewards": [1, 2, 3]}')], []))
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    with _serving(server) as url:
        url = url.replace("http://", "https://")
        assert _remote(url, [], ca_bundle=str(cert))(_images(), PROMPTS).tolist() == [1, 2, 3]
        sleeps = []
        with pytest.raises(RewardError, match="failed TLS verification: SSLCertVerificationError: .*reward.ca_bundle"):
            _remote(url, sleeps, retries=2)(_images(), PROMPTS)
        assert sleeps == []  # a certificate does not get better on retry
    with pytest.raises(ValueError, match="reward.ca_bundle: no such file"):
        _remote(url, [], ca_bundle=str(tmp_path / "missing.pem"))
    with pytest.raises(ValueError, match="reward.ca_bundle verifies https servers, but reward.url is http"):
        _remote("http://127.0.0.1:1/score", [], ca_bundle=str(cert))


# ----------------------------------------------------------------------------- example server: bounded work


def _png_header_only(width, height):
    """A PNG whose header claims width x height but whose pixel data is a few bytes: cheap to send, huge to decode."""

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")
    return base64.b64encode(png).decode("ascii")


def _post(url, payload, timeout=5.0):
    with httpx.Client(trust_env=False) as client:
        response = client.post(url, json=payload, timeout=timeout)
    return response.status_code, response.json()


def test_example_server_rejects_huge_images_from_their_headers(monkeypatch):
    decoded = []
    monkeypatch.setattr(remote_module.Image, "open", lambda *a, **k: decoded.append(1) or pytest.fail("decoded"))
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with _serving(TOOL.make_server(0)) as url:
        start = time.monotonic()
        status, reply = _post(url, {"images": [_png_header_only(6000, 6000)] * 2, "prompts": ["a", "b"]})
        elapsed = time.monotonic() - start
    assert status == 413 and "2 images of 6000x6000 are 72000000 pixels, more than 33554432" in reply["error"]
    assert decoded == [] and elapsed < 1.0
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 64 << 10  # KiB: far below 72M pixels
    with pytest.raises(remote_module.PixelLimitError, match="1 images of 100x100 are 10000 pixels, more than 9999"):
        decode_png_base64([_png_header_only(100, 100)], max_pixels=9999)


def test_example_server_is_threaded_and_refuses_bodies_without_length():
    with _serving(TOOL.make_server(0)) as url:
        port = int(url.split(":")[2].split("/")[0])
        with socket.create_connection(("127.0.0.1", port)) as stalled:
            stalled.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\n")  # never finishes its headers
            start = time.monotonic()
            assert _remote(url, [], retries=0)(_images(), PROMPTS).shape == (3,)
            assert time.monotonic() - start < 2.0  # served beside the stalled connection
        with socket.create_connection(("127.0.0.1", port), timeout=5) as chunked:
            chunked.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                            b"5\r\nhello\r\n0\r\n\r\n")
            assert chunked.recv(4096).startswith(b"HTTP/1.1 411 ")


def test_example_server_exits_after_max_requests():
    server = TOOL.make_server(0, max_requests=2)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    remote = _remote(f"http://127.0.0.1:{server.server_port}/score", [], retries=0)
    remote(_images(), PROMPTS)
    remote(_images(), PROMPTS)
    thread.join(timeout=5)
    assert not thread.is_alive() and server.requests_served == 2
    server.server_close()
