"""Weight updates to `leantune vllm-serve` as transactions (issue 39): each way an update can fail leaves the served
weights as they were (the greedy completions of fixed prompts unchanged), and a complete update afterwards applies.

The server runs in this process (make_server + serve on a thread, the transformers engine on the tiny Llama), so a
test can make staging fail or stall and shorten the expiry; a client killed mid-update is a real process.
"""

from __future__ import annotations

import functools
import json
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

from leantune.generation import served_weights
from leantune.generation.vllm_client import VLLMServerClient, VLLMServerError
from leantune.generation.vllm_server import TransformersEngine, make_server, serve

from ..fixtures.models import tiny_model
from ..fixtures.served import PROMPTS, greedy, local_greedy, perturbed

TOKEN = "transaction-test-token"
LAYER0 = [f"model.layers.0.{part}.weight" for part in (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
    "mlp.down_proj", "input_layernorm", "post_attention_layernorm")]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(the in-process server, its URL)."""
    path = tmp_path_factory.mktemp("transactions") / "model"
    tiny_model().save_pretrained(path)
    server = make_server(TransformersEngine(str(path)), host="127.0.0.1", port=0, token=TOKEN, socket_timeout=2,
                         update_expiry=60)
    thread = threading.Thread(target=serve, args=(server,), daemon=True)
    thread.start()
    yield server, f"http://127.0.0.1:{server.server_address[1]}"
    server.stopping.set()
    thread.join(timeout=15)


@pytest.fixture
def client(served):
    """A client of the server, which serves the checkpoint's weights again (whatever earlier tests sent)."""
    client = VLLMServerClient(served[1], request_timeout=30, token=TOKEN)
    client.update_weights(tiny_model().state_dict().items())
    assert client.generate(PROMPTS, greedy(6)) == original()
    return client


@functools.cache
def original() -> list[list[int]]:
    """The checkpoint's greedy completions of PROMPTS."""
    return local_greedy(tiny_model().eval(), PROMPTS, greedy(6))


def applies_a_complete_update_afterwards(client) -> None:
    policy = perturbed(tiny_model(), seed=7).eval()
    expected = local_greedy(policy, PROMPTS, greedy(6))
    assert expected != original()
    client.update_weights(policy.state_dict().items(), chunk_bytes=2**20)
    assert client.generate(PROMPTS, greedy(6)) == expected


def begin(client, update_id: str) -> None:
    client._call("POST", "/update_weights/begin", {"update_id": update_id})


def send(client, update_id: str, tensors: dict) -> dict:
    from safetensors.torch import save

    return client._post_bytes(f"/update_weights/chunk?update_id={update_id}", save(tensors))


def commit(client, update_id: str, names: list[str]) -> dict:
    return client._call("POST", "/update_weights/commit", {"update_id": update_id, "names": names,
                                                            "count": len(names)})


def zeroed(*names: str) -> dict:
    state = tiny_model().state_dict()
    return {name: torch.zeros_like(state[name]) for name in names}


def test_a_bad_body_discards_the_update(client):
    """Issue 39: a good chunk, a body that is not safetensors, then the end of the update applied the good chunk."""
    begin(client, "u1")
    assert send(client, "u1", zeroed("lm_head.weight")) == {"loaded": 1}
    with pytest.raises(VLLMServerError, match="HTTP 400.*not a safetensors file.*discarded"):
        client._post_bytes("/update_weights/chunk?update_id=u1", b"not safetensors at all")
    with pytest.raises(VLLMServerError, match="HTTP 409.*not in progress"):
        commit(client, "u1", ["lm_head.weight"])
    assert client.generate(PROMPTS, greedy(6)) == original()
    applies_a_complete_update_afterwards(client)


def test_a_chunk_over_the_limit_discards_the_update(served, client):
    begin(client, "u2")
    send(client, "u2", zeroed("lm_head.weight"))
    limit = client.wait_until_up(5)["max_request_bytes"]
    with socket.create_connection(("127.0.0.1", served[0].server_address[1]), timeout=10) as sock:
        sock.sendall(f"POST /update_weights/chunk?update_id=u2 HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     f"Authorization: Bearer {TOKEN}\r\nContent-Type: application/octet-stream\r\n"
                     f"Content-Length: {limit + 1}\r\n\r\n".encode())
        assert sock.recv(4096).startswith(b"HTTP/1.1 413")
    with pytest.raises(VLLMServerError, match="HTTP 409.*not in progress"):
        commit(client, "u2", ["lm_head.weight"])
    assert client.generate(PROMPTS, greedy(6)) == original()
    applies_a_complete_update_afterwards(client)


def test_a_fault_while_staging_is_a_500_and_discards_the_update(served, client, monkeypatch):
    checked = served_weights.checked_tensor
    calls = []

    def failing(name, tensor, expected):
        calls.append(name)
        if len(calls) > 3:  # after some tensors were staged
            raise RuntimeError("injected fault while staging")
        return checked(name, tensor, expected)

    monkeypatch.setattr(served_weights, "checked_tensor", failing)
    policy = perturbed(tiny_model(), seed=8)
    with pytest.raises(VLLMServerError, match="HTTP 500.*injected fault"):
        client.update_weights(policy.state_dict().items(), chunk_bytes=2**10)
    assert served[0].updates.in_progress is None and len(calls) == 4
    monkeypatch.setattr(served_weights, "checked_tensor", checked)
    assert client.generate(PROMPTS, greedy(6)) == original()
    applies_a_complete_update_afterwards(client)


def test_a_client_that_times_out_aborts_and_never_commits(served, client, monkeypatch):
    """Issue 39: on its own timeout the client ended the update with `done`, which applied what was staged."""
    server = served[0]
    checked = served_weights.checked_tensor

    def slow(name, tensor, expected):
        if name == "model.norm.weight":
            time.sleep(3)  # past the client's 1 s
        return checked(name, tensor, expected)

    monkeypatch.setattr(served_weights, "checked_tensor", slow)
    updates_before = client.wait_until_up(5)["weight_updates"]
    impatient = VLLMServerClient(served[1], request_timeout=1, token=TOKEN)
    tensors = [("lm_head.weight", torch.zeros(32000, 64)), ("model.norm.weight", torch.zeros(64))]
    with pytest.raises(VLLMServerError, match="gave no answer within 1 s"):
        impatient.update_weights(tensors, chunk_bytes=2**10)  # lm_head staged; norm's chunk times out
    assert server.updates.in_progress is None  # the client aborted it at once
    time.sleep(2.5)  # the slow check ends: it finds its update gone and stages nothing
    assert server.updates.in_progress is None
    assert client.wait_until_up(5)["weight_updates"] == updates_before  # nothing was committed
    monkeypatch.setattr(served_weights, "checked_tensor", checked)
    assert client.generate(PROMPTS, greedy(6)) == original()
    applies_a_complete_update_afterwards(client)


DEAD_CLIENT = r"""
import json, socket, sys, time
port, token, update_id, chunk_path = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
chunk = open(chunk_path, "rb").read()
def post(path, body, content_type):
    sock = socket.create_connection(("127.0.0.1", int(port)))
    sock.sendall((f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {token}\r\n"
                  f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body)
    assert sock.recv(4096).startswith(b"HTTP/1.1 200"), "refused"
post("/update_weights/begin", json.dumps({"update_id": update_id}).encode(), "application/json")
post(f"/update_weights/chunk?update_id={update_id}", chunk, "application/octet-stream")
print("staged", flush=True)
time.sleep(120)
"""


def kill_a_client_mid_update(served, update_id: str, tensors: dict, tmp_path) -> None:
    """A real process begins an update, sends one chunk, and is killed with SIGKILL before it commits."""
    from safetensors.torch import save_file

    chunk = tmp_path / f"{update_id}.safetensors"
    save_file(tensors, str(chunk))
    process = subprocess.Popen([sys.executable, "-c", DEAD_CLIENT, str(served[0].server_address[1]), TOKEN,
                                update_id, str(chunk)], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "staged"
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=10)
    assert served[0].updates.in_progress == update_id  # left behind, staged


def test_a_killed_clients_update_never_merges_into_the_next_and_expires(served, client, tmp_path):
    """Issue 39: a zeroed lm_head staged by a crashed sync was applied by a later update that sent only norm."""
    kill_a_client_mid_update(served, "dead1", zeroed("lm_head.weight"), tmp_path)
    assert client.generate(PROMPTS, greedy(6)) == original()
    norm = torch.linspace(-3.0, 3.0, 64)  # a norm that changes the greedy completions
    client.update_weights([("model.norm.weight", norm)])  # a new begin replaces the dead update
    only_norm = tiny_model().eval()
    only_norm.model.norm.weight.data.copy_(norm)
    assert client.generate(PROMPTS, greedy(6)) == local_greedy(only_norm, PROMPTS, greedy(6)) != original()
    updates = served[0].updates
    kill_a_client_mid_update(served, "dead2", zeroed("lm_head.weight"), tmp_path)
    updates.expiry_seconds = 0.5
    try:
        deadline = time.monotonic() + 10
        while updates.in_progress is not None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert updates.in_progress is None  # expired: its stage is freed without a new begin
    finally:
        updates.expiry_seconds = 60
    with pytest.raises(VLLMServerError, match="HTTP 409"):
        commit(client, "dead2", ["lm_head.weight"])
    applies_a_complete_update_afterwards(client)


@pytest.mark.parametrize("sent, declared, message", [
    (LAYER0[:1], LAYER0[:1], r"layer model\.layers\.0 is incomplete"),
    (LAYER0[:-1], LAYER0, "declared tensors that never arrived: " + LAYER0[-1].replace(".", r"\.")),
    (LAYER0, LAYER0[1:], "arrived but not declared"),
])
def test_a_partial_set_of_tensors_for_one_layer_is_not_applied(client, sent, declared, message):
    """vLLM reprocesses a layer only when all its tensors arrive: an update must hold whole layers, and exactly the
    tensors it declares."""
    begin(client, "partial")
    send(client, "partial", zeroed(*sent))
    with pytest.raises(VLLMServerError, match=f"HTTP 400.*{message}"):
        commit(client, "partial", declared)
    assert client.generate(PROMPTS, greedy(6)) == original()
    applies_a_complete_update_afterwards(client)


def test_a_stale_updates_chunk_is_refused_without_touching_the_current_one(client):
    begin(client, "old")
    begin(client, "new")  # replaces "old"
    with pytest.raises(VLLMServerError, match="HTTP 409.*'old' is not in progress"):
        send(client, "old", zeroed("lm_head.weight"))
    norm = torch.full((64,), 0.5)
    send(client, "new", {"model.norm.weight": norm})
    assert commit(client, "new", ["model.norm.weight"])["updates"] >= 1
    only_norm = tiny_model().eval()
    only_norm.model.norm.weight.data.copy_(norm)
    assert client.generate(PROMPTS, greedy(6)) == local_greedy(only_norm, PROMPTS, greedy(6))


def test_a_commit_must_declare_its_tensors(client):
    begin(client, "count")
    send(client, "count", zeroed("model.norm.weight"))
    with pytest.raises(VLLMServerError, match="HTTP 400.*'count' must be the number of names"):
        client._call("POST", "/update_weights/commit", {"update_id": "count", "names": ["model.norm.weight"],
                                                        "count": 2})
    with pytest.raises(VLLMServerError, match="HTTP 400.*update_id: 1 to 64"):
        client._call("POST", "/update_weights/begin", {"update_id": "../../x"})
    with pytest.raises(VLLMServerError, match="HTTP 400.*only"):
        client._call("POST", "/update_weights/begin", json.loads('{"update_id": "a", "names": []}'))
    assert client.generate(PROMPTS, greedy(6)) == original()


def test_a_request_without_the_token_cannot_end_someone_elses_update(served, client):
    """Only an authenticated refusal ends an update: a stranger's chunk, abort or oversized body for its id does
    nothing, and the update commits."""
    port = served[0].server_address[1]
    begin(client, "mine")
    norm = torch.full((64,), 0.25)
    send(client, "mine", {"model.norm.weight": norm})
    for head in ("POST /update_weights/chunk?update_id=mine HTTP/1.1\r\nContent-Type: application/octet-stream\r\n"
                 "Content-Length: 999999999999\r\n",
                 "POST /update_weights/abort HTTP/1.1\r\nContent-Type: application/json\r\nContent-Length: 21\r\n"):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(f"{head}Host: 127.0.0.1\r\nAuthorization: Bearer wrong\r\n\r\n".encode()
                         + b'{"update_id": "mine"}')
            assert sock.recv(4096).startswith(b"HTTP/1.1 401")
    assert served[0].updates.in_progress == "mine"
    commit(client, "mine", ["model.norm.weight"])
    only_norm = tiny_model().eval()
    only_norm.model.norm.weight.data.copy_(norm)
    assert client.generate(PROMPTS, greedy(6)) == local_greedy(only_norm, PROMPTS, greedy(6))
