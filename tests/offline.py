"""Helpers the tests share: a real transformers tokenizer built offline, and a protocol's conformance."""

from __future__ import annotations

import inspect


def byte_level_tokenizer(chat_template: str, **special):
    """A real ``PreTrainedTokenizerFast`` (byte-level BPE without merges: one token per byte) with
    ``chat_template``; ``special``: its special tokens (``eos_token=...``, ``additional_special_tokens=[...]``),
    so the same transformers code path runs as for an instruct model's tokenizer, with no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **special)
    fast.chat_template = chat_template
    return fast


def public_methods(protocol) -> set[str]:
    return {n for n, v in vars(protocol).items() if inspect.isfunction(v) and not n.startswith("_")}


def assert_defines_every_method(protocol, classes, methods) -> None:
    """Every class defines each of ``methods`` itself (not inherited, not probed), with the protocol's parameters."""
    for cls in classes:
        for name in methods:
            own = vars(cls).get(name)
            assert inspect.isfunction(own), f"{cls.__name__} does not define {name}"
            want = list(inspect.signature(getattr(protocol, name)).parameters)
            assert list(inspect.signature(own).parameters) == want, (cls.__name__, name)
