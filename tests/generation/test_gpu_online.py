"""GPU-only checks of the online trainers' generation backends: vLLM colocated (sleep mode, weight sync, PEFT),
the vLLM server engine, and DeepSpeed ZeRO-3 gathering. Skipped without CUDA, vLLM or DeepSpeed.

Run on a GPU machine (one GPU is enough):

    pip install -e '.[vllm,deepspeed,test]'
    python -m pytest tests/generation/test_gpu_online.py -m gpu -v -s

Each scenario runs in its own process (`python -m tests.test_gpu_online SCENARIO WORKDIR`): a process holds one
vLLM engine with sleep mode at most, and ZeRO-3 needs torch.distributed's environment. A scenario asserts as it goes
and writes its measurements to WORKDIR/SCENARIO.json, which the test prints (-s shows them).

Greedy completions of vLLM and transformers are compared token for token on prompts whose greedy path has a clear
margin in transformers (top-1 minus top-2 logit at least MIN_MARGIN standard deviations of the logits at every
step), so kernel-level rounding (vLLM's attention kernels may use TF32) cannot flip a token.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from leantune.utils.imports import is_available

from ..fixtures.paths import REPO

MAX_NEW_TOKENS = 12
MIN_MARGIN = 0.01
N_PROMPTS = 6
EOS, PAD = 2, 0

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_vllm = pytest.mark.skipif(not is_available("vllm"), reason="needs leantune[vllm]")
needs_deepspeed = pytest.mark.skipif(not is_available("deepspeed"), reason="needs leantune[deepspeed]")


# --- the tests: one subprocess per scenario -----------------------------------------------------------------------


@pytest.mark.gpu
@cuda
@needs_vllm
def test_vllm_colocate_sleep_wake_sync(tmp_path):
    result = run_scenario("colocate_sleep", tmp_path)
    assert result["freed_gib"] > 0


@pytest.mark.gpu
@cuda
@needs_vllm
def test_vllm_colocate_peft_sync(tmp_path):
    run_scenario("colocate_peft", tmp_path)


@pytest.mark.gpu
@cuda
@needs_vllm
def test_vllm_server_engine_sync(tmp_path):
    run_scenario("server_vllm", tmp_path)


@pytest.mark.gpu
@cuda
@needs_deepspeed
def test_zero3_gathering_for_generation_and_sync(tmp_path):
    result = run_scenario("zero3", tmp_path, distributed=True)
    assert result["peak_mib_gather_off"] <= result["peak_mib_gather_on"]


@pytest.mark.gpu
@cuda
@needs_deepspeed
def test_zero3_peft_sync(tmp_path):
    run_scenario("zero3_peft", tmp_path, distributed=True)


def run_scenario(name: str, workdir: Path, distributed: bool = False, timeout: float = 1500) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    if distributed:  # torch.distributed's environment for a world of one process (what accelerate launch sets)
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(free_port()))
    process = subprocess.run([sys.executable, "-m", "tests.test_gpu_online", name, str(workdir)], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=timeout)
    output = process.stdout + process.stderr
    if process.returncode != 0:
        pytest.fail(f"scenario {name} failed (exit {process.returncode}):\n{output[-8000:]}")
    result = json.loads((workdir / f"{name}.json").read_text())
    print(f"\n{name}: {json.dumps(result)}")
    return result


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# --- shared pieces of the scenarios -------------------------------------------------------------------------------


def device() -> str:
    return os.environ.get("LEANTUNE_GPU_TEST_DEVICE", "cuda")


def tokenizer():
    from transformers import AutoTokenizer

    from ..fixtures.paths import TOKENIZER_DIR

    return AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))


def policy_config(vocab_size: int = 32000, hidden: int = 256, layers: int = 2):
    """A small Llama with head size 64 (what vLLM's kernels support) and an untied head."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                       num_hidden_layers=layers, num_attention_heads=hidden // 64,
                       num_key_value_heads=max(1, hidden // 128),
                       max_position_embeddings=512, tie_word_embeddings=False, initializer_range=0.1,
                       bos_token_id=1, eos_token_id=EOS, pad_token_id=PAD)


def saved_policy(workdir: Path, seed: int = 0) -> Path:
    """A random-weight policy saved with the real tokenizer (vLLM starts from the folder)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    path = workdir / "policy"
    LlamaForCausalLM(policy_config()).save_pretrained(path)
    tokenizer().save_pretrained(path)
    return path


def load_policy(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device()).eval()


def greedy_settings():
    from leantune.generation.sampling import SamplingSettings

    return SamplingSettings(max_new_tokens=MAX_NEW_TOKENS, temperature=0.0, eos_token_ids=(EOS,), pad_token_id=PAD)


@torch.no_grad()
def hf_greedy(model, prompts, with_margins: bool = False):
    """transformers greedy completions, one prompt at a time; optionally each one's smallest relative margin."""
    from leantune.generation.sampling import cut_at_eos

    completions, margins = [], []
    dev = next(model.parameters()).device
    for ids in prompts:
        out = model.generate(input_ids=torch.tensor([ids], device=dev), max_new_tokens=MAX_NEW_TOKENS,
                             do_sample=False, eos_token_id=[EOS], pad_token_id=PAD, output_scores=True,
                             return_dict_in_generate=True)
        completions.append(cut_at_eos(out.sequences[0, len(ids):].tolist(), (EOS,)))
        steps = [(s[0].float().topk(2).values, s[0].float().std()) for s in out.scores]
        margins.append(min(((top[0] - top[1]) / std).item() for top, std in steps))
    return (completions, margins) if with_margins else completions


def confident_prompts(models, seed: int = 0, candidates: int = 200) -> list[list[int]]:
    """N_PROMPTS random prompts whose greedy path has a clear margin under every one of `models`."""
    rng = random.Random(seed)
    chosen = []
    for _ in range(candidates):
        ids = [1] + [rng.randrange(3, 32000) for _ in range(rng.randrange(2, 12))]
        if all(hf_greedy(model, [ids], with_margins=True)[1][0] >= MIN_MARGIN for model in models):
            chosen.append(ids)
            if len(chosen) == N_PROMPTS:
                return chosen
    raise AssertionError(f"only {len(chosen)} of {candidates} prompts have a greedy margin of {MIN_MARGIN}")


@torch.no_grad()
def perturb(model, seed: int, scale: float = 0.05) -> None:
    """Stands in for optimisation steps: every weight moves."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    for param in model.parameters():
        param.add_(torch.randn(param.shape, generator=generator).to(param) * scale)


def online_args(workdir: Path, **overrides):
    from leantune.trainers.online_config import OnlineConfig

    settings = dict(output_dir=str(workdir / "out"), report_to=[], use_vllm=True, vllm_mode="colocate",
                    vllm_gpu_memory_utilization=0.3, vllm_max_model_length=256, max_completion_length=MAX_NEW_TOKENS,
                    bf16=False, fp16=False, seed=0)
    return OnlineConfig(**{**settings, **overrides})


def write_result(workdir: Path, name: str, result: dict) -> None:
    (workdir / f"{name}.json").write_text(json.dumps(result, indent=1))


# --- the scenarios ----------------------------------------------------------------------------------------------


def scenario_colocate_sleep(workdir: Path) -> dict:
    """Sleep frees GPU memory; after waking, generation is refused until a sync; then it is the updated policy's."""
    from accelerate import Accelerator

    from leantune.generation.sampling import SamplingSettings
    from leantune.generation.vllm_colocate import VLLMColocateBackend

    policy = load_policy(saved_policy(workdir))
    updated = load_policy(workdir / "policy")
    perturb(updated, seed=1)
    prompts = confident_prompts([policy, updated])
    sampling = greedy_settings()
    backend = VLLMColocateBackend(online_args(workdir, vllm_enable_sleep_mode=True), policy, None, Accelerator())
    assert backend.needs_sync and backend.last_sleep_freed_bytes is not None  # asleep after start-up

    backend.wake_up()
    backend.sync_weights(policy)
    before = backend.generate(prompts, sampling)
    assert before == hf_greedy(policy, prompts), "vLLM after the first sync differs from transformers"

    policy.load_state_dict(updated.state_dict())  # the optimisation steps
    free_before_sleep = torch.cuda.mem_get_info()[0]
    backend.sleep()
    freed = backend.last_sleep_freed_bytes
    assert freed > 0 and torch.cuda.mem_get_info()[0] > free_before_sleep, "sleep freed no GPU memory"

    backend.wake_up()
    try:
        backend.generate(prompts, sampling)
        raise AssertionError("generate after wake_up without a sync was not refused")
    except RuntimeError as error:
        assert "sync_weights" in str(error)
    backend.sync_weights(policy)
    after = backend.generate(prompts, sampling)
    expected = hf_greedy(policy, prompts)
    assert after == expected, f"vLLM after sleep/wake/sync: {after}\ntransformers: {expected}"
    assert after != before, "the updated policy's completions equal the old ones: the test proves nothing"

    backend.sleep()  # a second cycle with unchanged weights gives the same completions
    backend.wake_up()
    backend.sync_weights(policy)
    again = backend.generate(prompts, sampling)
    assert again == after
    sampling_t1 = SamplingSettings(max_new_tokens=MAX_NEW_TOKENS, temperature=1.0, eos_token_ids=(EOS,),
                                   pad_token_id=PAD)
    sampled = backend.generate([prompts[0]] * 4, sampling_t1)
    assert len({tuple(c) for c in sampled}) > 1, "repeats of a prompt were sampled identically"
    seeded = dataclasses.replace(sampling_t1, seed=77)
    first = backend.generate([prompts[0]] * 4, seeded)
    assert backend.generate([prompts[0]] * 4, seeded) == first, "a seeded round is not reproducible"
    assert len({tuple(c) for c in first}) > 1, "seeded repeats of a prompt were sampled identically"
    backend.close()
    return {"freed_gib": freed / 2**30, "prompts": len(prompts), "completion_tokens": sum(map(len, after))}


def scenario_colocate_peft(workdir: Path) -> dict:
    """The merged LoRA weights in vLLM give the PEFT model's greedy completions."""
    import copy

    from accelerate import Accelerator
    from peft import LoraConfig, get_peft_model

    from leantune.generation.vllm_colocate import VLLMColocateBackend

    base = load_policy(saved_policy(workdir))
    base_copy = copy.deepcopy(base)
    peft_model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])).eval()
    torch.manual_seed(3)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.3)
    prompts = confident_prompts([peft_model, base_copy])
    backend = VLLMColocateBackend(online_args(workdir), peft_model, None, Accelerator())
    backend.sync_weights(peft_model)
    got = backend.generate(prompts, greedy_settings())
    expected = hf_greedy(peft_model, prompts)
    assert got == expected, f"vLLM with merged LoRA: {got}\nPEFT in transformers: {expected}"
    assert got != hf_greedy(base_copy, prompts), "the adapter does not change the completions: the test proves nothing"
    assert not any(getattr(m, "merged", False) for m in peft_model.modules() if hasattr(m, "merged_adapters"))
    backend.close()
    return {"prompts": len(prompts), "completion_tokens": sum(map(len, got))}


def scenario_server_vllm(workdir: Path) -> dict:
    """`leantune vllm-serve --engine vllm`: after a sync over HTTP, greedy completions are the local model's."""
    from types import SimpleNamespace

    from leantune.generation.vllm_client import VLLMServerBackend, VLLMServerClient

    path = saved_policy(workdir)
    policy = load_policy(path)
    perturb(policy, seed=2)
    prompts = confident_prompts([policy])
    port = free_port()
    log = open(workdir / "server.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "leantune.cli.main", "vllm-serve", "--model", str(path), "--port", str(port),
         "--host", "127.0.0.1", "--gpu_memory_utilization", "0.3", "--max_model_len", "256", "--dtype", "float32"],
        stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        args = SimpleNamespace(vllm_server_base_url=None, vllm_server_host="127.0.0.1", vllm_server_port=port,
                               vllm_server_timeout=600)
        started = time.monotonic()
        backend = VLLMServerBackend(args, policy, None, accelerator=None)
        startup = time.monotonic() - started
        backend.chunk_bytes = 4 * 2**20  # several chunks
        backend.sync_weights(policy)
        got = backend.generate(prompts, greedy_settings())
        expected = hf_greedy(policy, prompts)
        assert got == expected, f"server after sync: {got}\ntransformers: {expected}"
        VLLMServerClient(backend.client.base_url).close_server()
        server.wait(timeout=120)
    finally:
        if server.poll() is None:
            server.kill()
        log.close()
    return {"server_startup_s": startup, "prompts": len(prompts)}


def _zero3_accelerator():
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "bf16": {"enabled": False}, "fp16": {"enabled": False}, "zero_allow_untested_optimizer": True}
    return Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config), mixed_precision="no")


def _peak_mib(run) -> tuple[object, float, float]:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated()
    started = time.perf_counter()
    result = run()
    torch.cuda.synchronize()
    return result, (torch.cuda.max_memory_allocated() - baseline) / 2**20, time.perf_counter() - started


def scenario_zero3(workdir: Path) -> dict:
    """ZeRO-3: the same completions with and without gathering for generation; the sync gathers a module at a time."""
    from transformers import LlamaForCausalLM

    from leantune.generation.weight_sync import policy_weights_for_sync
    from leantune.generation.zero3 import gathered_for_generation, is_zero3

    accelerator = _zero3_accelerator()
    torch.manual_seed(0)
    model = LlamaForCausalLM(policy_config(vocab_size=1024, hidden=512, layers=8))
    reference = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    total_mib = sum(t.numel() * t.element_size() for t in reference.values()) / 2**20
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    engine, optimizer = accelerator.prepare(model, optimizer)
    assert is_zero3(accelerator)
    engine.eval()
    unwrapped = accelerator.unwrap_model(engine)
    prompts = torch.tensor([[1, 5, 9, 200, 7, 33], [1, 6, 10, 300, 8, 44]], device=accelerator.device)

    def generate(enabled: bool, sample: bool):
        def run():
            with gathered_for_generation(engine, accelerator, enabled), torch.no_grad():
                if sample:
                    torch.manual_seed(1234)
                sampling = {"do_sample": True, "temperature": 1.0, "top_k": 0} if sample else {"do_sample": False}
                out = unwrapped.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts),
                                         max_new_tokens=16, pad_token_id=PAD, eos_token_id=None, **sampling)
                return out[:, prompts.shape[1]:].tolist()
        return _peak_mib(run)

    generate(False, sample=False)  # warm-up: kernels and workspaces are allocated outside the measurements
    greedy_on, peak_on, seconds_on = generate(True, sample=False)
    greedy_off, peak_off, seconds_off = generate(False, sample=False)
    sampled_on, _, _ = generate(True, sample=True)
    sampled_off, _, _ = generate(False, sample=True)
    assert greedy_on == greedy_off, "greedy completions differ with and without gathering"
    assert sampled_on == sampled_off, "seeded sampled completions differ with and without gathering"

    def sync():
        return {name: tensor.cpu().clone() for name, tensor in policy_weights_for_sync(engine, accelerator)}

    synced, sync_peak, _ = _peak_mib(sync)
    assert sorted(synced) == sorted(reference)
    for name, tensor in reference.items():
        assert torch.equal(synced[name], tensor), f"{name} differs after the ZeRO-3 gathering"
    assert sync_peak < 0.25 * total_mib, f"the sync gathered {sync_peak:.1f} MiB of a {total_mib:.1f} MiB model"
    return {"model_mib": total_mib, "peak_mib_gather_on": peak_on, "peak_mib_gather_off": peak_off,
            "seconds_gather_on": seconds_on, "seconds_gather_off": seconds_off, "sync_peak_mib": sync_peak}


def scenario_zero3_peft(workdir: Path) -> dict:
    """ZeRO-3 with LoRA: the sync's merged weights equal merge_and_unload of the unsharded model."""
    import copy

    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    from leantune.generation.weight_sync import policy_weights_for_sync

    accelerator = _zero3_accelerator()
    torch.manual_seed(0)
    model = get_peft_model(LlamaForCausalLM(policy_config(vocab_size=1024, hidden=512, layers=4)),
                           LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.3)
    expected = copy.deepcopy(model).merge_and_unload().state_dict()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    engine, optimizer = accelerator.prepare(model, optimizer)
    synced = {name: tensor.cpu().clone() for name, tensor in policy_weights_for_sync(engine, accelerator)}
    assert sorted(synced) == sorted(expected)
    worst = max((synced[name] - tensor).abs().max().item() for name, tensor in expected.items())
    assert worst <= 1e-5, f"merged weights under ZeRO-3 differ by {worst}"
    again = {name: tensor.cpu().clone() for name, tensor in policy_weights_for_sync(engine, accelerator)}
    assert all(torch.equal(again[name], synced[name]) for name in synced), "the sync changed the sharded weights"
    return {"tensors": len(synced), "max_abs_diff": worst}


SCENARIOS = {name.removeprefix("scenario_"): fn for name, fn in globals().items() if name.startswith("scenario_")}


def main(argv: list[str]) -> int:
    name, workdir = argv[0], Path(argv[1])
    workdir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "4")
    result = SCENARIOS[name](workdir)
    write_result(workdir, name, result)
    print(f"{name}: {json.dumps(result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
