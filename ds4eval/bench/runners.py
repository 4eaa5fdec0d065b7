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
- `TransformersRunner`: a Hugging Face transformers model of the GGUF's shape (its
  architecture's config class, same layers, widths, heads, vocabulary, RoPE base and norm
  epsilon, tied output when the GGUF has no output matrix) with random bfloat16 weights,
  the fast recipe for transformers: a `StaticCache` of the run's context and, unless
  `compile=False`, the one-token forward under `torch.compile` (mode "reduce-overhead",
  CUDA graphs, on CUDA). The weights are random because only speed is compared: the
  arithmetic per token is the same whatever the values. Prefill is one forward over the
  ids; decode takes each argmax on the device (banned ids masked), feeds it back without a
  copy to the host and synchronises once at the end, which is the best case for it. `load()` includes compiling: it runs one
  prefill and two decode steps, so compile time shows in the load figure and not in a
  timed step.

Each runner holds at most one loaded model; `close()` frees it so that repetitions start
from nothing. It does not time anything; engine_bench does.
"""
from __future__ import annotations

import gc
import importlib
import inspect
import os
import threading
from typing import Any, Sequence

import numpy as np

from ds4eval.bench.engine_bench import LLAMA_CPP, OURS, TRANSFORMERS, Vocab, ordinary_ids

INSTALL_HINT = ("llama-cpp-python is not installed: install the optional extra with "
                "`pip install 'ds4eval[llamacpp]'` (it builds llama.cpp from source, several minutes)")
LLAMA_N_BATCH = 512


TRANSFORMERS_HINT = ("transformers is not installed: install the optional extra with "
                     "`pip install 'ds4eval[reference]'`")
# GGUF architecture -> transformers config class of the same network.
TRANSFORMERS_CONFIGS = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}


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


class TransformersUnavailable(RuntimeError):
    """transformers is missing or has no model of this architecture; the message says which."""


class TransformersRunner:
    engine = TRANSFORMERS
    weights = "bf16-random"

    def __init__(self, path: str, *, ctx: int, device: str = "cpu", compile: bool = True, seed: int = 0):
        from engine.config import ModelConfig, UnsupportedModel
        from engine.gguf_file import read_gguf

        contents = read_gguf(path)
        try:
            self.shape = ModelConfig.from_metadata(contents.metadata)
        except UnsupportedModel as e:
            raise TransformersUnavailable(str(e)) from None
        if self.shape.arch not in TRANSFORMERS_CONFIGS:
            raise TransformersUnavailable(f"no transformers model for architecture {self.shape.arch!r} "
                                          f"(supported: {', '.join(sorted(TRANSFORMERS_CONFIGS))})")
        try:
            importlib.import_module("transformers")
        except ImportError:
            raise TransformersUnavailable(TRANSFORMERS_HINT) from None
        self.tied = "output.weight" not in contents.tensors
        self.path, self.ctx, self.device, self.compile, self.seed = path, ctx, device, compile, seed
        self.threads = default_threads()
        self.model_name = os.path.basename(path)
        self._model: Any = None
        self._cache: Any = None
        self._step: Any = None
        self._logits: Any = None  # after the last evaluated position, on the device
        self._cache_arg = "past_key_values"
        self._pos = 0

    @property
    def model(self) -> Any:
        """The transformers model between `load()` and `close()` (None otherwise)."""
        return self._model

    def config(self) -> Any:
        """The transformers config of the GGUF's shape."""
        import transformers

        s = self.shape
        cls = getattr(transformers, TRANSFORMERS_CONFIGS[s.arch])
        return cls(vocab_size=s.n_vocab, hidden_size=s.n_embd, intermediate_size=s.n_ff,
                   num_hidden_layers=s.n_layer, num_attention_heads=s.n_head, num_key_value_heads=s.n_head_kv,
                   head_dim=s.head_dim, max_position_embeddings=self.ctx, rms_norm_eps=s.norm_eps,
                   rope_parameters={"rope_type": "default", "rope_theta": s.rope_base},
                   tie_word_embeddings=self.tied, use_cache=True)

    def load(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM, StaticCache

        torch.manual_seed(self.seed)
        config = self.config()
        with torch.device(self.device):
            self._model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
        self._cache = StaticCache(config=config, max_cache_len=self.ctx)
        # Newer transformers name the cache argument `cache`; older ones `past_key_values`.
        params = inspect.signature(self._model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        forward = self._model.forward
        if self.compile:
            mode = "reduce-overhead" if self.device == "cuda" else None
            forward = torch.compile(forward, mode=mode, fullgraph=True)
        self._step = forward
        # Compile (and capture) now, inside the load figure.
        self.prefill([0, 1])
        self.decode(2, frozenset())

    def vocab(self) -> Vocab:
        return Vocab(tuple(range(self.shape.n_vocab)), None, False, frozenset())

    def _forward(self, ids: Any, positions: Any, step: Any) -> Any:
        out = step(input_ids=ids, position_ids=positions.unsqueeze(0), cache_position=positions,
                   use_cache=True, logits_to_keep=1, **{self._cache_arg: self._cache})
        return out.logits[0, -1].float()

    def prefill(self, ids: Sequence[int]) -> None:
        import torch

        with torch.inference_mode():
            self._prefill(ids)

    def _prefill(self, ids: Sequence[int]) -> None:
        import torch

        self._cache.reset()
        tokens = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
        positions = torch.arange(len(ids), device=self.device)
        # Prompts of every length run eagerly: a compiled graph per length would compile per step.
        self._logits = self._forward(tokens, positions, self._model.forward)
        self._pos = len(ids)
        self._sync()

    def decode(self, n: int, banned: frozenset[int]) -> list[int]:
        import torch

        with torch.inference_mode():
            return self._decode(n, banned)

    def _decode(self, n: int, banned: frozenset[int]) -> list[int]:
        import torch

        mask = torch.tensor(sorted(banned), dtype=torch.long, device=self.device) if banned else None
        out = []
        logits = self._logits
        for _ in range(n):
            if mask is not None:
                logits = logits.index_fill(0, mask, float("-inf"))
            token = torch.argmax(logits).reshape(1, 1)
            out.append(token)
            logits = self._forward(token, torch.tensor([self._pos], device=self.device), self._step)
            self._pos += 1
        self._logits = logits
        self._sync()
        return [int(t) for t in torch.cat(out).flatten().tolist()]

    def _sync(self) -> None:
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()

    def close(self) -> None:
        self._model = self._cache = self._step = self._logits = None
        gc.collect()
        if self.device == "cuda":
            import torch

            torch.cuda.empty_cache()
