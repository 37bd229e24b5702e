"""GRPO's TRL 1.16 objective options: by-hand float64 values of each loss variant, the trainer's chunked / full-logits
and padded / padding-free paths equal with them on, and the sampling log-probs every generation backend returns
(transformers' generate, the `leantune vllm-serve` protocol with its CPU engine, the colocated vLLM extraction)."""

from __future__ import annotations

import math
import threading
from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator

from leantune import GRPOConfig, GRPOTrainer
from leantune.generation.sampling import Completions, SamplingSettings
from leantune.generation.server_requests import logprobs_from_json, logprobs_to_json
from leantune.generation.transformers_backend import TransformersBackend
from leantune.generation.vllm_client import VLLMServerClient
from leantune.generation.vllm_colocate import completions_of
from leantune.generation.vllm_server import TransformersEngine, make_server, serve
from leantune.losses.policy_gradient import (
    GRPOObjective,
    grpo_token_loss,
    high_entropy_mask,
    loss_aggregation,
    off_policy_sequence_mask,
    sampling_correction_weights,
)
from leantune.models.output_head import OutputHead, compute_head_in_fp32
from leantune.trainers.parts.logprob_engine import LogProbPath

from ..fixtures.data import count_a
from ..fixtures.data import reversal_prompts_with_answers as prompts
from ..fixtures.models import char_model
from ..fixtures.online_rounds import assert_grads_close, loss_and_grads, one_round
from ..fixtures.online_rounds import grpo_config as config

pytestmark = pytest.mark.quick  # the quick tier (tests/quick_tier.py): this file's tests take seconds

F64 = torch.float64
# The by-hand cases are float64 sums and products of a handful of terms: exact to ~1e-15 of values of order 1.
EXACT = dict(rtol=1e-12, atol=1e-12)


def t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


# --- the loss variants, by hand ---------------------------------------------------------------------------------

SEQUENCE = torch.tensor([0, 0, 1, 1, 2])
LOGPS = [math.log(p) for p in (0.5, 0.5, 0.5, 0.5, 0.2)]
OLD = [math.log(p) for p in (0.25, 0.25, 1.0, 0.5, 0.1)]  # ratios 2, 2, 0.5, 1, 2
REF = [math.log(p) for p in (0.25, 0.5, 0.25, 0.5, 0.1)]  # ref / policy: 0.5, 1, 0.5, 1, 0.5
ADVANTAGES = [1.0, -1.0, -2.0]  # per completion: tokens get 1, 1, -1, -1, -2
K3_HALF = 0.5 - math.log(0.5) - 1  # k3 where ref / policy = 0.5


def test_token_level_clip_delta_masks_weights_and_bias_corrected_kl_by_hand():
    logps = t(LOGPS).requires_grad_()
    objective = GRPOObjective(epsilon_low=0.2, epsilon_high=0.28, delta=1.5, beta=0.1)
    token_mask = torch.tensor([True, False, True, True, True])
    sequence_mask = t([1.0, 1.0, 0.0])  # completion 2 (token 4) dropped
    weights = t([0.5, 1.0, 2.0, 1.0, 1.0])
    loss, metrics = grpo_token_loss(logps, t(OLD), t(ADVANTAGES), SEQUENCE, 3, objective, ref_logps=t(REF),
                                    sampling_weights=weights, token_mask=token_mask, sequence_mask=sequence_mask)
    # clipped terms -min(r A, clip(r) A), r capped at delta=1.5:  token 0: -min(1.5, 1.28) = -1.28 (x weight 0.5);
    # token 1: masked; token 2: -min(-0.5, -0.8) = 0.8 (x weight 2); token 3: 1; token 4: -min(-3, -2.56) = 3, dropped
    policy = [-1.28 * 0.5, 0.0, 0.8 * 2.0, 1.0, 0.0]
    kl = [K3_HALF * 2.0, 0.0, K3_HALF * 0.5, 0.0, K3_HALF * 2.0]  # k3 x ratio (2, 2, 0.5, 1, 2)
    torch.testing.assert_close(loss.detach(), t([p + 0.1 * k for p, k in zip(policy, kl)]), **EXACT)
    loss.sum().backward()
    # d/dlogp: the clipped, capped and masked policy terms have none; token 3 is unclipped: -A r = 1.
    # KL x r: d(k3 r)/dlogp = (1 - ref/policy) r + k3 r
    kl_grad = [(0.5 * 2.0 + K3_HALF * 2.0), 0.0, (0.5 * 0.5 + K3_HALF * 0.5), 0.0, (0.5 * 2.0 + K3_HALF * 2.0)]
    torch.testing.assert_close(logps.grad, t([0.1 * g for g in kl_grad]) + t([0, 0, 0, 1.0, 0]), **EXACT)
    assert metrics["kl"].item() == pytest.approx(sum(kl) / 5, rel=1e-12)
    # clip counts on the capped ratio: tokens 0, 1 high-clipped (A > 0), token 2 low-clipped (A < 0, r < 0.8)
    assert metrics["clip_ratio/high_mean"].item() == pytest.approx(2 / 5)
    assert metrics["clip_ratio/low_mean"].item() == pytest.approx(1 / 5)


def test_bias_corrected_kl_changes_the_gradient_even_on_policy():
    ref = t(REF)
    grads = {}
    for corrected in (True, False):
        logps = t(LOGPS).requires_grad_()
        objective = GRPOObjective(beta=1.0, use_bias_correction_kl=corrected)
        loss, _ = grpo_token_loss(logps, logps.detach(), torch.zeros(3, dtype=F64), SEQUENCE, 3, objective,
                                  ref_logps=ref)
        loss.sum().backward()
        grads[corrected] = logps.grad
        # on-policy the ratio is 1: the value is the plain k3 either way
        torch.testing.assert_close(loss.detach(), (ref - logps).exp().detach() - (ref - logps).detach() - 1, **EXACT)
    k3 = [K3_HALF, 0.0, K3_HALF, 0.0, K3_HALF]
    plain = [1 - 0.5, 0.0, 1 - 0.5, 0.0, 1 - 0.5]  # d k3 / d logp = 1 - ref / policy
    torch.testing.assert_close(grads[False], t(plain), **EXACT)
    torch.testing.assert_close(grads[True], t([p + k for p, k in zip(plain, k3)]), **EXACT)  # + k3 x d r


def test_sequence_level_ratio_gspo_by_hand():
    # completion 0: token ratios 2 and 1 -> one ratio sqrt(2) = exp(mean log-ratio); completion 1: ratio 1
    logps = t([math.log(0.5), math.log(0.5), math.log(0.4)]).requires_grad_()
    old = t([math.log(0.25), math.log(0.5), math.log(0.4)])
    sequence = torch.tensor([0, 0, 1])
    objective = GRPOObjective(epsilon_low=0.2, epsilon_high=0.5, importance_sampling_level="sequence")
    token_loss, metrics = grpo_token_loss(logps, old, t([1.0, -1.0]), sequence, 2, objective)
    root2 = math.sqrt(2.0)
    torch.testing.assert_close(token_loss.detach(), t([-root2, -root2, 1.0]), **EXACT)  # each token: its completion's
    loss = loss_aggregation("grpo").total(token_loss, sequence, 2)
    assert loss.item() == pytest.approx(1.0 - root2, rel=1e-12)
    loss.backward()
    # d(-A exp(mean log-ratio)) / dlogp_i = -A s / |completion|
    torch.testing.assert_close(logps.grad, t([-root2 / 2, -root2 / 2, 1.0]), **EXACT)
    assert metrics["clip_ratio/high_mean"].item() == 0.0
    # with epsilon_high 0.28, sqrt(2) is clipped: counted once per completion (1 of 2), not per token (2 of 3)
    _, metrics = grpo_token_loss(logps, old, t([1.0, -1.0]), sequence, 2,
                                 GRPOObjective(epsilon_high=0.28, importance_sampling_level="sequence"))
    assert metrics["clip_ratio/high_mean"].item() == 0.5


def test_vllm_importance_sampling_weights_by_hand():
    old = t([-1.0, -1.0, -2.0, -0.5])
    sampling = t([-1.5, float("nan"), -1.0, -0.5])  # log pi_old - log pi_vllm: 0.5, (unreported: 0), -1, 0
    sequence = torch.tensor([0, 0, 1, 1])
    e = math.exp

    def weights(mode, low, high):
        return sampling_correction_weights(old, sampling, sequence, 2, mode, low, high)[0]

    torch.testing.assert_close(weights("token_truncate", None, 1.5), t([1.5, 1.0, e(-1), 1.0]), **EXACT)
    torch.testing.assert_close(weights("token_mask", 0.5, 1.5), t([0.0, 1.0, 0.0, 1.0]), **EXACT)
    # per completion: exp of the summed differences, 0.5 and -1
    torch.testing.assert_close(weights("sequence_truncate", 0.5, 1.5), t([1.5, 1.5, 0.5, 0.5]), **EXACT)
    torch.testing.assert_close(weights("sequence_mask", 0.5, 3.0), t([e(0.5), e(0.5), 0.0, 0.0]), **EXACT)
    _, ratios = sampling_correction_weights(old, sampling, sequence, 2, "sequence_mask", 0.5, 3.0)
    assert ratios.numel() == 2  # one ratio per completion for the metrics


def test_off_policy_mask_and_high_entropy_mask_by_hand():
    logps = t([-1.0, -1.0, -2.0, -0.5])
    behaviour = t([-0.5, -0.7, -2.0, float("nan")])  # divergences 0.5, 0.3 (mean 0.4) | 0, unreported (mean 0)
    sequence = torch.tensor([0, 0, 1, 1])
    mask = off_policy_sequence_mask(logps, behaviour, t([-1.0, -1.0]), sequence, 2, 0.35)
    assert mask.tolist() == [0.0, 1.0]  # negative advantage and mean divergence 0.4 > 0.35: dropped
    assert off_policy_sequence_mask(logps, behaviour, t([-1.0, -1.0]), sequence, 2, 0.45).tolist() == [1.0, 1.0]
    assert off_policy_sequence_mask(logps, behaviour, t([0.0, -1.0]), sequence, 2, 0.35).tolist() == [1.0, 1.0]
    entropy = torch.tensor([0.1, 0.5, 0.2, 0.9, 0.4])
    # top 40%: threshold = the 0.6 quantile, linear: sorted [.1 .2 .4 .5 .9] at position 2.4 -> 0.4 + 0.4 x 0.1
    assert high_entropy_mask(entropy, entropy, 0.4).tolist() == [False, True, False, True, False]
    assert high_entropy_mask(entropy, entropy, 1.0).all() and high_entropy_mask(entropy, entropy, 0.0).sum() == 1
    # the threshold comes from the pooled values (all processes), not this process's alone
    assert high_entropy_mask(entropy, torch.tensor([0.0, 0.0, 0.0, 0.0, 0.3]), 0.4).tolist() == [
        True, True, True, True, True]


def test_cispo_sapo_luspo_vespo_by_hand():
    """The four TRL 1.16 loss types beyond the clipped ones, on the shared case: token ratios 2, 2, 0.5, 1, 2 and
    token advantages 1, 1, -1, -1, -2 (three completions: tokens 0-1, 2-3, 4)."""
    logp_values, a_tok = LOGPS, [1.0, 1.0, -1.0, -1.0, -2.0]
    ratios = [2.0, 2.0, 0.5, 1.0, 2.0]

    def run(objective, **kwargs):
        logps = t(logp_values).requires_grad_()
        loss, metrics = grpo_token_loss(logps, t(OLD), t(ADVANTAGES), SEQUENCE, 3, objective, **kwargs)
        loss.sum().backward()
        return loss.detach(), logps.grad, metrics

    # cispo: the ratio capped at epsilon_high (1.5) and detached, times -A x logp; gradient -w A
    loss, grad, metrics = run(GRPOObjective(epsilon_high=1.5, loss_type="cispo"))
    w = [min(r, 1.5) for r in ratios]
    torch.testing.assert_close(loss, t([-wi * a * lp for wi, a, lp in zip(w, a_tok, logp_values)]), **EXACT)
    torch.testing.assert_close(grad, t([-wi * a for wi, a in zip(w, a_tok)]), **EXACT)
    assert metrics["cispo_clip_ratio"].item() == pytest.approx(2 / 5)  # ratio above the cap where A > 0
    # sapo: -sigmoid(tau (r - 1)) x 4 / tau x A, tau 1 where A > 0 else 1.05; d/dlogp = -4 s (1 - s) r A
    loss, grad, _ = run(GRPOObjective(loss_type="sapo", sapo_temperature_pos=1.0, sapo_temperature_neg=1.05))
    taus = [1.0 if a > 0 else 1.05 for a in a_tok]
    gates = [1 / (1 + math.exp(-tau * (r - 1))) for tau, r in zip(taus, ratios)]
    torch.testing.assert_close(loss, t([-g * 4 / tau * a for g, tau, a in zip(gates, taus, a_tok)]), **EXACT)
    torch.testing.assert_close(grad, t([-4 * g * (1 - g) * r * a for g, r, a in zip(gates, ratios, a_tok)]), **EXACT)
    assert loss_aggregation("sapo").total(loss, SEQUENCE, 3).item() == pytest.approx(
        sum((loss[i] + loss[j]).item() / 2 for i, j in ((0, 1), (2, 3))) + loss[4].item(), rel=1e-12)  # per completion
    # luspo (sequence level): each completion's clipped loss on all its tokens, summed: a completion's loss x length
    loss, _, _ = run(GRPOObjective(epsilon_low=0.2, epsilon_high=0.2, importance_sampling_level="sequence",
                                   loss_type="luspo"))
    # sequence ratios exp(mean log r): 2, sqrt(0.5), 2 -> -min(2, 1.2) = -1.2; -min(-0.707, -0.8) = 0.8; 4
    assert loss_aggregation("luspo").total(loss, SEQUENCE, 3).item() == pytest.approx(2 * -1.2 + 2 * 0.8 + 4.0, rel=1e-12)
    assert loss_aggregation("luspo").items(3, 5, 8) == 3 and loss_aggregation("cispo").items(3, 5, 8) == 5
    # vespo: phi(w) = exp(lam + k log w - lam w), w = the completion's product of token ratios; loss -phi A logp
    loss, grad, metrics = run(GRPOObjective(loss_type="vespo"))
    w_seq, a_seq = [4.0, 0.5, 2.0], ADVANTAGES
    kl_pairs = [(2.0, 3.0) if a >= 0 else (3.0, 2.0) for a in a_seq]  # (k, lambda) by the advantage's sign
    phi = [math.exp(lam + k * math.log(wv) - lam * wv) for wv, (k, lam) in zip(w_seq, kl_pairs)]
    phi_tok = [phi[i] for i in SEQUENCE.tolist()]
    torch.testing.assert_close(grad, t([-p * a for p, a in zip(phi_tok, a_tok)]), **EXACT)
    torch.testing.assert_close(loss, t([-p * a * lp for p, a, lp in zip(phi_tok, a_tok, logp_values)]), **EXACT)
    assert metrics["vespo/phi_seq_mean"].item() == pytest.approx(sum(phi) / 3, rel=1e-12)
    # vLLM's per-token weights enter w (and multiply nothing else): halving token 4's weight halves w of completion 2
    loss, grad, _ = run(GRPOObjective(loss_type="vespo"), sampling_weights=t([1.0, 1.0, 1.0, 1.0, 0.5]))
    k, lam = kl_pairs[2]
    assert grad[4].item() == pytest.approx(-math.exp(lam + k * math.log(1.0) - lam * 1.0) * -2.0, rel=1e-12)


@pytest.mark.parametrize("loss_type", ["cispo", "sapo", "luspo", "vespo"])
def test_new_loss_types_give_the_same_loss_and_gradients_padded_and_padding_free(loss_type, char_tokenizer):
    """Padded + full logits against padding-free + chunked log-probs, off-policy (fp32): loss rel 1e-5 (sums of ~100
    fp32 terms of order 1), gradients `assert_grads_close` (rel 1e-5 of each tensor's largest entry)."""
    options = dict(OPTIONS, loss_type=loss_type, epsilon_high=1.2 if loss_type == "cispo" else 0.28,
                   importance_sampling_level="sequence" if loss_type == "luspo" else "token")
    results = []
    for padding_free, path in ((False, LogProbPath.FULL), (True, LogProbPath.CHUNKED)):
        trainer = GRPOTrainer(char_model(char_tokenizer), count_a,
                              args=config(padding_free=padding_free, shared_prompt=False, **options),
                              train_dataset=prompts(), processing_class=char_tokenizer)
        torch.manual_seed(5)
        batch = off_policy_batch(trainer, one_round(trainer)[0])
        trainer.logprob_path = path
        results.append(loss_and_grads(trainer, batch))
    (loss, grads), (expected_loss, expected_grads) = results
    assert torch.isfinite(expected_loss) and expected_loss.abs() > 1e-6
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-7)
    assert_grads_close(grads, expected_grads)


# --- through the trainer ----------------------------------------------------------------------------------------

OPTIONS = dict(beta=0.1, importance_sampling_level="sequence", delta=1.3, epsilon_high=0.28, top_entropy_quantile=0.5,
               off_policy_mask_threshold=0.02, cast_lm_head_to_fp32=True, loss_type="grpo")


def off_policy_batch(trainer, batch: dict) -> dict:
    """The batch with generation-time log-probs moved by +0.3 on even completions and -0.35 on odd ones (plus a
    +-0.05 ramp over the tokens), and reference log-probs by +-0.2 per token: ratios ~0.74 and ~1.42, so whatever the
    advantages, the off-policy mask (even, A < 0), the delta cap (odd, A < 0), the clip and the KL all act."""
    from leantune.data.collators import sequence_starts
    from leantune.losses.token_logprobs import select_targets, target_sequences

    batch = dict(batch)
    trainer.rounds.attach_logps([batch], policy_too=True)
    sequence = target_sequences(select_targets(batch["labels"]), sequence_starts(batch))
    n = len(sequence)
    offsets = torch.where(sequence % 2 == 0, 0.3, -0.35) + torch.linspace(-0.05, 0.05, n)
    batch["old_logps"] = batch["old_logps"] + offsets
    batch["ref_logps"] = batch["ref_logps"] + 0.2 * (1 - 2 * (torch.arange(n) % 2))
    return batch


def test_new_options_give_the_same_loss_and_gradients_on_every_path(char_tokenizer):
    """Padded / padding-free x chunked / full logits, all options on, off-policy (fp32). Loss: rel 1e-5 (sums of ~100
    fp32 terms of order 1); gradients: `assert_grads_close` (rel 1e-5 of each tensor's largest entry)."""
    results = {}
    for padding_free in (False, True):
        trainer = GRPOTrainer(char_model(char_tokenizer), count_a,
                              args=config(padding_free=padding_free, shared_prompt=False, **OPTIONS),
                              train_dataset=prompts(), processing_class=char_tokenizer)
        assert trainer.model.get_output_embeddings()._leantune_fp32
        torch.manual_seed(5)
        batch = off_policy_batch(trainer, one_round(trainer)[0])
        for path in (LogProbPath.CHUNKED, LogProbPath.FULL):
            trainer.logprob_path = path
            trainer.run_metrics.values["train"].clear()
            loss, grads = loss_and_grads(trainer, batch)
            results[padding_free, path] = (loss, grads, batch["input_ids"][batch["input_ids"] != 0].tolist())
    expected_loss, expected_grads, expected_ids = results[False, LogProbPath.FULL]
    for key, (loss, grads, ids) in results.items():
        assert ids == expected_ids, f"{key}: a different round"
        torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-7)
        assert_grads_close(grads, expected_grads)
    # the options matter: the plain objective on the same (padded, full-logits) batch gives another loss
    plain = GRPOTrainer(char_model(char_tokenizer), count_a, args=config(loss_type="grpo", beta=0.1,
                                                                        shared_prompt=False),
                        train_dataset=prompts(), processing_class=char_tokenizer)
    plain.logprob_path = LogProbPath.FULL
    torch.manual_seed(5)
    batch = off_policy_batch(plain, one_round(plain)[0])
    assert abs(loss_and_grads(plain, batch)[0].item() - expected_loss.item()) > 1e-3


def test_cast_lm_head_to_fp32_projects_in_float32_and_keeps_tied_weights(char_tokenizer):
    model = char_model(char_tokenizer).to(torch.bfloat16)
    head = OutputHead.of(model).module
    hidden = torch.randn(3, 5, head.in_features, dtype=torch.bfloat16)
    bf16_logits = head(hidden)
    compute_head_in_fp32(model)
    logits = head(hidden)
    assert logits.dtype == torch.float32 and head.weight.dtype == torch.bfloat16
    assert head.weight is model.get_input_embeddings().weight  # still tied; embeddings still give bf16
    assert model.get_input_embeddings()(torch.tensor([[3, 4]])).dtype == torch.bfloat16
    # exactly the fp32 product of the bf16 values (same matmul), and not the bf16 one
    torch.testing.assert_close(logits, hidden.float() @ head.weight.float().T, rtol=1e-6, atol=1e-6)
    assert (logits - bf16_logits.float()).abs().max() > 1e-3
    with torch.no_grad():  # the model's own forward goes through it: fp32 logits
        assert model(input_ids=torch.tensor([[1, 5, 6]])).logits.dtype == torch.float32


def test_cast_lm_head_to_fp32_refuses_a_peft_adapter_on_the_head(char_tokenizer):
    from peft import LoraConfig

    args = config(cast_lm_head_to_fp32=True)
    with pytest.raises(ValueError, match="cast_lm_head_to_fp32"):
        GRPOTrainer(char_model(char_tokenizer), count_a, args=args, train_dataset=prompts(),
                    processing_class=char_tokenizer,
                    peft_config=LoraConfig(r=2, target_modules=["q_proj", "lm_head"]))


def test_config_validation_of_the_new_fields(tmp_path):
    def build(**fields):
        return GRPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, **fields)

    for fields, message in [
        (dict(importance_sampling_level="seq"), "importance_sampling_level"),
        (dict(vllm_importance_sampling_mode="token"), "vllm_importance_sampling_mode"),
        (dict(vllm_importance_sampling_clip_min=3.0), "must be less than"),
        (dict(vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=None), "clip_min"),
        (dict(top_entropy_quantile=1.5), "top_entropy_quantile"),
        (dict(delta=0.0), "delta"),
    ]:
        with pytest.raises(ValueError, match=message):
            build(**fields)
    assert build(vllm_importance_sampling_cap=2.0).vllm_importance_sampling_clip_max == 2.0  # TRL's old name
    assert build(use_vllm=True).needs_sampling_logprobs and not build().needs_sampling_logprobs
    assert not build(use_vllm=True, vllm_importance_sampling_correction=False).needs_sampling_logprobs


# --- sampling log-probs from every backend ----------------------------------------------------------------------

EOS = 2


def own_logprobs(model, prompt: list[int], completion: list[int], temperature: float) -> torch.Tensor:
    """The model's log-probs of `completion` after `prompt`, one unpadded row, at this temperature."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + completion])).logits[0].double()
    rows = logits[len(prompt) - 1:-1] / temperature
    return torch.log_softmax(rows, -1).gather(-1, torch.tensor(completion).unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_transformers_backend_returns_the_models_own_logprobs(char_tokenizer, temperature):
    model = char_model(char_tokenizer).eval()
    backend = TransformersBackend(model, Accelerator(cpu=True))
    prompts_ = [[1, 40, 41, 42, 43, 44], [1, 50, 51], [1, 60, 61, 62]]  # different lengths: left padding
    sampling = SamplingSettings(max_new_tokens=10, temperature=temperature, eos_token_ids=(EOS,), pad_token_id=0,
                                seed=3)
    completions = backend.generate(prompts_, sampling)
    assert isinstance(completions, Completions) and len(completions.logprobs) == 3
    for prompt, ids, logprobs in zip(prompts_, completions, completions.logprobs):
        assert len(logprobs) == len(ids) > 0
        # left-padded batched generation against one unpadded row: fp32 attention over the same real tokens, rounding
        # ~1e-6 on log-probs of order 1-5 (measured max 5e-7); 1e-4 is far below any real mismatch (a wrong position
        # or a missing temperature moves them by > 0.1)
        expected = own_logprobs(model, prompt, ids, temperature or 1.0)
        torch.testing.assert_close(torch.tensor(logprobs, dtype=F64), expected, rtol=0, atol=1e-4)
    assert backend.generate(prompts_, SamplingSettings(max_new_tokens=4, logprobs=False)).logprobs is None


def test_transformers_backend_logprobs_follow_top_k_filtering(char_tokenizer):
    """The sampled distribution after top-k is the top-k logits renormalised: logp - logsumexp(top k)."""
    model = char_model(char_tokenizer).eval()
    sampling = SamplingSettings(max_new_tokens=6, temperature=0.8, top_k=5, eos_token_ids=(EOS,), pad_token_id=0,
                                seed=1)
    prompt = [1, 40, 41]
    completions = TransformersBackend(model, Accelerator(cpu=True)).generate([prompt], sampling)
    ids = completions[0]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].double() / 0.8
    top = logits.topk(5, dim=-1).values
    expected = logits.gather(-1, torch.tensor(ids).unsqueeze(-1)).squeeze(-1) - torch.logsumexp(top, -1)
    torch.testing.assert_close(torch.tensor(completions.logprobs[0], dtype=F64), expected, rtol=0, atol=1e-4)


@pytest.fixture
def in_process_server(tmp_path):
    """`leantune vllm-serve`'s HTTP server and transformers engine on a thread of this process; its base URL."""
    started = []

    def start(model) -> str:
        path = tmp_path / f"served{len(started)}"
        model.save_pretrained(path)
        server = make_server(TransformersEngine(str(path)), host="127.0.0.1", port=0)
        thread = threading.Thread(target=serve, args=(server,), daemon=True)
        thread.start()
        started.append((server, thread))
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server, thread in started:
        server.stopping.set()
        thread.join(timeout=10)


def test_server_returns_the_models_own_logprobs_to_its_client(char_tokenizer, in_process_server):
    model = char_model(char_tokenizer).eval()
    client = VLLMServerClient(in_process_server(model), request_timeout=30)
    prompts_ = [[1, 40, 41, 42], [1, 40, 41, 42], [1, 50]]
    for temperature in (0.0, 0.9):
        sampling = SamplingSettings(max_new_tokens=8, temperature=temperature, eos_token_ids=(EOS,), pad_token_id=0,
                                    seed=11)
        completions = client.generate(prompts_, sampling)
        assert len(completions.logprobs) == 3
        for prompt, ids, logprobs in zip(prompts_, completions, completions.logprobs):
            # the server generates unpadded rows: the same fp32 computation up to batch shape (1e-4: as above)
            expected = own_logprobs(model, prompt, ids, temperature or 1.0)
            torch.testing.assert_close(torch.tensor(logprobs, dtype=F64), expected, rtol=0, atol=1e-4)
    plain = client.generate(prompts_, SamplingSettings(max_new_tokens=3, logprobs=False))
    assert plain.logprobs is None and len(plain) == 3


def test_logprobs_travel_as_json_with_unreported_values_as_null():
    rows = [[-0.5, float("nan")], [], [float("-inf")]]
    assert logprobs_to_json(rows) == [[-0.5, None], [], [None]]
    back = logprobs_from_json(logprobs_to_json(rows))
    assert back[0][0] == -0.5 and math.isnan(back[0][1]) and math.isnan(back[2][0]) and back[1] == []


def test_colocated_vllm_outputs_become_completions_with_the_sampled_tokens_logprobs():
    """vLLM's RequestOutput shape: outputs[0].token_ids and, with logprobs=0, one {token id: Logprob} per position
    (the sampled token's entry; vLLM may add others). Cut after EOS; NaN where an entry is missing."""
    def position(token, value, extra=()):
        return {token: SimpleNamespace(logprob=value), **{t: SimpleNamespace(logprob=-9.0) for t in extra}}

    outputs = [
        SimpleNamespace(outputs=[SimpleNamespace(token_ids=(5, 6, EOS, 7), logprobs=[
            position(5, -0.1, extra=(9,)), position(6, -0.2), position(EOS, -0.3), position(7, -0.4)])]),
        SimpleNamespace(outputs=[SimpleNamespace(token_ids=(8, 9), logprobs=[position(8, -1.0), {}])]),
        SimpleNamespace(outputs=[SimpleNamespace(token_ids=(4,), logprobs=None)]),
    ]
    sampling = SamplingSettings(max_new_tokens=8, eos_token_ids=(EOS,))
    completions = completions_of(outputs, sampling)
    assert completions == [[5, 6, EOS], [8, 9], [4]]
    assert completions.logprobs[0] == [-0.1, -0.2, -0.3]
    assert completions.logprobs[1][0] == -1.0 and math.isnan(completions.logprobs[1][1])
    assert math.isnan(completions.logprobs[2][0])
    assert completions_of(outputs, SamplingSettings(max_new_tokens=2, logprobs=False)).logprobs is None


def test_vllm_sampling_params_ask_for_the_sampled_tokens_logprob(monkeypatch):
    import sys
    import types

    from leantune.generation.vllm_colocate import to_vllm_sampling_params

    module = types.ModuleType("vllm")
    module.SamplingParams = lambda **kwargs: kwargs
    monkeypatch.setitem(sys.modules, "vllm", module)
    assert to_vllm_sampling_params(SamplingSettings(max_new_tokens=4))["logprobs"] == 0
    assert "logprobs" not in to_vllm_sampling_params(SamplingSettings(max_new_tokens=4, logprobs=False))


# --- vLLM's correction end to end, against the server's CPU engine ------------------------------------------------


def test_grpo_with_the_server_corrects_by_the_engines_logprobs(char_tokenizer, in_process_server):
    """The engine holds the policy's weights (synced), so its log-probs are the trainer's: ratio ~1. Moving the
    sampling log-probs by +log 2 makes every token-level weight 1/2, which halves the policy gradient (beta = 0)."""
    model = char_model(char_tokenizer)
    url = in_process_server(char_model(char_tokenizer, seed=1))  # other weights until the first sync
    args = config(use_vllm=True, vllm_mode="server", vllm_server_base_url=url, vllm_server_timeout=30,
                  vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=3.0,
                  loss_type="dapo")
    trainer = GRPOTrainer(model, count_a, args=args, train_dataset=prompts(), processing_class=char_tokenizer)
    batch = one_round(trainer)[0]
    assert "old_logps" in batch and len(batch["sampling_logps"]) == len(batch["old_logps"])  # always, with vLLM
    # engine (unpadded rows) vs trainer (padded scoring batch): fp32 rounding, as in the backend tests
    torch.testing.assert_close(batch["sampling_logps"], batch["old_logps"], rtol=0, atol=1e-4)
    _, grads = loss_and_grads(trainer, batch)
    logged = trainer.run_metrics.values["train"]
    assert logged["sampling/sampling_logp_difference/max"][0] < 1e-4
    assert logged["sampling/importance_sampling_ratio/mean"][0] == pytest.approx(1.0, abs=1e-4)
    shifted = dict(batch, sampling_logps=batch["sampling_logps"] + math.log(2.0))
    _, halved = loss_and_grads(trainer, shifted)
    # on-policy the gradient is -sum(A x w x dlogp) / tokens: w = 1 to 1e-4 (above) against exactly 1/2, so each
    # gradient entry halves to within 2e-4 of the tensor's largest entry
    for name, grad in grads.items():
        assert grad.abs().max() > 0
        torch.testing.assert_close(halved[name], grad / 2, rtol=0, atol=2e-4 * float(grad.abs().max()))
    assert trainer.run_metrics.values["train"]["sampling/importance_sampling_ratio/mean"][1] == pytest.approx(0.5, abs=1e-4)


# --- the entropy bonus ------------------------------------------------------------------------------------------


def test_entropy_bonus_is_coef_times_mean_entropy_on_every_path(char_tokenizer):
    """loss(coef) = loss(0) - coef x mean token entropy, whatever the loss type's normaliser; its gradient is the
    same through chunked and full logits, padded and padding-free (rel 1e-5: sums of ~100 fp32 terms of order 1)."""
    results = {}
    for loss_type in ("dapo", "dr_grpo"):
        for padding_free, path in ((False, LogProbPath.FULL), (True, LogProbPath.CHUNKED)):
            losses = {}
            for coef in (0.0, 0.5):
                trainer = GRPOTrainer(char_model(char_tokenizer), count_a,
                                      args=config(padding_free=padding_free, shared_prompt=False, loss_type=loss_type,
                                                  entropy_coef=coef, beta=0.1),
                                      train_dataset=prompts(), processing_class=char_tokenizer)
                trainer.current_gradient_accumulation_steps = 1
                torch.manual_seed(5)
                batch = off_policy_batch(trainer, one_round(trainer)[0])
                trainer.logprob_path = path
                trainer.run_metrics.values["train"].clear()
                losses[coef] = loss_and_grads(trainer, batch)
                entropy = trainer.run_metrics.values["train"]["entropy"][-1]
            (plain, _), (with_bonus, grads) = losses[0.0], losses[0.5]
            assert with_bonus.item() == pytest.approx(plain.item() - 0.5 * entropy, rel=1e-5)
            assert trainer.run_metrics.values["train"]["policy_loss"][-1] == pytest.approx(plain.item(), rel=1e-5)
            results[loss_type, padding_free] = grads
        assert_grads_close(results[loss_type, True], results[loss_type, False])


def test_adaptive_entropy_moves_once_per_optimizer_step_and_resumes(char_tokenizer, tmp_path):
    from leantune.losses.entropy_bonus import EntropyBonus

    args = config(entropy_coef=0.01, use_adaptive_entropy=True, entropy_target=100.0, entropy_coef_delta=0.005,
                  gradient_accumulation_steps=2, per_device_train_batch_size=4, max_steps=3, save_strategy="steps",
                  save_steps=3, output_dir=str(tmp_path))
    trainer = GRPOTrainer(char_model(char_tokenizer), count_a, args=args, train_dataset=prompts(),
                          processing_class=char_tokenizer)
    trainer.train()
    # entropy (~ln 60 at most) is below the target at every step: +delta per optimizer step, not per micro-batch
    assert trainer.entropy_coef == pytest.approx(0.01 + 3 * 0.005)
    assert [e["entropy_coef"] for e in trainer.state.log_history if "entropy_coef" in e][:3] == pytest.approx(
        [0.015, 0.02, 0.025])
    resumed = EntropyBonus.from_config(args)
    resumed.load(str(tmp_path / "checkpoint-3"))
    assert resumed.coef == pytest.approx(0.025) and resumed.last_step_entropy < 100.0
    # above the target it decreases towards entropy_coef_min and the bonus is off while entropy stays above it
    bonus = EntropyBonus(0.01, adaptive=True, target=0.5, coef_min=0.0, delta=0.005)
    assert bonus.applied_coef == 0.0  # nothing measured yet
    bonus.observe(torch.tensor([1.0, 2.0]))
    bonus.end_step(lambda totals: totals)
    assert (bonus.coef, bonus.last_step_entropy, bonus.applied_coef) == (pytest.approx(0.005), 1.5, 0.0)
