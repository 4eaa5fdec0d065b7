"""The engines `ds4-bench engine` measures, behind the `Runner` interface of engine_bench.

- `Ds4Runner`: the in-process engine through its public API (`load_model`, sessions,
  `generate` with `SamplingParams(argmax_ignoring_eos=True)`). The session's logits come
  back to the CPU after every step, so wall-clock times include any GPU work.
- `LlamaCppRunner`: llama-cpp-python (the optional `llamacpp` extra) on the same GGUF:
  `Llama(model_path, n_ctx, n_threads, n_threads_batch, n_batch=512, logits_all=False)`,
  loaded without ggml's extra buffer types unless `extra_buffers` (`--llama-extra-buffers`:
  llama-cpp-python 0.3.36 built for an AMX CPU segfaults in ggml's AMX matmul with them on
  the embedded model's Q4_1 file), prefill `reset()` + `eval(ids)`, decode `eval([token])` with an argmax over the last
  logits read from the context (`llama_get_logits_ith(ctx, -1)`: with logits_all off the
  wrapper keeps no score rows), the banned ids masked. The binding's other defaults stay
  as they are (no flash attention unless the binding turns it on).

Each runner holds at most one loaded model; `close()` frees it so that repetitions start
from nothing. It does not time anything; engine_bench does.
"""
from __future__ import annotations

import gc
import os
import threading
from typing import Any, Sequence

import numpy as np

from ds4eval.bench.engine_bench import LLAMA_CPP, OURS, Vocab, ordinary_ids

INSTALL_HINT = ("llama-cpp-python is not installed: install the optional extra with "
                "`pip install 'ds4eval[llamacpp]'` (it builds llama.cpp from source, several minutes)")
LLAMA_N_BATCH = 512


class LlamaCppMissing(RuntimeError):
    """llama_cpp cannot be imported; the message says how to install it."""


def import_llama_cpp() -> Any:
    try:
        import llama_cpp
    except ImportError:
        raise LlamaCppMissing(INSTALL_HINT) from None
    return llama_cpp


_params_lock = threading.Lock()


def load_llama(llama_cpp: Any, *, extra_buffers: bool = True, **kwargs: Any) -> Any:
    """`llama_cpp.Llama(**kwargs)`; with `extra_buffers=False` the model is loaded without
    ggml's extra buffer types (its repacked and AMX weight layouts: llama.cpp's `--no-repack`).
    The binding has no argument for that model parameter, so its default-parameters function
    is swapped for the one construction (under a lock, restored after)."""
    if extra_buffers:
        return llama_cpp.Llama(**kwargs)
    binding = llama_cpp.llama_cpp
    with _params_lock:
        default = binding.llama_model_default_params

        def without_extra_buffers() -> Any:
            params = default()
            params.use_extra_bufts = False
            return params

        binding.llama_model_default_params = without_extra_buffers
        try:
            return llama_cpp.Llama(**kwargs)
        finally:
            binding.llama_model_default_params = default


def default_threads() -> int:
    """The thread count ds4 computes with (torch's intra-op pool), so both engines get the same."""
    import torch

    return torch.get_num_threads()


class Ds4Runner:
    engine = OURS

    def __init__(self, path: str, *, ctx: int, device: str = "cpu", weights: str = "packed"):
        self.path = path
        self.ctx = ctx
        self.device = device
        self.weights = weights
        self.threads = default_threads()
        self.model_name = os.path.basename(path)
        self._model: Any = None
        self._session: Any = None

    def load(self) -> None:
        from engine import load_model

        self._model = load_model(self.path, ctx=self.ctx, device=self.device, weights=self.weights)

    def vocab(self) -> Vocab:
        m = self._model
        types = m.metadata.get("tokenizer.ggml.token_type")
        exclude = [m.bos_id, m.eos_id, *m.eos_ids]
        return Vocab(ordinary_ids(types, m.n_vocab, exclude), m.bos_id, bool(m.add_bos), frozenset(m.eos_ids))

    def prefill(self, ids: Sequence[int]) -> None:
        self._session = self._model.new_session()
        self._session.sync(list(ids))

    def decode(self, n: int, banned: frozenset[int]) -> list[int]:
        from engine import SamplingParams, generate

        # argmax_ignoring_eos masks the model's own end-of-generation ids, which are what
        # `banned` holds whenever this runner supplied the vocabulary.
        params = SamplingParams(argmax_ignoring_eos=True)
        return list(generate(self._session, params, n))

    def close(self) -> None:
        device = self.device
        self._session = None
        self._model = None
        gc.collect()
        if device == "cuda":
            import torch

            torch.cuda.empty_cache()


class LlamaCppRunner:
    engine = LLAMA_CPP
    weights = "gguf"

    def __init__(self, path: str, *, ctx: int, threads: int, device: str = "cpu", extra_buffers: bool = False):
        self._llama_cpp = import_llama_cpp()
        self.extra_buffers = extra_buffers
        self.path = path
        self.ctx = ctx
        self.threads = threads
        # Offload only when asked for the GPU and the installed build can do it.
        self._offload = device == "cuda" and bool(self._llama_cpp.llama_supports_gpu_offload())
        self.device = "cuda" if self._offload else "cpu"
        self.model_name = os.path.basename(path)
        self._llm: Any = None

    def load(self) -> None:
        self._llm = load_llama(
            self._llama_cpp, extra_buffers=self.extra_buffers,
            model_path=self.path, n_ctx=self.ctx, n_threads=self.threads, n_threads_batch=self.threads,
            n_batch=LLAMA_N_BATCH, logits_all=False, verbose=False, n_gpu_layers=-1 if self._offload else 0,
        )

    def vocab(self) -> Vocab:
        llm = self._llm
        bos, eos = llm.token_bos(), llm.token_eos()
        return Vocab(ordinary_ids(None, llm.n_vocab(), [bos, eos]), bos, False, frozenset({eos}))

    def last_logits(self) -> np.ndarray:
        """A view of the logits after the last evaluated token (valid until the next eval)."""
        ptr = self._llama_cpp.llama_get_logits_ith(self._llm.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self._llm.n_vocab(),))

    def prefill(self, ids: Sequence[int]) -> None:
        self._llm.reset()
        self._llm.eval(list(ids))

    def decode(self, n: int, banned: frozenset[int]) -> list[int]:
        banned_idx = np.fromiter(sorted(banned), dtype=np.int64)
        out = []
        for _ in range(n):
            logits = self.last_logits().copy()
            if banned_idx.size:
                logits[banned_idx] = -np.inf
            token = int(np.argmax(logits))
            out.append(token)
            self._llm.eval([token])
        return out

    def close(self) -> None:
        if self._llm is not None:
            close = getattr(self._llm, "close", None)
            if close is not None:
                close()
            self._llm = None
        gc.collect()
