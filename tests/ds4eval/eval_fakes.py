"""A scripted fake of the engine API for ds4eval tests (no weights).

It follows the engine API contract (tokenize/detokenize/text_stream/render_chat/new_session,
session sync/sample/eval with progress and cancel) with a byte tokenizer, and a script that maps
the rendered prompt to the reply text.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

class FakeCancelled(Exception):
    pass


@dataclass
class FakeSamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    argmax_ignoring_eos: bool = False


FAKE_API = types.SimpleNamespace(SamplingParams=FakeSamplingParams, Cancelled=FakeCancelled)

EOS = 256
SPECIALS = {"<|im_end|>": 256, "<think>": 257, "</think>": 258, "<|im_start|>": 259}


class FakeTextStream:
    def __init__(self, model):
        self.model, self.buf = model, b""

    def push(self, tok: int) -> str:
        if tok >= 256:
            return self.flush() + self.model.detokenize([tok])
        self.buf += bytes([tok])
        try:
            text = self.buf.decode("utf-8")
        except UnicodeDecodeError:
            return ""  # wait for the rest of a multi-byte character
        self.buf = b""
        return text

    def flush(self) -> str:
        text, self.buf = self.buf.decode("utf-8", errors="replace"), b""
        return text


class FakeSession:
    def __init__(self, model):
        self.model = model
        self.tokens: list[int] = []
        self.sampled = 0
        self.reply: list[int] = []
        self.sync_calls = 0

    @property
    def n_past(self) -> int:
        return len(self.tokens)

    def sync(self, ids, progress=None, cancel=None) -> int:
        self.sync_calls += 1
        reused = 0
        while reused < min(len(ids), len(self.tokens)) and ids[reused] == self.tokens[reused]:
            reused += 1
        self.tokens = self.tokens[:reused]
        for start in range(reused, len(ids), 64):
            if cancel and cancel():
                raise FakeCancelled()
            self.tokens.extend(ids[start:start + 64])
            if progress:
                progress(len(self.tokens), len(ids))
        if len(self.tokens) > self.model.n_ctx:
            raise RuntimeError("KV cache overflow")
        self.sampled = 0
        self.reply = self.model.tokenize(self.model.script(self.model.detokenize(ids)), special=True)
        return reused

    def sample(self, params) -> int:
        if self.model.delay:
            import time

            time.sleep(self.model.delay)
        tok = self.reply[self.sampled] if self.sampled < len(self.reply) else EOS
        self.sampled += 1
        return tok

    def eval(self, tok: int) -> None:
        self.tokens.append(tok)
        if len(self.tokens) > self.model.n_ctx:
            raise RuntimeError("KV cache overflow")


class FakeModel:
    """Byte-level model whose 'generation' is script(prompt_text) -> reply text."""

    name = "fake-model"
    path = "/dev/null"
    n_vocab = 260
    bos_id = 259
    eos_id = EOS
    eos_ids = frozenset({EOS})
    add_bos = False

    def __init__(self, script=None, n_ctx=4096, thinking=False, delay=0.0):
        self.script = script or (lambda prompt: "Answer: 4")
        self.n_ctx = n_ctx
        self.thinking = thinking
        self.delay = delay
        self.sessions: list[FakeSession] = []

    def tokenize(self, text: str, special: bool = False) -> list[int]:
        out: list[int] = []
        specials = SPECIALS if self.thinking else {k: v for k, v in SPECIALS.items() if "think" not in k}
        i = 0
        while i < len(text):
            for s, tid in specials.items():
                if special and text.startswith(s, i):
                    out.append(tid)
                    i += len(s)
                    break
            else:
                out.extend(text[i].encode("utf-8"))
                i += 1
        return out

    def prompt_ids(self, ids) -> list[int]:
        if self.add_bos and (not ids or ids[0] != self.bos_id):
            return [self.bos_id, *ids]
        return list(ids)

    def detokenize(self, ids) -> str:
        inv = {v: k for k, v in SPECIALS.items()}
        out, buf = [], b""
        for t in ids:
            if t >= 256:
                out.append(buf.decode("utf-8", errors="replace"))
                buf = b""
                out.append(inv[t])
            else:
                buf += bytes([t])
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def text_stream(self):
        return FakeTextStream(self)

    def render_chat(self, messages, add_generation_prompt=True, tools=None, **extra) -> str:
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        if add_generation_prompt:
            text += "<|im_start|>assistant\n"
            if self.thinking and extra.get("enable_thinking", True):
                text += "<think>\n"
        return text

    def new_session(self):
        s = FakeSession(self)
        self.sessions.append(s)
        return s
