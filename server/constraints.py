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

Schemas are checked before any grammar work, in bounded time (`schema_problem`): at most
`MAX_SCHEMA_BYTES` of compact JSON (the grammar engine's cost grows with the schema: a 0.3 MB
schema of 10,000 optional properties took seconds to validate and 7 to 20 s to compile on the
inference thread), at most `MAX_SCHEMA_MEMBERS` object properties and `anyOf`/`oneOf`
alternatives in all (`schema_members`; the compilation's cost grows faster than their number:
64 KiB of one object's optional properties, about 2,400, took 0.5 s of validation and
compilation, all of it holding the interpreter lock, and the grammar engine gave up at the first
token of such an object beyond about 490 optional properties; 256 take about 10 ms), and no `$ref` cycle through required members only (`{"$ref": "#/$defs/n"}`
with `n` requiring a property `c` of schema `n`): no finite document matches such a schema,
and the grammar engine gives up on it only at the first generated token. Every message the
grammar engine gives (`brief`) is cut to its first line and `MAX_MESSAGE_CHARS`: its verbose
form dumps the parser's state, which has no place in an answer or a log line.

It does not sample, run forward passes or know any API's field names. A constraint is used
from one thread (the worker's); building the tokenizer is guarded by a lock.
"""
from __future__ import annotations

import json
import logging
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import llguidance
import numpy as np
import torch

log = logging.getLogger("ds4.server.constraints")

# Control tokens carry this prefix in the grammar's vocabulary: no UTF-8 text starts with it.
_SPECIAL_MARK = b"\xff"
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_SCHEMA_BYTES = 64 * 1024
MAX_SCHEMA_MEMBERS = 256
"""Object properties plus `anyOf`/`oneOf` alternatives in one schema, all of them counted."""
MAX_MESSAGE_CHARS = 300


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
        return brief(str(e))
    return brief(messages[0]) if is_error else None


def brief(message: str) -> str:
    """A grammar engine message as one short line (see the module docstring)."""
    line = message.strip().split("\n", 1)[0]
    return line if len(line) <= MAX_MESSAGE_CHARS else line[:MAX_MESSAGE_CHARS - 3] + "..."


# --- schemas (pure, bounded) ---------------------------------------------------------------

def schema_problem(schema: dict[str, Any] | None) -> str | None:
    """Why `schema` is refused before any grammar is built (see the module docstring), or None."""
    if schema is None:
        return None
    # The members first: counting stops at the limit, where serialising a hostile schema to
    # measure it would take its whole size (tens of milliseconds of the interpreter lock).
    if schema_members(schema, stop_above=MAX_SCHEMA_MEMBERS) > MAX_SCHEMA_MEMBERS:
        return (f"the schema has more object properties and anyOf/oneOf alternatives than the limit of "
                f"{MAX_SCHEMA_MEMBERS:,} (MAX_SCHEMA_MEMBERS)")
    size = len(json.dumps(schema, separators=(",", ":"), ensure_ascii=False).encode("utf-8"))
    if size > MAX_SCHEMA_BYTES:
        return (f"the schema is {size:,} bytes of JSON, more than the limit of {MAX_SCHEMA_BYTES:,} bytes "
                "(MAX_SCHEMA_BYTES)")
    cycle = required_cycle(schema)
    if cycle is not None:
        return ("no finite JSON document matches the schema: it requires " + " -> ".join(cycle)
                + ", a $ref cycle through required members only")
    return None


def schema_members(schema: Any, stop_above: int | None = None) -> int:
    """Object properties and `anyOf`/`oneOf` alternatives anywhere in `schema` (`$defs` included),
    counted iteratively (a schema nests as deep as its JSON); with `stop_above`, the count so far
    as soon as it exceeds that."""
    count = 0
    stack = [schema]
    while stack:
        if stop_above is not None and count > stop_above:
            return count
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            props = node.get("properties")
            count += len(props) if isinstance(props, dict) else 0
            for key in ("anyOf", "oneOf"):
                count += len(node[key]) if isinstance(node.get(key), list) else 0
            stack.extend(node.values())
    return count


def required_cycle(schema: dict[str, Any]) -> list[str] | None:
    """A cycle of `$ref`s that every instance must follow forever, as the JSON pointers and
    members it passes through, or None. The members an instance must hold: a `$ref`'s target,
    every `allOf` member, the schemas of `required` properties, and array items up to
    `minItems`. `anyOf` and `oneOf` are not followed (another branch may end the recursion),
    so a cycle found is certain and some infinite schemas pass (the grammar engine then says)."""
    on_path: dict[int, int] = {}  # id of a schema on the current path -> its place in `path`
    path: list[str] = []
    done: set[int] = set()
    # Iterative depth-first search: a schema nests as deep as its JSON, which may be deep.
    stack: list[tuple[Any, str, bool]] = [(schema, "#", True)]
    while stack:
        node, label, entering = stack.pop()
        if not isinstance(node, dict):
            continue
        key = id(node)
        if not entering:
            on_path.pop(key, None)
            path.pop()
            done.add(key)
            continue
        if key in on_path:
            return path[on_path[key]:] + [label]
        if key in done:
            continue
        on_path[key] = len(path)
        path.append(label)
        stack.append((node, label, False))
        stack.extend((child, name, True) for name, child in reversed(_required_members(node, schema)))
    return None


def _required_members(node: dict[str, Any], root: dict[str, Any]) -> list[tuple[str, Any]]:
    members: list[tuple[str, Any]] = []
    ref = node.get("$ref")
    if isinstance(ref, str):
        target = _resolve(ref, root)
        if target is not None:
            members.append((ref, target))
    for i, sub in enumerate(node.get("allOf") or []) if isinstance(node.get("allOf"), list) else ():
        members.append((f"allOf/{i}", sub))
    props, required = node.get("properties"), node.get("required")
    if isinstance(props, dict) and isinstance(required, list):
        members.extend((f"properties/{name}", props[name]) for name in required
                       if isinstance(name, str) and name in props)
    min_items = node.get("minItems")
    if isinstance(min_items, int) and min_items > 0:
        prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
        members.extend((f"prefixItems/{i}", sub) for i, sub in enumerate(prefix[:min_items]))
        if len(prefix) < min_items and isinstance(node.get("items"), dict):
            members.append(("items", node["items"]))
    return members


def _resolve(ref: str, root: dict[str, Any]) -> Any:
    """The schema a local `$ref` ("#", "#/$defs/name", ...) points at; None for any other."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return None
    node: Any = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


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

class GrammarConstraint:
    """One grammar applied from the step where `armed()` first holds (see the module docstring).

    When the grammar engine fails during decoding (one of its limits, such as the Earley items
    a step may create, or a token it does not accept) the constraint gives up instead of
    failing the request: `failure` holds the engine's message (one line), one warning is
    logged, a whole-document grammar reports `complete` (the generation ends there, finish
    reason "stop") and an opening grammar stops constraining."""

    def __init__(self, model: Any, grammar: str, *, release: bool = False,
                 armed: Callable[[], bool] | None = None) -> None:
        self.n_vocab = model.n_vocab
        self.matcher = llguidance.LLMatcher(grammar_tokenizer(model), grammar, log_level=0)
        if self.matcher.is_error():
            raise ValueError(f"grammar: {brief(self.matcher.get_error())}")
        self.release = release
        self._armed = armed
        self.active = armed is None
        self.n_forced = 0
        self.n_masked = 0
        self.failure: str | None = None

    @property
    def satisfied(self) -> bool:
        """The grammar has matched a whole text and takes nothing more."""
        return self.matcher.is_stopped()

    @property
    def complete(self) -> bool:
        return not self.release and (self.failure is not None or self.satisfied)

    def decide(self) -> Step | None:
        if self.failure is not None:
            return None
        if not self.active:
            if self._armed is None or not self._armed():
                return None
            self.active = True
        if self.satisfied:
            return None
        try:
            # Forced bytes are cheap to ask for; their tokenization (canonical, through the
            # model's tokenizer) is asked only when there are some.
            forced = self.matcher.compute_ff_tokens() if self.matcher.compute_ff_bytes() else None
            bitmask = None if forced else self.matcher.compute_bitmask()
        except (ValueError, RuntimeError) as e:
            self._give_up(str(e))
            return None
        if self.matcher.is_error():
            self._give_up(self.matcher.get_error())
            return None
        if forced:
            self.n_forced += 1
            return Step(forced=int(forced[0]))
        self.n_masked += 1
        return Step(allowed=unpack_mask(bitmask, self.n_vocab))

    def advance(self, token: int) -> None:
        if not self.active or self.satisfied or self.failure is not None:
            return
        if not self.matcher.consume_token(int(token)):
            self._give_up(f"token {token} does not continue the grammar: {self.matcher.get_error()}")

    def _give_up(self, message: str) -> None:
        self.failure = brief(message)
        log.warning("the output grammar gave up after %d constrained steps: %s; %s", self.n_forced + self.n_masked,
                    self.failure, "the opening is no longer enforced" if self.release else "the generation ends here")


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
