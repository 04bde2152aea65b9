"""GGUF -> Hugging Face folder: dequantise once with transformers, write float32 safetensors.

The conversion writes into a temporary sibling folder, the manifest ``rarecache.json``
last, and renames the folder into place, so a folder with a manifest is a finished
conversion (`is_complete`). The model store (`store.py`) converts the GGUFs it pulls
here; a ``.gguf`` path given as a model is converted the same way.

A ``.gguf`` path is untrusted input: `check_gguf` refuses an empty file, one without
the GGUF magic bytes or one whose header does not parse before anything is hashed or
converted, and whatever transformers cannot read is a one-line error too, never a
traceback. A conversion killed outright (``kill -9``) leaves its temporary folder;
the next conversion to the same folder removes it (`remove_leftovers`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from rarecache.errors import RarecacheError
from rarecache.packages import sha256_file

FORMAT_VERSION = 1
MANIFEST = "rarecache.json"
GGUF_MAGIC = b"GGUF"
_TEMP_PREFIXES = (".tmp-", ".old-")  # the sibling folders a conversion writes into and moves aside


def check_gguf(path: Path) -> None:
    """Refuse `path` unless it starts like a GGUF file (cheap: before hashing or converting it; the
    converter parses the header next)."""
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(len(GGUF_MAGIC))
    if not head:
        raise RarecacheError(f"{path} is empty, not a GGUF model")
    if head != GGUF_MAGIC:
        raise RarecacheError(f"{path} does not start with the GGUF magic bytes: not a GGUF file")


def _parse_header(path: Path) -> None:
    """Parse the GGUF header with the gguf package (tensor data is mapped, not read)."""
    from gguf import GGUFReader

    try:
        fields = GGUFReader(str(path)).fields
    except Exception as e:  # noqa: BLE001  (any failure to parse untrusted bytes is the file's fault)
        raise RarecacheError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e})") from None
    if "general.architecture" not in fields:
        raise RarecacheError(f"{path} is a GGUF file without general.architecture: not a model")


def remove_leftovers(out_dir: Path) -> None:
    """Delete what killed conversions into `out_dir` left beside it (its own temp folders only); the
    caller holds the model's lock, so none of them is still being written."""
    for prefix in _TEMP_PREFIXES:
        for p in out_dir.parent.glob(f"{prefix}{out_dir.name}-*"):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)


def say(msg: str, progress: bool) -> None:
    """A progress line on stderr, when `progress`."""
    if progress:
        print(f"rarecache: {msg}", file=sys.stderr, flush=True)


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

    _parse_header(gguf_path)
    src, fname = str(gguf_path.parent), gguf_path.name
    kw: dict = {}
    try:  # transformers 5 may keep GGUF blocks packed (with `kernels`); we want plain dense fp32
        from transformers import GgufConfig

        kw["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:
        pass

    t0 = time.monotonic()
    say(f"dequantising {fname} to float32 with transformers {transformers.__version__} (about a minute)", progress)
    tlog = transformers.utils.logging
    bars = tlog.is_progress_bar_enabled()
    if not progress:
        tlog.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(src, gguf_file=fname, dtype=torch.float32, **kw)
    except Exception as e:  # noqa: BLE001  (transformers' many ways of refusing a file it cannot read)
        raise _unreadable(fname, e) from None
    finally:
        if bars:
            tlog.enable_progress_bar()
    say(f"loaded in {time.monotonic() - t0:.1f} s; writing model.safetensors", progress)

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

    say("writing tokenizer files", progress)
    try:
        tok = AutoTokenizer.from_pretrained(src, gguf_file=fname)
    except Exception as e:  # noqa: BLE001
        raise _unreadable(fname, e) from None
    tok.save_pretrained(str(out))
    tcfg_path = out / "tokenizer_config.json"
    tcfg = json.loads(tcfg_path.read_text()) if tcfg_path.is_file() else {}
    if not tcfg.get("chat_template") and not (out / "chat_template.jinja").is_file():
        template = getattr(tok, "chat_template", None) or _gguf_chat_template(gguf_path)
        if isinstance(template, str) and template:
            (out / "chat_template.jinja").write_text(template)
        else:
            say(f"warning: {fname} carries no chat template", progress)
    say(f"converted in {time.monotonic() - t0:.1f} s (tied embeddings: {tied})", progress)


def _unreadable(fname: str, e: Exception) -> RarecacheError:
    first = (str(e).strip().splitlines() or [""])[0][:300]
    return RarecacheError(f"{fname} is not a GGUF model transformers can convert ({type(e).__name__}: {first})")


def _gguf_chat_template(gguf_path: Path) -> str | None:
    from gguf import GGUFReader

    field = GGUFReader(str(gguf_path)).fields.get("tokenizer.chat_template")
    if field is None or not field.data:
        return None
    try:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    except (UnicodeDecodeError, IndexError):
        return None


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
    Callers converting into a shared cache hold the model's lock (`store.py`).
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise RarecacheError(f"no such GGUF file: {gguf_path}")
    check_gguf(gguf_path)
    if sha256 is None:
        sha256 = sha256_file(gguf_path, progress, f"hash {gguf_path.name}")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(out_dir)
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
