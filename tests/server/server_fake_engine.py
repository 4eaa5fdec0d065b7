"""A deterministic stand-in for the engine, implementing the engine API contract.

Tokenizer: one id per UTF-8 byte (0..255) plus three special tokens, so token counts are
easy to predict (`len(text.encode())` plus one per special marker). The chat template is
ChatML. "Inference": after `sync(prompt)`, the next-token logits (peaked enough that sampling at
temperature 1 practically never deviates) spell out
`reply(prompt_text)` byte by byte and then put EOS first — so greedy decoding returns the
scripted reply, and `argmax_ignoring_eos` continues with '.' bytes.

`generation_prefix` imitates templates that open a thinking block in the generation prompt.
Slowness is controllable (`prefill_delay` per prefill chunk, `decode_delay` per eval) for
keepalive and cancellation tests. Nothing here loads weights.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable

import torch

IM_START, IM_END, EOT = 256, 257, 258
SPECIALS = {"<|im_start|>": IM_START, "<|im_end|>": IM_END, "<|endoftext|>": EOT}
SPECIAL_TEXT = {v: k for k, v in SPECIALS.items()}
N_VOCAB = 259
DEFAULT_REPLY = "Hello, world! This is the scripted reply."


class FakeCancelled(Exception):
    pass


@dataclass(frozen=True)
class FakeSamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    argmax_ignoring_eos: bool = False


FAKE_ENGINE = SimpleNamespace(SamplingParams=FakeSamplingParams, Cancelled=FakeCancelled)
"""The engine types the serial worker uses, for `InferenceWorker(model, FAKE_ENGINE)` and
`create_app(..., engine=FAKE_ENGINE)` (the batched loop needs the real engine)."""


class FakeTextStream:
    def __init__(self) -> None:
        self._pending = b""

    def push(self, token: int) -> str:
        if token in SPECIAL_TEXT:
            out, self._pending = self._pending.decode("utf-8", "replace") + SPECIAL_TEXT[token], b""
            return out
        self._pending += bytes([token])
        for cut in range(len(self._pending), max(-1, len(self._pending) - 4), -1):
            try:
                text = self._pending[:cut].decode("utf-8")
            except UnicodeDecodeError:
                continue
            self._pending = self._pending[cut:]
            return text
        return ""

    def flush(self) -> str:
        out, self._pending = self._pending.decode("utf-8", "replace"), b""
        return out


class FakeModel:
    name = "fake-model"
    path = "/nonexistent/fake-model.gguf"
    n_vocab = N_VOCAB
    bos_id = EOT
    eos_id = IM_END
    eos_ids = frozenset({IM_END, EOT})
    add_bos = False
    weight_bytes = 1_000_000
    kv_bytes_per_token = 100

    def __init__(self, reply: str | Callable[[str], str] = DEFAULT_REPLY, *, n_ctx: int = 1024,
                 prefill_chunk: int = 64, prefill_delay: float = 0.0, decode_delay: float = 0.0,
                 generation_prefix: str = "") -> None:
        self.reply = reply if callable(reply) else (lambda _prompt, r=reply: r)
        self.n_ctx = n_ctx
        self.prefill_chunk = prefill_chunk
        self.prefill_delay = prefill_delay
        self.decode_delay = decode_delay
        self.generation_prefix = generation_prefix
        """Text the template writes after the assistant header (e.g. "<think>\n" for thinking models)."""
        self.sessions: list[FakeSession] = []
        self.rendered: list[str] = []

    def memory_bytes(self, n_sessions: int, ctx: int) -> int:
        return self.weight_bytes + n_sessions * ctx * self.kv_bytes_per_token

    def tokenize(self, text: str, special: bool = False) -> list[int]:
        if not special:
            return list(text.encode("utf-8"))
        ids: list[int] = []
        i = 0
        while i < len(text):
            for marker, tid in SPECIALS.items():
                if text.startswith(marker, i):
                    ids.append(tid)
                    i += len(marker)
                    break
            else:
                j = min((k for k in (text.find(m, i) for m in SPECIALS) if k != -1), default=len(text))
                ids.extend(text[i:j].encode("utf-8"))
                i = j
        return ids

    def prompt_ids(self, ids: list[int]) -> list[int]:
        ids = list(ids)
        if self.add_bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids.insert(0, self.bos_id)
        return ids

    def detokenize(self, ids: list[int]) -> str:
        out, buf = [], b""
        for t in ids:
            if t in SPECIAL_TEXT:
                out.append(buf.decode("utf-8", "replace"))
                out.append(SPECIAL_TEXT[t])
                buf = b""
            else:
                buf += bytes([t])
        out.append(buf.decode("utf-8", "replace"))
        return "".join(out)

    def text_stream(self) -> FakeTextStream:
        return FakeTextStream()

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None, **extra: Any) -> str:
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
        text = "".join(parts)
        self.rendered.append(text)
        return text

    def new_session(self) -> FakeSession:
        s = FakeSession(self)
        self.sessions.append(s)
        return s


class FakeSession:
    def __init__(self, model: FakeModel) -> None:
        self.model = model
        self.tokens: list[int] = []
        self._prompt_len = 0
        self._reply: list[int] = []
        self.owner_thread: int | None = None

    @property
    def n_past(self) -> int:
        return len(self.tokens)

    def sync(self, ids: list[int], progress: Callable[[int, int], None] | None = None,
             cancel: Callable[[], bool] | None = None) -> int:
        self.owner_thread = threading.get_ident()
        reused = 0
        for a, b in zip(self.tokens, ids):
            if a != b:
                break
            reused += 1
        reused = min(reused, len(ids) - 1) if ids else 0
        del self.tokens[reused:]
        self._prompt_len = len(ids)
        self._reply = list(self.model.reply(self.model.detokenize(ids)).encode("utf-8"))
        total = len(ids)
        while len(self.tokens) < total:
            if cancel is not None and cancel():
                raise FakeCancelled()
            if self.model.prefill_delay:
                time.sleep(self.model.prefill_delay)
            n = len(self.tokens)
            self.tokens.extend(ids[n:n + self.model.prefill_chunk])
            if progress is not None:
                progress(len(self.tokens), total)
        return reused

    @property
    def logits(self) -> torch.Tensor:
        k = self.n_past - self._prompt_len
        out = torch.zeros(N_VOCAB)
        if k < len(self._reply):
            out[self._reply[k]] = 30.0
            out[IM_END] = 20.0
        else:
            out[IM_END] = 30.0
            out[ord(".")] = 20.0
        return out

    def eval(self, token: int) -> None:
        if self.n_past >= self.model.n_ctx:
            raise RuntimeError("context full")
        if self.model.decode_delay:
            time.sleep(self.model.decode_delay)
        self.tokens.append(token)

    def sample(self, params: FakeSamplingParams) -> int:
        logits = self.logits
        if params.argmax_ignoring_eos:
            logits[list(self.model.eos_ids)] = float("-inf")
            return int(torch.argmax(logits))
        if params.temperature == 0:
            return int(torch.argmax(logits))
        gen = torch.Generator().manual_seed(((params.seed or 0) + self.n_past) % 2**63)
        probs = torch.softmax(logits / params.temperature, dim=-1)
        return int(torch.multinomial(probs, 1, generator=gen))

    def truncate(self, n: int) -> None:
        del self.tokens[n:]
