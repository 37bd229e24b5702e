"""Attacks on `leantune vllm-serve` (issue 27): each sent from this process to the real server in a subprocess.

One server for the module (`--engine transformers`, the tiny saved Llama, on 127.0.0.1 with a token, small limits);
every test asserts the status code and that the attack had no effect (no file written by injected code, the served
weights unchanged after a refused update, the server still answering).
"""

from __future__ import annotations

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
MAX_PROMPTS, MAX_NEW_TOKENS, MAX_CONNECTIONS, SOCKET_TIMEOUT = 8, 16, 3, 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer_dir):
    """test_vllm_server.py's saved model."""
    return saved_served_model(tmp_path_factory.mktemp("served") / "model", tokenizer_dir)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    """The server on a free port with a token and small limits; (base URL, its log path)."""
    log_path = tmp_path_factory.mktemp("secure_server") / "server.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), TOKEN_ENV: TOKEN}
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "leantune.cli.main", "vllm-serve", "--model", str(model_dir), "--engine",
             "transformers", "--port", "0", "--max_prompts", str(MAX_PROMPTS), "--max_new_tokens",
             str(MAX_NEW_TOKENS), "--max_connections", str(MAX_CONNECTIONS), "--socket_timeout", str(SOCKET_TIMEOUT)],
            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    old_token = os.environ.get(TOKEN_ENV)
    os.environ[TOKEN_ENV] = TOKEN  # the client reads it
    try:
        url = wait_for_url(log_path, process)
        yield url, log_path
        VLLMServerClient(url).close_server()
        assert process.wait(timeout=30) == 0
    finally:
        if old_token is None:
            os.environ.pop(TOKEN_ENV, None)
        else:
            os.environ[TOKEN_ENV] = old_token
        if process.poll() is None:
            process.kill()


def raw(url: str, head: str, body: bytes = b"", timeout: float = 20.0) -> tuple[int, bytes]:
    """Send bytes as they are (no client fixes them up); the answer's status and body (read until it closes)."""
    parts = urlparse(url)
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
    client = VLLMServerClient(server[0])
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
        VLLMServerClient(server[0])._call("POST", "/generate", {"prompts": [[1, 415]], "sampling": sampling})
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
    url, log_path = server
    assert "this machine may connect with the token in $LEANTUNE_VLLM_SERVER_TOKEN" in log_path.read_text()
    before = client.generate(PROMPTS, greedy(6))
    from safetensors.torch import save

    zeros = save({"model.norm.weight": torch.zeros(64)})
    for head, body in [("GET /health HTTP/1.1\r\n", b""), ("POST /close HTTP/1.1\r\nContent-Length: 2\r\n", b"{}"),
                       (f"POST /update_weights HTTP/1.1\r\nContent-Length: {len(zeros)}\r\n", zeros),
                       ("POST /update_weights/done HTTP/1.1\r\nContent-Length: 2\r\n", b"{}")]:
        for token_line in ("", "Authorization: Bearer wrong-token\r\n", f"Authorization: Basic {TOKEN}\r\n"):
            status, answer = raw(url, head + token_line + "Connection: close\r\n\r\n", body)
            assert status == 401 and b"LEANTUNE_VLLM_SERVER_TOKEN" in answer
    assert client.generate(PROMPTS, greedy(6)) == before  # not closed, weights unchanged


@pytest.mark.quick
def test_a_non_loopback_host_without_a_token_is_refused_at_start(monkeypatch, capsys):
    from leantune.cli.vllm_serve import VLLMServeArguments, run

    assert VLLMServeArguments().host == "127.0.0.1"
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    assert run(["--model", "x", "--engine", "transformers", "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--host 0.0.0.0" in err and TOKEN_ENV in err


# --- memory and stalls --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("length, status", [("-1", 400), ("12abc", 400), (None, 411), ("huge", 413)])
def test_a_bad_content_length_is_answered_before_any_body_is_read(server, length, status):
    url = server[0]
    limit = VLLMServerClient(url).wait_until_up(10)["max_request_bytes"]
    assert limit < 128 * 2**20  # the tiny model's ~17 MiB plus the margin, below --max_request_mb's 8 GiB
    header = "" if length is None else f"Content-Length: {limit + 1 if length == 'huge' else length}\r\n"
    # no body is sent: the answer can only come if the server did not wait to read one
    got, answer = raw(url, f"POST /update_weights HTTP/1.1\r\n{auth()}{header}Connection: close\r\n\r\n", timeout=10)
    assert got == status, answer
    assert VLLMServerClient(url).wait_until_up(10)["status"] == "ok"


def test_connections_are_bounded_and_an_idle_socket_times_out(server):
    url = server[0]
    parts = urlparse(url)
    idle = [socket.create_connection((parts.hostname, parts.port)) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.5)  # the server has taken them: every slot is held by a connection that sends nothing
        status, answer = raw(url, f"GET /health HTTP/1.1\r\n{auth()}Connection: close\r\n\r\n")
        assert status == 503 and b"busy" in answer
        started = time.monotonic()
        # the client waits out the 503s; the server drops the idle sockets after --socket_timeout
        assert VLLMServerClient(url, request_timeout=30).wait_until_up(30)["status"] == "ok"
        assert SOCKET_TIMEOUT - 1 < time.monotonic() - started < SOCKET_TIMEOUT + 10
        for sock in idle:
            sock.settimeout(5)
            assert sock.recv(1) == b""  # closed by the server
    finally:
        for sock in idle:
            sock.close()


@pytest.mark.parametrize("request_json, message", [
    ({"prompts": [[1, 415]] * (MAX_PROMPTS + 1), "sampling": {"max_new_tokens": 2}}, "over the server's limit of 8"),
    ({"prompts": [[1, 415]], "sampling": {"max_new_tokens": MAX_NEW_TOKENS + 1}}, "max_new_tokens: 17 is outside"),
    ({"prompts": [[1, 32000]], "sampling": {"max_new_tokens": 2}}, r"prompts\[0\]: token ids must be integers in"),
    ({"prompts": [[1, 415]], "sampling": {"max_new_tokens": 2, "temperature": "hot"}}, "temperature: must be a"),
    ({"prompts": [[1, 415]], "sampling": {"max_new_tokens": 2}, "extra": {}}, "'prompts' and 'sampling' only"),
])
def test_requests_over_the_limits_are_refused(server, request_json, message):
    with pytest.raises(VLLMServerError, match=f"HTTP 400.*{message}"):
        VLLMServerClient(server[0])._call("POST", "/generate", request_json)


# --- weight updates -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk, message", [
    ({"model.norm.weight": torch.full((64,), float("nan")),
      "model.layers.0.mlp.gate_proj.weight": torch.zeros(3, 3)}, "(NaN or infinite|shape)"),
    ({"model.norm.weight": torch.full((64,), float("nan"))}, "model.norm.weight: has NaN"),
    ({"model.norm.weight": torch.ones(64, dtype=torch.int64)}, "dtype int64 does not cast to the model's float32"),
    ({"model.norm.weight": torch.ones(64, dtype=torch.float64)}, "dtype float64 does not cast"),
    ({"model.norm.weight": torch.ones(65)}, r"shape \[65\], the model's is \[64\]"),
])
def test_a_bad_tensor_refuses_its_update_and_changes_nothing(server, client, chunk, message):
    from safetensors.torch import save

    before = client.generate(PROMPTS, greedy(6))
    with pytest.raises(VLLMServerError, match=f"HTTP 400.*{message}"):
        client._post_bytes("/update_weights", save(chunk))
    with pytest.raises(VLLMServerError, match="HTTP 400.*the update was refused"):
        client._call("POST", "/update_weights/done", {})  # ends the refused update: nothing of it applied
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


def test_the_configs_request_timeout_reaches_the_client(server):
    from types import SimpleNamespace

    from leantune import GRPOConfig
    from leantune.generation.vllm_client import DEFAULT_REQUEST_TIMEOUT, VLLMServerBackend

    assert GRPOConfig.__dataclass_fields__["vllm_server_request_timeout"].default == DEFAULT_REQUEST_TIMEOUT
    args = SimpleNamespace(vllm_server_base_url=server[0], vllm_server_host="0.0.0.0", vllm_server_port=8000,
                           vllm_server_timeout=30.0, vllm_server_request_timeout=7.0)
    assert VLLMServerBackend(args, tiny_model(), None, accelerator=None).client.request_timeout == 7.0
