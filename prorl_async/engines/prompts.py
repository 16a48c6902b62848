"""Prompt rows -> token ids, the same way for every engine.

A row's ``prompt`` is a string or chat messages (``[{"role", "content"}, ...]``, DESIGN.md
"Dataset rows"). Chat messages go through the tokenizer's chat template when it has one:
the template is rendered to text (``tokenize=False``) and encoded *without* adding special
tokens, since the template already writes them (BOS / ``<|im_start|>``); rendering to text
sidesteps ``apply_chat_template(tokenize=True)``'s return type, which changed across
transformers versions (a list of ids in 4.x, a ``BatchEncoding`` in 5.x). A model without a
template gets the message contents joined by newlines, encoded as a plain string. A string
prompt is encoded as is (special tokens added by the tokenizer's own post-processor),
whether or not the model has a template: a dataset that wants the template gives messages.
"""

from __future__ import annotations


class PromptError(ValueError):
    """A prompt that cannot be turned into token ids; the message names the row and the fix."""


def _is_messages(prompt) -> bool:
    return isinstance(prompt, list) and all(isinstance(m, dict) and "content" in m for m in prompt)


def encode_prompt(tokenizer, prompt, row_id: str = "?") -> list[int]:
    """Token ids of ``prompt`` (string or chat messages) for ``tokenizer``; see the module doc."""
    if isinstance(prompt, list):
        if not prompt or not _is_messages(prompt):
            raise PromptError(f"prompt of row {row_id!r}: a list prompt must be non-empty chat messages "
                              f"[{{'role': ..., 'content': ...}}, ...], got {str(prompt)[:80]!r}")
        if getattr(tokenizer, "chat_template", None):
            try:
                text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
            except Exception as e:
                raise PromptError(f"prompt of row {row_id!r}: the model's chat template cannot render "
                                  f"these messages ({type(e).__name__}: {e}); check the roles and contents") from None
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            ids = tokenizer("\n".join(str(m["content"]) for m in prompt))["input_ids"]
    elif isinstance(prompt, str):
        ids = tokenizer(prompt)["input_ids"]
    else:
        raise PromptError(f"prompt of row {row_id!r}: must be a string or chat messages, "
                          f"got {type(prompt).__name__}")
    if not ids or not all(isinstance(t, int) for t in ids):
        raise PromptError(f"prompt of row {row_id!r}: encoded to {str(ids)[:80]!r}, not a non-empty list of "
                          f"token ids; check the tokenizer")
    unknown = [t for t in ids if not 0 <= t < len(tokenizer)]
    if unknown:
        raise PromptError(f"prompt of row {row_id!r}: token ids {unknown[:5]} are outside the vocabulary "
                          f"({len(tokenizer)}); the tokenizer does not match the model")
    return list(ids)
