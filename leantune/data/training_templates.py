"""Mask templates: leantune's own versions of known chat templates, with `{% generation %}` markers.

`assistant_only_loss` finds assistant tokens from a template's `{% generation %}` blocks, or, without them, from the
tokens each assistant turn adds to the rendered conversation (sft_tokenization.py). That second way needs a
template whose rendering of a conversation's first messages is a prefix of the whole; some model families break it
(Qwen3 drops the reasoning of assistant turns before the last user query; DeepSeek-R1-Distill's generation prompt
opens a `<think>` block its rendered turns never show; Phi-3 and Phi-3.5 end a conversation with the end-of-text
token). For those, leantune ships a template of its own
(templates/*.jinja) that writes exactly the same text as the family's template, with `{% generation %}` around what
each assistant turn writes.

Recognition is exact: the SHA-256 of the tokenizer's template, after only line endings and surrounding whitespace
are normalised, must be one leantune knows. The mask template is used only to locate assistant tokens: the token
ids still come from the tokenizer's own template, and the two renderings are compared for every conversation
(`sft_tokenization.py`), so a mask can never belong to other tokens. Unknown templates keep the prefix method.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from .chat_template import has_generation_markers

logger = logging.getLogger("leantune.data")
TEMPLATE_DIR = Path(__file__).parent / "templates"


@dataclass(frozen=True)
class MaskTemplate:
    family: str  # the model family, as a person names it
    file: str  # leantune's marked template, in TEMPLATE_DIR
    originals: frozenset[str]  # template_digest() of each revision of the family's own template it matches
    why: str  # why the prefix method cannot locate this family's assistant turns

    @property
    def text(self) -> str:
        return _read(self.file)


ENDS_WITH_END_OF_TEXT = ("it ends a conversation rendered without a generation prompt with the end-of-text token, so "
                         "a conversation up to a turn is not a prefix of the whole")

# Measured with leantune's prefix method (assistant_masks_from_prefixes) on multi-turn conversations with and
# without reasoning and tool calls; families it handles need no entry here (see docs/trl_compatibility.md).
MASK_TEMPLATES = (
    MaskTemplate(
        family="Qwen3",
        file="qwen3.jinja",
        originals=frozenset({"a55ee1b1660128b7098723e0abcd92caa0788061051c62d51cbe87d9cf1974d8"}),
        why="it shows an assistant turn's <think> block only after the last user query, so earlier turns render "
            "differently once later turns follow",
    ),
    MaskTemplate(
        family="DeepSeek-R1-Distill",
        file="deepseek_r1_distill.jinja",
        originals=frozenset({"56a1447ad31926fdc21fb07e56e5642bd9c850c4f52d8c8af7bbe5f079a84f5f"}),
        why="its generation prompt opens a <think> block that rendered assistant turns never show",
    ),
    MaskTemplate(
        family="Phi-3",
        file="phi3.jinja",
        originals=frozenset({"dcaee66df77bfbb789ec541fe713218da30225a526f1db97138fc39ee6dc56aa"}),
        why=ENDS_WITH_END_OF_TEXT,
    ),
    MaskTemplate(
        family="Phi-3.5",
        file="phi3_5.jinja",
        originals=frozenset({"78d976a442bcde2f0be15aafbb8e3050e1104f86732266f68403251b89982a90"}),
        why=ENDS_WITH_END_OF_TEXT,
    ),
)


def normalise(template: str) -> str:
    """Only what saving and loading a tokenizer may change: line endings and whitespace around the whole text."""
    return template.replace("\r\n", "\n").replace("\r", "\n").strip()


def template_digest(template: str) -> str:
    return hashlib.sha256(normalise(template).encode("utf-8")).hexdigest()


@cache
def _read(file: str) -> str:
    return (TEMPLATE_DIR / file).read_text(encoding="utf-8")


@cache
def _lookup(digest: str) -> MaskTemplate | None:
    return next((known for known in MASK_TEMPLATES if digest in known.originals), None)


def mask_template_for(chat_template) -> MaskTemplate | None:
    """leantune's marked equivalent of `chat_template`, when the template is one it knows and has no
    `{% generation %}` markers of its own; else None (a template with markers is used as it is)."""
    if not isinstance(chat_template, str) or has_generation_markers(chat_template):
        return None
    return _lookup(template_digest(chat_template))


def announce_mask_template(tokenizer) -> MaskTemplate | None:
    """Log, once per trainer, that assistant tokens will be located with leantune's template for this family."""
    known = mask_template_for(getattr(tokenizer, "chat_template", None))
    if known is not None:
        logger.info(
            "assistant_only_loss: the chat template is %s's, which has no {%% generation %%} markers and where "
            "assistant turns cannot be located from its prefixes (%s); leantune locates them with its own %s "
            "template with markers (leantune/data/templates/%s), which renders the same tokens (checked for every "
            "conversation). The token ids are the tokenizer's own.",
            known.family, known.why, known.family, known.file,
        )
    return known
