"""tests/engine/kernel_report.py's pure parts: the longest loop of a SASS listing, and the one-line
error where Triton is absent (compiling needs Triton's NVIDIA backend, which CI does not have)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import kernel_report  # noqa: E402

SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   LDG.E R2, desc[UR4][R2.64] ;
        /*0020*/                   FADD R3, R2, R2 ;
        /*0030*/              @!P0 BRA 0x10 ;
        /*0040*/                   HGMMA.64x16x16.F32.BF16 R40, R24, gdesc[UR20], RZ, !UPT ;
        /*0050*/                   FFMA R4, R3, R3, R4 ;
        /*0060*/                   FFMA R5, R3, R3, R5 ;
        /*0070*/               @P1 BRA 0x40 ;
        /*0080*/                   EXIT ;
"""


def test_the_longest_backward_branch_is_the_loop():
    size, ops = kernel_report.loop_opcodes(SASS)
    assert size == 4  # 0x40 .. 0x70: the HGMMA, two FFMAs and the branch
    assert ops == {"HGMMA": 1, "FFMA": 2, "BRA": 1}


def test_no_backward_branch_is_no_loop():
    assert kernel_report.loop_opcodes(SASS.replace("BRA 0x40", "BRA 0x80").replace("BRA 0x10", "BRA 0x80")) == (0, {})


@pytest.mark.skipif(importlib.util.find_spec("triton") is not None, reason="Triton is installed here")
def test_without_triton_it_says_so_in_one_line(capsys):
    assert kernel_report.main(["moe-gate-up"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs Triton" in err
