"""engine.synthetic's dense random files run in llama.cpp as well as in the engine (where
llama-cpp-python is installed): its loader knows the pre-tokenizer they name ("gpt-2": it
refuses "gpt2" as an unknown pre-tokenizer type), and its first
greedy token after a prompt is among the engine's five most likely."""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from engine import load_model
from engine.synthetic import RandomModelSpec, write_random_gguf


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is not installed")
@pytest.mark.parametrize("arch, qtype", [("llama", "Q4_1"), ("qwen3", "Q8_0")])
def test_random_files_load_and_decode_in_llama_cpp(tmp_path, arch, qtype):
    import llama_cpp

    path = str(write_random_gguf(tmp_path / f"{arch}.gguf", RandomModelSpec(arch=arch, qtype=qtype, seed=5)))
    prompt = [5, 6, 7, 8]
    llm = llama_cpp.Llama(model_path=path, n_ctx=64, n_threads=2, verbose=False)
    try:
        llm.eval(prompt)
        theirs = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),)).copy()
    finally:
        llm.close()
    s = load_model(path, ctx=64).new_session()
    s.sync(prompt)
    assert np.isfinite(theirs).all()
    assert int(np.argmax(theirs)) in np.argsort(-s.logits.float().numpy())[:5]
