"""Turn SFT examples of any accepted format into input_ids plus the masks that choose the loss tokens."""

from __future__ import annotations

from .chat_template import has_generation_markers, row_template_kwargs
from .formats import SFTFormat, data_code_digest, message_has_payload
from .template_spans import announce_located, message_span
from .training_templates import MASK_TEMPLATES, mask_template_for


def is_empty_example(example: dict, fmt: SFTFormat, text_field: str) -> bool:
    """An example with nothing to learn from: dropped and counted before tokenisation."""
    if fmt is SFTFormat.LANGUAGE_MODELING:
        text = example.get(text_field)
        return text is None or not str(text).strip()
    if fmt is SFTFormat.PROMPT_COMPLETION:
        completion = example.get("completion")
        return example.get("prompt") is None or completion is None or not completion.strip()
    if fmt is SFTFormat.CONVERSATIONAL:
        messages = example.get("messages") or []
        return not any(message_has_payload(m) for m in messages)
    if fmt is SFTFormat.CONVERSATIONAL_PROMPT_COMPLETION:
        completion = example.get("completion") or []
        return not any(message_has_payload(m) for m in completion)
    return not example.get("input_ids")


def _append_eos(ids: list[int], eos_id: int | None) -> list[int]:
    return ids + [eos_id] if eos_id is not None and (not ids or ids[-1] != eos_id) else ids


def _split_at_prompt(prompt_ids: list[int], full_ids: list[int], completion_ids_fallback):
    """Completion mask from the prompt prefix; re-tokenise apart when the joint tokenisation merges the boundary."""
    n = len(prompt_ids)
    if full_ids[:n] == prompt_ids:
        return full_ids, [0] * n + [1] * (len(full_ids) - n)
    completion_ids = completion_ids_fallback()
    return prompt_ids + completion_ids, [0] * n + [1] * len(completion_ids)


def _render_ids(tokenizer, messages: list[dict], add_generation_prompt: bool, **template_kwargs) -> list[int]:
    encoded = tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=True, add_generation_prompt=add_generation_prompt, **template_kwargs
    )
    return list(encoded["input_ids"])


def assistant_masks_from_prefixes(tokenizer, messages: list[dict], ids: list[int], **template_kwargs) -> list[int]:
    """The assistant-token mask for a chat template without `{% generation %}` markers.

    Any template that renders a conversation's first k messages as a token prefix of the whole conversation shows
    where each assistant turn lies: its tokens are those between the conversation rendered up to the turn (with the
    generation prompt, which is the model's cue, not its output) and rendered through the end of the turn. The prefix
    property is checked for every turn; where a template breaks it (it re-renders earlier turns once later ones
    follow, as harmony and Qwen3 do), the turn is located in the whole conversation's own rendering instead
    (template_spans.message_span); a turn neither way finds is an error, never a guessed mask."""
    mask = [0] * len(ids)
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        start = _render_ids(tokenizer, messages[:i], add_generation_prompt=True, **template_kwargs)
        end = _render_ids(tokenizer, messages[: i + 1], add_generation_prompt=False, **template_kwargs)
        broken = next(((prefix, what) for prefix, what in (
            (start, f"the first {i} message(s) with add_generation_prompt=True"), (end, f"the first {i + 1} message(s)"))
            if ids[: len(prefix)] != prefix), None)
        if broken is None and len(end) < len(start):
            broken = (start, f"the first {i} message(s) with add_generation_prompt=True")
            ids_compared = end
        else:
            ids_compared = ids
        if broken is None:
            mask[len(start):len(end)] = [1] * (len(end) - len(start))
            continue
        span = message_span(tokenizer, messages, i, ids, last=i + 1, **template_kwargs)
        if span is None:
            raise _inconsistent_template(tokenizer, broken[1], i, broken[0], ids_compared)
        announce_located("assistant turns")
        mask[span[0]:span[1]] = [1] * (span[1] - span[0])
    return mask


def _inconsistent_template(tokenizer, what: str, turn: int, prefix: list[int], whole: list[int]) -> ValueError:
    at = next((j for j, (a, b) in enumerate(zip(prefix, whole)) if a != b), min(len(prefix), len(whole)))
    return ValueError(
        f"assistant_only_loss: the chat template has no {{% generation %}} markers, so leantune locates assistant "
        f"message {turn} by rendering the conversation up to it and through it; but {what} render(s) to tokens that "
        f"are not a prefix of the whole conversation (they differ at token {at}: "
        f"{tokenizer.decode(prefix[at:at + 8])!r} vs {tokenizer.decode(whole[at:at + 8])!r}); nor does the whole "
        "conversation's rendering show where the turn is (its text changes no token, or no generation prompt precedes "
        "it). The template renders "
        "earlier turns differently depending on what follows (e.g. it drops reasoning from earlier turns, or its "
        "generation prompt is not how it starts an assistant turn), and leantune has no marked equivalent of it (it "
        f"knows these templates exactly as shipped: {', '.join(known.family for known in MASK_TEMPLATES)}). Use a "
        "template whose "
        "prefixes are consistent, or wrap assistant output in {% generation %} ... {% endgeneration %} "
        "(chat_template_path=)."
    )


class SFTTokenizer:
    """Batched tokenisation for one dataset format; one instance per prepare call."""

    def __init__(self, tokenizer, fmt: SFTFormat, text_field: str, assistant_only_loss: bool, eos_token_id):
        self.tokenizer = tokenizer
        self.fmt = fmt
        self.text_field = text_field
        self.assistant_only_loss = assistant_only_loss
        self.eos_token_id = eos_token_id
        self.code = data_code_digest()  # a datasets cache written by other code is not reused
        # A known template whose prefixes cannot locate assistant turns: leantune's marked equivalent gives the mask
        # (data/training_templates.py); its text is part of this object's state, so of the datasets fingerprint.
        known = mask_template_for(tokenizer.chat_template) if assistant_only_loss else None
        self.mask_family = known.family if known else None
        self.mask_template = known.text if known else None

    def __call__(self, batch: dict) -> dict:
        size = len(next(iter(batch.values())))
        rows = [{k: batch[k][i] for k in batch} for i in range(size)]
        out: dict[str, list] = {"input_ids": []}
        if self.fmt in (SFTFormat.PROMPT_COMPLETION, SFTFormat.CONVERSATIONAL_PROMPT_COMPLETION):
            out["completion_mask"] = []
        if self.assistant_only_loss:
            out["assistant_masks"] = []
        if self.fmt is SFTFormat.LANGUAGE_MODELING:
            encoded = self.tokenizer([r[self.text_field] for r in rows])["input_ids"]
            out["input_ids"] = [_append_eos(ids, self.eos_token_id) for ids in encoded]
        elif self.fmt is SFTFormat.PROMPT_COMPLETION:
            self._prompt_completion(rows, out)
        else:
            for row in rows:
                self._conversation(row, out)
        return out

    def _prompt_completion(self, rows: list[dict], out: dict) -> None:
        prompts = [r["prompt"] for r in rows]
        prompt_ids = self.tokenizer(prompts)["input_ids"]
        full_ids = self.tokenizer([r["prompt"] + r["completion"] for r in rows])["input_ids"]
        for row, p_ids, f_ids in zip(rows, prompt_ids, full_ids):
            def apart(row=row):
                return self.tokenizer(row["completion"], add_special_tokens=False)["input_ids"]

            ids, mask = _split_at_prompt(p_ids, f_ids, apart)
            eos_added = _append_eos(ids, self.eos_token_id)
            mask = mask + [1] * (len(eos_added) - len(ids))
            out["input_ids"].append(eos_added)
            out["completion_mask"].append(mask)

    def _conversation(self, row: dict, out: dict) -> None:
        template = self.tokenizer.apply_chat_template
        if self.fmt is SFTFormat.CONVERSATIONAL:
            messages = row["messages"]
        else:
            messages = list(row["prompt"]) + list(row["completion"])
        # Without {% generation %} markers the assistant turns are found from the template's prefixes.
        marked = self.assistant_only_loss and has_generation_markers(self.tokenizer.chat_template)
        kwargs = row_template_kwargs(row)  # the row's `tools` and `chat_template_kwargs`, as in TRL
        encoded = template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=marked, **kwargs)
        ids = list(encoded["input_ids"])
        if self.fmt is SFTFormat.CONVERSATIONAL_PROMPT_COMPLETION:
            prompt_ids = list(template(list(row["prompt"]), tokenize=True, return_dict=True, add_generation_prompt=True,
                                       **kwargs)["input_ids"])
            n = len(prompt_ids)
            if ids[:n] != prompt_ids:  # the template re-renders the prompt once the completion follows
                span = message_span(self.tokenizer, messages, len(row["prompt"]), ids, **kwargs)
                if span is None:
                    raise ValueError(
                        "The chat template renders the prompt differently alone (with add_generation_prompt=True) "
                        "than as the start of the whole conversation, and the whole conversation's rendering does "
                        "not show where the completion starts, so the completion cannot be located. Use a template "
                        "whose generation prompt is a prefix of the rendered assistant turn.")
                announce_located("where the completion starts")
                n = span[0]
            out["completion_mask"].append([0] * n + [1] * (len(ids) - n))
        out["input_ids"].append(ids)
        if marked:
            out["assistant_masks"].append(list(encoded["assistant_masks"]))
        elif self.mask_template is not None:
            out["assistant_masks"].append(self._mask_from_known_template(messages, ids, kwargs))
        elif self.assistant_only_loss:
            out["assistant_masks"].append(assistant_masks_from_prefixes(self.tokenizer, messages, ids, **kwargs))

    def _mask_from_known_template(self, messages: list[dict], rendered: list[int], kwargs: dict) -> list[int]:
        """The assistant mask from leantune's marked template for this family, which must render the very tokens
        the tokenizer's own template rendered."""
        encoded = self.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                     return_assistant_tokens_mask=True,
                                                     chat_template=self.mask_template, **kwargs)
        if list(encoded["input_ids"]) != rendered:
            raise ValueError(
                f"assistant_only_loss: leantune's {self.mask_family} template (used only to locate assistant tokens) "
                "renders this conversation differently from the tokenizer's own template, so its mask would not fit "
                "the tokens. Please report it to leantune with the conversation; meanwhile wrap the assistant output "
                "of your template in {% generation %} ... {% endgeneration %} (chat_template_path=)."
            )
        return list(encoded["assistant_masks"])
