"""Compiled CPU kernels for the engine's hot paths, built on first use.

`decode_attention()`, `int4_linear()` and `int4_linear_tiles()` return the ops
`torch.ops.ds4.decode_attention`, `torch.ops.ds4.int4_linear` and `torch.ops.ds4.int4_linear_tiles`
(contracts in the .cpp files), or None where the library cannot be built or loaded here
(`unavailable_reason()` then says why in one line), where the CPU lacks the instructions
(AVX512-BF16 for int4_linear, AMX-BF16 for int4_linear_tiles) or, for the tile op, where the
operating system refuses the tile state; callers then keep their other paths.

The C++ sources are compiled once per machine with the host's vector instructions
(-march=native) into `$XDG_CACHE_HOME/ds4eval/kernels/ds4_kernels_<tag>.so` (default
`~/.cache/...`), where the tag hashes the sources, the torch version and the CPU's model and
flags, so a home directory shared by different machines never loads code built for another CPU.
A build takes a few seconds; later loads only open the library.  Each build runs in a private
temporary directory and the finished library is renamed into place, so processes never wait on
each other's build: an interrupted build (Ctrl-C, kill -9) leaves only a temporary directory,
removed by a later build once it is an hour old, never a lock that hangs later starts.  Two
checkouts of the same sources share one library.  Building needs a C++ compiler; ninja comes
with this package.
OpenMP threads are torch's own (the kernel links the libgomp torch has loaded), so
`torch.set_num_threads` governs it like any torch op.
It does not decide when a kernel is used; see engine.models.llama.
"""
from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import torch

_SOURCES = [Path(__file__).with_name(n) for n in ("decode_attention.cpp", "int4_linear.cpp")]
_lock = threading.Lock()
_loaded: dict[str, object] = {}


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


def _tag(source: bytes) -> str:
    h = hashlib.sha256(source)
    h.update(torch.__version__.encode())
    h.update(_cpu_signature().encode())
    return h.hexdigest()[:16]


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


def library_path() -> Path:
    """Where the library for these sources, this torch and this CPU lives once built."""
    source = b"".join(p.read_bytes() for p in _SOURCES)
    return build_dir() / f"ds4_kernels_{_tag(source)}.so"


def remove_stale_builds(root: Path, now: float) -> None:
    for d in root.glob(".build-*"):
        try:
            if now - d.stat().st_mtime > STALE_BUILD_S:
                shutil.rmtree(d, ignore_errors=True)
        except OSError:
            pass


def build_library(target: Path) -> None:
    """Compile into a private directory, then rename the library to `target` (atomic)."""
    from torch.utils import cpp_extension

    root = target.parent
    root.mkdir(parents=True, exist_ok=True)
    remove_stale_builds(root, time.time())
    work = Path(tempfile.mkdtemp(prefix=".build-", dir=root))
    try:
        _ensure_ninja()
        name = target.stem
        cpp_extension.load(name=name, sources=[str(p) for p in _SOURCES], build_directory=str(work),
                           extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
                           is_python_module=False, verbose=False)
        os.replace(work / f"{name}.so", target)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _load() -> None:
    target = library_path()
    if target.is_file():
        torch.ops.load_library(str(target))
    else:
        build_library(target)  # cpp_extension.load has loaded it already


def _built() -> bool:
    """Build or load the library once per process; False (with a reason) if that failed."""
    with _lock:
        if "ok" not in _loaded:
            try:
                _load()
                _loaded["ok"] = True
            except Exception as e:  # any build or load failure means: use the torch paths
                lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
                errors = [ln for ln in lines if "error" in ln.lower()]
                _loaded["ok"] = False
                _loaded["reason"] = f"{type(e).__name__}: {(errors or lines or ['no message'])[0]}"[:300]
        return bool(_loaded["ok"])


def decode_attention() -> Callable[..., torch.Tensor] | None:
    """The decode-attention op; None if the library cannot be built or loaded here."""
    return torch.ops.ds4.decode_attention if _built() else None


def int4_linear() -> Callable[..., torch.Tensor] | None:
    """The 4-bit grouped matmul op; None without the library or where the compiler does not
    target AVX512-BF16 (the op is then not part of the library)."""
    if not _built():
        return None
    try:
        return torch.ops.ds4.int4_linear
    except (AttributeError, RuntimeError):
        return None


@functools.cache
def int4_linear_tiles() -> Callable[..., torch.Tensor] | None:
    """The 4-bit grouped matmul op on AMX tiles (same contract as int4_linear); None without
    the library, AMX-BF16 or the operating system's leave to use the tiles (tried once on a
    small product)."""
    if not _built():
        return None
    try:
        op = torch.ops.ds4.int4_linear_tiles
        op(torch.zeros(1, 32), torch.zeros(1, 1, 8, 32, dtype=torch.uint8), torch.zeros(1, 1, 2, 16))
    except (AttributeError, RuntimeError):
        return None
    return op


def unavailable_reason() -> str | None:
    """Why the library could not be built or loaded (None if it was not asked for or is loaded)."""
    return _loaded.get("reason")  # type: ignore[return-value]
