"""Every field of TRL 1.16's configs exists in leantune's with TRL's default (from a snapshot: TRL not needed);
fields leantune does not implement yet refuse other values; the implemented ones do what they say."""

from __future__ import annotations

import dataclasses
import json

import pytest

import leantune
from devkit import trl_fields
from leantune.trainers.config_utils import UNSUPPORTED_TRL_FIELDS, checkpointing_field

from ..fixtures.models import tiny_model
from ..fixtures.paths import REPO

pytestmark = pytest.mark.quick  # the quick tier (tests/quick_tier.py): this file's tests take seconds

SNAPSHOT = trl_fields.load_snapshot()
CONFIGS = tuple(SNAPSHOT["configs"])


def _explained(config: str, field: str) -> bool:
    return (config, field) in trl_fields.DIFFERS or ("*", field) in trl_fields.DIFFERS


@pytest.mark.parametrize("config", CONFIGS)
def test_every_trl_field_exists_with_trls_default(config):
    ours = trl_fields.leantune_fields(config)
    missing = [field for field in SNAPSHOT["configs"][config] if field not in ours]
    assert not missing, f"{config} lacks TRL's {missing}"
    differ = [(field, info["default"], repr(trl_fields._default(ours[field])))
              for field, info in SNAPSHOT["configs"][config].items()
              if info["default"] != repr(trl_fields._default(ours[field])) and not _explained(config, field)]
    assert not differ, f"{config}: defaults differ from TRL's without a reason in bench/trl_fields.py: {differ}"


def test_docs_table_is_up_to_date():
    written = (REPO / "docs" / "trl_compatibility.md").read_text(encoding="utf-8")
    assert written == trl_fields.render_docs(SNAPSHOT), "run `python bench/trl_fields.py --docs`"
    assert "MISSING" not in written and "UNEXPLAINED" not in written


def test_every_refused_field_is_a_trl_field():
    names = {field for fields in SNAPSHOT["configs"].values() for field in fields}
    assert set(UNSUPPORTED_TRL_FIELDS) <= names


def _other_value(field: dataclasses.Field):
    default = field.default
    if isinstance(default, bool):
        return not default
    if isinstance(default, (int, float)):
        return default + 1
    if isinstance(default, str):
        return default + "_other"
    kind = str(field.type)
    return {"a": 1} if "dict" in kind else 0.5 if "float" in kind else 3 if "int" in kind else "other"


REFUSED = [(config, field) for config in CONFIGS for field in UNSUPPORTED_TRL_FIELDS
           if field in trl_fields.leantune_fields(config)]


@pytest.mark.parametrize(("config", "field"), REFUSED, ids=[f"{c}-{f}" for c, f in REFUSED])
def test_unsupported_fields_accept_trls_default_and_refuse_other_values(config, field, tmp_path):
    klass = getattr(leantune, config)
    value = _other_value(trl_fields.leantune_fields(config)[field])
    with pytest.raises(ValueError, match=rf"^`{field}`=.* is not supported by leantune yet; "):
        klass(output_dir=str(tmp_path), report_to=[], **{field: value})


def test_every_config_builds_with_trls_defaults(tmp_path):
    for config in CONFIGS:
        args = getattr(leantune, config)(output_dir=str(tmp_path), report_to=[])
        assert args.trust_remote_code is False
        # TRL's gradient_checkpointing=True, resolved to the new name where transformers has it (5.19+)
        assert getattr(args, checkpointing_field(args)) is True


def test_gradient_checkpointing_false_still_turns_it_off(tmp_path):
    args = leantune.SFTConfig(output_dir=str(tmp_path), report_to=[], gradient_checkpointing=False)
    assert getattr(args, checkpointing_field(args)) is False


# --- trust_remote_code: a model folder whose architecture is Python code shipped in the folder ------------------

REMOTE_CONFIG = '''
from transformers import LlamaConfig


class RemoteTinyConfig(LlamaConfig):
    model_type = "remote_tiny"
'''
REMOTE_MODEL = '''
from transformers import LlamaForCausalLM

from .configuration_remote_tiny import RemoteTinyConfig


class RemoteTinyForCausalLM(LlamaForCausalLM):
    config_class = RemoteTinyConfig
'''


@pytest.fixture
def remote_code_model(tmp_path, tokenizer):
    folder = tmp_path / "remote-tiny"
    tiny_model().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "configuration_remote_tiny.py").write_text(REMOTE_CONFIG)
    (folder / "modeling_remote_tiny.py").write_text(REMOTE_MODEL)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="remote_tiny", architectures=["RemoteTinyForCausalLM"],
                  auto_map={"AutoConfig": "configuration_remote_tiny.RemoteTinyConfig",
                            "AutoModelForCausalLM": "modeling_remote_tiny.RemoteTinyForCausalLM"})
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def test_trust_remote_code_loads_a_custom_architecture(remote_code_model, tmp_path):
    from datasets import Dataset

    from leantune import SFTConfig, SFTTrainer

    data = Dataset.from_list([{"prompt": "1 + 1 =", "completion": " 2"}] * 4)
    args = dict(output_dir=str(tmp_path / "out"), report_to=[], max_steps=1, per_device_train_batch_size=2)
    with pytest.raises(Exception, match="trust_remote_code"):
        SFTTrainer(model=remote_code_model, args=SFTConfig(**args), train_dataset=data)
    trainer = SFTTrainer(model=remote_code_model, args=SFTConfig(**args, trust_remote_code=True), train_dataset=data)
    assert type(trainer.model).__name__ == "RemoteTinyForCausalLM"
    assert trainer.processing_class.eos_token == "</s>"  # the tokenizer was loaded from the folder with it too


def test_model_init_kwargs_trust_remote_code_wins(remote_code_model):
    from leantune.models.loading import load_causal_lm

    with pytest.raises(Exception, match="trust_remote_code"):
        load_causal_lm(remote_code_model, {"trust_remote_code": False}, trust_remote_code=True)
    assert type(load_causal_lm(remote_code_model, None, trust_remote_code=True)).__name__ == "RemoteTinyForCausalLM"


def test_dpo_pad_token_sets_the_tokenizers_padding_token(tokenizer, tmp_path):
    from datasets import Dataset

    from leantune import DPOConfig, DPOTrainer

    data = Dataset.from_list([{"prompt": "1 + 1 =", "chosen": " 2", "rejected": " 3"}] * 4)
    args = DPOConfig(output_dir=str(tmp_path), report_to=[], max_steps=1, per_device_train_batch_size=2,
                     pad_token="<unk>")
    trainer = DPOTrainer(model=tiny_model(), ref_model=tiny_model(), args=args, train_dataset=data,
                         processing_class=tokenizer)
    assert trainer.processing_class.pad_token == "<unk>"
    with pytest.raises(ValueError, match="pad_token"):
        DPOTrainer(model=tiny_model(), ref_model=tiny_model(), train_dataset=data, processing_class=tokenizer,
                   args=DPOConfig(output_dir=str(tmp_path), report_to=[], pad_token="<not a token>"))
