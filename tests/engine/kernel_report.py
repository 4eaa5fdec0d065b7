"""Compiles one of the engine's Triton kernels for a GPU that is not here (sm_90 unless told) as
Triton's JIT compiles it for arguments of the given sizes, and reports what the compiler made of
it: registers, spills, shared memory, which loads the software pipeline turned into
asynchronous copies and which stayed plain loads, and the longest loop's instructions by kind.
A script for reading kernels without a GPU, not a test.

The JIT marks every pointer, and every integer argument that is a multiple of 16, as divisible
by 16 (`tt.divisibility`) unless the kernel excludes the argument (`do_not_specialize`).
Without those hints the compiler cannot prove a row aligned and may load it a byte a thread
and pipeline nothing: the kernel it builds is not the one that runs. The hints are given here to
exactly the arguments the JIT would give them to, from the sizes in `KERNELS` or `--arg`.

It needs Triton with its NVIDIA backend (ptxas and cuobjdump come in its wheel), not a GPU:

    PYTHONPATH=$PWD python tests/engine/kernel_report.py moe-gate-up --set UNROLL=1
    PYTHONPATH=$PWD python tests/engine/kernel_report.py int4-gemm --set BM=64 --warps 4 --stages 3
    PYTHONPATH=$PWD python tests/engine/kernel_report.py moe-down --ptr act_ptr=fp32 --no-hints
"""
from __future__ import annotations

import argparse
import collections
import importlib
import inspect
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True)
class KernelSpec:
    """A kernel and the arguments of one of its launches: pointers' element types, integers'
    values (their divisibility is what the JIT specializes on), constexprs."""

    kernel: Callable[[], object]  # returns the triton.jit function (imported only when asked)
    pointers: dict[str, str]
    ints: dict[str, int]
    constexprs: dict[str, object] = field(default_factory=dict)


def _kernel(module: str, name: str) -> Callable[[], object]:
    return lambda: getattr(importlib.import_module(f"engine.{module}"), name)


# 32 rows of Qwen3-30B-A3B's experts (top-8 of 128, 2048 x 768; their inputs in bfloat16, as
# MoeLaunch's gemm_narrow_input and gemm_narrow_act pass them) and a 2048 x 2048 dense matrix.
KERNELS = {
    "moe-gate-up": KernelSpec(
        _kernel("cuda_moe", "_gate_up_blocks"),
        dict(x_ptr="bf16", sorted_ptr="i32", owner_ptr="i32", w_ptr="u8", sm_ptr="fp16", act_ptr="bf16"),
        dict(P=256, F=768, K=2048, n_groups=64, stride_x=2048),
        dict(TOPK=8, FMT=0, G=32, BM=16, BN=64, UNROLL=2, TRANSPOSED=True, DEPENDENT=False)),
    "moe-down": KernelSpec(
        _kernel("cuda_moe", "_down_blocks"),
        dict(act_ptr="bf16", sorted_ptr="i32", owner_ptr="i32", wt_ptr="fp32", w_ptr="u8", sm_ptr="fp16",
             part_ptr="fp32"),
        dict(P=256, D=2048, F=768, n_groups=24),
        dict(FMT=0, G=32, BM=16, BN=64, UNROLL=2, TRANSPOSED=True, DEPENDENT=False)),
    "int4-gemm": KernelSpec(
        _kernel("cuda_int4", "_int4_gemm"),
        dict(x_ptr="fp32", q_ptr="u8", sm_ptr="fp16", out_ptr="fp32"),
        dict(M=16, N=2048, K=2048, stride_x=2048, groups_per_split=64),
        dict(BM=16, BN=64, UNROLL=2, ADD=False, TRANSPOSED=True)),
    "int4-gemv": KernelSpec(
        _kernel("cuda_int4", "_int4_gemv"),
        dict(x_ptr="fp32", w_ptr="i32", sm_ptr="fp16", out_ptr="fp32"),
        dict(N=2048, K=2048, stride_x=2048, groups_per_split=64),
        dict(BN=16, GB=32, ADD=False, PREFETCH=False, DEPENDENT=False)),
}


class ReportError(Exception):
    pass


def _value(text: str) -> object:
    """A constexpr from the command line: an int, or a Triton dtype by name (bf16, fp32, ...)."""
    try:
        return int(text)
    except ValueError:
        import triton.language as tl

        names = {"bf16": tl.bfloat16, "fp16": tl.float16, "fp32": tl.float32}
        if text not in names:
            raise ReportError(f"not an int or one of {sorted(names)}: {text!r}")
        return names[text]


def _pairs(items: list[str], what: str) -> dict[str, str]:
    out = {}
    for item in items:
        name, eq, value = item.partition("=")
        if not eq:
            raise ReportError(f"{what} wants NAME=VALUE, got {item!r}")
        out[name] = value
    return out


def compile_kernel(spec: KernelSpec, pointers: dict[str, str], ints: dict[str, int], constexprs: dict,
                   hints: bool, sm: int, warps: int, stages: int):
    """The compiled kernel, its signature built from the function's own parameters."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = spec.kernel()
    names = [p.name for p in fn.params]
    skipped = {names[i] if isinstance(i, int) else i for i in getattr(fn, "do_not_specialize", ())}
    signature, consts, attrs = {}, {}, {}
    for i, p in enumerate(fn.params):
        if p.is_constexpr:
            if p.name in constexprs:
                consts[(i,)] = constexprs[p.name]
            elif p.name == "OPERAND":
                consts[(i,)] = tl.bfloat16
            elif p.default is not inspect.Parameter.empty:
                consts[(i,)] = p.default
            else:
                raise ReportError(f"{p.name} (constexpr) needs a value: --set {p.name}=...")
            signature[p.name] = "constexpr"
        elif p.name in pointers:
            signature[p.name] = "*" + pointers[p.name]
            if hints:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif p.name in ints:
            signature[p.name] = "i32"
            if hints and p.name not in skipped and ints[p.name] % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            raise ReportError(f"argument {p.name} has no type: --ptr {p.name}=fp32 or --arg {p.name}=2048")
    src = ASTSource(fn=fn, signature=signature, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", sm, 32),
                          options={"num_warps": warps, "num_stages": stages})


def _tool(name: str) -> str:
    import triton.backends.nvidia as nvidia

    path = os.path.join(os.path.dirname(nvidia.__file__), "bin", name)
    if not os.path.exists(path):
        raise ReportError(f"{name} is not in Triton's NVIDIA backend ({path})")
    return path


def loop_opcodes(sass: str) -> tuple[int, collections.Counter]:
    """The longest loop's (a backward branch's span) instruction count and opcodes, from
    cuobjdump's SASS."""
    lines = re.findall(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);", sass)
    code = [(int(a, 16), op, rest) for a, _, op, rest in lines]
    best = (0, 0)
    for addr, op, rest in code:
        target = re.search(r"0x([0-9a-f]+)", rest) if op.startswith("BRA") else None
        if target and int(target.group(1), 16) < addr and addr - int(target.group(1), 16) > best[1] - best[0]:
            best = (int(target.group(1), 16), addr)
    body = [op.split(".")[0] for addr, op, _ in code if best[0] <= addr <= best[1]] if best[1] else []
    return len(body), collections.Counter(body)


def report(kernel, sm: int) -> list[str]:
    ttgir = kernel.asm["ttgir"]
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        arch = f"sm_{sm}a" if sm >= 90 else f"sm_{sm}"
        ptxas = subprocess.run([_tool("ptxas"), "--gpu-name", arch, "-v", ptx, "-o", cubin],
                               capture_output=True, text=True)
        if ptxas.returncode:
            raise ReportError(f"ptxas failed: {ptxas.stderr.strip().splitlines()[-1]}")
        sass = subprocess.run([_tool("cuobjdump"), "-sass", cubin], capture_output=True, text=True).stdout
    used = [line.split("ptxas info    : ")[-1] for line in ptxas.stderr.splitlines() if "Used" in line]
    spills = [line.split("ptxas info    : ")[-1].strip() for line in ptxas.stderr.splitlines() if "spill" in line]
    copies = re.findall(r"async_copy_global_to_local .*?: (tensor<[^>]*>)", ttgir)
    plain = re.findall(r"tt\.load [^\n]*?: (tensor<[^>]*>|!tt\.ptr<[^>]*>)", ttgir)
    size, ops = loop_opcodes(sass)
    lines = [f"registers and shared: {'; '.join(used)}; shared memory {kernel.metadata.shared} bytes",
             f"spills: {'; '.join(spills) or 'none'}",
             f"asynchronous copies ({len(copies)}): " + ", ".join(sorted(set(copies))),
             f"plain loads ({len(plain)}): " + ", ".join(sorted(set(plain)))]
    if size:
        lines.append(f"longest loop: {size} instructions; " + ", ".join(f"{op} {n}" for op, n in ops.most_common(12)))
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("kernel", choices=sorted(KERNELS))
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="a constexpr (int, or bf16/fp32)")
    ap.add_argument("--arg", action="append", default=[], metavar="NAME=INT", help="an integer argument's value")
    ap.add_argument("--ptr", action="append", default=[], metavar="NAME=DTYPE", help="a pointer's element type")
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--sm", type=int, default=90, help="compute capability to compile for (90: H100/H200)")
    ap.add_argument("--no-hints", action="store_true", help="leave out the JIT's divisibility hints")
    args = ap.parse_args(argv)
    try:
        import triton  # noqa: F401
    except ImportError:
        print("kernel_report: needs Triton (pip install triton)", file=sys.stderr)
        return 2
    spec = KERNELS[args.kernel]
    try:
        constexprs = {**spec.constexprs, **{k: _value(v) for k, v in _pairs(args.set, "--set").items()}}
        ints = {**spec.ints, **{k: int(v) for k, v in _pairs(args.arg, "--arg").items()}}
        pointers = {**spec.pointers, **_pairs(args.ptr, "--ptr")}
        kernel = compile_kernel(spec, pointers, ints, constexprs, not args.no_hints, args.sm, args.warps,
                                args.stages)
        lines = report(kernel, args.sm)
    except (ReportError, ValueError) as e:
        print(f"kernel_report: {e}", file=sys.stderr)
        return 2
    print(f"{args.kernel} sm_{args.sm}, {args.warps} warps, {args.stages} stages"
          f"{', no divisibility hints' if args.no_hints else ''}")
    for line in lines:
        print("  " + line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
