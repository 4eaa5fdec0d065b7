"""The engines `ds4-bench engine` measures, behind the `Runner` interface of engine_bench.

- `Ds4Runner`: the in-process engine through its public API (`load_model`, sessions,
  `generate` with `SamplingParams(argmax_ignoring_eos=True)`). Every step ends with its
  greedy ids on the host (on CUDA the logits stay on the device), so wall-clock times
  include any GPU work. A batch is `Model.new_sessions(N)` (one KV pool), each row synced to
  all but its last id and that id run through one `engine.batch.decode_batch` step, so the
  CUDA graph for N rows is captured untimed; each timed step picks every row's greedy id
  the way `generate` does and runs one `decode_batch` for all rows.
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
  timed step. A batch of N rows gets a `StaticCache` of its own, an eager prefill [N, C]
  and steps of input [N, 1], all rows at one shared position, argmax per row on the
  device. The compiled step specialises to each N (one graph per N, `dynamic=False`):
  before the prefill, `prefill_batch` runs it twice on the new cache, which compiles for N
  the first time in the process (the warm-up repetition, `--warmup`) and captures the CUDA
  graph for that cache every time, so neither falls in the timed steps.

Each runner holds at most one loaded model; `close()` frees it so that repetitions start
from nothing. It does not time anything; engine_bench does.
"""
from __future__ import annotations

import gc
import importlib
import inspect
import os
import threading
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ds4bench.engine_bench import LLAMA_CPP, OURS, TRANSFORMERS, Vocab, ordinary_ids

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


def llama_offloads(llama_cpp: Any, device: str) -> bool:
    """Whether llama.cpp runs on the GPU: only when asked for CUDA and the installed build
    can offload (a CPU-only build then runs on the CPU)."""
    return device == "cuda" and bool(llama_cpp.llama_supports_gpu_offload())


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

    def __init__(self, path: str, *, ctx: int, device: str = "cpu", weights: str = "packed",
                 cpu_kernels: str | None = None, batch_invariant: bool = False):
        self.path = path
        self.batch_invariant = batch_invariant
        self.ctx = ctx
        self.device = device
        self.weights = weights
        self.cpu_kernels = cpu_kernels
        self.threads = default_threads()
        self.model_name = os.path.basename(path)
        self._model: Any = None
        self._session: Any = None
        self._batch: list[Any] | None = None  # the sessions of a batch measurement

    def kernels(self) -> str:
        """The engine's CPU kernel path and why (engine.kernels); ModelLoadError for a named path
        this machine cannot run."""
        from engine import ModelLoadError, kernels

        if self.device != "cpu":
            return f"{self.device} (engine.cuda_int4 and CUDA graphs where they apply)"
        try:
            return kernels.cpu_kernels(self.cpu_kernels).describe()
        except kernels.KernelsUnavailable as e:
            raise ModelLoadError(str(e)) from None

    def load(self) -> None:
        from engine import load_model

        self._model = load_model(self.path, ctx=self.ctx, device=self.device, weights=self.weights,
                                 cpu_kernels=self.cpu_kernels, batch_invariant=self.batch_invariant)

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

    def prefill_batch(self, rows: Sequence[Sequence[int]]) -> None:
        from engine.batch import decode_batch

        self._free_sessions()
        self._batch = self._model.new_sessions(len(rows))  # one KV pool for all rows
        # Each row's last id goes through one batched step, as the timed ones will: on CUDA it
        # captures the decoding graph for this many rows outside the timing.
        for session, ids in zip(self._batch, rows):
            if len(ids) > 1:
                session.sync(list(ids[:-1]))
        decode_batch(self._batch, [int(ids[-1]) for ids in rows])

    def decode_batch(self, n: int, banned: frozenset[int]) -> list[list[int]]:
        from engine import Sampler, SamplingParams
        from engine.batch import decode_batch

        # What `generate` does per token, for every row: the greedy id without `banned` (from
        # the ids a CUDA step already copied to the host when `banned` is the model's eos set),
        # then one forward pass for all rows.
        sampler = Sampler(SamplingParams(argmax_ignoring_eos=True), banned)
        steps = []
        for _ in range(n):
            tokens = [sampler(s.raw_logits) for s in self._batch]
            decode_batch(self._batch, tokens)
            steps.append(tokens)
        return [list(row) for row in zip(*steps)]

    def _free_sessions(self) -> None:
        self._session = self._batch = None
        gc.collect()
        if self.device == "cuda":
            import torch

            torch.cuda.empty_cache()

    def close(self) -> None:
        self._model = None
        self._free_sessions()


class LlamaCppRunner:
    engine = LLAMA_CPP
    weights = "gguf"

    def __init__(self, path: str, *, ctx: int, threads: int, device: str = "cpu", extra_buffers: bool = False):
        self._llama_cpp = import_llama_cpp()
        self.extra_buffers = extra_buffers
        self.path = path
        self.ctx = ctx
        self.threads = threads
        self._offload = llama_offloads(self._llama_cpp, device)
        self.device = "cuda" if self._offload else "cpu"
        self.model_name = os.path.basename(path)
        self._llm: Any = None

    def kernels(self) -> str:
        """What this llama.cpp build computes with (ggml's own report)."""
        info = self._llama_cpp.llama_print_system_info()
        return " ".join((info.decode() if isinstance(info, bytes) else str(info)).split())

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


@dataclass
class _Rows:
    """Rows decoding together in one static cache, all holding the same number of ids."""

    cache: Any
    logits: Any = None  # float32 [rows, n_vocab] after each row's last id, on the device
    pos: int = 0  # ids each row holds


def static_cache(config: Any, n_rows: int, ctx: int) -> Any:
    """A transformers `StaticCache` of ctx positions for n_rows rows. Versions whose constructor
    takes `max_batch_size` size it then; later ones at the first forward pass (lazily)."""
    from transformers import StaticCache

    sized = "max_batch_size" in inspect.signature(StaticCache.__init__).parameters
    return StaticCache(config=config, max_cache_len=ctx, **({"max_batch_size": n_rows} if sized else {}))


def allow_recompiles(n: int) -> None:
    """Let torch.compile keep at least n graphs of one function (`recompile_limit`, called
    `cache_size_limit` in older torch): past the limit a `fullgraph` compile fails."""
    import torch._dynamo.config as dynamo

    name = "recompile_limit" if hasattr(dynamo, "recompile_limit") else "cache_size_limit"
    if hasattr(dynamo, name):
        setattr(dynamo, name, max(getattr(dynamo, name), n))


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
        self._step: Any = None
        self._one: _Rows | None = None  # prefill / decode
        self._batch: _Rows | None = None  # prefill_batch / decode_batch
        self._cache_arg = "past_key_values"
        self._batch_sizes: set[int] = set()  # row counts the compiled step has been given, over all loads

    @property
    def model(self) -> Any:
        """The transformers model between `load()` and `close()` (None otherwise)."""
        return self._model

    def kernels(self) -> str:
        """torch's own kernels: its CPU dispatch level (ATEN_CPU_CAPABILITY) or the device."""
        import torch

        if self.device != "cpu":
            return f"torch {torch.__version__} on {self.device}"
        return f"torch {torch.__version__}, ATen CPU capability {torch.backends.cpu.get_cpu_capability()}"

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
        from transformers import AutoModelForCausalLM

        torch.manual_seed(self.seed)
        config = self.config()
        with torch.device(self.device):
            self._model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
        self._one = _Rows(static_cache(config, 1, self.ctx))
        # Newer transformers name the cache argument `cache`; older ones `past_key_values`.
        params = inspect.signature(self._model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        forward = self._model.forward
        if self.compile:
            mode = "reduce-overhead" if self.device == "cuda" else None
            # dynamic=False: one graph specialised to each batch shape, never a shape-generic one.
            forward = torch.compile(forward, mode=mode, fullgraph=True, dynamic=False)
        self._step = forward
        # Compile (and capture) now, inside the load figure.
        self.prefill([0, 1])
        self.decode(2, frozenset())

    def vocab(self) -> Vocab:
        return Vocab(tuple(range(self.shape.n_vocab)), None, False, frozenset())

    def prefill(self, ids: Sequence[int]) -> None:
        import torch

        with torch.inference_mode():
            self._prefill(self._one, [ids])

    def decode(self, n: int, banned: frozenset[int]) -> list[int]:
        import torch

        with torch.inference_mode():
            return self._decode(self._one, n, banned)[0]

    def prefill_batch(self, rows: Sequence[Sequence[int]]) -> None:
        import torch

        self._batch = None  # the last batch's cache goes before the next one is made
        # Made outside inference mode, as load() makes the one-row cache: the compiled step's
        # guards tell the two kinds of tensor apart, so N = 1 reuses the one-row graph.
        batch = _Rows(static_cache(self._model.config, len(rows), self.ctx))
        with torch.inference_mode():
            if self.compile:
                self._warm(batch.cache, len(rows))
            self._prefill(batch, rows)
        self._batch = batch

    def decode_batch(self, n: int, banned: frozenset[int]) -> list[list[int]]:
        import torch

        with torch.inference_mode():
            return self._decode(self._batch, n, banned)

    def _warm(self, cache: Any, n_rows: int) -> None:
        """Compile the step for n_rows (once per process) and capture it on this cache (CUDA graphs
        are recorded per cache), untimed: an eager step sizes the cache, then two compiled ones,
        each at position 0 of an emptied cache."""
        import torch

        self._batch_sizes.add(n_rows)
        allow_recompiles(len(self._batch_sizes) + 8)  # one graph per row count, and torch's usual headroom
        ids = torch.zeros((n_rows, 1), dtype=torch.long, device=self.device)
        start = torch.zeros(1, dtype=torch.long, device=self.device)
        for step in (self._model.forward, self._step, self._step):
            cache.reset()
            self._forward(ids, start, step, cache)
        cache.reset()

    def _forward(self, ids: Any, positions: Any, step: Any, cache: Any) -> Any:
        """ids [rows, T] at positions [T] (the same for every row) -> float32 logits [rows, n_vocab]
        after each row's last id."""
        out = step(input_ids=ids, position_ids=positions.expand(ids.shape[0], -1), cache_position=positions,
                   use_cache=True, logits_to_keep=1, **{self._cache_arg: cache})
        return out.logits[:, -1].float()

    def _prefill(self, rows: _Rows, ids: Sequence[Sequence[int]]) -> None:
        import torch

        rows.cache.reset()
        tokens = torch.tensor([list(r) for r in ids], dtype=torch.long, device=self.device)  # [rows, T]
        positions = torch.arange(tokens.shape[1], device=self.device)
        # Prompts of every length run eagerly: a compiled graph per length would compile per step.
        rows.logits = self._forward(tokens, positions, self._model.forward, rows.cache)
        rows.pos = tokens.shape[1]
        self._sync()

    def _decode(self, rows: _Rows, n: int, banned: frozenset[int]) -> list[list[int]]:
        import torch

        mask = torch.tensor(sorted(banned), dtype=torch.long, device=self.device) if banned else None
        out = []
        logits = rows.logits
        for _ in range(n):
            if mask is not None:
                logits = logits.index_fill(1, mask, float("-inf"))
            tokens = logits.argmax(-1, keepdim=True)  # [rows, 1], left on the device
            out.append(tokens)
            logits = self._forward(tokens, torch.tensor([rows.pos], device=self.device), self._step, rows.cache)
            rows.pos += 1
        rows.logits = logits
        self._sync()
        return torch.cat(out, dim=1).tolist()

    def _sync(self) -> None:
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()

    def close(self) -> None:
        self._model = self._step = self._one = self._batch = None
        gc.collect()
        if self.device == "cuda":
            import torch

            torch.cuda.empty_cache()
