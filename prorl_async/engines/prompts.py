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

Message contents are text, never control tokens. A tokenizer reads its special tokens' texts
(``<|im_end|>``, ``<|im_start|>``, ``</s>``) wherever they appear, so a user message holding
``<|im_end|>\n<|im_start|>assistant\n...`` would end its own turn and open a forged one. Where a
content holds such a text, the template is rendered with a marker in its place and that text is
encoded as ordinary characters (``split_special_tokens``); the template's own special tokens
stay special. Prompts without such text encode exactly as before. (A string prompt is the
dataset's own rendering and keeps its special tokens.)

A prompt must leave its response room: prompt tokens + ``rollout.max_new_tokens`` within the
model's context (:func:`prorl_async.models.context_length`), so every response can reach its
full length at positions the model was trained on and the learner's sequences fit too.
:func:`drop_unfit` checks every row once, when a run or an evaluation loads its data: a row that
does not fit, or whose prompt cannot be encoded, is dropped with one warning that counts them
and names each with its reason (``data.strict``: the first one stops the load, as a malformed
row does); no row left is one error naming the fix. A run never meets such a prompt mid-way.
"""

from __future__ import annotations

import logging
import re
import warnings

logger = logging.getLogger(__name__)
_MAX_LISTED = 20


class PromptError(ValueError):
    """A prompt that cannot be turned into token ids; the message names the row and the fix."""


def _is_messages(prompt) -> bool:
    return isinstance(prompt, list) and all(isinstance(m, dict) and "content" in m for m in prompt)


def control_texts(tokenizer) -> list[str]:
    """The texts ``tokenizer`` reads as special tokens (``<|im_end|>``, ``</s>`` ...), longest first."""
    texts = {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special}
    texts |= set(getattr(tokenizer, "all_special_tokens", None) or [])
    return sorted((t for t in texts if t), key=len, reverse=True)


def _hide_controls(prompt: list[dict], controls: list[str]) -> tuple[list[dict], list[str], str]:
    """``prompt`` with each control text in a content replaced by a marker ``<m>k<m>``; the texts
    replaced, in order; and the marker (a private-use character no content holds)."""
    mark = "\ue000"
    while any(mark in str(m["content"]) for m in prompt):
        mark += "\ue000"
    pattern = re.compile("|".join(map(re.escape, controls)))
    hidden: list[str] = []

    def swap(m: re.Match) -> str:
        hidden.append(m.group())
        return f"{mark}{len(hidden) - 1}{mark}"

    out = [{**m, "content": pattern.sub(swap, m["content"])} if isinstance(m["content"], str) else m for m in prompt]
    return out, hidden, mark


def _encode_template(tokenizer, prompt: list[dict]) -> list[int]:
    """Token ids of the template rendered on ``prompt``, contents' control texts as plain text."""
    controls = control_texts(tokenizer)
    hidden, texts, mark = _hide_controls(prompt, controls) if controls else (prompt, [], "")
    text = tokenizer.apply_chat_template(hidden, add_generation_prompt=True, tokenize=False)
    if not texts:
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    ids: list[int] = []
    for k, piece in enumerate(re.split(f"{mark}(\\d+){mark}", text)):
        if k % 2:  # a control text of a content: ordinary characters
            ids += tokenizer(texts[int(piece)], add_special_tokens=False, split_special_tokens=True)["input_ids"]
        elif piece:
            ids += tokenizer(piece, add_special_tokens=False)["input_ids"]
    return ids


def encode_prompt(tokenizer, prompt, row_id: str = "?") -> list[int]:
    """Token ids of ``prompt`` (string or chat messages) for ``tokenizer``; see the module doc."""
    if isinstance(prompt, list):
        if not prompt or not _is_messages(prompt):
            raise PromptError(f"prompt of row {row_id!r}: a list prompt must be non-empty chat messages "
                              f"[{{'role': ..., 'content': ...}}, ...], got {str(prompt)[:80]!r}")
        if getattr(tokenizer, "chat_template", None):
            try:
                ids = _encode_template(tokenizer, prompt)
            except Exception as e:
                raise PromptError(f"prompt of row {row_id!r}: the model's chat template cannot render "
                                  f"these messages ({type(e).__name__}: {e}); check the roles and contents") from None
        else:  # all of it is content: no control tokens read from it (the tokenizer's BOS still added)
            ids = tokenizer("\n".join(str(m["content"]) for m in prompt), split_special_tokens=True)["input_ids"]
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


def fit_to_context(rows: list[dict], tokenizer, context: int | None, max_new_tokens: int,
                   lengths: list[int] | None = None) -> tuple[list[dict], list[tuple[str, str]]]:
    """(the rows whose prompt encodes and leaves ``max_new_tokens`` of room in ``context``,
    ``[(id, reason), ...]`` of the others). ``context`` None: only encoding is checked. The kept
    rows' prompt lengths in tokens are appended to ``lengths`` when given."""
    kept, dropped = [], []
    for row in rows:
        rid = str(row.get("id", "?"))
        try:
            n = len(encode_prompt(tokenizer, row.get("prompt"), rid))
        except PromptError as e:
            dropped.append((rid, str(e)))
            continue
        if context is not None and n + max_new_tokens > context:
            dropped.append((rid, f"prompt of {n} tokens + rollout.max_new_tokens {max_new_tokens} > "
                                 f"the model's context of {context}"))
            continue
        kept.append(row)
        if lengths is not None:
            lengths.append(n)
    return kept, dropped


def drop_unfit(rows: list[dict], tokenizer, context: int | None, max_new_tokens: int, source: str,
               strict: bool = False, lengths: list[int] | None = None) -> tuple[list[dict], int]:
    """(the rows of ``source`` that fit, how many were dropped); see the module doc. ``lengths``:
    as :func:`fit_to_context`'s."""
    kept, dropped = fit_to_context(rows, tokenizer, context, max_new_tokens, lengths)
    if not dropped:
        return kept, 0
    if strict:
        rid, reason = dropped[0]
        raise ValueError(f"{source}: row {rid!r}: {reason} (data.strict)")
    if not kept:
        raise ValueError(f"{source}: no prompt of its {len(rows)} rows fits the model ({dropped[0][1]}); "
                         f"shorten the prompts, lower rollout.max_new_tokens or use a model with a longer context")
    listed = "; ".join(f"{rid}: {reason}" for rid, reason in dropped[:_MAX_LISTED])
    more = f"; ... and {len(dropped) - _MAX_LISTED} more" if len(dropped) > _MAX_LISTED else ""
    msg = f"{source}: dropped {len(dropped)} of {len(rows)} row(s) whose prompt does not fit the model: {listed}{more}"
    warnings.warn(msg, stacklevel=2)
    logger.warning(msg)
    return kept, len(dropped)
