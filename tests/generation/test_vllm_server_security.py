"""Attacks on `leantune vllm-serve` (issues 27 and 39): each sent from this process to the real server in a
subprocess, most as raw bytes on a socket (no client fixes them up).

One server for the module (`--engine transformers`, the tiny saved Llama, on 127.0.0.1 with a token, small limits);
every test asserts the status code and that the attack had no effect (no file written by injected code, the served
weights unchanged after a refused update, the server still answering, no traceback in its log). The weight update
transaction's failures are in test_weight_transactions.py.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import threading
import time
from urllib.parse import urlparse

import pytest
import torch

from leantune.generation.server_access import TOKEN_ENV
from leantune.generation.vllm_client import VLLMServerClient, VLLMServerError

from ..fixtures.models import tiny_model
from ..fixtures.paths import REPO
from ..fixtures.served import PROMPTS, greedy, local_greedy, perturbed, saved_served_model, wait_for_url

TOKEN = "test-token-6f1c"
MAX_PROMPTS, MAX_NEW_TOKENS, MAX_CONNECTIONS, SOCKET_TIMEOUT, HEAD_TIMEOUT = 8, 16, 3, 2, 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer_dir):
    """test_vllm_server.py's saved model."""
    return saved_served_model(tmp_path_factory.mktemp("served") / "model", tokenizer_dir)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    """The server on a free port with a token and small limits; (base URL, its log path, its process)."""
    log_path = tmp_path_factory.mktemp("secure_server") / "server.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), TOKEN_ENV: TOKEN}
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "leantune.cli.main", "vllm-serve", "--model", str(model_dir), "--engine",
             "transformers", "--port", "0", "--max_prompts", str(MAX_PROMPTS), "--max_new_tokens",
             str(MAX_NEW_TOKENS), "--max_connections", str(MAX_CONNECTIONS), "--socket_timeout", str(SOCKET_TIMEOUT),
             "--head_timeout", str(HEAD_TIMEOUT)],
            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    try:
        url = wait_for_url(log_path, process)
        yield url, log_path, process
        VLLMServerClient(url, token=TOKEN).close_server()
        assert process.wait(timeout=30) == 0
        assert "Traceback" not in log_path.read_text()  # every attack was answered, none crashed a handler
    finally:
        if process.poll() is None:
            process.kill()


def raw(url: str, head: str, body: bytes = b"", timeout: float = 20.0, host: str | None = None) -> tuple[int, bytes]:
    """Send bytes as they are (no client fixes them up; a `Host` line first, the URL's unless `host` is given);
    the answer's status and body (read until it closes)."""
    parts = urlparse(url)
    method_line, _, rest = head.partition("\r\n")
    head = f"{method_line}\r\nHost: {host or parts.netloc}\r\n{rest}"
    with socket.create_connection((parts.hostname, parts.port), timeout=timeout) as sock:
        sock.sendall(head.encode() + body)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, data.partition(b"\r\n\r\n")[2]


def auth() -> str:
    return f"Authorization: Bearer {TOKEN}\r\n"


def checkpoint_state(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir).state_dict()


@pytest.fixture
def client(server, model_dir):
    """A client of the server, which serves the checkpoint's weights again (whatever earlier tests sent)."""
    client = VLLMServerClient(server[0], token=TOKEN)
    client.update_weights(checkpoint_state(model_dir).items())
    return client


# --- code execution from a request --------------------------------------------------------------------------------


def test_custom_generate_from_a_request_is_refused_and_never_runs(server, tmp_path):
    marker = tmp_path / "ran"
    code = tmp_path / "attack" / "custom_generate"
    code.mkdir(parents=True)
    (code / "generate.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n\n"
                                      "def generate(model, *args, **kwargs):\n    return model.generate(*args)\n")
    sampling = {"max_new_tokens": 2, "temperature": 0.0,
                "extra": {"custom_generate": str(tmp_path / "attack"), "trust_remote_code": True}}
    with pytest.raises(VLLMServerError, match=r"HTTP 400.*sampling\.extra\.custom_generate: not a generation option"):
        VLLMServerClient(server[0], token=TOKEN)._call("POST", "/generate", {"prompts": [[1, 415]],
                                                                             "sampling": sampling})
    assert not marker.exists()


def test_generation_options_are_an_allow_list_mapped_per_engine(server, client):
    ask = lambda extra: client._call("POST", "/generate", {  # noqa: E731
        "prompts": [[1, 415, 2936]], "sampling": {"max_new_tokens": 6, "temperature": 0.0, "extra": extra}})
    assert len(ask({"no_repeat_ngram_size": 2})["completions"][0]) == 6  # allowed, and a transformers option
    with pytest.raises(VLLMServerError, match="HTTP 400.*presence_penalty: not supported by the transformers engine"):
        ask({"presence_penalty": 0.5})
    with pytest.raises(VLLMServerError, match=r"HTTP 400.*sampling\.extra\.min_tokens: must be an integer"):
        ask({"min_tokens": "3"})


# --- access -------------------------------------------------------------------------------------------------------


def test_without_the_token_nothing_is_served_and_close_and_updates_do_nothing(server, client, model_dir):
    url, log_path, _ = server
    assert "this machine may connect with the token in $LEANTUNE_VLLM_SERVER_TOKEN" in log_path.read_text()
    before = client.generate(PROMPTS, greedy(6))
    from safetensors.torch import save

    zeros = save({"model.norm.weight": torch.zeros(64)})
    begin = b'{"update_id": "u1"}'
    for head, body in [("GET /health HTTP/1.1\r\n", b""), (json_post("/close", 2), b"{}"),
                       (json_post("/update_weights/begin", len(begin)), begin),
                       (f"POST /update_weights/chunk?update_id=u1 HTTP/1.1\r\nContent-Type: application/octet-stream"
                        f"\r\nContent-Length: {len(zeros)}\r\n", zeros),
                       (json_post("/update_weights/commit", 2), b"{}")]:
        for token_line in ("", "Authorization: Bearer wrong-token\r\n", f"Authorization: Basic {TOKEN}\r\n",
                           f"Authorization: Bearer {TOKEN[:-1]}\r\n"):
            status, answer = raw(url, head + token_line + "Connection: close\r\n\r\n", body)
            assert status == 401 and b"LEANTUNE_VLLM_SERVER_TOKEN" in answer
    assert client.generate(PROMPTS, greedy(6)) == before  # not closed, weights unchanged


def json_post(path: str, length: int) -> str:
    return f"POST {path} HTTP/1.1\r\nContent-Type: application/json\r\nContent-Length: {length}\r\n"


@pytest.mark.parametrize("with_token", [False, True])
def test_a_browser_page_cannot_close_the_server(server, client, with_token):
    """Issue 39's attack: a POST with a foreign Host, a foreign Origin and text/plain (a form a page can send) to
    /close. Each of the three alone is refused too, even with the token."""
    url = server[0]
    token = auth() if with_token else ""
    close = "POST /close HTTP/1.1\r\nContent-Length: 2\r\n"
    attacks = [  # (head after the request line, Host, status)
        (f"{token}Origin: http://evil.example\r\nContent-Type: text/plain\r\n", "evil.example:8000", 403),
        (f"{token}Content-Type: application/json\r\n", "evil.example", 403),  # DNS rebinding: a foreign name
        (f"{token}Content-Type: application/json\r\n", "10.1.2.3", 403),  # another address than loopback
        (f"{token}Origin: http://127.0.0.1:1\r\nContent-Type: application/json\r\n", None, 403),
    ]
    if with_token:  # without the token these get 401 first; with it, the content type still refuses them
        attacks += [(f"{token}Content-Type: text/plain\r\n", None, 415),
                    (f"{token}Content-Type: application/x-www-form-urlencoded\r\n", None, 415),
                    (f"{token}Content-Type: multipart/form-data; boundary=x\r\n", None, 415)]
    else:
        attacks += [("Content-Type: text/plain\r\n", None, 401)]
    for head, host, status in attacks:
        got, answer = raw(url, close + head + "Connection: close\r\n\r\n", b"{}", host=host)
        assert got == status, (head, host, answer)
    assert client.wait_until_up(10)["status"] == "ok"  # still serving
    for host in ("localhost:1234", "[::1]:80", "127.0.0.2"):  # loopback names and addresses, any port (a tunnel)
        assert raw(url, f"GET /health HTTP/1.1\r\n{auth()}Connection: close\r\n\r\n", host=host)[0] == 200


@pytest.mark.quick
def test_a_non_loopback_host_without_a_token_is_refused_at_start(monkeypatch, capsys):
    from leantune.cli.vllm_serve import VLLMServeArguments, run

    assert VLLMServeArguments().host == "127.0.0.1"
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    assert run(["--model", "x", "--engine", "transformers", "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--host 0.0.0.0" in err and TOKEN_ENV in err


# --- framing, memory and stalls -----------------------------------------------------------------------------------


@pytest.mark.parametrize("lengths, status", [
    (["-1"], 400), (["12abc"], 400), (["9" * 5000], 400), (["5", "6"], 400), ([], 411), (["huge"], 413),
    (["2", "chunked"], 400), (["chunked"], 400),
])
def test_a_bad_content_length_is_answered_400_before_any_body_is_read(server, lengths, status):
    """Framing errors (h11: not digits, 5,000 digits, two different lengths; ours: chunked, none, over the limit)
    are answered at once, without a traceback in the log (checked at the module's end)."""
    url = server[0]
    limit = VLLMServerClient(url, token=TOKEN).wait_until_up(10)["max_request_bytes"]
    assert limit < 128 * 2**20  # the tiny model's ~17 MiB plus the margin, below --max_request_mb's 8 GiB
    header = "".join("Transfer-Encoding: chunked\r\n" if value == "chunked" else
                     f"Content-Length: {limit + 1 if value == 'huge' else value}\r\n" for value in lengths)
    # no body is sent: the answer can only come if the server did not wait to read one
    head = f"POST /generate HTTP/1.1\r\n{auth()}Content-Type: application/json\r\n{header}Connection: close\r\n\r\n"
    got, answer = raw(url, head, timeout=10)
    assert got == status, answer
    assert VLLMServerClient(url, token=TOKEN).wait_until_up(10)["status"] == "ok"


def server_threads(process) -> int:
    return int(re.search(r"Threads:\s+(\d+)", open(f"/proc/{process.pid}/status").read()).group(1))


def test_tokenless_connections_trickling_their_heads_hold_no_slot_and_are_closed(server):
    """Issue 39's attack: more tokenless connections than --max_connections, each sending a header byte every
    second. The authenticated /health is served all along; each of them is closed within --head_timeout, however
    it trickles; they take no thread."""
    url, _, process = server
    parts = urlparse(url)
    threads_before = server_threads(process)
    hostile = [socket.create_connection((parts.hostname, parts.port)) for _ in range(4 * MAX_CONNECTIONS)]
    try:
        for sock in hostile:
            sock.sendall(b"GET /health HTTP/1.1\r\nX-Slow: ")
        started = time.monotonic()
        closed_at: dict[int, float] = {}
        while len(closed_at) < len(hostile) and time.monotonic() - started < HEAD_TIMEOUT + 8:
            for index, sock in enumerate(hostile):
                if index not in closed_at:
                    try:
                        sock.sendall(b"a")
                        sock.settimeout(0.01)
                        if sock.recv(1) == b"":
                            closed_at[index] = time.monotonic() - started
                    except TimeoutError:
                        pass
                    except OSError:
                        closed_at[index] = time.monotonic() - started
            status, _ = raw(url, f"GET /health HTTP/1.1\r\n{auth()}Connection: close\r\n\r\n", timeout=5)
            assert status == 200  # served while every hostile connection is open
            assert server_threads(process) <= threads_before  # no thread per connection
            time.sleep(1.0)
        assert len(closed_at) == len(hostile) and max(closed_at.values()) < HEAD_TIMEOUT + 3
    finally:
        for sock in hostile:
            sock.close()


@contextlib.contextmanager
def every_slot_stalled(url: str):
    """MAX_CONNECTIONS connections, each holding a request slot with an authenticated POST whose body never comes
    (until the server drops it after --socket_timeout); yields them, closes them after."""
    parts = urlparse(url)
    stalled = []
    try:
        for _ in range(MAX_CONNECTIONS):
            sock = socket.create_connection((parts.hostname, parts.port))
            sock.sendall(f"POST /generate HTTP/1.1\r\nHost: {parts.netloc}\r\n{auth()}Content-Type: "
                         "application/json\r\nContent-Length: 100\r\n\r\n{".encode())
            stalled.append(sock)
        time.sleep(0.5)
        yield stalled
    finally:
        for sock in stalled:
            sock.close()


def test_authenticated_requests_are_bounded_and_a_stalled_body_times_out(server):
    url = server[0]
    with every_slot_stalled(url) as stalled:
        status, answer = raw(url, f"GET /health HTTP/1.1\r\n{auth()}Connection: close\r\n\r\n")
        assert status == 503 and b"busy" in answer
        started = time.monotonic()
        # the client waits out the 503s; the server drops the stalled bodies after --socket_timeout (408)
        assert VLLMServerClient(url, request_timeout=30, token=TOKEN).wait_until_up(30)["status"] == "ok"
        assert SOCKET_TIMEOUT - 1 < time.monotonic() - started < SOCKET_TIMEOUT + 10
        for sock in stalled:
            sock.settimeout(5)
            assert sock.recv(4096).startswith(b"HTTP/1.1 408")


def test_a_big_body_refused_while_busy_is_sent_again(server):
    """A full house answers 503 before reading a request's body and closes the connection; a client still sending a
    big body (an update's chunk) sees the connection reset, not the 503. Nothing of the request was read, so the
    client sends it again, as after a 503, and gets the server's own answer once a slot is free (here: the update id
    it never began, 409/400), not an unexplained `Connection reset by peer` (seen in bench/server_soak.py with
    vLLM, where a chunk's POST met a full house and the trainer's update failed unnamed)."""
    url = server[0]
    with every_slot_stalled(url):
        big = bytes(16 * 2**20)  # far more than the socket buffers take before the server closes
        with pytest.raises(VLLMServerError) as error:
            VLLMServerClient(url, request_timeout=30, token=TOKEN)._post_bytes(
                "/update_weights/chunk?update_id=never-begun", big)
        assert error.value.status in (400, 404, 409), error.value


@pytest.mark.parametrize("request_json, message", [
    ({"prompts": [[1, 415]] * (MAX_PROMPTS + 1), "sampling": {"max_new_tokens": 2}}, "over the server's limit of 8"),
    ({"prompts": [[1, 415]], "sampling": {"max_new_tokens": MAX_NEW_TOKENS + 1}}, "max_new_tokens: 17 is outside"),
    ({"prompts": [[1, 32000]], "sampling": {"max_new_tokens": 2}}, r"prompts\[0\]: token ids must be integers in"),
    ({"prompts": [[1, 415]], "sampling": {"max_new_tokens": 2, "temperature": "hot"}}, "temperature: must be a"),
    ({"prompts": [[1, 415]], "sampling": {"max_new_tokens": 2}, "extra": {}}, "'prompts' and 'sampling' only"),
])
def test_requests_over_the_limits_are_refused(server, request_json, message):
    with pytest.raises(VLLMServerError, match=f"HTTP 400.*{message}"):
        VLLMServerClient(server[0], token=TOKEN)._call("POST", "/generate", request_json)


# --- weight updates -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk, message", [
    ({"model.norm.weight": torch.full((64,), float("nan")),
      "model.layers.0.mlp.gate_proj.weight": torch.zeros(3, 3)}, "(NaN or infinite|shape)"),
    ({"model.norm.weight": torch.full((64,), float("nan"))}, "model.norm.weight: has NaN"),
    ({"model.norm.weight": torch.ones(64, dtype=torch.int64)}, "dtype int64 does not cast to the model's float32"),
    ({"model.norm.weight": torch.ones(64, dtype=torch.float64)}, "dtype float64 does not cast"),
    ({"model.norm.weight": torch.ones(65)}, r"shape \[65\], the model's is \[64\]"),
    ({"model.no_such.weight": torch.ones(64)}, "not the model's"),
])
def test_a_bad_tensor_refuses_its_update_and_changes_nothing(server, client, chunk, message):
    from safetensors.torch import save

    before = client.generate(PROMPTS, greedy(6))
    client._call("POST", "/update_weights/begin", {"update_id": "bad"})
    with pytest.raises(VLLMServerError, match=f"HTTP 400.*{message}.*the update is discarded"):
        client._post_bytes("/update_weights/chunk?update_id=bad", save(chunk))
    with pytest.raises(VLLMServerError, match="HTTP 409.*not in progress"):  # nothing left to commit
        client._call("POST", "/update_weights/commit", {"update_id": "bad", "names": list(chunk), "count": len(chunk)})
    assert client.generate(PROMPTS, greedy(6)) == before


def test_an_update_applies_whole_or_not_at_all(server, client, model_dir):
    original = local_greedy(tiny_model().eval(), PROMPTS, greedy(6))
    assert client.generate(PROMPTS, greedy(6)) == original
    policy = perturbed(tiny_model(), seed=3).eval()
    moved = local_greedy(policy, PROMPTS, greedy(6))
    assert moved != original
    # good chunks first (1 MiB each), then a NaN one: nothing of the update is applied
    bad = list(policy.state_dict().items()) + [("model.norm.weight", torch.full((64,), float("nan")))]
    with pytest.raises(VLLMServerError, match="NaN"):
        client.update_weights(bad, chunk_bytes=2**20)
    assert client.generate(PROMPTS, greedy(6)) == original
    # the client ended the refused update, so the next one is accepted whole; bfloat16 widens to float32 exactly
    bf16 = {name: tensor.to(torch.bfloat16) for name, tensor in policy.state_dict().items()}
    client.update_weights(bf16.items(), chunk_bytes=2**20)
    policy.load_state_dict({name: tensor.float() for name, tensor in bf16.items()})
    assert client.generate(PROMPTS, greedy(6)) == local_greedy(policy, PROMPTS, greedy(6))


# --- the client's timeout -----------------------------------------------------------------------------------------


def test_the_client_times_out_naming_the_server():
    with socket.socket() as listener:  # accepts, never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        held = []
        threading.Thread(target=lambda: held.append(listener.accept()), daemon=True).start()
        started = time.monotonic()
        with pytest.raises(VLLMServerError, match=re.escape(f"POST {url}/generate: the vLLM server gave no answer "
                                                            "within 1 s (vllm_server_request_timeout)")):
            VLLMServerClient(url, request_timeout=1).generate([[1, 2]], greedy(2))
        assert time.monotonic() - started < 10
        for conn, _ in held:
            conn.close()


def test_the_configs_request_timeout_reaches_the_client(server, monkeypatch):
    from types import SimpleNamespace

    from leantune import GRPOConfig
    from leantune.generation.vllm_client import DEFAULT_REQUEST_TIMEOUT, VLLMServerBackend

    assert GRPOConfig.__dataclass_fields__["vllm_server_request_timeout"].default == DEFAULT_REQUEST_TIMEOUT
    args = SimpleNamespace(vllm_server_base_url=server[0], vllm_server_host="0.0.0.0", vllm_server_port=8000,
                           vllm_server_timeout=30.0, vllm_server_request_timeout=7.0)
    monkeypatch.setenv(TOKEN_ENV, TOKEN)  # the trainer's client reads the token from the variable
    assert VLLMServerBackend(args, tiny_model(), None, accelerator=None).client.request_timeout == 7.0


# --- the client's proxies and deadline ----------------------------------------------------------------------------


def test_the_client_never_sends_loopback_traffic_or_its_token_through_a_proxy(server, monkeypatch):
    """Issue 39: with http_proxy set, loopback requests went to the proxy, the bearer token with them."""
    from leantune.generation.server_transport import goes_direct

    with socket.socket() as proxy:  # a proxy that records whatever reaches it
        proxy.bind(("127.0.0.1", 0))
        proxy.listen()
        proxy.settimeout(0.2)
        with socket.socket() as spare:
            spare.bind(("127.0.0.1", 0))
            dead = spare.getsockname()[1]  # nothing listens there once this closes
        for name in ("no_proxy", "NO_PROXY"):
            monkeypatch.delenv(name, raising=False)
        for address in (f"http://127.0.0.1:{dead}", f"http://127.0.0.1:{proxy.getsockname()[1]}"):
            for name in ("http_proxy", "HTTP_PROXY", "all_proxy"):
                monkeypatch.setenv(name, address)
            client = VLLMServerClient(server[0].replace("127.0.0.1", "localhost"), request_timeout=10, token=TOKEN)
            assert client.wait_until_up(5)["status"] == "ok"
            assert len(client.generate(PROMPTS[:1], greedy(2))) == 1
        with pytest.raises(TimeoutError):
            proxy.accept()  # no connection ever reached the proxy
        monkeypatch.setenv("no_proxy", "trainer-box,.cluster")
        assert goes_direct("http://trainer-box:8000") and goes_direct("http://node3.cluster:8000")
        assert goes_direct("http://[::1]:8000") and not goes_direct("http://other-box:8000")


def test_the_client_gives_up_on_a_trickled_answer_at_its_deadline():
    """A server that answers one byte a second (every single read well within any per-read timeout) is given up
    on at the request's deadline."""
    answer = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 40\r\n\r\n" + b" " * 38 + b"{}"
    stop = threading.Event()

    def trickle(listener):
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            for byte in answer[:60]:
                if stop.wait(1.0):
                    return
                conn.sendall(bytes([byte]))

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        thread = threading.Thread(target=trickle, args=(listener,), daemon=True)
        thread.start()
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        started = time.monotonic()
        try:
            with pytest.raises(VLLMServerError, match="gave no answer within 3 s"):
                VLLMServerClient(url, request_timeout=3, token="t").generate([[1, 2]], greedy(2))
            assert time.monotonic() - started < 6
        finally:
            stop.set()
            thread.join(timeout=5)
