"""Every trainer under DDP, FSDP2, ZeRO-2 and ZeRO-3, launched for real as 2 CPU processes by `accelerate launch` with
the accelerate config files in examples/accelerate/, against one process with the same global batch.

What runs here is what a GPU user runs: the shipped config files as they are, DeepSpeed with its own defaults. The
CPU-only parts are the helpers in devkit/cpu_engines/ (accelerate's FSDP on CPU processes, DeepSpeed's CPU
accelerator). One more ZeRO-3 launch, of two cases, uses devkit/cpu_engines/deepspeed_zero3_cpu.json for what is
measured rather than trained: the plan's accuracy (the plan models neither DeepSpeed's prefetching nor its
small-parameter persistence; see docs/plan.md) and the weights held during sharded generation.

Tolerances (SGD with momentum 0.9, no clipping, 2 steps, lr 1e-2; tests/scripts/engine_run.py):
- Per-step losses: 1e-5 relative. The engines change only how partial sums over the global batch are ordered and
  all-reduced (fp32, ~1e-7 relative; measured: identical to the last bit for most cases). A lost or duplicated row
  moves a 16-row batch's loss by ~1e-2.
- Final weights: per parameter, |W_n - W_1| <= 1e-5 |W_1 - W_0| + 2^-22 |W_1|. The update W_1 - W_0 is linear in the
  global batch's gradient, so it agrees to fp32 rounding (measured <= 5e-6 of it); each of the 2 steps then stores
  W + update rounded to fp32, a half-ulp per element (2^-24 |W| in norm), which the second term allows twice over.
  Parameters whose update is tiny next to the weight (q/k projections of a random model: |U| ~ 1e-4 |W|) differ by
  that rounding alone (measured 3.7e-9 = one ulp of their entries).
- Online methods (GRPO, RLOO, PPO, Online DPO, on-policy GKD) sample their completions per process, so their reference is the 2-process DDP run: the
  same seeds give the same completions under every engine (asserted), and then the same losses and weights.
"""

from __future__ import annotations

import gzip
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ..fixtures.data import gsm8k_rows
from ..fixtures.launched_runs import assert_same_losses, assert_same_weights
from ..fixtures.launchers import accelerate_launch, cpu_only, launch
from ..fixtures.models import tiny_model
from ..fixtures.paths import CPU_ENGINES, HH_PAIRS, REPO, SCRIPTS, require

SCRIPT = SCRIPTS / "engine_run.py"
HELPERS = CPU_ENGINES
EXAMPLES = REPO / "examples" / "accelerate"

OFFLINE = ["sft", "sft_tied", "sft_packed_padding_free", "sft_lora", "dpo", "dpo_padding_free",
           "dpo_padding_free_precomputed", "kto", "reward"]
OFFLINE = OFFLINE + ["gkd"]  # GKD off-policy (lmbda=0): SFT's paths, its frozen teacher placed as DPO's reference
ONLINE = ["grpo", "rloo", "grpo_reward_model", "ppo", "online_dpo"]
ONLINE = ONLINE + ["gkd_on_policy"]  # GKD with lmbda=1: both steps on the student's own samples, generated per process
RESUMED = {"sft_resumed": "sft"}  # stopped after step 1 and resumed from the engine's (ZeRO-3: sharded) checkpoint
# GRPO with shared_prompt=True: each group's prompt scored once; the unshared "grpo" case's completions, losses and
# weights (under DDP) are its reference under every engine
SHARED_PROMPT = {"grpo_shared": "grpo"}
ONLINE = ONLINE + list(SHARED_PROMPT)
SAME_AS = {**RESUMED, **SHARED_PROMPT}  # a case whose reference is another case's run
# Under the sharding engines, a case that takes the same code path as another one there is left to DDP (padded DPO,
# as padding-free DPO; RLOO, as GRPO), which keeps the suite's time in bounds.
SHARDED = [c for c in OFFLINE if c != "dpo"] + list(RESUMED) + ["grpo", "grpo_reward_model"]
SHARDED = SHARDED + ["ppo"]  # PPO's value head is sharded with the policy: gathered to save it
SHARDED = SHARDED + ["online_dpo"]  # (and GKD, from OFFLINE: its frozen teacher sharded too, its head gathered)
SHARDED = SHARDED + list(SHARED_PROMPT)  # the shared prompt's K/V gradients summed over branches, then sharded
ENGINE_CASES = {
    "ddp": OFFLINE + list(RESUMED) + ONLINE,
    # GRPO's unshared path runs here as "grpo_reward_model" (GRPO plus a sharded reward model), its shared one as
    # "grpo_shared": plain "grpo" is left to DDP and ZeRO-3 (where sharded generation is compared with it)
    "fsdp2": [c for c in SHARDED if c != "grpo"],
    # ZeRO-2 shards only gradients and optimizer states, the same way for every trainer: one of each kind
    "zero2": ["sft", "sft_lora", "dpo", "kto", "reward", "sft_resumed", "grpo"] + ["gkd"],
    # precompute_ref_log_probs without a ref_model is refused under ZeRO-3 (docs/scale_out.md)
    # "sft" runs in the measured launch below (its plan check); "sft_tied" and "sft_packed_padding_free" train SFT's
    # chunked loss for two steps here, with DeepSpeed's defaults (whose prefetch once stopped step 2)
    "zero3": [c for c in SHARDED if c not in ("sft", "dpo_padding_free_precomputed")]
    + ["gkd_on_policy"],  # the student gathered for its own samples, the teacher sharded
}
# ZeRO-3 with devkit/cpu_engines/deepspeed_zero3_cpu.json: "sft"'s measured step against the plan, and the weights a
# sharded generation round holds (against "grpo" of the launch with DeepSpeed's defaults)
ZERO3_MEASURED = ["sft", "grpo_sharded_generation"]
# DeepSpeed's CPU accelerator compiles its shared-memory all-reduce op (deepspeed_shm_comm) in every process group it
# starts: ~55 s on this 2-core machine. Built once per machine here, as CI's vLLM venv is (torch rebuilds it when its
# sources or flags change; concurrent builds wait on torch's lock file).
TORCH_EXTENSIONS = Path.home() / ".cache" / "leantune" / "torch_extensions"

pytestmark = [pytest.mark.slow, cpu_only,
              pytest.mark.skipif(sys.platform != "linux", reason="gloo multi-process runs on Linux")]


@pytest.fixture(scope="module")
def assets(tmp_path_factory, tokenizer_dir):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("scale_out")
    tiny_model().save_pretrained(root / "model")
    AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(root / "model")
    tied = tiny_model()  # the chunked head then projects with the (sharded) input embedding
    tied.config.tie_word_embeddings = True
    tied.tie_weights()
    tied.save_pretrained(root / "tied_model")
    AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(root / "tied_model")
    rows = gsm8k_rows(64)
    with open(root / "sft.jsonl", "w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps({"prompt": row["question"], "completion": " " + row["answer"]}) + "\n")
    with open(root / "prompts.jsonl", "w", encoding="utf-8") as handle:
        for row in rows[:16]:
            handle.write(json.dumps({"prompt": row["question"][:80]}) + "\n")
    with gzip.open(require(HH_PAIRS), "rt", encoding="utf-8") as source, open(root / "pairs.jsonl", "w") as handle:
        for _, line in zip(range(16), source):
            handle.write(line.rstrip("\n") + "\n")
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(1)  # a reward model of the same tiny shape, one score per sequence
    config = tiny_model().config
    config.num_labels = 1
    AutoModelForSequenceClassification.from_config(config).save_pretrained(root / "reward_model")
    AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(root / "reward_model")
    return SimpleNamespace(root=root, model=root / "model")


def zero3_measured_config(root: Path) -> Path:
    """examples/accelerate/zero3.yaml with the DeepSpeed settings of devkit/cpu_engines/deepspeed_zero3_cpu.json: for
    the plan-accuracy and generation-memory checks only (ZERO3_MEASURED); every trainer runs zero3.yaml as shipped."""
    path = root / "zero3_measured.yaml"
    text = (EXAMPLES / "zero3.yaml").read_text()
    text = text.replace("deepspeed_config:\n", f"deepspeed_config:\n  deepspeed_config_file: {HELPERS / 'deepspeed_zero3_cpu.json'}\n")
    lines = [line for line in text.splitlines() if not line.strip().startswith(("zero_stage", "zero3_save_16bit",
                                                                                "offload_", "mixed_precision"))]
    path.write_text("\n".join(lines) + "\n")
    return path


def run_engine(assets, engine: str, cases: list[str]) -> Path:
    out = assets.root / engine
    env = {"DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": str(TORCH_EXTENSIONS)}
    if engine == "one":
        command = [sys.executable, str(SCRIPT), str(out), str(assets.root), "4", *cases]
    else:
        # the shipped config as it is: DS_ACCELERATOR=cpu (above) is all DeepSpeed needs on a machine without a GPU
        config = zero3_measured_config(assets.root) if engine == "zero3_measured" else EXAMPLES / f"{engine}.yaml"
        flags = accelerate_launch("--config_file", str(config))
        command = [*flags, str(SCRIPT), str(out), str(assets.root), "2", *cases]
        if engine == "fsdp2":
            env.update(PYTHONPATH=os.pathsep.join([str(HELPERS), str(REPO)]), LEANTUNE_TEST_CPU_FSDP="1")
    run, _ = launch(command, timeout=600, extra_env=env)
    assert run.returncode == 0, run.stderr[-4000:]
    return out


def ranks(out: Path, case: str) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((out / case).glob("rank*.json"))]


def saved_weights(out: Path, case: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    folder = out / case
    name = "adapter_model.safetensors" if (folder / "adapter_model.safetensors").exists() else "model.safetensors"
    return load_file(str(folder / name))


@pytest.fixture(scope="module")
def initial(assets):
    from safetensors.torch import load_file

    return load_file(str(assets.model / "model.safetensors"))


def tied_initial(assets) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(assets.root / "tied_model" / "model.safetensors"))


@pytest.fixture(scope="module")
def one_process(assets):
    return run_engine(assets, "one", OFFLINE)


@pytest.fixture(scope="module")
def ddp(assets):
    return run_engine(assets, "ddp", ENGINE_CASES["ddp"])


ENGINES = {  # engine: (distributed type accelerate reports, share of each parameter a process holds)
    "ddp": ("MULTI_CPU", 1.0),
    "fsdp2": ("FSDP", 0.5),
    "zero2": ("DEEPSPEED", 1.0),
    "zero3": ("DEEPSPEED", 0.5),
}


# the output head each engine reaches the chunked loss's weight through, chosen when the trainer is built
# (models/output_head.py's `head_kind`): whole in every process (DDP, ZeRO-2), or gathered by the engine's hooks
HEADS = {"ddp": "DDPOutputHead", "fsdp2": "ShardedOutputHead", "zero2": "DDPOutputHead", "zero3": "ShardedOutputHead"}


@pytest.mark.parametrize("engine", list(ENGINES))
def test_every_trainer_matches_one_process_under_each_engine(engine, assets, initial, one_process, ddp):
    cases = ENGINE_CASES[engine]
    out = ddp if engine == "ddp" else run_engine(assets, engine, ENGINE_CASES[engine])
    # ZeRO-3's plan check launched apart: the plan models neither prefetch nor persistence (docs/plan.md)
    measured = run_engine(assets, "zero3_measured", ZERO3_MEASURED) if engine == "zero3" else out
    distributed_type, held = ENGINES[engine]
    for case in cases:
        first, second = ranks(out, case)
        assert first["world"] == second["world"] == 2 and first["engine"] == distributed_type, (case, first)
        assert first["head"] == second["head"] == HEADS[engine], (case, first["head"])
        assert first["local_fraction"] == pytest.approx(held), (case, first["local_fraction"])
        assert first["losses"] == second["losses"]
        reference = ddp if case in ONLINE else one_process
        expected = ranks(reference, SAME_AS.get(case, case))[0]
        assert_same_losses(first["losses"], expected["losses"])
        if case in ONLINE:
            assert first["completions"] == expected["completions"] and first["completions"]
        start = tied_initial(assets) if case == "sft_tied" else initial
        assert_same_weights(saved_weights(out, case), saved_weights(reference, SAME_AS.get(case, case)), start)
    for case in {"gkd": 0, "gkd_on_policy": 2}.keys() & set(cases):  # every step's source, on both processes
        assert [r["on_policy_steps"] for r in ranks(out, case)] == [{"gkd": 0, "gkd_on_policy": 2}[case]] * 2
    if "ppo" in cases:  # PPO's value head trains with the policy, saved beside it (gathered from the shards)
        from safetensors.torch import load_file

        first, second = ranks(out, "ppo")
        if engine == "ddp":  # each process holds the whole head: the same on both
            assert first["value_function"] == second["value_function"] and any(first["value_function"])
        value, expected = (load_file(str(folder / "ppo" / "value_function.safetensors")) for folder in (out, ddp))
        assert_same_weights(value, expected, {})  # the head starts at 0: its weights are its update
    if held < 1.0:  # the full weights gathered from the shards (FSDP FULL_STATE_DICT, ZeRO-3 16-bit gather) load
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(measured / "sft"))
        assert_same_weights({k: v.detach() for k, v in model.state_dict().items()},
                            saved_weights(one_process, "sft"), initial)
    if engine in ("ddp", "fsdp2"):  # rank 0's measured step 2 against its plan (tests/planning/test_plan_engines.py)
        from ..fixtures.launched_plans import assert_rank_zero_planned

        assert_rank_zero_planned(assets, out, engine)
    elif engine in ("zero2", "zero3"):  # each rank's planned step against its measured breakdown (planning/zero.py)
        from ..fixtures.launched_plans import assert_zero_plan_matches

        deepspeed_file = HELPERS / "deepspeed_zero3_cpu.json" if engine == "zero3" else None  # zero2: accelerate's
        assert_zero_plan_matches(assets, measured, engine, deepspeed_file)
    if engine == "zero3":
        for first in ranks(measured, "sft"):
            assert first["engine"] == "DEEPSPEED" and first["local_fraction"] == pytest.approx(held)
            assert_same_losses(first["losses"], ranks(one_process, "sft")[0]["losses"])
        gathered, sharded = ranks(out, "grpo")[0], ranks(measured, "grpo_sharded_generation")[0]
        # ds3_gather_for_generation=True holds the whole model once per round; False never holds more than the
        # layer at work (here the 32k x 64 embedding, 49% of this tiny model) and the same completions come out.
        assert gathered["gathered_during_generation"] == [1.0, 1.0]
        assert max(sharded["gathered_during_generation"]) < 0.6
        assert sharded["completions"] == gathered["completions"]
        assert sharded["losses"] == gathered["losses"]
