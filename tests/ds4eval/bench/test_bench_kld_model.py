"""ds4-bench kld on the embedded model: a float32-path base and the packed path over a few hundred corpus tokens."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from ds4eval.bench import cli


@pytest.mark.model
def test_kld_of_the_packed_path_on_the_embedded_model(embedded_path, tmp_path):
    base, out = tmp_path / "base.npz", tmp_path / "kld.json"
    common = ["-m", embedded_path, "--tokens", "300", "--ctx", "160"]
    r = CliRunner().invoke(cli.main, ["kld", "--save-base", str(base), "--weights", "float32", *common])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(cli.main, ["kld", "--base", str(base), "--weights", "packed", "--json", str(out), *common])
    assert r.exit_code == 0, r.output
    s = json.loads(out.read_text())["summary"]
    assert s["positions"] == 298 and s["windows"] == 2  # SmolLM2 adds no BOS: windows of 160 and 140 tokens
    assert 0 < s["kl_mean"]["value"] < 0.01 and s["same_top"]["value"] > 0.9
    assert abs(s["ppl_ratio"]["value"] - 1) < 0.05 and s["known_share"] == 1.0


@pytest.mark.model
def test_kld_of_llama_cpp_against_the_float32_path(embedded_path, tmp_path):
    pytest.importorskip("llama_cpp", reason="needs the optional llamacpp extra")
    base, out = tmp_path / "base.npz", tmp_path / "kld.json"
    common = ["-m", embedded_path, "--tokens", "300", "--ctx", "160"]
    r = CliRunner().invoke(cli.main, ["kld", "--save-base", str(base), "--weights", "float32", *common])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(cli.main, ["kld", "--base", str(base), "--stack", "llamacpp", "--json", str(out), *common])
    assert r.exit_code == 0, r.output
    doc = json.loads(out.read_text())
    s = doc["summary"]
    assert s["positions"] == 298 and s["known_share"] == 1.0
    # Another implementation of the same Q4 weights: close to the float32 path, not equal to it.
    assert 0 < s["kl_mean"]["value"] < 0.01 and s["same_top"]["value"] > 0.9
    assert abs(s["ppl_ratio"]["value"] - 1) < 0.05
