"""engine — GGUF inference in PyTorch: token ids in, logits and tokens out.

This is the public, stable API that the server, ds4-eval and outside callers use.
Everything not re-exported here is internal.

    from engine import load_model, SamplingParams

    model = load_model()                       # embedded SmolLM2-135M-Instruct (Q4_1)
    text = model.render_prompt([{"role": "user", "content": "Hi"}])
    ids = model.prompt_ids(model.tokenize_prompt(text))
    s = model.new_session()
    reused = s.sync(ids)                        # prefix reuse + chunked prefill
    for tok in generate(s, SamplingParams(temperature=0), max_tokens=32):
        ...

Model (returned by `load_model(path=None, *, ctx=None, device="cpu", weights="packed",
kv_type=None)`; `weights="float32"` is the exact dequantized reference path; `kv_type` is the
KV cache's element type, "f32", "f16" or "bf16" (default f16 on CPU, f32 with float32
weights, bf16 on CUDA);
`ModelLoadError` on failure):
  - `name`, `path`, `config` (ModelConfig), `n_ctx` (session context size),
    `bos_id`, `eos_id`, `eos_ids` (frozenset: ids that end generation), `n_vocab`,
    `quant` (the dominant tensor type), `metadata` (every GGUF key as a Python value),
    `load_seconds`.
  - `max_token_bytes`: the byte length of the longest token, so that a text of n bytes has
    at least ceil(n / max_token_bytes) tokens (a size check before tokenizing).
  - `tokenize(text, special=False) -> list[int]`: with `special=True` special-token
    text such as `<|im_start|>` becomes its single id; never adds BOS by itself.
  - `prompt_ids(ids) -> list[int]`: the one add-BOS rule — a new list with `bos_id` first
    when `add_bos` and the ids do not already start with it.
  - `detokenize(ids) -> str`, `text_stream() -> TextStream` (incremental, UTF-8 safe).
  - `token_bytes(id) -> (bytes, is_control)`: one vocabulary entry as the bytes it decodes to.
  - `render_chat(messages, add_generation_prompt=True, tools=None, **extra) -> str`: the
    template's text as is; tokenizing it with `special=True` would turn a `<|im_start|>` typed
    into a message into the control token.
  - Prompt text (`engine.prompt_text`), the safe form of a rendered chat:
    `render_prompt(messages, ...)` renders with every message and tool string escaped,
    `tokenize_prompt(text)` makes control tokens of the template's markers only,
    `detokenize_prompt(ids)` is the prompt text of ids, `escape_text(text)` escapes one string.
  - `new_session() -> Session`; `new_sessions(n) -> list[Session]`: n sessions whose
    caches are slots of one pool, for batched decoding (each also works alone).
  - Memory: `weight_bytes`, `kv_bytes_per_token`, `memory_bytes(n_sessions, ctx)`,
    `kv_dtype`.

Session:
  - `tokens` (ids whose KV is cached), `n_past`.
  - `sync(ids, progress=None, cancel=None) -> int`: make the cache hold exactly `ids`,
    reusing the longest common prefix; returns the number of reused tokens.
    `progress(done, total)` is called after each prefill chunk; `cancel()` is polled
    between chunks and between layers, and returning True raises `Cancelled`, leaving
    the session valid at the last complete chunk.
  - `logits`: float32 CPU tensor [n_vocab] for the next token (after sync/eval).
    `raw_logits`: the same where the forward pass left it: on CUDA an
    `engine.device_sampling.DeviceLogits` (the device row with its greedy ids already on
    the host; `Sampler` picks from it without copying the row), copied to the host only
    when `logits` is read.
  - `eval(token)`: append one token.  `sample(params) -> int`.  `truncate(n)`.
  - `extend_logits(ids) -> Tensor [len(ids), n_vocab]`: append ids and return the logits
    after every one of them (teacher-forced scoring); `logits` is left unset.
  - `reset()`: forget everything, keeping the cache's memory.
  - `save_payload() -> bytes`, `load_payload(data)`: tokens + KV for the disk cache.
  - `start_prefill(ids) -> Prefill`: the rest of a sync as `step()`s, for schedulers.

Contract (`engine.protocols`): `EngineAPI` (this package's `SamplingParams`, `Sampler`,
`Cancelled`, `BatchScheduler`, `GenRequest`: the server and ds4-eval take any object that has
them, so tests inject a fake), `ModelLike` (what they use of a Model), `SessionLike`, and
`Network`, the per-family forward pass.  Architectures (`engine.models.ARCHITECTURES`):
GGUF `general.architecture` -> the module and class of its Network; a new family is one
module under engine/models/ and one registry line, and `Model` asks its network for the KV
bytes per token and a step's working buffers.  `engine.session.common_prefix(a, b)` is the
one longest-common-prefix count.

On CUDA decoding steps replay captured graphs (`engine.cuda_graphs`; `DS4_CUDA_GRAPHS=0`
decodes eagerly) and prefill runs in chunks of 2048 tokens.

Batching (`engine.batch`, `BatchScheduler` and `GenRequest` also at top level): `decode_batch(sessions, tokens)` evaluates one token for each
of N sessions in one forward pass, each row's logits bitwise equal to decoding it alone
(on CPU; on CUDA within the kernels' rounding); `BatchScheduler(model, n_slots)` runs `GenRequest`s,
interleaving prefill chunks with batched decode steps; `check_capacity` refuses
configurations that do not fit in memory.

Threads (`engine.threads`): `EngineThread` is the one thread that runs all of a process's
torch work, from `load_model` to the last token (`call`, `submit`, `close`). torch's OpenMP
pool is per calling thread, and two pools on the same cores make every kernel wait
passively, so the server, ds4-eval and ds4-bench load and run the model on one. By default
it also uses only the cores that other processes leave free, re-read every half second
(`threads=N` fixes the count); decoding results do not depend on it.

It does not know about HTTP, chat APIs, tool syntaxes or benchmarks.
"""

from engine.batch import BatchScheduler, CapacityError, GenRequest
from engine.config import ModelConfig, UnsupportedModel
from engine.errors import Cancelled
from engine.model import Model, ModelLoadError, default_model_path, generate, load_model
from engine.sampling import Sampler, SamplingParams
from engine.session import Session
from engine.threads import EngineThread
from engine.tokenizer import TextStream

__all__ = [
    "BatchScheduler", "CapacityError", "Cancelled", "EngineThread", "GenRequest", "Model", "ModelConfig", "ModelLoadError", "Sampler", "SamplingParams", "Session",
    "TextStream", "UnsupportedModel", "default_model_path", "generate", "load_model",
]
