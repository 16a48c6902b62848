"""Chat-message prompts (verl rows, builtin:humaneval) reach a model with a chat template as its token ids.

The tokenizer is a real ``PreTrainedTokenizerFast`` (byte-level, built offline) with a Jinja
chat template, so the same transformers code path runs as for an instruct model's tokenizer.
"""

import pytest

from prorl_async.data.datasets import load_rows
from tests.offline import byte_level_tokenizer

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


@pytest.fixture(scope="module")
def chat_tokenizer():
    return byte_level_tokenizer(TEMPLATE)


def test_chat_prompts_of_humaneval_and_verl_rows_encode_to_template_ids(chat_tokenizer, tmp_path):
    import json

    from prorl_async.engines.prompts import encode_prompt

    verl = {"data_source": "openai/gsm8k", "ability": "math",
            "prompt": [{"role": "user", "content": "What is 2+3?"}],
            "reward_model": {"style": "rule", "ground_truth": "5"}, "extra_info": {"index": 0}}
    (tmp_path / "v.jsonl").write_text(json.dumps(verl) + "\n")
    rows = load_rows("builtin:humaneval?n=2") + load_rows(str(tmp_path / "v.jsonl"), strict=True)
    for row in rows:
        ids = encode_prompt(chat_tokenizer, row["prompt"])
        text = chat_tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
        assert all(isinstance(i, int) for i in ids)
        assert chat_tokenizer.decode(ids) == text and text.endswith("<|assistant|>\n")
        assert row["prompt"][-1]["content"] in text
