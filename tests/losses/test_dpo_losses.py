"""Every DPO loss type of TRL 1.16 against values computed by hand, several at once, and on the trainer.

The per-pair formulas are written out again here, in float64 with `math`, independently of
leantune/losses/preference.py; the losses are evaluated in float64 too, so they agree to rounding (rel 1e-12).
"""

from __future__ import annotations

import math

import pytest
import torch
from datasets import Dataset

from leantune import DPOConfig, DPOTrainer
from leantune.losses.preference import DPO_LOSS_TYPES, dpo_loss, pair_sequence_logps, wpo_weights
from leantune.losses.token_logprobs import select_targets

from ..fixtures.comparisons import GradientRecorder, rel_diff
from ..fixtures.data import hh_rows
from ..fixtures.models import tiny_model

pytestmark = pytest.mark.quick  # the quick tier (tests/quick_tier.py): this file's tests take seconds

# Three pairs: summed completion log-probs of policy and reference, chosen and rejected, and completion lengths.
PC, PR = [-4.0, -7.5, -3.2], [-5.0, -6.0, -8.1]
RC, RR = [-4.3, -7.0, -3.9], [-4.6, -6.4, -7.2]
LC, LR = [4, 6, 3], [5, 2, 7]
RAW_PC = [-4.4, -8.0, -3.2]  # chosen sums without LD-DPO weighting (what sft reads)
BETA, EPS, TAU = 0.5, 0.1, 0.05


def ls(x: float) -> float:  # log sigmoid
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def sig(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def by_hand(loss_type: str, eps: float = EPS) -> list[float]:
    """Per-pair loss. c = pc - rc, r = pr - rr (log-ratios), d = c - r."""
    b = BETA
    c = [p - q for p, q in zip(PC, RC)]
    r = [p - q for p, q in zip(PR, RR)]
    d = [x - y for x, y in zip(c, r)]
    if loss_type == "sigmoid":  # -log s(b d)
        return [-ls(b * x) for x in d]
    if loss_type == "hinge":  # max(0, 1 - b d)
        return [max(0.0, 1 - b * x) for x in d]
    if loss_type == "ipo":  # (c/|chosen| - r/|rejected| - 1/(2b))^2
        return [(x / lc - y / lr - 1 / (2 * b)) ** 2 for x, y, lc, lr in zip(c, r, LC, LR)]
    if loss_type == "exo_pair":  # s(bd) (log s(bd) - log(1-eps)) + s(-bd) (log s(-bd) - log eps)
        return [sig(b * x) * (ls(b * x) - math.log(1 - eps)) + sig(-b * x) * (ls(-b * x) - math.log(eps)) for x in d]
    if loss_type == "nca_pair":  # -log s(bc) - 0.5 log s(-bc) - 0.5 log s(-br)
        return [-ls(b * x) - 0.5 * ls(-b * x) - 0.5 * ls(-b * y) for x, y in zip(c, r)]
    if loss_type == "robust":  # (-(1-eps) log s(bd) + eps log s(-bd)) / (1 - 2 eps)
        return [(-(1 - eps) * ls(b * x) + eps * ls(-b * x)) / (1 - 2 * eps) for x in d]
    if loss_type == "bco_pair":  # -log s(bc) - log s(-br)   (TRL 1.16: no running mean of rewards)
        return [-ls(b * x) - ls(-b * y) for x, y in zip(c, r)]
    if loss_type == "sppo_hard":  # (c - 1/(2b))^2 + (r + 1/(2b))^2
        return [(x - 0.5 / b) ** 2 + (y + 0.5 / b) ** 2 for x, y in zip(c, r)]
    if loss_type == "aot":  # cDPO on sort(pc - pr) - sort(rc - rr) over the batch
        e = [x - y for x, y in zip(sorted(p - q for p, q in zip(PC, PR)), sorted(p - q for p, q in zip(RC, RR)))]
        return [-(1 - eps) * ls(b * x) - eps * ls(-b * x) for x in e]
    if loss_type == "aot_unpaired":  # cDPO on sort(c) - sort(r) over the batch
        e = [x - y for x, y in zip(sorted(c), sorted(r))]
        return [-(1 - eps) * ls(b * x) - eps * ls(-b * x) for x in e]
    if loss_type == "apo_zero":  # 1 - s(bc) + s(br)
        return [1 - sig(b * x) + sig(b * y) for x, y in zip(c, r)]
    if loss_type == "apo_down":  # s(bc) + 1 - s(b (c - r))
        return [sig(b * x) + 1 - sig(b * (x - y)) for x, y in zip(c, r)]
    if loss_type == "discopop":  # l = bd, m = s(l / tau): -log s(l) (1 - m) + exp(-l) m
        return [-ls(b * x) * (1 - sig(b * x / TAU)) + math.exp(-b * x) * sig(b * x / TAU) for x in d]
    if loss_type == "sft":  # -(sum of chosen token log-probs over the batch) / (chosen tokens), for every pair
        return [-sum(RAW_PC) / sum(LC)] * 3
    if loss_type == "sigmoid_norm":  # -log s(b (c/|chosen| - r/|rejected|))
        return [-ls(b * (x / lc - y / lr)) for x, y, lc, lr in zip(c, r, LC, LR)]
    raise KeyError(loss_type)


def tensors(requires_grad=False):
    pc, pr = (torch.tensor(v, dtype=torch.float64, requires_grad=requires_grad) for v in (PC, PR))
    rc, rr, raw = (torch.tensor(v, dtype=torch.float64) for v in (RC, RR, RAW_PC))
    return pc, pr, rc, rr, raw


def loss_of(loss_type, pc=None, pr=None, raw=None, **kwargs):
    tpc, tpr, rc, rr, traw = tensors()
    pc = tpc if pc is None else pc
    pr = tpr if pr is None else pr
    kwargs.setdefault("label_smoothing", EPS if loss_type in ("exo_pair", "robust", "aot", "aot_unpaired") else 0.0)
    return dpo_loss(pc, pr, rc, rr, BETA, loss_type, chosen_lengths=torch.tensor(LC),
                    rejected_lengths=torch.tensor(LR), chosen_raw_logps=traw if raw is None else raw,
                    discopop_tau=TAU, **kwargs)


def test_every_trl_loss_type_is_covered():
    assert set(DPO_LOSS_TYPES) == {"sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair",
                                   "sppo_hard", "aot", "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft",
                                   "sigmoid_norm"}  # TRL 1.16's list, no more, no less


@pytest.mark.parametrize("loss_type", DPO_LOSS_TYPES)
def test_loss_type_against_hand_computed_values(loss_type):
    losses, chosen_rewards, rejected_rewards = loss_of(loss_type)
    assert losses.dtype == torch.float64
    assert losses.tolist() == pytest.approx(by_hand(loss_type), rel=1e-12)  # float64 both ways: rounding only
    assert chosen_rewards.tolist() == pytest.approx([BETA * (p - q) for p, q in zip(PC, RC)], rel=1e-12)
    assert rejected_rewards.tolist() == pytest.approx([BETA * (p - q) for p, q in zip(PR, RR)], rel=1e-12)


# d loss / d (policy chosen) < 0 and d loss / d (policy rejected) > 0 for each pair, at these inputs (all margins
# well inside the losses' active regions). Left out: discopop (not monotone near margin 0, by design), apo_down's
# chosen side (it lowers the chosen likelihood on purpose), sft's rejected side (0: sft reads chosen only), aot's
# per-pair signs (sorting pairs them across examples; their sums are checked).
@pytest.mark.parametrize("loss_type", [t for t in DPO_LOSS_TYPES if t != "discopop"])
def test_gradient_directions(loss_type):
    pc, pr, _, _, raw = tensors(requires_grad=True)
    raw = pc if loss_type == "sft" else raw  # sft's gradient flows through the chosen log-probs
    losses, _, _ = loss_of(loss_type, pc=pc, pr=pr, raw=raw)
    losses.sum().backward()
    if loss_type in ("aot", "aot_unpaired"):
        assert pc.grad.sum() < 0 and pr.grad.sum() > 0
        return
    if loss_type != "apo_down":
        assert (pc.grad < 0).all(), pc.grad
    if loss_type == "sft":
        assert pr.grad is None or (pr.grad == 0).all()
    else:
        assert (pr.grad > 0).all(), pr.grad


def test_list_of_loss_types_is_the_weighted_sum():
    combined, _, _ = loss_of(["sigmoid", "sft", "apo_zero"], loss_weights=[0.8, 0.2, 1.0])
    expected = [0.8 * a + 0.2 * b + 1.0 * c for a, b, c in zip(by_hand("sigmoid"), by_hand("sft"), by_hand("apo_zero"))]
    assert combined.tolist() == pytest.approx(expected, rel=1e-12)
    unweighted, _, _ = loss_of(["sigmoid", "ipo"])  # no weights: all 1
    assert unweighted.tolist() == pytest.approx([a + b for a, b in zip(by_hand("sigmoid"), by_hand("ipo"))],
                                                rel=1e-12)
    with pytest.raises(ValueError, match="loss_weights"):
        loss_of(["sigmoid", "ipo"], loss_weights=[1.0])


@pytest.mark.parametrize("f_divergence_type", ["forward_kl", "js_divergence", "alpha_divergence"])
def test_f_divergence_scores_for_sigmoid_and_sigmoid_norm(f_divergence_type):
    alpha = 0.3
    # score(u) for u = pi/ref, from log u: forward KL 1 - 1/u; JS log(2u / (1 + u)); alpha (u^(a-1) - 1) / (a - 1)
    score = {"forward_kl": lambda lr: 1 - math.exp(-lr),
             "js_divergence": lambda lr: math.log(2 * math.exp(lr) / (1 + math.exp(lr))),
             "alpha_divergence": lambda lr: (math.exp((alpha - 1) * lr) - 1) / (alpha - 1)}[f_divergence_type]
    sc = [score(p - q) for p, q in zip(PC, RC)]
    sr = [score(p - q) for p, q in zip(PR, RR)]
    losses, _, _ = loss_of("sigmoid", f_divergence_type=f_divergence_type, f_alpha_divergence_coef=alpha)
    assert losses.tolist() == pytest.approx([-ls(BETA * (x - y)) for x, y in zip(sc, sr)], rel=1e-12)
    losses, _, _ = loss_of("sigmoid_norm", f_divergence_type=f_divergence_type, f_alpha_divergence_coef=alpha)
    expected = [-ls(BETA * (x / a - y / b)) for x, y, a, b in zip(sc, sr, LC, LR)]
    assert losses.tolist() == pytest.approx(expected, rel=1e-12)
    with pytest.raises(ValueError, match="f_divergence_type"):
        loss_of("apo_zero", f_divergence_type=f_divergence_type)


def test_alpha_divergence_at_alpha_1_is_reverse_kl():
    assert loss_of("sigmoid", f_divergence_type="alpha_divergence", f_alpha_divergence_coef=1.0)[0].tolist() == \
        pytest.approx(by_hand("sigmoid"), rel=1e-12)


@pytest.mark.parametrize("ld_alpha", [None, 0.0, 0.25, 1.0])
def test_ld_alpha_weights_tokens_beyond_the_shared_length_padded_and_padding_free(ld_alpha):
    # 2 pairs: chosen completions of 3 and 1 targets, rejected of 5 and 2; shared lengths 3 and 1
    completion = [3, 1, 5, 2]
    prompt, width = 2, 8
    padded = torch.full((4, width), -100)
    flat = []
    for row, n in enumerate(completion):
        padded[row, prompt:prompt + n] = 7  # a label at position t is the target of position t - 1
        flat += [-100] * prompt + [7] * n
    flat = torch.tensor(flat + [-100, -100])[None]  # one padding-free row, a trailing padding segment
    flat_starts = torch.tensor([0, 5, 8, 15, 19])  # segment offsets: prompt + completion each, then the padding
    values = {}
    for name, labels, starts in (("padded", padded, torch.arange(4) * width), ("flat", flat, flat_starts)):
        targets = select_targets(labels)
        logps = -0.1 * torch.arange(1, len(targets) + 1, dtype=torch.float64)  # target k (in order): -0.1 (k+1)
        values[name] = pair_sequence_logps(logps, targets, starts, 2, ld_alpha)
    # by hand: target k's log-prob is -0.1 (k+1), sequences' targets in order; weight 1 for the first `shared`
    # targets of a sequence, ld_alpha (None: 1) beyond
    w = 1.0 if ld_alpha is None else ld_alpha
    shared = [3, 1, 3, 1]
    expected, raw, k = [], [], 0
    for n, s in zip(completion, shared):
        vals = [-0.1 * (k + i + 1) for i in range(n)]
        expected.append(sum(vals[:s]) + w * sum(vals[s:]))
        raw.append(sum(vals))
        k += n
    for name, got in values.items():
        assert got.lengths.tolist() == completion, name
        assert got.logps.tolist() == pytest.approx(expected, rel=1e-12), name
        assert got.raw_logps.tolist() == pytest.approx(raw, rel=1e-12), name


def test_wpo_weights_by_hand():
    # two sequences in padded rows: targets 3 and 1; weight = exp(mean over targets of logp - log sum p^2)
    labels = torch.full((2, 6), -100)
    labels[0, 2:5] = 7
    labels[1, 3] = 7
    targets = select_targets(labels)
    logps = torch.tensor([-1.0, -2.0, -3.0, -0.5], dtype=torch.float64)
    log_sum_sq = torch.tensor([-0.5, -0.5, -1.0, -0.25], dtype=torch.float64)
    weights = wpo_weights(logps, log_sum_sq, targets, torch.arange(2) * 6, torch.tensor([3, 1]))
    expected = [math.exp(((-1.0 + 0.5) + (-2.0 + 0.5) + (-3.0 + 1.0)) / 3), math.exp(-0.5 + 0.25)]
    assert weights.tolist() == pytest.approx(expected, rel=1e-12)


def test_config_keeps_trl_types_and_refuses_what_leantune_lacks():
    assert DPOConfig(output_dir="x", use_cpu=True).loss_type == ["sigmoid"]  # TRL's default: a list
    assert DPOConfig(output_dir="x", use_cpu=True, loss_type="ipo").loss_type == "ipo"  # not rewritten
    DPOConfig(output_dir="x", use_cpu=True, loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.5], ld_alpha=0.5,
              f_divergence_type="js_divergence")
    for bad, field_name in ((dict(use_weighting=True, loss_type="aot"), "use_weighting"),
                            (dict(loss_type="nope"), "loss_type"),
                            (dict(loss_type=["sigmoid", "ipo"], loss_weights=[1.0]), "loss_weights"),
                            (dict(loss_type="exo_pair"), "label_smoothing"),
                            (dict(label_smoothing=0.1), "label_smoothing"),  # no effect on sigmoid in TRL 1.16
                            (dict(loss_type="bco_pair", f_divergence_type="forward_kl"), "f_divergence_type"),
                            (dict(ld_alpha=1.5), "ld_alpha"), (dict(f_divergence_type="kl"), "f_divergence_type")):
        with pytest.raises(ValueError, match=field_name):
            DPOConfig(output_dir="x", use_cpu=True, **bad)


# --- on the trainer: chunked == full logits, padding-free == padded ----------------------------------------------


@pytest.fixture(scope="module")
def pairs() -> Dataset:
    rows = hh_rows(24)
    # the 4 shortest pairs (about 50-200 tokens a sequence), untruncated: one batch of the whole set, quick on CPU
    return Dataset.from_list(sorted(rows, key=lambda row: len(row["chosen"]) + len(row["rejected"]))[:4])


def one_step(tokenizer, dataset, tmp_path, **overrides):
    args = DPOConfig(output_dir=str(tmp_path), max_length=None, report_to=[], save_strategy="no", use_cpu=True,
                     per_device_train_batch_size=4, max_steps=1, max_grad_norm=0.0, seed=0, logging_steps=1,
                     learning_rate=1e-3, memory_breakdown=False, **overrides)
    model = tiny_model()
    # a different reference (seed 1): log-ratios, margins and the sorted orders of aot are all non-trivial
    trainer = DPOTrainer(model=model, ref_model=tiny_model(seed=1), args=args, train_dataset=dataset,
                         processing_class=tokenizer)
    recorder = GradientRecorder(trainer.model)
    trainer.add_callback(recorder)
    trainer.train()
    return recorder.grads, next(entry for entry in trainer.state.log_history if "loss" in entry)


@pytest.mark.parametrize("loss", [
    dict(loss_type="sigmoid"), dict(loss_type="ipo"), dict(loss_type="apo_zero"), dict(loss_type="sft"),
    dict(loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.5]),
    dict(loss_type=["sigmoid_norm", "aot"], ld_alpha=0.5),
    dict(loss_type=["sigmoid", "ipo"], use_weighting=True),
], ids=["sigmoid", "ipo", "apo_zero", "sft", "sigmoid+sft", "sigmoid_norm+aot+ld_alpha", "sigmoid+ipo+wpo"])
def test_chunked_and_padding_free_give_the_same_loss_and_gradients(loss, tokenizer, pairs, tmp_path):
    reference_grads, reference_log = one_step(tokenizer, pairs, tmp_path / "ref", chunked_loss=False, **loss)
    assert math.isfinite(reference_log["loss"]) and reference_log["loss"] != 0
    for chunked, padding_free in ((True, False), (False, True), (True, True)):
        extra = dict(loss_chunk_size=32) if chunked else {}
        grads, log = one_step(tokenizer, pairs, tmp_path / f"{chunked}{padding_free}", chunked_loss=chunked,
                              padding_free=padding_free, **extra, **loss)
        # every layout and path gives the same fp32 per-token log-probs (per-token differences ~1e-7 relative),
        # summed per sequence in a different order; the loss math after the sums is the same code: 1e-5 is well
        # above the rounding of sums of a few hundred terms
        assert log["loss"] == pytest.approx(reference_log["loss"], rel=1e-5), (chunked, padding_free)
        for name, expected in reference_grads.items():
            assert rel_diff(grads[name], expected) <= 1e-5, (chunked, padding_free, name)
    if loss.get("use_weighting"):  # the weights are there: without them the loss is another one
        _, unweighted = one_step(tokenizer, pairs, tmp_path / "plain", **dict(loss, use_weighting=False))
        assert abs(unweighted["loss"] - reference_log["loss"]) > 1e-3 * abs(unweighted["loss"])
