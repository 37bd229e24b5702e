"""The tokenizer that dataset maps hold: without its construction-time copies, which datasets would hash every map.

datasets fingerprints each `.map()` by pickling its function, and with it the tokenizer the function holds. A
Llama-style tokenizer of transformers 5 keeps the vocabulary and merges it built its backend from (32k and 59k Python
entries for a 32k vocabulary, four times that at 128k). Nothing reads them after construction, and pickling them
costs ~2 s a map on one CPU core (~10 s of each trainer build; measured), paid by every trainer a script builds and
by every process of a launch. The backend (`_tokenizer`) holds the same vocabulary and merges and pickles as one
string, so a fingerprint still changes whenever tokenization can, and a cached map is reused exactly as before.
"""

from __future__ import annotations

import copy

CONSTRUCTION_COPIES = ("_vocab", "_merges")


def tokenizer_for_maps(tokenizer):
    """A shallow copy of `tokenizer` without its construction-time copies (the same backend object: it tokenizes the
    same); the tokenizer itself where it has none, or no backend to fingerprint instead."""
    fields = vars(tokenizer) if hasattr(tokenizer, "__dict__") else {}
    if fields.get("_tokenizer") is None or not any(name in fields for name in CONSTRUCTION_COPIES):
        return tokenizer
    lean = copy.copy(tokenizer)
    for name in CONSTRUCTION_COPIES:
        vars(lean).pop(name, None)
    return lean
