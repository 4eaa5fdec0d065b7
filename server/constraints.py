"""Decoding constraints: which tokens may come next, decided step by step for one generation.

The contract (`DecodingConstraint`), asked by `server.jobs.TokenDecoder` before every token:
- `decide() -> Step | None`: None leaves the step to the sampler as usual; a `Step` either
  forces one token (`forced`: taken without sampling) or narrows the choice to `allowed`
  (bool [n_vocab], True where a token may follow; the sampler draws among those, greedy
  decoding takes the best of them);
- `advance(token)`: the token that was taken (forced, sampled or chosen greedily);
- `complete`: True once the generation must end here (the finish reason is then "stop").

Two constraints, one mechanism:
- `GrammarConstraint`: a grammar over the model's vocabulary (JSON schema or Lark text,
  compiled by llguidance), armed by a condition (for instance "the splitter is outside
  thinking") and, once armed, applied to every step until the grammar is satisfied. With
  `release=False` (a whole document) it then reports `complete`; with `release=True` (an
  opening that the model continues freely) it stops constraining instead.
- `ToolCallPolicy`: what `tool_choice` and `parallel_tool_calls` ask of a chat generation:
  an optional opening grammar (the syntax's call opening, with the allowed function names)
  and, for a single call, `complete` as soon as the splitter has seen one whole call.

The grammar engine needs the vocabulary as bytes: `grammar_tokenizer(model)` builds it once
per model (about 0.6 s for 49k tokens on one core) and keeps it; control tokens are marked
so that no grammar text ever matches them, and the model's end-of-generation ids are the
grammar's EOS (allowed exactly where the document may end).

`grammar_error(grammar)` checks a grammar without a model (the APIs answer 400 with it).
`json_grammar(schema)` is the grammar of one JSON document (compact separators, no free
whitespace, so that a model cannot loop on blank space); `literal_choice(texts)` a grammar
matching exactly one of the texts.

It does not sample, run forward passes or know any API's field names. A constraint is used
from one thread (the worker's); building the tokenizer is guarded by a lock.
"""
from __future__ import annotations

import json
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import llguidance
import numpy as np
import torch

# Control tokens carry this prefix in the grammar's vocabulary: no UTF-8 text starts with it.
_SPECIAL_MARK = b"\xff"
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Step:
    forced: int | None = None
    allowed: torch.Tensor | None = None


class DecodingConstraint(Protocol):
    def decide(self) -> Step | None: ...

    def advance(self, token: int) -> None: ...

    @property
    def complete(self) -> bool: ...


# --- grammars (pure text) ------------------------------------------------------------------

def json_grammar(schema: dict[str, Any] | None) -> str:
    """The grammar of one JSON document valid against `schema` (None: any JSON object)."""
    return llguidance.LLMatcher.grammar_from_json_schema(schema if schema is not None else {"type": "object"},
                                                         overrides=JSON_OPTIONS)


def literal_choice(texts: Sequence[str]) -> str:
    """The grammar of exactly one of `texts` (a Lark alternation of string literals)."""
    if not texts:
        raise ValueError("literal_choice needs at least one text")
    return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(t) for t in texts))


def grammar_error(grammar: str) -> str | None:
    """Why the grammar cannot be used (unsupported schema keyword, bad syntax), or None."""
    try:
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    except ValueError as e:
        return str(e)
    return messages[0] if is_error else None


# --- the vocabulary ------------------------------------------------------------------------

class _Vocabulary:
    """What `llguidance.TokenizerWrapper` reads: every token's bytes, EOS, and a tokenizer."""

    def __init__(self, model: Any) -> None:
        self._model = model
        self.tokens: list[bytes] = []
        self.special_token_ids: list[int] = []
        for i in range(model.n_vocab):
            data, control = model.token_bytes(i)
            if control:
                self.special_token_ids.append(i)
                data = _SPECIAL_MARK + data
            self.tokens.append(data)
        self.eos_token_id = model.eos_id
        self.bos_token_id = model.bos_id

    def __call__(self, text: bytes | str) -> list[int]:
        # llguidance tokenizes forced text with this (its fast-forward tokens).
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._model.tokenize(text)


_TOKENIZERS: "weakref.WeakKeyDictionary[Any, llguidance.LLTokenizer]" = weakref.WeakKeyDictionary()
_TOKENIZERS_LOCK = threading.Lock()


def grammar_tokenizer(model: Any) -> llguidance.LLTokenizer:
    """The model's vocabulary for grammars, built on first use and kept while the model lives."""
    with _TOKENIZERS_LOCK:
        tok = _TOKENIZERS.get(model)
        if tok is None:
            eos = sorted(model.eos_ids) or [model.eos_id]
            tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocabulary(model)), n_vocab=model.n_vocab,
                                         eos_token=eos)
            _TOKENIZERS[model] = tok
        return tok


def apply_mask(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """A copy of the logits row with the tokens outside `allowed` at -inf.

    Done in numpy: one thread, about 50 us for 49k tokens, where torch's element-wise ops on
    a row this long go parallel and cost milliseconds when the cores are busy."""
    row = logits.detach().float().cpu().numpy()
    return torch.from_numpy(np.where(allowed.numpy(), row, np.float32(-np.inf)))


def unpack_mask(bitmask: bytes, n_vocab: int) -> torch.Tensor:
    """llguidance's bitmask (bit i of 32-bit little-endian word j: token 32 j + i) as bool [n_vocab]."""
    bits = np.unpackbits(np.frombuffer(bitmask, dtype=np.uint8), bitorder="little")[:n_vocab]
    return torch.from_numpy(bits.view(np.bool_))


# --- constraints ---------------------------------------------------------------------------

class ConstraintViolation(RuntimeError):
    """A token outside the grammar was taken (a bug: the mask should have made it impossible)."""


class GrammarConstraint:
    """One grammar applied from the step where `armed()` first holds (see the module docstring)."""

    def __init__(self, model: Any, grammar: str, *, release: bool = False,
                 armed: Callable[[], bool] | None = None) -> None:
        self.n_vocab = model.n_vocab
        self.matcher = llguidance.LLMatcher(grammar_tokenizer(model), grammar, log_level=0)
        if self.matcher.is_error():
            raise ValueError(f"grammar: {self.matcher.get_error()}")
        self.release = release
        self._armed = armed
        self.active = armed is None
        self.n_forced = 0
        self.n_masked = 0

    @property
    def satisfied(self) -> bool:
        """The grammar has matched a whole text and takes nothing more."""
        return self.matcher.is_stopped()

    @property
    def complete(self) -> bool:
        return not self.release and self.satisfied

    def decide(self) -> Step | None:
        if not self.active:
            if self._armed is None or not self._armed():
                return None
            self.active = True
        if self.satisfied:
            return None
        # Forced bytes are cheap to ask for; their tokenization (canonical, through the model's
        # tokenizer) is asked only when there are some.
        forced = self.matcher.compute_ff_tokens() if self.matcher.compute_ff_bytes() else None
        if forced:
            self.n_forced += 1
            return Step(forced=int(forced[0]))
        self.n_masked += 1
        return Step(allowed=unpack_mask(self.matcher.compute_bitmask(), self.n_vocab))

    def advance(self, token: int) -> None:
        if not self.active or self.satisfied:
            return
        if not self.matcher.consume_token(int(token)):
            raise ConstraintViolation(f"token {token} does not continue the grammar: {self.matcher.get_error()}")


class ToolCallPolicy:
    """`tool_choice` and `parallel_tool_calls` for one chat generation.

    `opening`: the grammar of the call opening (None: the model decides whether to call);
    `single_call`: end the generation once the splitter has seen one complete call."""

    def __init__(self, opening: GrammarConstraint | None, splitter: Any, single_call: bool) -> None:
        self.opening = opening
        self.splitter = splitter
        self.single_call = single_call

    @property
    def complete(self) -> bool:
        return self.single_call and self.splitter is not None and self.splitter.n_calls >= 1

    def decide(self) -> Step | None:
        return self.opening.decide() if self.opening is not None else None

    def advance(self, token: int) -> None:
        if self.opening is not None:
            self.opening.advance(token)


def outside_thinking(splitter: Any) -> Callable[[], bool]:
    """The arming condition "the generation has left its thinking block" (always, without a splitter)."""
    if splitter is None:
        return lambda: True
    return lambda: not splitter.in_thinking
