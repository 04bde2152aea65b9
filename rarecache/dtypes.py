"""The compute dtype a run uses when nobody names one (`--dtype auto`, every command's default).

Why a rule and not a fixed default: bfloat16 halves the bytes every product reads, and where the vector
units multiply bf16 natively (AVX-512 BF16, AMX, CUDA) it runs about twice as fast as float32; where they
do not (AVX2: most rented and owned x86 machines) torch emulates it, and one 512 x 1536 x 8960 product
ran at 0.7 GFLOP/s in bfloat16 against 84 in float32 on the same AVX2 core (issue #55). So: bfloat16 on
CUDA and on CPUs that run bf16 matrix products natively, float32 elsewhere. Native is asked of torch
itself (`torch.cpu._is_avx512_bf16_supported`, `_is_amx_tile_supported`), else read from the CPU's
feature flags (/proc/cpuinfo `avx512_bf16`, `amx_bf16`); never from a list of CPU names. oneDNN capped
below bf16 by the environment (`ONEDNN_MAX_CPU_ISA=AVX2`) emulates bf16 whatever the CPU has (0.3 GFLOP/s on
an AMX core), so the cap counts too. A dtype the user
names (`--dtype bfloat16|float32`) is always obeyed; a command prints which dtype `auto` chose and why,
and warns where bfloat16 was asked for on a machine that emulates it.

Light on purpose: `--help` builds every parser from this module, so torch is imported inside the functions.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from .errors import RarecacheError

DTYPE_NAMES = ("bfloat16", "float32")  # what a model computes in
DTYPE_CHOICES = ("auto", *DTYPE_NAMES)  # what a user may ask for
DTYPE_HELP = ("compute dtype (default: auto: bfloat16 on CUDA and on CPUs with native bf16 products, AVX-512 BF16 "
              "or AMX; float32 elsewhere, where bf16 is emulated and many times slower)")
CPUINFO = Path("/proc/cpuinfo")


@dataclass(frozen=True)
class DtypeChoice:
    dtype: str  # "bfloat16" or "float32": what runs
    reason: str  # why, for the user
    capability: str  # torch.backends.cpu.get_cpu_capability(): which CPU kernels ran (figures name it)
    asked: str = "auto"
    best: str = ""  # what auto picks here

    def line(self) -> str:
        return f"dtype {self.dtype}: {self.reason}"

    @property
    def worth_saying(self) -> bool:
        """Whether a command tells the user: always for auto (what it chose and why), and where the user asked
        for bfloat16 on a machine that emulates it (many times slower); a dtype asked for and fine is obeyed
        silently."""
        return self.asked == "auto" or (self.dtype == "bfloat16" and self.best == "float32")


def cpu_capability() -> str:
    """The vector instruction set torch's CPU kernels dispatch to ("AVX2", "AVX512", ...)."""
    import torch

    return torch.backends.cpu.get_cpu_capability()


# oneDNN's ISA names (oneDNN 3.x, `ONEDNN_MAX_CPU_ISA`) below the ones that multiply bf16 natively: a cap at one
# of these emulates bf16. oneDNN lower-cases the value and ignores a name it does not know (no cap), as here.
ONEDNN_BELOW_BF16 = ("sse41", "avx", "avx2", "avx2_vnni", "avx2_vnni_2", "avx512_core", "avx512_core_vnni")
ONEDNN_CAP_VARS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")  # oneDNN reads the first one set


def onednn_cap() -> tuple[str, str] | None:
    """(variable, value) where the environment caps oneDNN's CPU kernels below bf16, else None."""
    import os

    var = next((v for v in ONEDNN_CAP_VARS if os.environ.get(v)), None)
    return (var, os.environ[var]) if var and os.environ[var].lower() in ONEDNN_BELOW_BF16 else None


def native_bf16() -> tuple[str, ...]:
    """Which of this CPU's features multiply bf16 natively ("avx512_bf16", "amx"); () when none does.
    torch's own queries, else (a torch without them) the kernel's feature flags."""
    import torch

    probes = (("avx512_bf16", getattr(torch.cpu, "_is_avx512_bf16_supported", None)),
              ("amx", getattr(torch.cpu, "_is_amx_tile_supported", None)))
    if all(probe is not None for _, probe in probes):
        return tuple(name for name, probe in probes if probe())
    flags = cpu_flags()
    return tuple(name for name, flag in (("avx512_bf16", "avx512_bf16"), ("amx", "amx_bf16")) if flag in flags)


def cpu_flags(path: Path | None = None) -> set[str]:
    """The first processor's feature flags from /proc/cpuinfo (empty where there is none: not Linux)."""
    try:
        text = (path or CPUINFO).read_text(errors="replace")
    except OSError:
        return set()
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "flags":
            return set(value.split())
    return set()


def resolve_dtype(asked: str = "auto", device: str = "cpu") -> DtypeChoice:
    """The dtype a run on `device` computes in when the user asked for `asked` ("auto" or a dtype name)."""
    if asked not in DTYPE_CHOICES:
        raise RarecacheError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, not {asked!r}")
    capability = cpu_capability()
    if str(device).split(":")[0] == "cuda":
        best, why = "bfloat16", "CUDA runs bf16 natively"
    elif (features := native_bf16()) and (cap := onednn_cap()):
        best, why = "float32", f"{cap[0]}={cap[1]} caps oneDNN below this CPU's native bf16 ({capability})"
    elif features:
        best, why = "bfloat16", f"this CPU runs bf16 natively ({capability}, {'+'.join(features)})"
    else:
        best, why = "float32", f"this CPU has no native bf16 ({capability})"
    if asked == "auto":
        return DtypeChoice(best, why, capability, asked, best)
    if asked == best:
        return DtypeChoice(asked, f"as asked ({why})", capability, asked, best)
    return DtypeChoice(asked, f"as asked, though {why}: {best} runs faster here (--dtype auto)", capability, asked,
                       best)


def gpu_or_cpu() -> str:
    """Where an engine that takes the GPU when there is one computes (vLLM): "cuda" or "cpu"."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def dtype_name(asked: str, device: str = "cpu") -> str:
    """`resolve_dtype`'s dtype alone, for the library's own defaults (which print nothing)."""
    return asked if asked in DTYPE_NAMES else resolve_dtype(asked, device).dtype


def announce(choice: DtypeChoice) -> None:
    """Tell the user which dtype runs and why, on stderr, where it is worth saying (a command does it once,
    before its work)."""
    if choice.worth_saying:
        print(choice.line(), file=sys.stderr)
