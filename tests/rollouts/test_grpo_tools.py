"""GRPO's agentic keywords (TRL's `tools`, `environment_factory`, `rollout_func`): multi-turn rollouts on a tiny Qwen2
with the real 32k tokenizer given a Qwen-style tool-calling chat template. The policy's turns are scripted (a random
model does not call tools), everything else is real: the chat template renders tool schemas, calls and results, the
trainer parses the calls, runs the tools and environments, and takes real optimizer steps.

What is checked: tool-result tokens are in the sequence but never targets (per token), the policy's later turns are;
environment rewards reach the advantages; the `environment` column routes each example to its environment and its
tools; malformed calls and over-budget results are counted; every construction-time error names what to do."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset

from leantune import GRPOConfig, GRPOTrainer
from leantune.trainers.parts.logprob_engine import LogProbPath

from ..fixtures.online_rounds import one_round
from ..fixtures.paths import CHAT_TEMPLATES, TOKENIZER_DIR
from ..fixtures.tokenizers import load_tokenizer
from ..fixtures.tool_calls import Script, call, multiply, tiny_policy, tool_calling

pytestmark = pytest.mark.quick  # the quick tier (tests/quick_tier.py): this file's tests take seconds

IGNORE = -100


@pytest.fixture(scope="module")
def tool_tokenizer():

    if not TOKENIZER_DIR.exists():
        pytest.skip(f"shared tokenizer not found at {TOKENIZER_DIR}")
    return tool_calling(load_tokenizer(TOKENIZER_DIR))


def config(**overrides) -> GRPOConfig:
    settings = dict(output_dir="/tmp/leantune-test-grpo-tools", use_cpu=True, report_to=[], save_strategy="no",
                    per_device_train_batch_size=3, num_generations=3, max_completion_length=64, max_steps=1,
                    learning_rate=0.05, logging_steps=1, disable_tqdm=True, memory_breakdown=False, seed=0,
                    shuffle_dataset=False, shared_prompt=False)  # the tests read the padded rows' labels (the shared
    settings.update(overrides)  # rows' tool turns: tests/trainers/test_shared_prompt.py)
    return GRPOConfig(**settings)


def questions(n: int = 3, **columns) -> Dataset:
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"What is {i} times 4?"}] for i in range(n)],
                              **columns})


def message_count(completions, **kwargs):
    return [float(len(completion)) for completion in completions]


# --- tools -----------------------------------------------------------------------------------------------------------


def test_tool_results_are_in_the_sequence_but_not_trained(tool_tokenizer):
    trainer = GRPOTrainer(tiny_policy(tool_tokenizer), message_count, args=config(), train_dataset=questions(1),
                          processing_class=tool_tokenizer, tools=[multiply])
    assert trainer.logprob_path is LogProbPath.CHUNKED  # multi-turn log-probs stay on the chunked head
    script = Script(tool_tokenizer, [call("multiply", a=3, b=4), call("multiply", a=3, c=4), "No tool needed."],
                    ["The answer is 12.", "I could not multiply."])
    trainer.model.generate = script
    (batch,) = one_round(trainer)
    # the tool's schema is in the prompt; the second turn continues only the two rollouts that called the tool
    assert '"name": "multiply"' in script.calls[0][0] and len(script.calls) == 2 and len(script.calls[1]) == 2
    assert "<|im_start|>tool\n12<|im_end|>" in script.calls[1][0]
    def turn(text):
        return tool_tokenizer(text, add_special_tokens=False)["input_ids"] + [tool_tokenizer.eos_token_id]

    policy = [turn(call("multiply", a=3, b=4)) + turn("The answer is 12."),
              turn(call("multiply", a=3, c=4)) + turn("I could not multiply."), turn("No tool needed.")]
    for row in range(3):
        ids, labels = batch["input_ids"][row], batch["labels"][row]
        # per token: the targets are exactly the tokens the policy generated, in order; nothing of the tool turns
        assert labels[labels != IGNORE].tolist() == policy[row]
        if row < 2:
            first = len(turn(call("multiply", a=3, b=4) if row == 0 else call("multiply", a=3, c=4)))
            targets = (labels != IGNORE).nonzero().flatten()
            gap = ids[targets[first - 1] + 1: targets[first]]  # between the two policy turns: the tool's turn
            assert (labels[targets[first - 1] + 1: targets[first]] == IGNORE).all() and len(gap) > 3
            shown = tool_tokenizer.decode(gap)
            assert shown.startswith("\n<|im_start|>tool\n") and shown.endswith("<|im_start|>assistant\n")
            assert ("12" if row == 0 else "unexpected keyword argument 'c'") in shown
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.model.generate = Script(tool_tokenizer, [call("multiply", a=3, b=4), call("multiply", a=3, c=4), "No."],
                                    ["12.", "Sorry."])
    trainer.train()
    logged = trainer.state.log_history[0]
    assert logged["tools/call_frequency"] == pytest.approx(2 / 3) and logged["tools/failure_frequency"] == 0.5
    assert logged["completions/max_length"] < len(batch["input_ids"][0])  # lengths count the policy's tokens only
    assert any(not torch.equal(before[name], p) for name, p in trainer.model.named_parameters())


async def async_add(a: int, b: int) -> int:
    """
    Adds two integers, asynchronously.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def test_async_tool_budget_and_iteration_limit(tool_tokenizer):
    """An async tool runs; a rollout stops after `max_tool_calling_iterations` rounds of calls; a tool result that
    would not fit in `max_completion_length` is not appended, and that is counted."""
    trainer = GRPOTrainer(tiny_policy(tool_tokenizer), message_count,
                          args=config(max_tool_calling_iterations=1, max_completion_length=40),
                          train_dataset=questions(1), processing_class=tool_tokenizer, tools=[async_add])
    long_call = call("async_add", a=1, b=2) + " " + "x " * 20  # leaves no room for the tool result
    script = Script(tool_tokenizer, [call("async_add", a=1, b=2), long_call, "plain"], [call("async_add", a=5, b=5)])
    trainer.model.generate = script
    one_round(trainer)
    assert len(script.calls) == 2 and "<|im_start|>tool\n3<|im_end|>" in script.calls[1][0]
    assert len(script.calls[1]) == 1  # the over-budget rollout ended at its call
    assert trainer.round_counts["tool_results_over_budget"] == 1
    store = trainer.run_metrics.values["train"]
    assert store["tools/call_frequency"] == [pytest.approx(2 / 3)]  # the second turn's call is not run (limit 1)


def test_malformed_tool_calls_are_counted_and_read_as_text(tool_tokenizer, caplog):
    seen = {}

    def capture(completions, **kwargs):
        seen["completions"] = completions
        return [0.0, 1.0, 0.5]

    trainer = GRPOTrainer(tiny_policy(tool_tokenizer), capture, args=config(), train_dataset=questions(1),
                          processing_class=tool_tokenizer, tools=[multiply])
    bad = ['<tool_call>\n{"arguments": {"a": 3}}\n</tool_call>',  # no name
           '<tool_call>\n{"name": "multiply", "arguments": {a: 3}}\n</tool_call>',  # not JSON
           '<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}']  # never closed
    script = Script(tool_tokenizer, bad)
    trainer.model.generate = script
    with caplog.at_level("WARNING", logger="leantune.online"):
        one_round(trainer)
    assert len(script.calls) == 1  # no tool ran, so no second turn
    assert trainer.round_counts["malformed_tool_calls"] == 3
    assert trainer.run_metrics.values["train"]["tools/malformed_frequency"] == [1.0]
    assert trainer.run_metrics.values["train"]["tools/call_frequency"] == [0.0]
    assert any("could not be parsed" in record.message for record in caplog.records)
    assert [c[-1]["content"].startswith("<tool_call>") for c in seen["completions"]] == [True] * 3
    assert all("tool_calls" not in c[-1] for c in seen["completions"])


# --- environments --------------------------------------------------------------------------------------------------


class Counter:
    def reset(self, **kwargs):
        self.count = 0
        return " Use the counter."

    def increment(self, step: int) -> int:
        """
        Adds to the counter.

        Args:
            step: How much to add.
        """
        self.count += step
        return self.count

    def get_reward(self) -> float:
        return float(self.count)


def test_environment_rewards_reach_advantages(tool_tokenizer):
    # No reward_funcs: the environment owns the reward (logged under its class name, weight 1)
    trainer = GRPOTrainer(tiny_policy(tool_tokenizer), args=config(), train_dataset=questions(1),
                          processing_class=tool_tokenizer, environment_factory=Counter)
    assert trainer.reward_func_names == ["Counter"] and trainer.reward_weights.tolist() == [1.0]
    assert [tool.__name__ for tool in trainer.tools] == ["increment"]
    script = Script(tool_tokenizer, [call("increment", step=2), call("increment", step=5), "no"], ["ok", "ok"])
    trainer.model.generate = script
    (batch,) = one_round(trainer)
    assert "What is 0 times 4? Use the counter." in script.calls[0][0]  # reset's observation ends the prompt
    assert [env.count for env in trainer.environments] == [2, 5, 0]
    rewards = torch.tensor([2.0, 5.0, 0.0])
    expected = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
    torch.testing.assert_close(batch["advantages"].float(), expected, atol=1e-4, rtol=1e-4)
    assert trainer.run_metrics.values["train"]["rewards/Counter/mean"] == [pytest.approx(7 / 3)]


def test_environment_column_routes_each_example(tool_tokenizer):
    resets = {"counter": [], "echo": []}

    class CountingCounter(Counter):
        def reset(self, **kwargs):
            resets["counter"].append(kwargs)
            return super().reset()

    class Echo:
        def reset(self, **kwargs):
            resets["echo"].append(kwargs)

        def shout(self, text: str) -> str:
            """
            Shouts.

            Args:
                text: What to shout.
            """
            return text.upper()

    def plain(completions, **kwargs):
        return [float(len(c)) for c in completions]

    dataset = questions(2, environment=["counter", "echo"], level=[1, 2])
    trainer = GRPOTrainer(tiny_policy(tool_tokenizer), plain, args=config(per_device_train_batch_size=4,
                                                                           num_generations=2),
                          train_dataset=dataset, processing_class=tool_tokenizer,
                          environment_factory={"counter": CountingCounter, "echo": Echo})
    # a reward column for the class that owns one; rollouts of the other class are not scored by it (None)
    assert trainer.reward_func_names == ["plain", "CountingCounter"]
    counter = CountingCounter()
    counter.reset()
    assert trainer.reward_funcs[-1](environments=[counter, Echo()]) == [0.0, None]
    script = Script(tool_tokenizer, [call("increment", step=1), "no", call("shout", text="hi"), call("increment", step=1)],
                    ["done", "done", "done"])
    trainer.model.generate = script
    one_round(trainer)
    prompts = script.calls[0]
    assert all('"increment"' in p and '"shout"' not in p for p in prompts[:2])  # each sees its own tools only
    assert all('"shout"' in p and '"increment"' not in p for p in prompts[2:])
    answers = script.calls[1]
    assert "<|im_start|>tool\n1<|im_end|>" in answers[0] and "<|im_start|>tool\nHI<|im_end|>" in answers[1]
    # the second echo rollout called `increment`, which is not its environment's tool: it gets an error result
    assert "Tool increment not found." in answers[2]
    assert trainer.round_counts["failed_tool_calls"] == 1
    assert [type(env).__name__ for env in trainer.environments] == ["CountingCounter"] * 2 + ["Echo"] * 2
    # `environment` routes, it is not passed to reset; the other columns are
    assert resets["counter"][-1]["level"] == 1 and all("environment" not in k for k in resets["counter"] + resets["echo"])


def test_environment_owned_data_trains(tool_tokenizer):
    class Guess:
        def reset(self, **kwargs):
            return "Guess the word."

    def text_length(completions, **kwargs):
        return [float(len(c[-1]["content"])) for c in completions]

    trainer = GRPOTrainer(tiny_policy(tool_tokenizer), text_length, args=config(max_steps=2),
                          processing_class=tool_tokenizer, environment_factory=Guess)
    script = Script(tool_tokenizer, lambda n: ["a", "abc", "abcdef"] * (n // 3))
    trainer.model.generate = script
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train()
    assert script.calls[0][0].endswith("<|im_start|>user\nGuess the word.<|im_end|>\n<|im_start|>assistant\n")
    assert trainer.state.global_step == 2
    assert any(not torch.equal(before[name], p) for name, p in trainer.model.named_parameters())


# --- rollout_func --------------------------------------------------------------------------------------------------


def test_rollout_func_masks_what_the_policy_did_not_sample(tool_tokenizer):
    seen = {}

    def rollout(prompts, trainer):
        seen["prompts"] = prompts
        n = len(prompts)
        return {"prompt_ids": [[5, 6, 7]] * n, "completion_ids": [[8, 9, 10, 11]] * n, "logprobs": [[0.0] * 4] * n,
                "env_mask": [[1, 0, 0, 1]] * n, "judge": ["a", "b", "c"], "run": "r1"}

    def reward(completions, judge, run, **kwargs):
        seen["judge"], seen["run"] = judge, run
        return [1.0, 0.0, 0.5]

    trainer = GRPOTrainer(tiny_policy(tool_tokenizer), reward, args=config(), train_dataset=questions(1),
                          processing_class=tool_tokenizer, rollout_func=rollout)
    (batch,) = one_round(trainer)
    assert len(seen["prompts"]) == 3 and seen["judge"] == ["a", "b", "c"] and seen["run"] == ["r1"] * 3
    assert batch["input_ids"][0].tolist()[:7] == [5, 6, 7, 8, 9, 10, 11]
    assert batch["labels"][0].tolist()[:7] == [IGNORE] * 3 + [8, IGNORE, IGNORE, 11]

    def incomplete(prompts, trainer):
        return {"prompt_ids": [[5]] * len(prompts), "completion_ids": [[8]] * len(prompts)}

    trainer = GRPOTrainer(tiny_policy(tool_tokenizer), reward, args=config(), train_dataset=questions(1),
                          processing_class=tool_tokenizer, rollout_func=incomplete)
    with pytest.raises(ValueError, match=r"rollout_func must return keys \['logprobs'\]"):
        one_round(trainer)


# --- construction-time errors --------------------------------------------------------------------------------------


class Plain:
    def reset(self, **kwargs):
        return None


class NoReset:
    def act(self, x: int) -> int:
        """
        Acts.

        Args:
            x: A value.
        """
        return x


def undocumented(a, b):
    return a


@pytest.mark.parametrize("case, match", [
    (dict(environment_factory=Plain, train_dataset=None), "`max_steps` must be set"),
    (dict(environment_factory={"a": Plain, "b": Plain}, train_dataset=None), "requires a `train_dataset`"),
    (dict(train_dataset=None), "`train_dataset` is required"),
    (dict(reward_funcs=None, environment_factory=Plain), "No reward source provided"),
    (dict(environment_factory=NoReset), "no `reset` method"),
    (dict(tools=[undocumented]), "tool 'undocumented' cannot be described"),
    (dict(tools=[multiply], train_dataset=Dataset.from_dict({"prompt": ["text prompt"] * 3})),
     "needs conversational prompts"),
    (dict(tools=[multiply], rollout_func=lambda prompts, trainer: {}), "`rollout_func` produces the whole rollout"),
    (dict(environment_factory={"a": Plain}, train_dataset=questions(3)), "by its `environment` column"),
    (dict(config={"max_tool_calling_iterations": -1}, tools=[multiply]), "max_tool_calling_iterations"),
])
def test_construction_errors(tool_tokenizer, case, match):
    case = dict(case)
    overrides = case.pop("config", {})
    if case.get("train_dataset", 0) is None:
        overrides.setdefault("max_steps", -1)  # TrainingArguments' "not set"
    with pytest.raises(ValueError, match=match):
        kwargs = dict(reward_funcs=message_count, args=config(**overrides), train_dataset=questions(3),
                      processing_class=tool_tokenizer)
        kwargs.update(case)
        GRPOTrainer(tiny_policy(tool_tokenizer), **kwargs)


def test_chat_template_without_tool_calls_is_refused(tokenizer):
    """The shared tokenizer's own template ([INST] ... [/INST]) has no tool-call markup leantune can read."""
    with pytest.raises(ValueError, match="cannot read tool calls"):
        GRPOTrainer(tiny_policy(tokenizer), message_count, args=config(), train_dataset=questions(3),
                    processing_class=tokenizer, tools=[multiply])


def test_unknown_environment_name_is_an_error_naming_the_choices(tool_tokenizer):
    trainer = GRPOTrainer(tiny_policy(tool_tokenizer), message_count, args=config(),
                          train_dataset=questions(1, environment=["typo"]), processing_class=tool_tokenizer,
                          environment_factory={"counter": Counter})
    trainer.model.generate = Script(tool_tokenizer, ["a", "b", "c"])
    with pytest.raises(ValueError, match=r"environment='typo'.*Expected one of: \['counter'\]"):
        trainer.train()


def test_template_that_rerenders_the_calling_turn_once_results_follow(tool_tokenizer):
    """Qwen3's own template (tests/fixtures/chat_templates/qwen3.jinja) writes an empty <think> block into an assistant
    turn only while no tool result follows it, so the conversation up to a tool call is not a prefix of the
    conversation with the results. TRL trains it (with a template of its own); leantune reads the results' tokens from
    Qwen3's rendering itself: everything after the <|im_end|> that closes the calling turn. The policy's turns stay
    exactly as generated (targets, per token) and nothing of the tool's turn is a target."""
    import copy

    tokenizer = copy.deepcopy(tool_tokenizer)
    tokenizer.add_tokens(["<tool_response>", "</tool_response>", "<think>", "</think>"])
    tokenizer.chat_template = (CHAT_TEMPLATES / "qwen3.jinja").read_text()
    trainer = GRPOTrainer(tiny_policy(tokenizer), message_count, args=config(), train_dataset=questions(1),
                          processing_class=tokenizer, tools=[multiply])
    script = Script(tokenizer, [call("multiply", a=3, b=4)] * 3, ["The answer is 12."] * 3)
    trainer.model.generate = script
    (batch,) = one_round(trainer)

    def turn(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]

    first, second = turn(call("multiply", a=3, b=4)), turn("The answer is 12.")
    for row in range(3):
        ids, labels = batch["input_ids"][row], batch["labels"][row]
        assert labels[labels != IGNORE].tolist() == first + second
        targets = (labels != IGNORE).nonzero().flatten()
        gap = ids[targets[len(first) - 1] + 1: targets[len(first)]]
        assert tokenizer.decode(gap) == ("\n<|im_start|>user\n<tool_response>\n12\n</tool_response><|im_end|>\n"
                                         "<|im_start|>assistant\n")
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    # rewards that differ (a rollout without a tool call has fewer messages), so the step has an advantage to follow
    trainer.model.generate = Script(tokenizer, [call("multiply", a=3, b=4), call("multiply", a=3, b=4), "No."],
                                    ["12.", "Twelve."])
    trainer.train()
    assert any(not torch.equal(before[name], p) for name, p in trainer.model.named_parameters())
