"""Tokenizer ids and rendered chat prompts against transformers, on a small trained BPE."""

from __future__ import annotations


import pytest
from rarecache.errors import RarecacheError
from rarecache.models.tokenizer import Tokenizer

from .conftest import TEXTS

transformers = pytest.importorskip("transformers")

def test_ids_and_chat_match_transformers(tok_dir):
    ours = Tokenizer.from_dir(tok_dir)
    ref = transformers.AutoTokenizer.from_pretrained(tok_dir)
    for text in TEXTS:
        assert ours.encode(text) == ref(text)["input_ids"]
        assert ours.decode(ours.encode(text)) == ref.decode(ref(text)["input_ids"], skip_special_tokens=True)
    messages = [{"role": "user", "content": "Write add(a, b)."},
                {"role": "assistant", "content": "def add(a, b): return a + b"},
                {"role": "user", "content": "Thanks!"}]
    for gen in (True, False):
        text = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        assert ours.render_chat(messages, add_generation_prompt=gen) == text
        assert ours.encode_chat(messages, gen) == ref(text, add_special_tokens=False)["input_ids"]
    assert ours.eos_token_ids == (ref.convert_tokens_to_ids("<|im_end|>"),)


def test_template_file_overrides_and_sandbox(tok_dir):
    (tok_dir / "chat_template.jinja").write_text("{{ ''.__class__.__mro__ }}")
    ours = Tokenizer.from_dir(tok_dir)
    with pytest.raises(RarecacheError, match="unsafe"):
        ours.render_chat([{"role": "user", "content": "x"}])


@pytest.mark.parametrize("messages", [[], [{"role": "user"}], ["hello"], [{"role": "user", "content": 3}]])
def test_bad_messages_are_refused(tok_dir, messages):
    with pytest.raises(RarecacheError, match="message"):
        Tokenizer.from_dir(tok_dir).render_chat(messages)


def test_missing_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(RarecacheError, match="no tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
