"""Reward functions of the online trainers: callables and their keyword arguments, names, weights and the combined
reward by hand, every bad return value, and reward models checked against a hand-run of the same model."""

from __future__ import annotations

import asyncio
import functools
import math

import numpy as np
import pytest
import torch

from leantune.rewards import RewardFunctionError, RewardFunctions, RewardScores

from ..fixtures.paths import TOKENIZER_DIR, require
from ..fixtures.tokenizers import load_tokenizer

pytestmark = pytest.mark.quick  # the quick tier (tests/quick_tier.py): this file's tests take seconds

PROMPTS = ["What is 2 + 2?", "Name a colour.", "Say hi."]
COMPLETIONS = [" 4", " blue", " hello there"]
COMPLETION_IDS = [[28705, 28781], [5045], [6312, 736]]


def score(funcs, prompts=PROMPTS, completions=COMPLETIONS, completion_ids=COMPLETION_IDS, **kwargs) -> RewardScores:
    return RewardFunctions(funcs).score(prompts, completions, completion_ids, **kwargs)


def completion_length(completions, **kwargs):
    return [float(len(c)) for c in completions]


def constant_one(completions, **kwargs):
    return [1.0] * len(completions)


# --- callables ----------------------------------------------------------------------------------------------------


def test_each_function_fills_its_own_column():
    scores = score([completion_length, constant_one])
    assert scores.names == ["completion_length", "constant_one"]
    assert scores.per_function.dtype == torch.float32 and scores.per_function.device.type == "cpu"
    torch.testing.assert_close(scores.per_function, torch.tensor([[2.0, 1.0], [5.0, 1.0], [12.0, 1.0]]))
    assert scores.missing == [0, 0] and scores.nan == [0, 0]


def test_dataset_columns_arrive_as_keyword_arguments():
    seen = {}

    def correctness(completions, answer, **kwargs):
        seen.update(kwargs)
        return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]

    scores = score(correctness, columns={"answer": ["4", "red", "hello there"], "level": [1, 2, 3]})
    assert scores.per_function[:, 0].tolist() == [1.0, 0.0, 1.0]
    assert seen["prompts"] == PROMPTS and seen["completion_ids"] == COMPLETION_IDS and seen["level"] == [1, 2, 3]
    assert "trainer_state" in seen and seen["trainer_state"] is None


def test_partial_and_trainer_state_pass_through():
    states = []

    def scaled_length(completions, factor, trainer_state, **kwargs):
        states.append(trainer_state)
        return [factor * len(c) for c in completions]

    state = object()
    rewards = RewardFunctions([functools.partial(scaled_length, factor=3)])
    scores = rewards.score(PROMPTS, COMPLETIONS, COMPLETION_IDS, trainer_state=state)
    assert rewards.names == ["scaled_length"]
    assert scores.per_function[:, 0].tolist() == [6.0, 15.0, 36.0]
    assert states == [state]


def test_names_of_functions_objects_and_duplicates():
    class LengthPenalty:
        def __call__(self, completions, **kwargs):
            return [-len(c) for c in completions]

    funcs = [completion_length, completion_length, functools.partial(functools.partial(completion_length)),
             LengthPenalty(), lambda completions, **kwargs: [0] * len(completions)]
    rewards = RewardFunctions(funcs)
    assert rewards.names == ["completion_length", "completion_length_2", "completion_length_3", "LengthPenalty",
                             "<lambda>"]
    torch.testing.assert_close(rewards.weights, torch.ones(5))


def test_accepted_return_types():
    returns = {
        "as_tuple": (1, 2.5, True),
        "as_numpy": np.array([1.0, 2.5, 1.0], dtype=np.float64),
        "as_tensor": torch.tensor([1.0, 2.5, 1.0], requires_grad=True),
        "as_scalars": [np.int64(1), torch.tensor(2.5), np.bool_(True)],
        "as_objects": np.array([1, None, 1.0], dtype=object),
    }
    funcs = []
    for name, value in returns.items():
        def func(completions, _value=value, **kwargs):
            return _value
        func.__name__ = name
        funcs.append(func)
    scores = score(funcs)
    expected = torch.tensor([1.0, 2.5, 1.0]).unsqueeze(1).repeat(1, 5)
    expected[1, 4] = math.nan
    torch.testing.assert_close(scores.per_function, expected, equal_nan=True)
    assert scores.missing == [0, 0, 0, 0, 1]


def test_async_functions_run_and_their_errors_name_them():
    async def judged(completions, **kwargs):
        await asyncio.sleep(0)
        return [0.5] * len(completions)

    async def broken_judge(completions, **kwargs):
        raise ConnectionError("judge unreachable")

    assert score([judged, constant_one]).per_function.tolist() == [[0.5, 1.0]] * 3
    with pytest.raises(RewardFunctionError, match="'broken_judge' raised ConnectionError: judge unreachable"):
        score([broken_judge])


# --- None, NaN and the combined reward ----------------------------------------------------------------------------


def test_none_and_nan_are_counted_and_combined_ignores_them_by_hand():
    def accuracy(completions, **kwargs):
        return [1.0, None, None, 0.0]

    def formatting(completions, **kwargs):
        return [0.5, float("nan"), None, 2.0]

    rewards = RewardFunctions([accuracy, formatting], reward_weights=[2.0, -1.0])
    scores = rewards.score(["p"] * 4, ["a", "b", "c", "d"], [[1]] * 4)
    assert scores.missing == [2, 1] and scores.nan == [0, 1]
    combined = scores.combined(rewards.weights)
    # Row 0: 2*1 - 0.5; row 1: nothing scored it (None and NaN); row 2: nothing; row 3: 2*0 - 2.
    torch.testing.assert_close(combined, torch.tensor([1.5, math.nan, math.nan, -2.0]), equal_nan=True)
    assert scores.unscored().tolist() == [False, True, True, False]
    # One function scoring a row is enough: its weighted reward alone.
    partly = RewardScores(torch.tensor([[math.nan, 3.0]]), ["a", "b"], [1, 0], [0, 0])
    assert partly.combined(torch.tensor([2.0, 0.5])).tolist() == [1.5]
    with pytest.raises(ValueError, match="expected 2 reward weights"):
        scores.combined(torch.ones(3))


def test_weights_must_match_and_be_finite():
    assert RewardFunctions([constant_one, completion_length], reward_weights=[0.5, 2]).weights.tolist() == [0.5, 2.0]
    with pytest.raises(ValueError, match="`reward_weights` has 1 entries but there are 2"):
        RewardFunctions([constant_one, completion_length], reward_weights=[1.0])
    with pytest.raises(ValueError, match="finite"):
        RewardFunctions([constant_one], reward_weights=[float("inf")])
    with pytest.raises(ValueError, match="finite"):
        RewardFunctions([constant_one], reward_weights=[float("nan")])


def test_weighted_sum_beyond_float32_is_an_error():
    # Each reward and weight is finite in float32 (max ~3.4028e38), but 3e38 * 2 overflows to inf in the sum.
    scores = RewardScores(torch.tensor([[3e38, 0.0], [1.0, 2.0]]), ["a", "b"], [0, 0], [0, 0])
    with pytest.raises(ValueError, match=r"1 completion\(s\) is beyond float32's range"):
        scores.combined(torch.tensor([2.0, 1.0]))
    assert scores.combined(torch.tensor([1.0, 1.0])).tolist() == [pytest.approx(3e38, rel=1e-6), 3.0]


# --- bad return values --------------------------------------------------------------------------------------------


def returning(value):
    def bad_reward(completions, **kwargs):
        if isinstance(value, Exception):
            raise value
        return value

    return bad_reward


@pytest.mark.parametrize(("value", "error", "message"), [
    (KeyError("answer"), RewardFunctionError, r"'bad_reward' raised KeyError: 'answer' \(while scoring 3 completions\)"),
    ([1.0, 2.0], ValueError, "'bad_reward' returned 2 rewards for 3 completions"),
    (1.0, TypeError, "'bad_reward' returned float"),
    (None, TypeError, "'bad_reward' returned NoneType"),
    ("1.0", TypeError, "'bad_reward' returned str"),
    ([1.0, "yes", 0.0], TypeError, "'bad_reward' returned a str at index 1"),
    ([1.0, 1j, 0.0], TypeError, "'bad_reward' returned a complex at index 1"),
    ([[1.0], [2.0], [3.0]], TypeError, "'bad_reward' returned a list at index 0"),
    (torch.ones(3, 1), TypeError, r"'bad_reward' returned a 2-D Tensor of shape \(3, 1\)"),
    ([float("inf"), 0.0, float("-inf")], ValueError, "'bad_reward' returned 2 infinite"),
    # finite as Python floats, infinite in the float32 column the trainer uses (float32's largest is ~3.4028e38)
    ([1e39, 0.0, -1e39], ValueError, "'bad_reward' returned 2 infinite"),
    (np.array([1e39, 0.0, 1.0]), ValueError, "'bad_reward' returned 1 infinite"),
])
def test_bad_return_values_name_the_function(value, error, message):
    with pytest.raises(error, match=message) as raised:
        score([constant_one, returning(value)])
    if error is RewardFunctionError:
        assert isinstance(raised.value.__cause__, KeyError)


def test_not_a_reward_function_and_column_mismatches():
    with pytest.raises(TypeError, match="reward function 1 is a int"):
        RewardFunctions([constant_one, 3])
    with pytest.raises(ValueError, match="column 'answer' has 2 entries for 3 completions"):
        score(constant_one, columns={"answer": ["4", "blue"]})
    with pytest.raises(ValueError, match="'completions' clashes"):
        score(constant_one, columns={"completions": ["4", "blue", "hi"]})


# --- reward models ------------------------------------------------------------------------------------------------

MAX_POSITIONS = 128


def tiny_reward_model(vocab_size: int, pad_token_id: int | None = 0, seed: int = 0):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_POSITIONS,
                         pad_token_id=pad_token_id, bos_token_id=1, eos_token_id=2, num_labels=1,
                         attn_implementation="sdpa")
    return LlamaForSequenceClassification(config).float().eval()


@pytest.fixture(scope="module")
def mistral_tokenizer():

    return load_tokenizer(require(TOKENIZER_DIR))


@pytest.fixture(scope="module")
def saved_reward_model(tmp_path_factory, mistral_tokenizer):
    """A tiny reward model and the tokenizer saved side by side, as a reward model checkpoint on disk is."""
    model = tiny_reward_model(len(mistral_tokenizer), pad_token_id=mistral_tokenizer.pad_token_id)
    path = tmp_path_factory.mktemp("rewards") / "tiny-llama-rm"
    model.save_pretrained(path)
    mistral_tokenizer.save_pretrained(path)
    return str(path), model


def by_hand(model, tokenizer, text: str, add_special_tokens: bool = True) -> float:
    ids = tokenizer(text, add_special_tokens=add_special_tokens, return_tensors="pt").input_ids
    with torch.no_grad():
        return model(input_ids=ids).logits[0, 0].item()


def test_reward_model_from_path_matches_a_hand_run_on_plain_text(saved_reward_model, mistral_tokenizer):
    path, model = saved_reward_model
    rewards = RewardFunctions(path)
    assert rewards.names == ["tiny-llama-rm"]
    loaded = rewards.funcs[0]
    assert not loaded.training and not any(p.requires_grad for p in loaded.parameters())
    scores = rewards.score(PROMPTS, COMPLETIONS, COMPLETION_IDS, columns={"answer": ["4", "blue", "hi"]})
    expected = [by_hand(model, mistral_tokenizer, p + c) for p, c in zip(PROMPTS, COMPLETIONS)]
    # scores of these random reward heads are ~0.1-0.3; a padded batch vs one unpadded forward changes only the
    # fp32 summation order (measured <= 6e-8); atol 1e-5 is ~1e-4 of the scores, 100x the rounding
    torch.testing.assert_close(scores.per_function[:, 0], torch.tensor(expected), atol=1e-5, rtol=0)
    assert len(set(expected)) == 3  # the texts really differ to the model


def test_reward_model_scores_the_chat_template_of_conversations(saved_reward_model, mistral_tokenizer):
    path, model = saved_reward_model
    prompts = [[{"role": "user", "content": p}] for p in PROMPTS]
    completions = [[{"role": "assistant", "content": c.strip()}] for c in COMPLETIONS]
    scores = RewardFunctions(path).score(prompts, completions, COMPLETION_IDS)
    texts = [mistral_tokenizer.apply_chat_template(p + c, tokenize=False) for p, c in zip(prompts, completions)]
    assert texts[0] == "<s>[INST] What is 2 + 2? [/INST] 4</s>"
    expected = [by_hand(model, mistral_tokenizer, text, add_special_tokens=False) for text in texts]
    torch.testing.assert_close(scores.per_function[:, 0], torch.tensor(expected), atol=1e-5, rtol=0)  # as above
    with pytest.raises(ValueError, match="all conversational"):
        RewardFunctions(path).score([prompts[0], PROMPTS[1]], [completions[0], COMPLETIONS[1]], COMPLETION_IDS[:2])


def test_reward_model_chunks_agree_with_one_at_a_time(saved_reward_model):
    path, _ = saved_reward_model
    rewards = RewardFunctions(path)
    prompts = [f"Question {i}: what is {i} times {i}?" for i in range(70)]
    completions = [" " + " ".join(["the answer is"] * (i % 7)) + f" {i * i}" for i in range(70)]
    batch_sizes = []
    hook = rewards.funcs[0].register_forward_pre_hook(
        lambda module, args, kwargs: batch_sizes.append(kwargs["input_ids"].shape[0]), with_kwargs=True)
    together = rewards.score(prompts, completions, [[1]] * 70).per_function[:, 0]
    hook.remove()
    assert batch_sizes == [64, 6]
    alone = torch.cat([rewards.score([p], [c], [[1]]).per_function[:, 0] for p, c in zip(prompts, completions)])
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=0)  # as above


def test_too_long_text_is_an_error_not_a_truncation(saved_reward_model):
    path, _ = saved_reward_model
    long_completion = " word" * (MAX_POSITIONS + 10)
    with pytest.raises(ValueError, match=rf"completion 1 is \d+ tokens .* max_position_embeddings \({MAX_POSITIONS}\)"):
        RewardFunctions(path).score(["a", "b"], [" short", long_completion], [[1], [1]])


def test_model_object_needs_a_tokenizer(mistral_tokenizer):
    model = tiny_reward_model(len(mistral_tokenizer))
    with pytest.raises(ValueError, match="reward_processing_classes"):
        RewardFunctions(model)
    with pytest.raises(ValueError, match=r"`reward_processing_classes` \(1\) must match the number of reward "
                                         r"functions \(2\)"):
        RewardFunctions([constant_one, model], reward_processing_classes=[mistral_tokenizer])


def test_pad_tokens_are_filled_in(mistral_tokenizer):
    import copy

    tokenizer = copy.deepcopy(mistral_tokenizer)
    tokenizer.pad_token = None
    model = tiny_reward_model(len(tokenizer), pad_token_id=None)
    rewards = RewardFunctions(model, reward_processing_classes=tokenizer)
    assert tokenizer.pad_token_id == tokenizer.eos_token_id == model.config.pad_token_id == 2
    assert rewards.names == ["LlamaForSequenceClassification"]
    assert rewards.to("cpu") is rewards
    assert torch.isfinite(rewards.score(PROMPTS, COMPLETIONS, COMPLETION_IDS).per_function).all()


def test_mixed_callable_and_model_with_weights(saved_reward_model, mistral_tokenizer):
    path, model = saved_reward_model
    in_memory = tiny_reward_model(len(mistral_tokenizer), pad_token_id=0, seed=1)
    rewards = RewardFunctions([completion_length, in_memory, path], reward_weights=[0.1, 2.0, -1.0],
                              reward_processing_classes=[None, mistral_tokenizer, None])
    assert rewards.names == ["completion_length", "LlamaForSequenceClassification", "tiny-llama-rm"]
    scores = rewards.score(PROMPTS, COMPLETIONS, COMPLETION_IDS)
    lengths = torch.tensor([2.0, 5.0, 12.0])
    first = torch.tensor([by_hand(in_memory, mistral_tokenizer, p + c) for p, c in zip(PROMPTS, COMPLETIONS)])
    second = torch.tensor([by_hand(model, mistral_tokenizer, p + c) for p, c in zip(PROMPTS, COMPLETIONS)])
    # as above; the weighted sum (|values| <= 1.4, weights <= 2) adds a few ulps (measured 1.2e-7)
    torch.testing.assert_close(scores.per_function, torch.stack([lengths, first, second], dim=1), atol=1e-5, rtol=0)
    torch.testing.assert_close(scores.combined(rewards.weights), 0.1 * lengths + 2.0 * first - second,
                               atol=1e-5, rtol=0)
    # A single tokenizer goes to the single reward model of the list.
    single = RewardFunctions([completion_length, in_memory], reward_processing_classes=mistral_tokenizer)
    assert single.tokenizers[1] is mistral_tokenizer


def test_model_init_kwargs_reach_from_pretrained(saved_reward_model):
    path, _ = saved_reward_model
    rewards = RewardFunctions([path], model_init_kwargs={"dtype": torch.float64})
    assert rewards.funcs[0].dtype == torch.float64
    assert rewards.score(PROMPTS, COMPLETIONS, COMPLETION_IDS).per_function.dtype == torch.float32
