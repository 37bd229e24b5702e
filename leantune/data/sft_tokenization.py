"""Turn SFT examples of any accepted format into input_ids plus the masks that choose the loss tokens."""

from __future__ import annotations

from .formats import SFTFormat


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
        return not any(str(m.get("content") or "").strip() for m in messages)
    if fmt is SFTFormat.CONVERSATIONAL_PROMPT_COMPLETION:
        completion = example.get("completion") or []
        return not any(str(m.get("content") or "").strip() for m in completion)
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


class SFTTokenizer:
    """Batched tokenisation for one dataset format; one instance per prepare call."""

    def __init__(self, tokenizer, fmt: SFTFormat, text_field: str, assistant_only_loss: bool, eos_token_id):
        self.tokenizer = tokenizer
        self.fmt = fmt
        self.text_field = text_field
        self.assistant_only_loss = assistant_only_loss
        self.eos_token_id = eos_token_id

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
        encoded = template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=self.assistant_only_loss
        )
        ids = list(encoded["input_ids"])
        if self.fmt is SFTFormat.CONVERSATIONAL_PROMPT_COMPLETION:
            prompt_ids = list(template(list(row["prompt"]), tokenize=True, return_dict=True, add_generation_prompt=True)["input_ids"])

            def apart():
                raise ValueError(
                    "The chat template renders the prompt differently alone (with add_generation_prompt=True) than "
                    "as the start of the whole conversation, so the completion cannot be located. Use a template "
                    "whose generation prompt is a prefix of the rendered assistant turn."
                )

            ids, mask = _split_at_prompt(prompt_ids, ids, apart)
            out["completion_mask"].append(mask)
        out["input_ids"].append(ids)
        if self.assistant_only_loss:
            out["assistant_masks"].append(list(encoded["assistant_masks"]))
