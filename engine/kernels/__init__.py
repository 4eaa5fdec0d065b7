"""Compiled CPU kernels for the engine's hot paths: one set per instruction set, chosen at load.

`cpu_kernels(name=None)` returns a `CpuKernels`: the ops the engine runs on this CPU and why
they were chosen.  The paths, best first:

| path       | needs (x86 /proc/cpuinfo flags)                 | int4 products            | other matmuls, attention |
|------------|-------------------------------------------------|--------------------------|--------------------------|
| `amx`      | avx512 + amx_tile, amx_bf16, the OS's leave      | AVX512-BF16; AMX tiles from 32 rows | AVX512 |
| `avx512`   | avx2 + avx512f/bw/vl/dq, avx512_bf16             | AVX512-BF16 vectors      | AVX512                   |
| `avx2`     | avx2, fma, f16c                                  | AVX2 + FMA               | AVX2 + FMA + F16C        |
| `portable` | a C++ compiler (any CPU: NEON on aarch64)        | the compiler's vectors   | the compiler's vectors   |
| `torch`    | nothing                                          | torch's own kernels, one row at a time (see engine.weights) |

Without a name, `$DS4_CPU_KERNELS` picks one (the documented override, for testing another
path on one machine: `DS4_CPU_KERNELS=avx2` runs the AVX2 code on an AVX512 host); unset, the
best path this CPU runs and this machine can build is taken, falling down the table when a
build fails.  A path asked for by name that the CPU cannot execute or that does not build is
an error (`KernelsUnavailable`), never a silent substitute.  `host_paths()` lists what the CPU
executes, for tests that run every path.  The ops and their contracts are in the .cpp files:
`attention` and `prefill_attention` (decode_attention.cpp), `int4` / `int4_add` / `int4_tiles` (int4_linear.cpp), `int8`, `f16`
and `kq` (dense_linear.cpp; `kq` on avx512 only), `repack_int4` / `repack_codes` / `repack_int8` /
`repack_kq` (repack.cpp), which lay GGUF blocks out
for them at load, `rms_norm` / `swiglu` / `geglu` (elementwise.cpp), and `attention_block` /
`ffn_block` and `gemma_attention_block` / `gemma_ffn_block` (block.cpp), a llama or Gemma
decoding layer's two halves each in one call of the ops above, with `rotate_halves`, Gemma's
q/k norms and rope as one op.  Every op computes a row's result from that row alone, in a fixed order.

Each path's sources are compiled once per machine with that instruction set's flags (isa.h
names the ops per set, so libraries for several sets load side by side in one process) into
`$XDG_CACHE_HOME/ds4eval/kernels/ds4_kernels_<set>_<tag>.so` (default `~/.cache/...`), where the
tag hashes the sources, the flags, the torch version and the CPU's model and flags.  A build
takes seconds; later loads only open the library.  Each build runs in a private temporary
directory and the finished library is renamed into place, so processes never wait on each
other's build: an interrupted build leaves only a temporary directory, removed by a later
build once it is an hour old.  Building needs a C++ compiler; ninja comes with this package.
OpenMP threads are torch's own (the kernels link the libgomp torch has loaded), so
`torch.set_num_threads` governs them like any torch op.
It does not decide which kernel a matrix uses; see engine.weights and engine.models.llama.
"""
from __future__ import annotations

import hashlib
import os
import platform
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

ENV_VAR = "DS4_CPU_KERNELS"
PATHS = ("amx", "avx512", "avx2", "portable", "torch")  # best first

_HERE = Path(__file__).resolve().parent
_ALL_SOURCES = ("all.cpp",)  # includes every source: one compilation per library
_AVX2_FLAGS = ("-mavx2", "-mfma", "-mf16c")
_AVX512_FLAGS = _AVX2_FLAGS + ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16")


@dataclass(frozen=True)
class Library:
    """One compiled library: its sources and flags; its ops are ds4::<op>_<name>."""

    name: str
    sources: tuple[str, ...]
    flags: tuple[str, ...]


LIBRARIES = {
    "avx512": Library("avx512", _ALL_SOURCES, _AVX512_FLAGS + ("-DDS4_ISA_AVX512",)),
    "amx": Library("amx", ("int4_linear.cpp",), _AVX512_FLAGS + ("-mamx-tile", "-mamx-bf16", "-DDS4_ISA_AMX")),
    "avx2": Library("avx2", _ALL_SOURCES, _AVX2_FLAGS + ("-DDS4_ISA_AVX2",)),
    "portable": Library("portable", _ALL_SOURCES, ()),
}

# What each path needs of an x86 CPU (flag names as in /proc/cpuinfo) and which libraries it loads.
_X86_NEEDS = {
    "avx2": frozenset({"avx2", "fma", "f16c"}),
    "avx512": frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"}),
    "amx": frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16",
                      "amx_tile", "amx_bf16"}),
}
_PATH_LIBRARIES = {"amx": ("avx512", "amx"), "avx512": ("avx512",), "avx2": ("avx2",), "portable": ("portable",),
                   "torch": ()}


# What the compiled attention (decode_attention.cpp) takes: head dims that are multiples of 16
# up to 256, and caches of these dtypes; the families keep torch's attention for the others.
ATTENTION_CACHE_DTYPES = (torch.float32, torch.float16)


def attention_fits(head_dim: int) -> bool:
    return head_dim % 16 == 0 and 0 < head_dim <= 256


class KernelsUnavailable(Exception):
    """A CPU kernel path asked for by name cannot run here (CPU, compiler or operating system)."""


@dataclass(frozen=True)
class CpuKernels:
    """The CPU ops of one path; None where the path has no such op (the caller keeps torch's)."""

    name: str
    reason: str  # why this path: chosen by CPU features, or named by the override
    attention: Callable[..., torch.Tensor] | None = None
    prefill_attention: Callable[..., torch.Tensor] | None = None
    int4: Callable[..., torch.Tensor] | None = None
    int4_tiles: Callable[..., torch.Tensor] | None = None
    int8: Callable[..., torch.Tensor] | None = None
    f16: Callable[..., torch.Tensor] | None = None
    repack_int4: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None  # GGUF blocks -> int4 layout
    repack_int8: Callable[..., tuple[torch.Tensor, ...]] | None = None  # GGUF 8-bit grouped types -> int8 layout
    kq: Callable[..., torch.Tensor] | None = None  # Q6_K / Q3_K / Q2_K at their own width (dense_linear.cpp; avx512 only)
    repack_kq: Callable[..., tuple[torch.Tensor, ...]] | None = None  # GGUF Q6_K / Q3_K / Q2_K -> kq's layout
    repack_codes: Callable[..., tuple[torch.Tensor, ...]] | None = None  # GGUF coded types -> int4 layout + fifth bits
    rms_norm: Callable[..., torch.Tensor] | None = None  # (x, w, eps): a step's RMSNorm, one op
    int4_add: Callable[..., None] | None = None  # (x, packed, scales, out): out += int4(x, ...)
    # Whether int4 / int4_add take 5-bit codes and IQ4 levels (`high`, `levels`): where a table
    # lookup costs what the nibble lookup does (AVX512-BF16), measured faster than the int8 op.
    int4_codes: bool = False
    swiglu: Callable[..., torch.Tensor] | None = None  # (gate_up [M, 2F]) -> silu(gate) * up [M, F]
    geglu: Callable[..., torch.Tensor] | None = None  # (gate_up [M, 2F]) -> gelu_tanh(gate) * up [M, F]
    attention_block: Callable[..., None] | None = None  # a llama decoding layer's attention half, one op
    ffn_block: Callable[..., None] | None = None  # ...and its SwiGLU feed-forward half (block.cpp)
    rotate_halves: Callable[..., None] | None = None  # Gemma's per-head q/k norms and neox rope, in place
    gemma_attention_block: Callable[..., None] | None = None  # a Gemma decoding layer's halves, one op each
    gemma_ffn_block: Callable[..., None] | None = None

    def describe(self) -> str:
        """One line for banners: the path and why."""
        return f"{self.name} ({self.reason})"


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (x86 `flags`, arm `Features`)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def _is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")


def missing_features(path: str, flags: frozenset[str] | None = None, x86: bool | None = None) -> list[str]:
    """What this CPU lacks for `path` (empty when it can execute it)."""
    if path not in PATHS:
        raise ValueError(f"unknown CPU kernel path {path!r} (expected one of {', '.join(PATHS)})")
    if path not in _X86_NEEDS:
        return []
    if not (_is_x86() if x86 is None else x86):
        return [f"an x86-64 CPU (this is {platform.machine()})"]
    return sorted(_X86_NEEDS[path] - (cpu_flags() if flags is None else flags))


def host_paths() -> list[str]:
    """The paths whose instructions this CPU executes, best first (whether they build is not
    checked here)."""
    return [p for p in PATHS if not missing_features(p)]


# ------------------------------------------------------------------------ building and loading

_lock = threading.Lock()
_loaded: dict[str, str | None] = {}  # library name -> None when loaded, else why it is not


def _cpu_signature() -> str:
    fields = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "flags", "Features", "CPU part") and key not in fields:
                    fields[key] = value.strip()
    except OSError:
        pass
    return platform.machine() + "|" + "|".join(f"{k}={v}" for k, v in sorted(fields.items()))


def build_dir() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "ds4eval" / "kernels"


def _ensure_ninja() -> None:
    # torch finds ninja on PATH; the `ninja` package's binary is not there unless the
    # environment is activated.
    try:
        import ninja
    except ImportError:
        return
    bin_dir = getattr(ninja, "BIN_DIR", None)
    path = os.environ.get("PATH", "")
    if bin_dir and bin_dir not in path.split(os.pathsep):
        os.environ["PATH"] = bin_dir + (os.pathsep + path if path else "")


STALE_BUILD_S = 3600  # a temporary build directory this old belongs to a build that died


def library_path(lib: Library) -> Path:
    """Where `lib` for these sources, this torch and this CPU lives once built."""
    h = hashlib.sha256()
    for path in sorted([*_HERE.glob("*.cpp"), *_HERE.glob("*.h")]):  # what all.cpp includes, and more
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    h.update(" ".join(lib.flags).encode())
    h.update(torch.__version__.encode())
    h.update(_cpu_signature().encode())
    return build_dir() / f"ds4_kernels_{lib.name}_{h.hexdigest()[:16]}.so"


def remove_stale_builds(root: Path, now: float) -> None:
    for d in root.glob(".build-*"):
        try:
            if now - d.stat().st_mtime > STALE_BUILD_S:
                shutil.rmtree(d, ignore_errors=True)
        except OSError:
            pass


def build_library(lib: Library, target: Path) -> None:
    """Compile into a private directory, then rename the library to `target` (atomic)."""
    from torch.utils import cpp_extension

    root = target.parent
    root.mkdir(parents=True, exist_ok=True)
    remove_stale_builds(root, time.time())
    work = Path(tempfile.mkdtemp(prefix=".build-", dir=root))
    try:
        _ensure_ninja()
        name = target.stem
        cpp_extension.load(name=name, sources=[str(_HERE / s) for s in lib.sources], build_directory=str(work),
                           extra_cflags=["-O3", "-fopenmp", *lib.flags], extra_ldflags=["-fopenmp"],
                           extra_include_paths=[str(_HERE)], is_python_module=False, verbose=False)
        os.replace(work / f"{name}.so", target)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _short_reason(e: Exception) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower()]
    return f"{type(e).__name__}: {(errors or lines or ['no message'])[0]}"[:300]


def load_library(name: str) -> str | None:
    """Build or load one library once per process; None when its ops are registered, else why
    not (one line)."""
    with _lock:
        if name not in _loaded:
            lib = LIBRARIES[name]
            try:
                target = library_path(lib)
                if target.is_file():
                    torch.ops.load_library(str(target))
                else:
                    build_library(lib, target)  # cpp_extension.load has loaded it already
                _loaded[name] = None
            except Exception as e:  # any build or load failure means: this path is not available
                _loaded[name] = _short_reason(e)
        return _loaded[name]


def _op(name: str, lib: str) -> Callable[..., torch.Tensor]:
    return getattr(torch.ops.ds4, f"{name}_{lib}")


def _tiles_usable(op: Callable[..., torch.Tensor]) -> str | None:
    """None when the operating system grants the tile state (tried once on a small product)."""
    try:
        op(torch.zeros(1, 32), torch.zeros(1, 1, 8, 32, dtype=torch.uint8), torch.zeros(1, 1, 2, 16))
    except RuntimeError as e:
        return _short_reason(e)
    return None


def _build_path(name: str, reason: str) -> CpuKernels:
    """The ops of path `name`; KernelsUnavailable when the CPU lacks it or it does not build."""
    missing = missing_features(name)
    if missing:
        raise KernelsUnavailable(f"CPU kernels {name!r} need {', '.join(missing)}, which this CPU lacks "
                                 f"(it runs: {', '.join(host_paths())})")
    for lib in _PATH_LIBRARIES[name]:
        why = load_library(lib)
        if why is not None:
            raise KernelsUnavailable(f"CPU kernels {name!r} could not be built: {why}")
    if name == "torch":
        return CpuKernels(name, reason)
    vec = "avx512" if name == "amx" else name
    tiles = None
    if name == "amx":
        tiles = _op("int4_linear", "amx")
        why = _tiles_usable(tiles)
        if why is not None:
            raise KernelsUnavailable(f"CPU kernels 'amx': the operating system refuses the AMX tile state ({why})")
    return CpuKernels(name, reason, attention=_op("decode_attention", vec),
                      prefill_attention=_op("prefill_attention", vec), int4=_op("int4_linear", vec),
                      int4_codes=vec == "avx512",
                      int4_tiles=tiles, int8=_op("int8_linear", vec), f16=_op("f16_linear", vec),
                      repack_int4=_op("repack_int4", vec), repack_int8=_op("repack_int8", vec),
                      kq=_op("kq_linear", vec) if vec == "avx512" else None, repack_kq=_op("repack_kq", vec),
                      repack_codes=_op("repack_codes", vec),
                      rms_norm=_op("rms_norm", vec), int4_add=_op("int4_linear_add", vec),
                      swiglu=_op("swiglu", vec), geglu=_op("geglu", vec),
                      attention_block=_op("attention_block", vec), ffn_block=_op("ffn_block", vec),
                      rotate_halves=_op("rotate_halves", vec),
                      gemma_attention_block=_op("gemma_attention_block", vec),
                      gemma_ffn_block=_op("gemma_ffn_block", vec))


_chosen: dict[tuple[str | None, str], CpuKernels] = {}


def cpu_kernels(name: str | None = None) -> CpuKernels:
    """The CPU kernel path `name`, else $DS4_CPU_KERNELS's, else the best that runs and builds
    here (cached per process).  KernelsUnavailable for a named path that cannot run here."""
    requested = name or os.environ.get(ENV_VAR, "").strip().lower() or None
    how = "named by the caller" if name else f"{ENV_VAR}={requested}" if requested else "auto"
    key = (requested, how)
    if key in _chosen:
        return _chosen[key]
    if requested is not None:
        if requested not in PATHS:
            raise KernelsUnavailable(f"unknown CPU kernel path {requested!r} (expected one of {', '.join(PATHS)})")
        chosen = _build_path(requested, how)
    else:
        skipped: list[str] = []
        for path in host_paths():
            try:
                reason = "the best this CPU runs" if not skipped else f"the best that builds here; {'; '.join(skipped)}"
                chosen = _build_path(path, reason)
                break
            except KernelsUnavailable as e:
                skipped.append(str(e))
    _chosen[key] = chosen
    return chosen


def unavailable_reason(name: str) -> str | None:
    """Why path `name` cannot run here (None when it can); builds it if needed."""
    try:
        cpu_kernels(name)
    except KernelsUnavailable as e:
        return str(e)
    return None
