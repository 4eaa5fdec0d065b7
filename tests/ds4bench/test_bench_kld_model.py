"""ds4-bench kld on the embedded model: a float32-path base and, against it, the packed path and
llama.cpp (where the llamacpp extra is installed) over a few hundred corpus tokens."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from ds4bench import cli


def common(embedded_path: str) -> list[str]:
    return ["-m", embedded_path, "--tokens", "300", "--ctx", "160"]


@pytest.fixture(scope="module")
def float32_base(embedded_path, tmp_path_factory):
    base = tmp_path_factory.mktemp("kld") / "base.npz"
    r = CliRunner().invoke(cli.main, ["kld", "--save-base", str(base), "--weights", "float32", *common(embedded_path)])
    assert r.exit_code == 0, r.output
    return base


def candidate_summary(embedded_path, base, tmp_path, *args: str) -> dict:
    out = tmp_path / "kld.json"
    r = CliRunner().invoke(cli.main, ["kld", "--base", str(base), "--json", str(out), *args, *common(embedded_path)])
    assert r.exit_code == 0, r.output
    return json.loads(out.read_text())["summary"]


@pytest.mark.model
def test_kld_of_the_packed_path_on_the_embedded_model(embedded_path, float32_base, tmp_path):
    s = candidate_summary(embedded_path, float32_base, tmp_path, "--weights", "packed")
    assert s["positions"] == 298 and s["windows"] == 2  # SmolLM2 adds no BOS: windows of 160 and 140 tokens
    assert 0 < s["kl_mean"]["value"] < 0.01 and s["same_top"]["value"] > 0.9
    assert abs(s["ppl_ratio"]["value"] - 1) < 0.05 and s["known_share"] == 1.0


@pytest.mark.model
def test_kld_of_llama_cpp_against_the_float32_path(embedded_path, float32_base, tmp_path):
    pytest.importorskip("llama_cpp", reason="needs the optional llamacpp extra")
    s = candidate_summary(embedded_path, float32_base, tmp_path, "--stack", "llamacpp")
    assert s["positions"] == 298 and s["known_share"] == 1.0
    # Another implementation of the same Q4 weights: close to the float32 path, not equal to it.
    assert 0 < s["kl_mean"]["value"] < 0.01 and s["same_top"]["value"] > 0.9
    assert abs(s["ppl_ratio"]["value"] - 1) < 0.05
