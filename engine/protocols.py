"""The engine's contract with its callers, as `typing.Protocol` classes.

- `EngineAPI`: what a caller takes from the engine package itself — the types it builds
  requests and sampling settings from and the exception a cancel raises.  `import engine`
  satisfies it; the server and ds4-eval take any object that does (a test fake, for one).
- `ModelLike`: what the server and ds4-eval use of a loaded model (`engine.Model`): context
  size, special ids, the one tokenize-then-BOS rule (`prompt_ids`), sessions and memory.
  Callers may also read `metadata`, `template`, `config`, `kv_dtype`, `net` where present
  (provenance, banners); those are not part of the contract.
- `SessionLike`: one token sequence and its KV cache (`engine.Session`).
- `Network`: the per-family forward pass that engine/models/*.py provide and
  `engine.models.ARCHITECTURES` registers; `Model` and `Session` reach the weights only
  through it, and ask it for the memory a cached token and a forward step need.

All are `runtime_checkable`, so `isinstance(x, ModelLike)` checks that the members exist
(not their signatures: tests/engine compares those).  It defines no behaviour and imports
nothing of the engine at run time.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from engine.kvcache import KVCache, KVPool


@runtime_checkable
class EngineAPI(Protocol):
    """The engine's public types, as a module or namespace provides them."""

    SamplingParams: type  # SamplingParams(temperature=, top_k=, top_p=, min_p=, seed=, ...)
    Sampler: type  # Sampler(params, eos_ids)(logits) -> int, one random stream per object
    Cancelled: type  # the exception a cancel callback's True raises
    BatchScheduler: type  # BatchScheduler(model, n_slots, ctx=None, check_memory=True, run_ahead=None, observer=None)
    GenRequest: type  # GenRequest(ids, params, max_tokens, on_token, cancel, slot, choose)


@runtime_checkable
class TextStreamLike(Protocol):
    """Incremental detokenizer: text for each pushed token, UTF-8 safe."""

    def push(self, token: int) -> str: ...

    def flush(self) -> str: ...


@runtime_checkable
class SessionLike(Protocol):
    """One token sequence and its KV cache, with prefix reuse."""

    tokens: list[int]  # ids whose KV is cached

    @property
    def n_past(self) -> int: ...

    @property
    def logits(self) -> "torch.Tensor": ...  # [n_vocab] float32, for the next token

    def sync(self, ids: list[int], progress: Callable[[int, int], None] | None = None,
             cancel: Callable[[], bool] | None = None) -> int: ...

    def eval(self, token: int) -> None: ...

    # Append ids and yield (offset, [chunk, n_vocab] float32 logits after each), chunk by chunk.
    def iter_extend_logits(self, ids: Any, cancel: Callable[[], bool] | None = None) -> Any: ...

    def sample(self, params: Any) -> int: ...

    def truncate(self, n: int) -> None: ...

    def reset(self) -> None: ...

    def save_payload(self) -> bytes: ...

    def load_payload(self, data: bytes) -> None: ...


@runtime_checkable
class ModelLike(Protocol):
    """A loaded model as the server and ds4-eval use it."""

    name: str
    path: str
    quant: str  # the dominant tensor type, e.g. "Q4_1"
    n_ctx: int
    device: Any  # torch.device

    @property
    def n_vocab(self) -> int: ...

    @property
    def bos_id(self) -> int | None: ...

    @property
    def eos_id(self) -> int | None: ...

    @property
    def eos_ids(self) -> frozenset[int]: ...

    @property
    def add_bos(self) -> bool: ...

    @property
    def max_token_bytes(self) -> int: ...

    def tokenize(self, text: str, special: bool = False) -> list[int]: ...

    def detokenize(self, ids: list[int]) -> str: ...

    def escape_text(self, text: str) -> str: ...

    def tokenize_prompt(self, prompt_text: str) -> list[int]: ...

    def detokenize_prompt(self, ids: list[int]) -> str: ...

    def render_prompt(self, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None,
                      **extra: Any) -> str: ...
    def token_bytes(self, token_id: int) -> tuple[bytes, bool]: ...

    # Meets the device's first uses (graph captures, compiles) for batches of up to `rows` rows
    # before the first request; returns engine.warmup.WarmUp (its `describe()` is one line).
    def warm_up(self, rows: int = 1) -> Any: ...

    def text_stream(self) -> TextStreamLike: ...

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None,
                    **extra: Any) -> str: ...

    def prompt_ids(self, ids: list[int]) -> list[int]: ...

    def new_session(self) -> SessionLike: ...

    def new_sessions(self, n: int) -> list[SessionLike]: ...

    @property
    def weight_bytes(self) -> int: ...

    @property
    def kv_bytes_per_token(self) -> int: ...

    def memory_bytes(self, n_sessions: int = 1, ctx: int | None = None) -> int: ...


@runtime_checkable
class Network(Protocol):
    """One architecture family's forward pass over its weights (engine/models/<family>.py).

    Built as `cls(cfg, gguf_contents, weights_format, device, cpu_kernels)` (cpu_kernels: the
    engine.kernels.CpuKernels path on CPU, None elsewhere); raises UnsupportedModel for a layout
    it cannot run.
    """

    @property
    def weight_bytes(self) -> int: ...

    @property
    def attention_path(self) -> str: ...  # how decode steps attend, for banners

    @property
    def kernel_path(self) -> str: ...  # which CPU kernels run and why, for banners

    def kv_bytes_per_token(self, dtype: "torch.dtype") -> int: ...

    def kv_bytes(self, ctx: int, dtype: "torch.dtype") -> int: ...  # one cache's bytes at ctx positions

    def work_bytes(self, n_tokens: int, ctx: int) -> int: ...  # one step's buffers, logits included

    def new_cache(self, n_ctx: int, dtype: "torch.dtype") -> "KVCache": ...

    def new_pool(self, n_slots: int, n_ctx: int, dtype: "torch.dtype") -> "KVPool": ...

    def forward(self, tokens: "torch.Tensor", start: int, cache: "KVCache", logits: str = "last",
                cancel: Callable[[], bool] | None = None) -> "torch.Tensor | None": ...

    def forward_rows(self, tokens: "torch.Tensor", caches: list["KVCache"]) -> "torch.Tensor": ...

    # One decode step for several rows (or the frontier token of one cache): the logits where the
    # device keeps them (on CUDA a captured graph, only greedy ids copied to the host).
    def decode(self, tokens: list[int], caches: list["KVCache"], eos_ids: frozenset[int] = frozenset()) -> Any: ...

    # `decode` in two halves: the step starts (where the device computes on its own, it runs
    # meanwhile) and the returned call waits for it, advances the caches and gives its logits.
    def decode_started(self, tokens: list[int], caches: list["KVCache"],
                       eos_ids: frozenset[int] = frozenset()) -> Callable[[], Any]: ...

    def decode_frontier(self, token: int, cache: "KVCache", eos_ids: frozenset[int] = frozenset(),
                        cancel: Callable[[], bool] | None = None) -> Any: ...

    # Launch a one-row step at cache.n + ahead without waiting (a pending step), or None where
    # the device cannot (CPU): a greedy session's run-ahead (engine.session).
    def decode_ahead(self, token: int | None, cache: "KVCache", eos_ids: frozenset[int], ahead: int,
                     after: Any = None, column: int = 0) -> Any: ...

    # The same for a step of several caches (tokens None: each row's greedy id of `after`), or
    # None: a batch scheduler's run-ahead (engine.batch).
    def decode_launch(self, tokens: list[int] | None, caches: list["KVCache"], eos_ids: frozenset[int],
                      ahead: int = 0, after: Any = None, column: int = 0) -> Any: ...


__all__ = ["EngineAPI", "ModelLike", "Network", "SessionLike", "TextStreamLike"]
