"""engine.synthetic's streamed mixture-of-experts GGUFs: the metadata and tensor table written
are the spec's, the bytes do not depend on the worker threads, the random blocks are valid with
weights of about 1/sqrt(width), and the tiny presets load and decode in the engine and (where
llama-cpp-python is installed) in llama.cpp."""
from __future__ import annotations

import dataclasses
import importlib.util
import math

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader
from gguf import quants as gq

from engine import ModelConfig, SamplingParams, generate, load_model
from engine import synthetic
from engine.gguf_file import read_gguf
from engine.synthetic import PRESETS, DeepSeek2Spec, QwenMoeSpec, moe_metadata, write_moe_gguf

TINY = ("qwen3moe-tiny", "qwen2moe-tiny", "deepseek2-tiny")


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("moe")
    return {name: write_moe_gguf(d / f"{name}.gguf", PRESETS[name]).path for name in TINY}


@pytest.mark.parametrize("name", TINY)
def test_metadata_and_tensor_table_round_trip(tiny_files, name):
    spec = PRESETS[name]
    contents = read_gguf(tiny_files[name])
    written = moe_metadata(spec)
    for key, value in written.items():
        got = contents.metadata[key]
        if isinstance(value, float):
            assert got == pytest.approx(value, rel=1e-6), key
        else:
            assert (list(got) if isinstance(value, list) else got) == value, key
    assert contents.metadata["general.architecture"] == spec.arch
    plans = spec.tensors()
    assert list(contents.tensors) == [p.name for p in plans]
    for p in plans:
        record = contents.tensors[p.name]
        assert tuple(record.shape) == p.shape and record.qtype == p.qtype, p.name
    cfg = ModelConfig.from_metadata(contents.metadata)
    assert (cfg.arch, cfg.n_layer, cfg.n_embd, cfg.n_expert, cfg.n_expert_used, cfg.n_ff_exp, cfg.n_vocab) == \
        (spec.arch, spec.n_layer, spec.n_embd, spec.n_expert, spec.n_expert_used, spec.n_ff_exp, spec.n_vocab)


def test_the_big_presets_have_the_real_models_shapes():
    q = PRESETS["qwen3-30b-a3b"]
    cfg = ModelConfig.from_metadata({"general.architecture": q.arch, **q.metadata()})
    assert (cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.n_expert, cfg.n_expert_used,
            cfg.n_ff_exp, cfg.n_vocab, cfg.qk_norm) == (48, 2048, 32, 4, 128, 128, 8, 768, 151936, True)
    # About the size of a Q4_K file of the model (17.3 GB), every layer matrix Q4_K.
    plans = q.tensors()
    assert 17.0e9 < sum(p.nbytes for p in plans) < 17.6e9
    assert {p.qtype for p in plans if p.name.startswith("blk.") and p.kind == "matrix"} == {QT.Q4_K}
    assert {p.qtype for p in plans if p.kind == "router"} == {QT.F32}
    d = PRESETS["deepseek-v2-lite"]
    cfg = ModelConfig.from_metadata({"general.architecture": d.arch, **d.metadata()})
    assert (cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.head_dim, cfg.rope_dim,
            cfg.head_dim_v, cfg.n_expert, cfg.n_ff_exp, cfg.n_expert_used, cfg.n_expert_shared,
            cfg.n_layer_dense_lead, cfg.n_ff, cfg.n_vocab, cfg.expert_gating) == \
        (27, 2048, 16, 0, 512, 192, 64, 128, 64, 1408, 6, 2, 1, 10944, 102400, "softmax")
    types = {p.name.split(".")[-2]: p.qtype for p in d.tensors() if p.name.startswith("blk.1.")}
    # 1408- and 128-wide rows do not take 256-wide blocks: llama.cpp's Q5_0 fallback, as in its files.
    assert types["ffn_down_exps"] == QT.Q5_0 and types["attn_k_b"] == QT.Q5_0
    assert types["ffn_gate_exps"] == types["attn_v_b"] == QT.Q4_K


def test_bytes_do_not_depend_on_threads(tmp_path, monkeypatch):
    monkeypatch.setattr(synthetic, "SLAB_BYTES", 40_000)  # many slabs per tensor
    spec = dataclasses.replace(PRESETS["deepseek2-tiny"], n_layer=2)
    one = write_moe_gguf(tmp_path / "one.gguf", spec, threads=1).path
    many = write_moe_gguf(tmp_path / "many.gguf", spec, threads=3).path
    assert open(one, "rb").read() == open(many, "rb").read()
    other = write_moe_gguf(tmp_path / "other.gguf", dataclasses.replace(spec, seed=1), threads=1).path
    assert open(one, "rb").read() != open(other, "rb").read()


def test_random_blocks_are_valid_weights_of_about_one_over_sqrt_width(tiny_files):
    r = GGUFReader(tiny_files["deepseek2-tiny"])
    seen = set()
    for t in r.tensors:
        if len(t.data.shape) < 2 or t.tensor_type == QT.F32:
            continue
        seen.add(QT(t.tensor_type))
        w = gq.dequantize(t.data, t.tensor_type)
        cols = int(t.shape[0])
        assert np.isfinite(w).all(), t.name
        rms = float(np.sqrt(np.mean(w.astype(np.float64) ** 2)))
        assert 0.05 / math.sqrt(cols) < rms < 5 / math.sqrt(cols), (t.name, rms)
    assert {QT.Q4_K, QT.Q5_0, QT.Q6_K} <= seen


@pytest.mark.parametrize("name", TINY)
def test_tiny_presets_load_and_decode_in_the_engine(tiny_files, name):
    model = load_model(tiny_files[name], ctx=64)
    s = model.new_session()
    s.sync([5, 6, 7, 8])
    out = list(generate(s, SamplingParams(argmax_ignoring_eos=True), 4))
    assert len(out) == 4 and all(0 <= t < PRESETS[name].n_vocab for t in out)
    assert np.isfinite(s.logits.numpy()).all()


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is not installed")
@pytest.mark.parametrize("name", TINY)
def test_tiny_presets_load_and_decode_in_llama_cpp(tiny_files, name):
    """llama.cpp accepts the files (tokenizer, keys, tensor shapes), and its first greedy token
    after a prompt is among the engine's five most likely."""
    import llama_cpp

    path = tiny_files[name]
    prompt = [5, 6, 7, 8]
    llm = llama_cpp.Llama(model_path=path, n_ctx=64, n_threads=2, verbose=False)
    try:
        assert llm.n_vocab() == PRESETS[name].n_vocab
        llm.eval(prompt)
        theirs = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),)).copy()
    finally:
        llm.close()
    assert np.isfinite(theirs).all()
    model = load_model(path, ctx=64)
    s = model.new_session()
    s.sync(prompt)
    ours = s.logits.float().numpy()
    assert int(np.argmax(theirs)) in np.argsort(-ours)[:5]


def test_command_line_writes_a_preset(tmp_path, capsys):
    out = tmp_path / "x.gguf"
    assert synthetic.main(["--preset", "qwen3moe-tiny", "--layers", "1", "--qtype", "Q8_0", "-o", str(out)]) == 0
    contents = read_gguf(out)
    assert contents.metadata["qwen3moe.block_count"] == 1
    assert contents.tensors["blk.0.ffn_up_exps.weight"].qtype == QT.Q8_0
    assert "MB/s" in capsys.readouterr().err


def test_specs_refuse_what_they_cannot_write():
    with pytest.raises(ValueError, match="qwen3moe or qwen2moe"):
        QwenMoeSpec(arch="llama").tensors()
    with pytest.raises(ValueError, match="fit neither"):
        DeepSeek2Spec(n_embd=100).tensors()
    with pytest.raises(ValueError, match="byte-level vocabulary"):
        synthetic.byte_level_tokenizer(10)
