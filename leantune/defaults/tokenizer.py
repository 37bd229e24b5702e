"""Character-level tokenizer for the built-in demo run.

Why character-level: the default ``leantune sft`` run must work with no files and
no network, so the tokenizer is assembled in code from a fixed alphabet.  One
token per character keeps the vocabulary tiny (~100 ids), which keeps the
embedding/LM-head small and lets a randomly initialised model learn
character-manipulation tasks quickly.

The tokenizer also carries a chat template, so the same object can be used for
conversational (``messages``) datasets.  Assistant turns are wrapped in
``{% generation %}`` blocks so that
``apply_chat_template(..., return_assistant_tokens_mask=True, return_dict=True)``
marks exactly the assistant reply plus its end-of-sequence token.
"""

from __future__ import annotations

import string

from tokenizers import Tokenizer, decoders, models, processors
from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<bos>"
EOS_TOKEN = "<eos>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS = [PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN]

# Role markers are single (special) tokens, so a chat turn header costs one id.
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]

# Printable ASCII (space .. '~') plus newline; the ordering is fixed so ids are
# stable across runs and machines.
CHARACTERS = [" "] + [c for c in string.printable if c.isprintable() and c != " "] + ["\n"]

# Template notes:
# - bos starts every conversation (the tokenizer does not add it again because
#   apply_chat_template tokenizes with add_special_tokens=False).
# - non-assistant turns end with a newline; assistant turns end with eos, and the
#   eos sits inside the generation block so it is trained on (the model must
#   learn to stop).
# - add_generation_prompt appends the assistant header only.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "<|assistant|>"
    "{% generation %}{{ message['content'] }}{{ eos_token }}{% endgeneration %}"
    "{% else %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_default_tokenizer(model_max_length: int = 512) -> PreTrainedTokenizerFast:
    """Build the bundled character-level tokenizer (deterministic, no files).

    Encoding prepends ``<bos>`` (like Llama tokenizers) unless
    ``add_special_tokens=False``; it never appends ``<eos>`` -- trainers add it
    to completions themselves.  Characters outside the alphabet map to ``<unk>``.
    """
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + ROLE_TOKENS + CHARACTERS)}
    # BPE with no merges == split every input "word" into single characters.
    # No pre-tokenizer: spaces are ordinary characters and survive round trips.
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK_TOKEN))
    tok.add_special_tokens(SPECIAL_TOKENS + ROLE_TOKENS)
    tok.decoder = decoders.Fuse()  # join characters without inserted spaces
    bos_id = vocab[BOS_TOKEN]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        additional_special_tokens=list(ROLE_TOKENS),
        chat_template=CHAT_TEMPLATE,
        model_max_length=model_max_length,
        padding_side="right",
        clean_up_tokenization_spaces=False,
    )
