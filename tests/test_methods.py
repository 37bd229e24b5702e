"""leantune/methods.py is the one table of the methods: every reader (exports, command line, planner, model card, TRL's
defaults) finds each method there and nowhere else."""

import pytest

import leantune
from leantune import methods
from leantune.cli.main import COMMANDS
from leantune.planning.planned_run import method_classes

pytestmark = pytest.mark.quick  # the quick tier (tests/quick_tier.py): this file's tests take seconds


def test_each_entry_is_its_trainer_config_exports_and_command():
    for name, method in methods.METHODS.items():
        trainer, config = method.trainer_class, method.config_class
        assert trainer.method == name and methods.of(trainer) is method
        assert getattr(leantune, trainer.__name__) is trainer and getattr(leantune, config.__name__) is config
        assert method.command in COMMANDS and COMMANDS[method.command] == method.help
        assert method_classes(method.command) == (trainer, config) == method_classes(trainer)
        for spelling in (name, method.command, method.card_name, method.command.upper()):
            assert methods.find(spelling) is method


def test_a_subclass_is_its_parents_method_and_an_unknown_name_lists_the_known():
    class MyGRPO(leantune.GRPOTrainer):
        pass

    assert methods.of(MyGRPO) is methods.METHODS["grpo"]
    with pytest.raises(ValueError, match="known: dpo, gkd, grpo, kto, online-dpo, ppo, reward, rloo, sft"):
        methods.find("nope")
