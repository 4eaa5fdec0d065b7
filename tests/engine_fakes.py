"""One fake of the engine for tests that must run without weights (ds4-eval's, the server's).

It satisfies the engine's Protocols (engine/protocols.py; tests/engine/test_protocols.py
checks it against them and against the real classes):
- `FAKE_ENGINE` (EngineAPI): `FakeSamplingParams` (the real fields, another type), `FakeSampler` (argmax at
  temperature 0, else a seeded draw), `FakeCancelled`, `FakeScheduler` (the scheduling
  contract of engine.batch.BatchScheduler over any fake sessions, without prefill chunks) and
  the engine's own `GenRequest` (plain data).
- `FakeModel` (ModelLike): one id per UTF-8 byte (0..255) plus the special tokens of its
  `FakeVocab`, so token counts are easy to predict; a ChatML template; "inference" that
  spells out `reply(prompt_text)`.  Two vocabularies: `CHATML_THINK` (the default: `<|im_end|>`
  256 = EOS, `<think>` 257, `</think>` 258, `<|im_start|>` 259 = BOS; the think markers are
  special only with `thinking=True`, which also makes the template open a thinking block) and
  `CHATML` (`<|im_start|>` 256, `<|im_end|>` 257 = EOS, `<|endoftext|>` 258 = BOS and EOS).
- `FakeSession` (SessionLike): after `sync(prompt)` its logits put the next token of the
  scripted reply first (30) and EOS second (20); once the reply is spelled out, EOS first and
  "." second, so `argmax_ignoring_eos` continues with dots.  The script advances when the
  token evaluated is the scripted one (or the reply is done): a token the caller forces in
  (an injected think-close, say) does not consume the script.  `start_prefill(ids)` returns
  the rest of a sync as chunk steps (`FakePrefill`, as `engine.session.Prefill`; `sync` runs
  them).  `iter_extend_logits` scores teacher-forced: after byte b, byte b + 1 is likeliest
  (logit 30) and EOS second (20).
Slowness is controllable (`prefill_delay` per prefill chunk, `decode_delay` per eval) for
pause, keepalive and cancellation tests.  Nothing here loads weights or runs torch kernels
beyond building small logits tensors.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
import types
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from engine.batch import GenRequest
from engine.prompt_text import PromptText, escape_strings
from engine.sampling import Sampler, SamplingParams, apply_logit_bias, filtered_probs
from engine.warmup import WarmUp


class FakeCancelled(Exception):
    pass


# The engine's fields and defaults, made here so they cannot drift; a distinct type, so a test
# sees whether the code under test used the injected engine or imported the real one.
FakeSamplingParams = dataclasses.make_dataclass(
    "FakeSamplingParams", [(f.name, f.type, dataclasses.field(default=f.default))
                           for f in dataclasses.fields(SamplingParams)], frozen=True)


class FakeSampler:
    """Sampler(params, eos_ids)(logits) -> int; one random stream per object, like engine.Sampler."""

    def __init__(self, params: FakeSamplingParams, eos_ids: frozenset[int] = frozenset()):
        self.params, self.eos_ids = params, frozenset(eos_ids)
        self.generator = torch.Generator().manual_seed(params.seed or 0)

    def __call__(self, logits: torch.Tensor) -> int:
        logits = apply_logit_bias(logits, self.params.logit_bias) if self.params.logit_bias else logits.clone()
        if self.params.argmax_ignoring_eos:
            logits[list(self.eos_ids)] = float("-inf")
            return int(torch.argmax(logits))
        if self.params.temperature == 0:
            return int(torch.argmax(logits))
        # The engine's own filters (temperature, top-k, top-p, min-p), so that the fake draws
        # from the distribution the real sampler would, extreme parameters included.
        probs = filtered_probs(logits.float(), self.params)
        return int(torch.multinomial(probs, 1, generator=self.generator))


@dataclass(frozen=True)
class FakeVocab:
    specials: dict[str, int]
    bos_id: int
    eos_id: int
    eos_ids: frozenset[int]

    @property
    def n_vocab(self) -> int:
        return 256 + len(self.specials)


CHATML_THINK = FakeVocab({"<|im_end|>": 256, "<think>": 257, "</think>": 258, "<|im_start|>": 259},
                         bos_id=259, eos_id=256, eos_ids=frozenset({256}))
CHATML = FakeVocab({"<|im_start|>": 256, "<|im_end|>": 257, "<|endoftext|>": 258},
                   bos_id=258, eos_id=257, eos_ids=frozenset({257, 258}))
DEFAULT_REPLY = "Answer: 4"
THINK_MARKERS = ("<think>", "</think>")


class FakeTextStream:
    def __init__(self, model: "FakeModel") -> None:
        self.model, self.buf = model, b""

    def push(self, token: int) -> str:
        if token >= 256:
            return self.flush() + self.model.detokenize([token])
        self.buf += bytes([token])
        try:
            text = self.buf.decode("utf-8")
        except UnicodeDecodeError:
            return ""  # wait for the rest of a multi-byte character
        self.buf = b""
        return text

    def flush(self) -> str:
        text, self.buf = self.buf.decode("utf-8", errors="replace"), b""
        return text


def peaked_logits(n_vocab: int, first: int, second: int) -> torch.Tensor:
    out = torch.zeros(n_vocab)
    out[second] = 20.0
    out[first] = 30.0
    return out


class FakePrefill:
    """`engine.session.Prefill`'s interface: the rest of a sync, one chunk per `step()`."""

    def __init__(self, session: "FakeSession", ids: list[int], reused: int) -> None:
        self.session = session
        self.ids = ids
        self.reused = reused
        self.total = len(ids) - reused
        self.evaluated = 0
        if self.total == 0:
            session._start(len(ids))

    @property
    def done(self) -> bool:
        return self.evaluated >= self.total

    def step(self, cancel: Callable[[], bool] | None = None) -> int:
        s = self.session
        if s.model.prefill_delay:
            time.sleep(s.model.prefill_delay)
        n = len(s.tokens)
        part = self.ids[n:n + s.model.prefill_chunk]
        s.tokens.extend(part)
        self.evaluated += len(part)
        if self.done:
            s._start(len(self.ids))
        return len(part)


class FakeSession:
    def __init__(self, model: "FakeModel") -> None:
        self.model = model
        self.tokens: list[int] = []
        self.owner_thread: int | None = None  # the thread of the last sync
        self._prompt_len = 0
        self._reply: list[int] = []
        self._advanced: list[bool] = []  # per token after the prompt: did it consume the script?
        self._sampler: FakeSampler | None = None

    @property
    def n_past(self) -> int:
        return len(self.tokens)

    def _position(self) -> int:
        return sum(self._advanced)

    def _next_scripted(self) -> int | None:
        k = self._position()
        return self._reply[k] if k < len(self._reply) else None

    def _start(self, prompt_len: int) -> None:
        self._prompt_len = prompt_len
        self._advanced = []
        self._reply = self.model.reply_ids(self.model.detokenize(self.tokens[:prompt_len]))

    def start_prefill(self, ids: list[int]) -> "FakePrefill":
        """As the engine's: truncate to the common prefix (the last token is evaluated again)
        and return the rest of the prefill as chunk steps."""
        ids = list(ids)
        if not ids:
            raise ValueError("sync needs at least one token")
        if len(ids) > self.model.n_ctx:
            raise ValueError(f"{len(ids)} tokens do not fit the context of {self.model.n_ctx}")
        self.owner_thread = threading.get_ident()
        reused = 0
        while reused < min(len(ids), len(self.tokens)) and ids[reused] == self.tokens[reused]:
            reused += 1
        reused = min(reused, len(ids) - 1)  # like the engine: the last token is evaluated again
        del self.tokens[reused:]
        return FakePrefill(self, ids, reused)

    def sync(self, ids: list[int], progress: Callable[[int, int], None] | None = None,
             cancel: Callable[[], bool] | None = None) -> int:
        job = self.start_prefill(ids)
        while not job.done:
            if cancel is not None and cancel():
                raise FakeCancelled()
            job.step(cancel)
            if progress is not None:
                progress(len(self.tokens), len(ids))
        return job.reused

    @property
    def logits(self) -> torch.Tensor:
        nxt, vocab = self._next_scripted(), self.model.vocab
        if nxt is None:
            return peaked_logits(vocab.n_vocab, vocab.eos_id, ord("."))
        return peaked_logits(vocab.n_vocab, nxt, vocab.eos_id)

    @property
    def raw_logits(self) -> torch.Tensor:
        """As the CPU engine's sessions: the frontier row is a host tensor."""
        return self.logits

    def eval(self, token: int) -> None:
        if self.n_past >= self.model.n_ctx:
            raise ValueError(f"{self.n_past + 1} tokens do not fit the context of {self.model.n_ctx}")
        if self.model.decode_delay:
            time.sleep(self.model.decode_delay)
        nxt = self._next_scripted()
        self._advanced.append(nxt is None or nxt == token)
        self.tokens.append(int(token))

    def iter_extend_logits(self, ids: Any, cancel: Callable[[], bool] | None = None) -> Any:
        """Teacher-forced logits: after byte b the next byte b + 1 is likeliest, EOS second."""
        ids = [int(t) for t in ids]
        if not ids:
            raise ValueError("extend_logits needs at least one token")
        if len(self.tokens) + len(ids) > self.model.n_ctx:
            raise ValueError(f"{len(self.tokens) + len(ids)} tokens do not fit the context of {self.model.n_ctx}")
        vocab = self.model.vocab
        for start in range(0, len(ids), self.model.prefill_chunk):
            if cancel is not None and cancel():
                raise FakeCancelled()
            part = ids[start: start + self.model.prefill_chunk]
            self.tokens.extend(part)
            yield start, torch.stack([peaked_logits(vocab.n_vocab, (t + 1) % 256, vocab.eos_id) for t in part])

    def sample(self, params: FakeSamplingParams) -> int:
        if self._sampler is None or self._sampler.params is not params:
            # The engine's own parameters get the engine's own sampler, so that a test can
            # run the real sampling filters over the scripted logits.
            kind = Sampler if isinstance(params, SamplingParams) else FakeSampler
            self._sampler = kind(params, self.model.eos_ids)
        return self._sampler(self.logits)

    def truncate(self, n: int) -> None:
        if n < len(self.tokens):
            del self.tokens[n:]
            del self._advanced[max(0, n - self._prompt_len):]

    def reset(self) -> None:
        self.tokens, self._prompt_len, self._reply, self._advanced = [], 0, [], []
        self._sampler = None

    def save_payload(self) -> bytes:
        return json.dumps({"tokens": self.tokens, "prompt_len": self._prompt_len,
                           "advanced": self._advanced}).encode()

    def load_payload(self, data: bytes) -> None:
        state = json.loads(data)
        if len(state["tokens"]) > self.model.n_ctx:
            raise ValueError("payload does not fit the context")
        self.tokens = list(state["tokens"])
        self._start(state["prompt_len"])
        self._advanced = list(state["advanced"])


class FakeModel:
    """A byte-level model whose 'generation' is reply(prompt_text) -> reply text."""

    quant = "fake"
    device = torch.device("cpu")
    weight_bytes = 1_000_000
    kv_bytes_per_token = 100

    def __init__(self, reply: str | Callable[[str], str] | None = None, *, vocab: FakeVocab = CHATML_THINK,
                 thinking: bool = False, n_ctx: int = 4096, prefill_chunk: int = 64, prefill_delay: float = 0.0,
                 decode_delay: float = 0.0, generation_prefix: str = "", name: str = "fake-model",
                 path: str = "/dev/null", add_bos: bool = False) -> None:
        reply = DEFAULT_REPLY if reply is None else reply
        self.reply = reply if callable(reply) else (lambda _prompt, r=reply: r)
        self.vocab, self.thinking, self.n_ctx = vocab, thinking, n_ctx
        self.prefill_chunk, self.prefill_delay, self.decode_delay = prefill_chunk, prefill_delay, decode_delay
        # Text the template writes after the assistant header (e.g. "<think>\n" for thinking models).
        self.generation_prefix = generation_prefix
        self.name, self.path, self.add_bos = name, path, add_bos
        self.sessions: list[Any] = []
        self.rendered: list[str] = []
        self.warmed_up: list[int] = []  # the rows of each warm_up call

    # --- ids ---
    @property
    def n_vocab(self) -> int:
        return self.vocab.n_vocab

    @property
    def bos_id(self) -> int:
        return self.vocab.bos_id

    @property
    def eos_id(self) -> int:
        return self.vocab.eos_id

    @property
    def eos_ids(self) -> frozenset[int]:
        return self.vocab.eos_ids

    def _specials(self) -> dict[str, int]:
        if self.thinking:
            return self.vocab.specials
        return {k: v for k, v in self.vocab.specials.items() if k not in THINK_MARKERS}

    # --- text ---
    @property
    def max_token_bytes(self) -> int:
        return max(len(k.encode("utf-8")) for k in self.vocab.specials)

    def tokenize(self, text: str, special: bool = False) -> list[int]:
        if not special:
            return list(text.encode("utf-8"))
        specials = self._specials()
        out: list[int] = []
        i = 0
        while i < len(text):
            for marker, tid in specials.items():
                if text.startswith(marker, i):
                    out.append(tid)
                    i += len(marker)
                    break
            else:
                out.extend(text[i].encode("utf-8"))
                i += 1
        return out

    def detokenize(self, ids: list[int]) -> str:
        names = {v: k for k, v in self.vocab.specials.items()}
        out, buf = [], b""
        for t in ids:
            if t in names:
                out.append(buf.decode("utf-8", errors="replace"))
                out.append(names[t])
                buf = b""
            else:
                buf += bytes([t])
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def _prompt_text(self) -> PromptText:
        return PromptText(self._specials())

    def escape_text(self, text: str) -> str:
        return self._prompt_text().escape(text)

    def tokenize_prompt(self, prompt_text: str) -> list[int]:
        specials = self._specials()
        out: list[int] = []
        for piece, is_control in self._prompt_text().split(prompt_text):
            out.extend([specials[piece]] if is_control else piece.encode("utf-8"))
        return out

    def detokenize_prompt(self, ids: list[int]) -> str:
        names = {v: k for k, v in self._specials().items()}
        pieces, run = [], []
        for t in ids:
            if t in names:
                if run:
                    pieces.append((self.detokenize(run), False))
                    run = []
                pieces.append((names[t], True))
            else:
                run.append(t)
        if run:
            pieces.append((self.detokenize(run), False))
        return self._prompt_text().escape_tokens(pieces)

    def render_prompt(self, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None,
                      **extra: Any) -> str:
        esc = self.escape_text
        return self.render_chat(escape_strings(messages, esc), add_generation_prompt,
                                escape_strings(tools, esc) if tools else tools, **extra)

    def warm_up(self, rows: int = 1) -> WarmUp:
        self.warmed_up.append(rows)
        return WarmUp(0.0, skipped="a fake model captures nothing")

    def token_bytes(self, token_id: int) -> tuple[bytes, bool]:
        if token_id < 256:
            return bytes([token_id]), False
        return self.detokenize([token_id]).encode("utf-8"), True

    def text_stream(self) -> FakeTextStream:
        return FakeTextStream(self)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None,
                    **extra: Any) -> str:
        parts = []
        if tools:
            parts.append(f"<|im_start|>system\nTools: {json.dumps(tools, ensure_ascii=False)}<|im_end|>\n")
        for m in messages:
            content = m.get("content") or ""
            for call in m.get("tool_calls") or []:
                content += f"<tool_call>{call['function']['name']} {call['function']['arguments']}</tool_call>"
            parts.append(f"<|im_start|>{m['role']}\n{content}<|im_end|>\n")
        if add_generation_prompt:
            parts.append("<|im_start|>assistant\n" + self.generation_prefix)
            if self.thinking and extra.get("enable_thinking", True):
                parts.append("<think>\n")
        text = "".join(parts)
        self.rendered.append(text)
        return text

    def prompt_ids(self, ids: list[int]) -> list[int]:
        if self.add_bos and (not ids or ids[0] != self.bos_id):
            return [self.bos_id, *ids]
        return list(ids)

    def reply_ids(self, prompt_text: str) -> list[int]:
        """The scripted reply to a prompt, as ids (special-token text parsed)."""
        return self.tokenize(self.reply(prompt_text), special=True)

    # --- sessions and memory ---
    def new_session(self) -> FakeSession:
        s = FakeSession(self)
        self.sessions.append(s)
        return s

    def new_sessions(self, n: int) -> list[FakeSession]:
        return [self.new_session() for _ in range(n)]

    def memory_bytes(self, n_sessions: int = 1, ctx: int | None = None) -> int:
        ctx = self.n_ctx if ctx is None else ctx
        return self.weight_bytes + n_sessions * ctx * self.kv_bytes_per_token


@dataclass
class FakeSlot:
    session: Any
    request: GenRequest | None = None


@dataclass
class FakeScheduler:
    """engine.batch.BatchScheduler's contract over fake sessions: a request syncs whole when its
    slot is free (the preferred one, else the first idle), then gets one token per `step()`."""

    model: Any
    n_slots: int
    ctx: int | None = None
    check_memory: bool = True
    run_ahead: bool | None = None  # nothing runs ahead of fake sessions
    observer: Any = None  # takes no step records: the fake's steps are not the engine's
    slots: list[FakeSlot] = field(init=False)
    queue: list[GenRequest] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self.slots = [FakeSlot(s) for s in self.model.new_sessions(self.n_slots)]

    def session(self, i: int) -> Any:
        return self.slots[i].session

    def submit(self, req: GenRequest) -> None:
        self.queue.append(req)

    @property
    def busy(self) -> bool:
        return bool(self.queue) or any(s.request is not None for s in self.slots)

    def _finish(self, slot: FakeSlot, reason: str) -> None:
        slot.request.finish, slot.request = reason, None

    def _admit(self) -> None:
        for req in list(self.queue):
            idle = [i for i, s in enumerate(self.slots) if s.request is None]
            i = req.slot if req.slot is not None else (idle[0] if idle else None)
            if i is None or i not in idle:
                continue
            self.queue.remove(req)
            slot = self.slots[i]
            slot.request = req
            req.reused = slot.session.sync(req.ids)

    @property
    def prefilling(self) -> bool:
        return False  # a request syncs whole when admitted: no chunk ever waits

    def step(self, prefill: bool = True) -> bool:
        """One token for every request; `prefill` holds nothing back (no chunks here)."""
        self._admit()
        eos = self.model.eos_ids
        for slot in self.slots:
            req = slot.request
            if req is None:
                continue
            if req.cancel is not None and req.cancel():
                self._finish(slot, "cancelled")
                continue
            tok = (req.choose or FakeSampler(req.params, eos))(slot.session.raw_logits)
            req.output.append(tok)
            if req.on_token is not None:
                req.on_token(tok)
            if tok in eos and not req.params.argmax_ignoring_eos:
                self._finish(slot, "stop")
            elif len(req.output) >= req.max_tokens or slot.session.n_past >= self.model.n_ctx:
                self._finish(slot, "length")
            else:
                slot.session.eval(tok)
        return self.busy

    def run(self) -> None:
        while self.step():
            pass


FAKE_ENGINE = types.SimpleNamespace(SamplingParams=FakeSamplingParams, Sampler=FakeSampler, Cancelled=FakeCancelled,
                                    BatchScheduler=FakeScheduler, GenRequest=GenRequest)
