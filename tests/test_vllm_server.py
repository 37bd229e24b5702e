"""`leantune vllm-serve` with its CPU engine, the server backend, and the colocated backend's bookkeeping (CPU).

The server runs as the real command in a subprocess (`--engine transformers`, a tiny saved Llama). The colocated
backend runs against a stand-in `vllm` module (an `LLM` backed by a transformers model) that checks what the backend
asks of vLLM: engine arguments, sampling parameters, weight loading through `collective_rpc`, sleep and wake. The
real vLLM engine is exercised in tests/test_gpu_online.py.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.machinery
import os
import re
import socket
import subprocess
import sys
import time
import types
from types import SimpleNamespace

import pytest
import torch

from leantune.generation.sampling import SamplingSettings, cut_at_eos
from leantune.generation.vllm_client import VLLMServerBackend, VLLMServerClient, VLLMServerError
from leantune.utils.imports import is_available

from .conftest import REPO, tiny_model

EOS, PAD = 2, 0
PROMPTS = [[1, 415, 2936, 9060], [1, 415, 2936, 9060], [1, 22557], [1, 1014, 349, 264, 1369, 28723]]


def greedy(max_new_tokens: int = 8, eos=(EOS,)) -> SamplingSettings:
    return SamplingSettings(max_new_tokens=max_new_tokens, temperature=0.0, eos_token_ids=tuple(eos), pad_token_id=PAD)


def local_greedy(model, prompts, sampling: SamplingSettings) -> list[list[int]]:
    """transformers greedy generation, one prompt at a time (no padding)."""
    out = []
    with torch.no_grad():
        for ids in prompts:
            tokens = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=sampling.max_new_tokens,
                                    do_sample=False, eos_token_id=list(sampling.eos_token_ids), pad_token_id=PAD)
            out.append(cut_at_eos(tokens[0, len(ids):].tolist(), sampling.eos_token_ids))
    return out


def perturbed(model, seed: int, scale: float = 0.05):
    torch.manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * scale)
    return model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer_dir):
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("served") / "model"
    tiny_model().save_pretrained(path)
    AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    """`leantune vllm-serve --engine transformers` on a free port; its base URL."""
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "leantune.cli.main", "vllm-serve", "--model", str(model_dir), "--engine",
             "transformers", "--host", "127.0.0.1", "--port", "0", "--seed", "0"],
            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    url = _wait_for_url(log_path, process)
    yield url
    try:
        VLLMServerClient(url).close_server()
        assert process.wait(timeout=30) == 0  # POST /close stops the server
    finally:
        if process.poll() is None:
            process.kill()


def _wait_for_url(log_path, process, timeout: float = 120.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        match = re.search(r"on (http://[\d.]+:\d+)", log_path.read_text())
        if match:
            return match.group(1)
        if process.poll() is not None:
            raise RuntimeError(f"vllm-serve exited with {process.returncode}:\n{log_path.read_text()}")
        time.sleep(0.2)
    process.kill()
    raise RuntimeError(f"vllm-serve did not start:\n{log_path.read_text()}")


def server_args(url: str, timeout: float = 30.0):
    return SimpleNamespace(vllm_server_base_url=url, vllm_server_host="0.0.0.0", vllm_server_port=8000,
                           vllm_server_timeout=timeout)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# --- the server and its client ------------------------------------------------------------------------------------


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
    with pytest.raises(VLLMServerError, match="not the model's: no.such.weight"):
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


@pytest.mark.skipif(is_available("vllm"), reason="vllm is installed")
def test_vllm_serve_without_vllm_names_the_extra(capsys):
    from leantune.cli.vllm_serve import run

    assert run(["--model", "x"]) == 2
    assert "pip install 'leantune[vllm]'" in capsys.readouterr().err


# --- the colocated backend against a stand-in vllm ----------------------------------------------------------------


class FakeSamplingParams:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)
        self.kwargs = kwargs


class FakeVLLMModel:
    """What vLLM's model offers the backend: `load_weights` of checkpoint-named tensors, `named_parameters`."""

    def __init__(self, hf_model):
        self.hf_model = hf_model

    def load_weights(self, weights):
        params = self.hf_model.state_dict()
        loaded = set()
        for name, tensor in weights:
            params[name].copy_(tensor)  # KeyError on a name vLLM would not know
            loaded.add(name)
        return loaded

    def named_parameters(self):
        return self.hf_model.named_parameters()


class FakeLLM:
    instances: list = []

    def __init__(self, model, **kwargs):
        from transformers import AutoConfig, AutoModelForCausalLM

        self.source, self.kwargs, self.calls = model, kwargs, []
        if kwargs.get("load_format") == "dummy":
            self.hf_model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model))
        else:
            self.hf_model = AutoModelForCausalLM.from_pretrained(model)
        self.hf_model.eval()
        self.worker = SimpleNamespace(get_model=lambda: FakeVLLMModel(self.hf_model), vllm_config=None)
        FakeLLM.instances.append(self)

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        return [method(self.worker, *args, **(kwargs or {}))]

    def generate(self, prompts, params, use_tqdm=True):
        self.calls.append("generate")
        assert all(set(p) == {"prompt_token_ids"} for p in prompts)
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        assert len(params_list) == len(prompts)
        outputs = []
        for prompt, param in zip(prompts, params_list):
            assert param.temperature == 0 and param.n == 1  # the stand-in only does greedy
            sampling = greedy(param.max_tokens, eos=param.stop_token_ids or ())
            ids = local_greedy(self.hf_model, [prompt["prompt_token_ids"]], sampling)[0]
            outputs.append(SimpleNamespace(outputs=[SimpleNamespace(token_ids=tuple(ids))]))
        return outputs

    def sleep(self, level=1):
        self.calls.append(("sleep", level))
        with torch.no_grad():  # level 2 drops the weights
            for param in self.hf_model.parameters():
                param.fill_(float("nan"))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")
        return True


@pytest.fixture
def fake_vllm(monkeypatch):
    module = types.ModuleType("vllm")
    module.__spec__ = importlib.machinery.ModuleSpec("vllm", None)
    module.LLM, module.SamplingParams = FakeLLM, FakeSamplingParams
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setattr("leantune.generation.vllm_colocate.require_cuda", lambda feature: None)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    FakeLLM.instances.clear()
    return module


def colocate_args(tmp_path, **overrides):
    from leantune.trainers.online_config import OnlineConfig

    settings = dict(output_dir=str(tmp_path / "out"), report_to=[], use_vllm=True, vllm_mode="colocate",
                    vllm_enable_sleep_mode=True, vllm_gpu_memory_utilization=0.25, vllm_max_model_length=128,
                    max_completion_length=8, seed=7)
    return OnlineConfig(**{**settings, **overrides})


def test_colocated_backend_syncs_after_every_wake_and_never_generates_stale(fake_vllm, model_dir, tmp_path):
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    from leantune.generation.vllm_colocate import VLLMColocateBackend

    policy = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    backend = VLLMColocateBackend(colocate_args(tmp_path), policy, None, Accelerator(cpu=True))
    llm = FakeLLM.instances[-1]
    assert llm.source == str(model_dir) and os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert {k: llm.kwargs[k] for k in ("enable_sleep_mode", "seed", "dtype", "gpu_memory_utilization",
                                       "max_model_len", "tensor_parallel_size")} == {
        "enable_sleep_mode": True, "seed": 7, "dtype": "float32", "gpu_memory_utilization": 0.25,
        "max_model_len": 128, "tensor_parallel_size": 1}
    assert "distributed_executor_backend" not in llm.kwargs  # a single process without torch.distributed
    assert llm.calls == [("sleep", 2)] and backend.needs_sync  # asleep until the first round
    sampling = greedy(8)

    backend.wake_up()
    with pytest.raises(RuntimeError, match="sync_weights"):
        backend.generate(PROMPTS, sampling)
    backend.sync_weights(policy)
    first = backend.generate(PROMPTS, sampling)
    assert first == local_greedy(policy, PROMPTS, sampling)
    assert llm.calls[1:] == [("wake_up", ["weights"]), ("wake_up", ["kv_cache"]), "reset_prefix_cache", "generate"]

    backend.sleep()
    perturbed(policy, seed=3)  # the optimisation steps
    backend.wake_up()
    assert backend.needs_sync
    with pytest.raises(RuntimeError, match="sync_weights"):
        backend.generate(PROMPTS, sampling)  # never from the dropped (here: NaN) weights
    backend.sync_weights(policy)
    second = backend.generate(PROMPTS, sampling)
    assert second == local_greedy(policy, PROMPTS, sampling) and second != first
    backend.close()


def test_colocated_backend_without_sleep_mode_and_an_unsaved_peft_policy(fake_vllm, tokenizer, tmp_path):
    from accelerate import Accelerator

    from leantune.generation.vllm_colocate import VLLMColocateBackend

    policy = _full_vocab_lora()
    assert policy.get_base_model().config._name_or_path == ""  # never saved: the engine starts from dummy weights
    backend = VLLMColocateBackend(colocate_args(tmp_path, vllm_enable_sleep_mode=False), policy, tokenizer,
                                  Accelerator(cpu=True))
    llm = FakeLLM.instances[-1]
    assert llm.kwargs["load_format"] == "dummy" and os.path.exists(os.path.join(llm.source, "config.json"))
    assert llm.calls == [] and backend.needs_sync
    backend.wake_up()
    backend.sleep()  # no-ops without sleep mode
    backend.sync_weights(policy)
    sampling = greedy(8)
    assert backend.generate(PROMPTS, sampling) == local_greedy(policy, PROMPTS, sampling)
    assert ("sleep", 2) not in llm.calls
    scratch = llm.source
    backend.close()
    assert not os.path.exists(scratch)


def test_vllm_sampling_parameters(fake_vllm):
    from leantune.generation.vllm_colocate import to_vllm_sampling_params, vllm_sampling_params

    sampling = SamplingSettings(max_new_tokens=16, temperature=0.7, top_p=0.9, top_k=None, min_p=None,
                                repetition_penalty=1.1, eos_token_ids=(2, 32000), extra={"presence_penalty": 0.5})
    assert to_vllm_sampling_params(sampling).kwargs == {
        "n": 1, "max_tokens": 16, "temperature": 0.7, "top_p": 0.9, "top_k": -1, "min_p": 0.0,
        "repetition_penalty": 1.1, "stop_token_ids": [2, 32000], "detokenize": False, "logprobs": 0,
        "presence_penalty": 0.5}
    assert not isinstance(vllm_sampling_params(sampling, 3), list)  # unseeded: one shared object
    seeded = SamplingSettings(max_new_tokens=4, top_k=20, min_p=0.05, seed=100)
    per_completion = vllm_sampling_params(seeded, 3)
    assert [p.kwargs["seed"] for p in per_completion] == [100, 101, 102]  # repeats of a prompt differ
    with_k = per_completion[0].kwargs
    assert with_k["top_k"] == 20 and with_k["min_p"] == 0.05 and with_k["stop_token_ids"] is None


# --- the GRPO trainer in server mode (last in this file: it changes the served weights) ---------------------------


def test_grpo_trains_against_the_server_and_syncs_each_optimizer_step(server, model_dir):
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
    backend = trainer._backend()
    assert backend.name != "transformers"
    synced_at = []
    original = backend.sync_weights
    backend.sync_weights = lambda model: (synced_at.append(trainer.state.global_step), original(model))
    trainer.train()
    assert synced_at == [0, 1, 2]  # one round per optimizer step, each after the policy moved
    trainer.state.global_step += 1  # as after another optimizer step
    trainer.generate_completions([[1, 415, 2936]], trainer.sampling)
    assert synced_at[-1] == trainer.state.global_step
    # the server now holds the trained weights: its greedy completions are the local model's
    sampling = greedy()
    assert backend.generate(PROMPTS, sampling) == local_greedy(trainer.model.eval(), PROMPTS, sampling)
