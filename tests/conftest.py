"""Shared fixtures: tiny random-weight models of each family (written to a temp dir by
transformers), a tiny source/target pair with a fitted map, and both directions of that
pair as chat models."""

from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from rarecache import LLM
from rarecache.engine.runner import Runner
from rarecache.models.tokenizer import Tokenizer
from rarecache.transfer.fitting.calibrate import Calibration, CalibrationConfig
from rarecache.transfer.fitting.corpus import load_corpus

transformers = pytest.importorskip("transformers")

TINY = dict(
    vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
)

FAMILIES = {
    "llama": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(attention_bias=True, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    ),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(head_dim=24)),
}


def error_of(err: str) -> str:
    """A command's stderr less the line `--dtype auto` prints first (which dtype runs and why, dtypes.py):
    what a user mistake leaves, one line."""
    first, sep, rest = err.partition("\n")
    return rest if sep and first.startswith("dtype ") else err


def make_tiny(family: str, path, seed: int = 0, **overrides):
    """Save a random `family` model under `path`; return the transformers model (fp32, eval)."""
    cfg_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    cfg = cfg_cls(**{**TINY, **extra, **overrides})
    model = model_cls(cfg).eval()
    with torch.no_grad():  # random biases and norm weights, so their handling is tested too
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(0.0 if name.endswith("bias") else 1.0, 0.2)
    model.save_pretrained(path)
    return model


@pytest.fixture(params=sorted(FAMILIES))
def tiny(request, tmp_path):
    """(family, path, transformers model) for each family."""
    hf = make_tiny(request.param, tmp_path)
    return request.param, tmp_path, hf


TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are helpful.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEXTS = ["def add(a, b):\n    return a + b", "Héllo wörld, 12345 tokens!", "  spaces\tand\ttabs  "]


def build_tokenizer(path):
    """A small byte-level BPE with a chat template, written to `path`."""
    path.mkdir(parents=True, exist_ok=True)
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXTS * 20 + ["the quick brown fox jumps over the lazy dog"] * 20, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "chat_template": TEMPLATE}))
    return path


@pytest.fixture()
def tok_dir(tmp_path):
    return build_tokenizer(tmp_path)


@pytest.fixture(scope="session")
def pair_dir(tmp_path_factory):
    """Two tiny Qwen2 models sharing a tokenizer (src: 3 layers, tgt: 4 layers, head_dim 24) and a corpus."""
    root = tmp_path_factory.mktemp("pair")
    for name, seed, kw in (("src", 1, {}), ("tgt", 2, dict(num_hidden_layers=4, head_dim=24))):
        build_tokenizer(root / name)
        make_tiny("qwen2", root / name, seed=seed, vocab_size=400, **kw)
    words = "the quick brown fox jumps over the lazy dog def add return tokens spaces".split()
    g = torch.Generator().manual_seed(0)
    docs = [" ".join(words[i] for i in torch.randint(0, len(words), (60,), generator=g)) for _ in range(12)]
    (root / "corpus.txt").write_text("\n\n\n".join(docs))
    return root


@pytest.fixture(scope="module")
def fitted(pair_dir, tmp_path_factory):
    """(source runner, target runner, a map fitted source -> target, two prompts of 37 and 23 tokens)."""
    source, target = Runner.load(pair_dir / "src"), Runner.load(pair_dir / "tgt")
    tok, corpus = Tokenizer.from_dir(pair_dir / "src"), load_corpus(str(pair_dir / "corpus.txt"))
    for runner in (source, target):  # as LLM does (the selectors that pick whole lines read it)
        runner.learn_lines(tok)
    cfg = CalibrationConfig(tokens=700, heldout_tokens=0, seq_len=48, k=2, rank=5)
    mapper = Calibration(source, target, tok, corpus, cfg, tmp_path_factory.mktemp("fit") / "m").run(progress=False)
    prompts = [tok.encode(corpus.documents[-1])[:37], tok.encode(corpus.documents[-2])[:23]]
    return source, target, mapper, prompts


@pytest.fixture(scope="module")
def chat(pair_dir, fitted, tmp_path_factory):
    """({"small": LLM, "large": LLM}, maps both ways: the fitted small -> large and one fitted large -> small)."""
    _, _, mapper, _ = fitted
    small, large = LLM(pair_dir / "src"), LLM(pair_dir / "tgt")
    cfg = CalibrationConfig(tokens=700, heldout_tokens=0, seq_len=48, k=2, rank=4)
    back = Calibration(large.runner, small.runner, small.tokenizer, load_corpus(str(pair_dir / "corpus.txt")), cfg,
                       tmp_path_factory.mktemp("back") / "m").run(progress=False)
    return {"small": small, "large": large}, {("small", "large"): mapper, ("large", "small"): back}
