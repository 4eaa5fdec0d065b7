"""GGUF tokenizers: text <-> token ids, built from a GGUF file's metadata.

Contract
    tok = Tokenizer.from_gguf_metadata(meta)     # meta: GGUF key -> python value
    tok.encode(text, special=False) -> list[int] # never adds BOS (see `tok.add_bos`)
    tok.decode(ids, skip_special=False) -> str
    tok.encode_prompt(prompt_text) -> list[int]  # rendered chat text, see engine.prompt_text
    tok.decode_prompt(ids) -> str                # the prompt text of ids
    tok.escape(text) -> str                      # plain text -> prompt text that stays text
    tok.piece(id) -> str                         # the token's stored text, for display
    tok.n_vocab, tok.bos_id, tok.eos_id, tok.eos_ids, tok.add_bos
    tok.max_token_bytes                          # the longest token's byte length
    TextStream(tok).push(id) -> str / .flush() -> str   # incremental, UTF-8 safe

Two vocabulary kinds, chosen by `tokenizer.ggml.model`:

* "gpt2": byte-level BPE. Tokens are spelled in GPT-2's byte alphabet (every byte is
  one printable character, a space is "Ġ"), merges come from `tokenizer.ggml.merges`.
  Text is first cut into words by the regular expressions of the vocabulary's
  pre-tokenizer, named by `tokenizer.ggml.pre` (see `PRE_TOKENIZER_SPLITS`); BPE
  then runs inside each word. An unknown pre-tokenizer name is an error, never a
  silent fallback: a wrong split gives plausible-looking but wrong ids.
* "llama": SentencePiece BPE. Tokens use "▁" for a space and carry scores; the
  highest-scoring adjacent pair is merged first. Characters missing from the
  vocabulary become `<0xNN>` byte tokens. With `tokenizer.ggml.add_space_prefix`
  (default on) a space is put in front of the text and in front of every piece of
  text that follows a special token, as SentencePiece and llama.cpp do. (Hugging
  Face's GGUF loader differs on two inputs: it adds no prefix to text that already
  starts with a space, nor to text after a special token.)

Special tokens are those whose `tokenizer.ggml.token_type` is CONTROL (3) or
USER_DEFINED (4). Control tokens (`<|im_start|>`, `<s>`) are only recognised in the
text when `special=True`; otherwise their text is tokenized like any other text, so
user-supplied text can never forge a control token. A rendered chat mixes both: its
prompt text (`engine.prompt_text`) escapes the control spellings that came from messages,
and `encode_prompt` turns only the unescaped ones into control tokens. User-defined tokens (such as
`<think>` in some vocabularies) are ordinary vocabulary that the BPE cannot build
from pieces, so they are always matched whole, as llama.cpp and transformers do.

The BPE itself runs in the `tokenizers` library; this module builds its model from
the metadata and does the special-token splitting and decoding itself.

It does not read files (the caller passes metadata), add BOS/EOS, truncate, pad, or
know about chat formats (see `engine.chat_template`).
"""

from __future__ import annotations

import bisect
import codecs
import itertools
import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
from tokenizers import Regex
from tokenizers import Tokenizer as _Backend
from tokenizers import models as _models
from tokenizers import pre_tokenizers as _pre

from engine.prompt_text import PromptText, spellings_pattern

# --- GGUF metadata keys --------------------------------------------------------
KEY_MODEL = "tokenizer.ggml.model"
KEY_PRE = "tokenizer.ggml.pre"
KEY_TOKENS = "tokenizer.ggml.tokens"
KEY_TOKEN_TYPE = "tokenizer.ggml.token_type"
KEY_SCORES = "tokenizer.ggml.scores"
KEY_MERGES = "tokenizer.ggml.merges"
KEY_BOS = "tokenizer.ggml.bos_token_id"
KEY_EOS = "tokenizer.ggml.eos_token_id"
KEY_EOT = "tokenizer.ggml.eot_token_id"
KEY_EOM = "tokenizer.ggml.eom_token_id"
KEY_UNK = "tokenizer.ggml.unknown_token_id"
KEY_ADD_BOS = "tokenizer.ggml.add_bos_token"
KEY_ADD_SPACE_PREFIX = "tokenizer.ggml.add_space_prefix"

# --- token types (gguf's TokenType) -------------------------------------------
TOKEN_NORMAL = 1
TOKEN_UNKNOWN = 2
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4
TOKEN_UNUSED = 5
TOKEN_BYTE = 6

# Control tokens that end a turn in widely used chat formats. llama.cpp treats these
# as end-of-generation when the vocabulary marks them CONTROL, even where the
# metadata names only one EOS; without this a ChatML model whose `eos_token_id` is
# `<|endoftext|>` would run past `<|im_end|>`.
END_OF_TURN_TEXTS = frozenset({
    "<|im_end|>",        # ChatML
    "<|eot_id|>",        # Llama 3
    "<|eom_id|>",        # Llama 3 tool turn
    "<|end|>",           # Phi-3
    "<end_of_turn>",     # Gemma
    "<|endoftext|>",     # GPT-2 family, SmolLM, Qwen
    "<|end_of_text|>",   # Llama 3 base
    "<EOT>",
    "<|end▁of▁sentence|>",  # DeepSeek (full-width bars)
})

SPM_SPACE = "\u2581"  # "▁"

# --- pre-tokenizer regular expressions ------------------------------------------
# Each entry is a sequence of patterns applied in turn: every pattern cuts each
# piece left by the previous one into its matches and the gaps between them (both
# kept). Patterns follow the vocabularies' own tokenizer.json files and llama.cpp.

# GPT-2's word pattern: English contractions, letters, digits, other symbols, each
# optionally led by one space; whitespace runs give their last space to the next word.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"

# Llama 3 / tiktoken cl100k: case-insensitive contractions, a letter run may take one
# leading non-letter (not a newline), digits in groups of at most three, newlines
# gathered with preceding whitespace.
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen2: like Llama 3 but every digit stands alone.
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _char_class(ranges: Iterable[tuple[int, int]]) -> str:
    return "".join(chr(lo) if lo == hi else f"{chr(lo)}-{chr(hi)}" for lo, hi in ranges)


# DeepSeek LLM's "letters" class: the cased scripts (Latin, Greek, Cyrillic, Armenian,
# Georgian, Cherokee, Glagolitic, Coptic, full-width Latin, Deseret, Osage, Old
# Hungarian, Warang Citi, Adlam ...), as code-point ranges.
_DEEPSEEK_LETTER_RANGES = (
    (0x41, 0x5A), (0x61, 0x7A), (0xB5, 0xB5), (0xC0, 0xD6), (0xD8, 0xF6), (0xF8, 0x1BA),
    (0x1BC, 0x1BF), (0x1C4, 0x293), (0x295, 0x2AF), (0x370, 0x373), (0x376, 0x377),
    (0x37B, 0x37D), (0x37F, 0x37F), (0x386, 0x386), (0x388, 0x38A), (0x38C, 0x38C),
    (0x38E, 0x3A1), (0x3A3, 0x3F5), (0x3F7, 0x481), (0x48A, 0x52F), (0x531, 0x556),
    (0x10A0, 0x10C5), (0x13A0, 0x13F5), (0x13F8, 0x13FD), (0x1C90, 0x1CBA), (0x1CBD, 0x1CBF),
    (0x1D00, 0x1D2B), (0x1D6B, 0x1D77), (0x1D79, 0x1D9A), (0x1E00, 0x1F15), (0x1F18, 0x1F1D),
    (0x1F20, 0x1F45), (0x1F48, 0x1F4D), (0x1F50, 0x1F57), (0x1F59, 0x1F59), (0x1F5B, 0x1F5B),
    (0x1F5D, 0x1F5D), (0x1F5F, 0x1F7D), (0x1F80, 0x1FB4), (0x1FB6, 0x1FBC), (0x1FBE, 0x1FBE),
    (0x1FC2, 0x1FC4), (0x1FC6, 0x1FCC), (0x1FD0, 0x1FD3), (0x1FD6, 0x1FDB), (0x1FE0, 0x1FEC),
    (0x1FF2, 0x1FF4), (0x1FF6, 0x1FFC), (0x2102, 0x2102), (0x2107, 0x2107), (0x210A, 0x2113),
    (0x2115, 0x2115), (0x2119, 0x211D), (0x2124, 0x2124), (0x2126, 0x2126), (0x2128, 0x2128),
    (0x212A, 0x212D), (0x212F, 0x2134), (0x2139, 0x2139), (0x213C, 0x213F), (0x2145, 0x2149),
    (0x214E, 0x214E), (0x2183, 0x2184), (0x2C00, 0x2C7B), (0x2C7E, 0x2CE4), (0x2CEB, 0x2CEE),
    (0x2CF2, 0x2CF3), (0xA640, 0xA66D), (0xA680, 0xA69B), (0xA722, 0xA76F), (0xA771, 0xA787),
    (0xA78B, 0xA78E), (0xAB70, 0xABBF), (0xFB00, 0xFB06), (0xFB13, 0xFB17), (0xFF21, 0xFF3A),
    (0xFF41, 0xFF5A), (0x10400, 0x1044F), (0x104B0, 0x104D3), (0x104D8, 0x104FB),
    (0x10C80, 0x10CB2), (0x10CC0, 0x10CF2), (0x118A0, 0x118DF), (0x1E900, 0x1E943),
)
# CJK unified ideographs, Samaritan..CJK blocks, and Hangul syllables.
_DEEPSEEK_CJK = _char_class(((0x4E00, 0x9FA5), (0x0800, 0x4E00), (0xAC00, 0xD7FF)))

_DEEPSEEK_LLM = (
    r"[\r\n]",
    r"\s?[" + _char_class(_DEEPSEEK_LETTER_RANGES) + r"]+",
    # ASCII punctuation, full-width punctuation, curly quotes, CJK punctuation.
    r"\s?[!-/:-~" + _char_class(((0xFF01, 0xFF0F), (0xFF1A, 0xFF5E), (0x2018, 0x201F), (0x3000, 0x3002))) + r"]+",
    r"\s+$",
    "[" + _DEEPSEEK_CJK + "]+",
    r"\p{N}+",
)

# DeepSeek V3: digit groups of up to three, CJK ideographs and kana as runs, then a
# word pattern where a letter run may be led by one ASCII punctuation character.
_DEEPSEEK_V3 = (
    r"\p{N}{1,3}",
    "[" + _char_class(((0x4E00, 0x9FA5), (0x3040, 0x309F), (0x30A0, 0x30FF))) + "]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)

# StarCoder-style vocabularies (SmolLM, Refact, Command-R ...): every digit is its own
# word, then GPT-2's pattern.
_DIGITS_THEN_GPT2 = (r"\p{N}", _GPT2)

PRE_TOKENIZER_SPLITS: Mapping[str, tuple[str, ...]] = {
    # "default" is what files without a specific pre-tokenizer say; transformers
    # (the reference used to test this module) reads those as GPT-2.
    "default": (_GPT2,),
    "gpt2": (_GPT2,),
    "gpt-2": (_GPT2,),
    "mpt": (_GPT2,),
    "olmo": (_GPT2,),
    "jais": (_GPT2,),
    "smollm": _DIGITS_THEN_GPT2,
    "starcoder": _DIGITS_THEN_GPT2,
    "refact": _DIGITS_THEN_GPT2,
    "command-r": _DIGITS_THEN_GPT2,
    "codeshell": _DIGITS_THEN_GPT2,
    "exaone": _DIGITS_THEN_GPT2,
    "minerva-7b": _DIGITS_THEN_GPT2,
    "llama3": (_LLAMA3,),
    "llama-v3": (_LLAMA3,),
    "llama-bpe": (_LLAMA3,),
    "falcon3": (_LLAMA3,),
    "dbrx": (_LLAMA3,),
    "smaug-bpe": (_LLAMA3,),
    "chatglm-bpe": (_LLAMA3,),
    "qwen2": (_QWEN2,),
    "stablelm2": (_QWEN2,),
    "deepseek-r1-qwen": (_QWEN2,),
    "megrez": (_QWEN2,),
    "deepseek-llm": _DEEPSEEK_LLM,
    "deepseek-v3": _DEEPSEEK_V3,
}

# Vocabularies whose tokenizer.json sets `ignore_merges`: a word that is itself a
# token is taken whole, even where the merges would not build it.
_IGNORE_MERGES = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3"})


class TokenizerError(ValueError):
    """The metadata does not describe a tokenizer this module can build."""


# --- GPT-2 byte alphabet ---------------------------------------------------------

def _gpt2_byte_alphabet() -> dict[int, str]:
    """Byte -> the printable character that stands for it in byte-level vocabularies.

    Printable Latin-1 bytes stand for themselves; the other 68 (controls, space,
    DEL, NBSP, soft hyphen) are moved to U+0100 upwards in byte order.
    """
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(0x100 + shifted)
            shifted += 1
    return table


BYTE_TO_CHAR: Mapping[int, str] = _gpt2_byte_alphabet()
CHAR_TO_BYTE: Mapping[str, int] = {c: b for b, c in BYTE_TO_CHAR.items()}

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")

# Token types whose text is their UTF-8 spelling in either vocabulary kind.
_LITERAL_KINDS = frozenset({TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNKNOWN})


def _byte_of_code() -> np.ndarray:
    """Code point -> the one byte it stands for in a byte-level token, -1 where that is not
    one byte (the last entry stands for every code point beyond the table)."""
    table = np.full(max(map(ord, BYTE_TO_CHAR.values())) + 2, -1, dtype=np.int16)
    for b, c in BYTE_TO_CHAR.items():
        table[ord(c)] = b
    for c in range(0x80):  # outside the alphabet, ASCII is still its own UTF-8 byte
        if table[c] < 0:
            table[c] = c
    return table


_BYTE_OF_CODE = _byte_of_code()


def _token_bytes(text: str, kind: int, spm: bool) -> bytes:
    if kind in _LITERAL_KINDS:
        return text.encode("utf-8")
    if spm:
        if kind == TOKEN_BYTE:
            m = _BYTE_TOKEN.fullmatch(text)
            if m:
                return bytes([int(m.group(1), 16)])
        return text.replace(SPM_SPACE, " ").encode("utf-8")
    # Byte-level: each character stands for one byte; anything outside the
    # alphabet (not expected in a well-formed vocabulary) is kept as UTF-8.
    out = bytearray()
    for ch in text:
        b = CHAR_TO_BYTE.get(ch)
        if b is None:
            out += ch.encode("utf-8")
        else:
            out.append(b)
    return bytes(out)


def vocabulary_bytes(tokens: Sequence[str], token_types: Sequence[int], spm: bool) -> list[bytes]:
    """The bytes each token contributes to decoded text (SentencePiece when `spm`, else
    byte-level): control, user-defined and unknown tokens as their UTF-8 text; SentencePiece
    tokens with "▁" as a space and `<0xNN>` byte tokens as that byte; byte-level tokens
    through the byte alphabet, a character outside it as its UTF-8.

    A byte-level vocabulary is mapped all at once (its characters through a code point ->
    byte table, then cut at the tokens' lengths) rather than character by character;
    the few tokens with a character outside the alphabet take the per-character way.
    """
    n = len(tokens)
    if spm:
        out = [t.replace(SPM_SPACE, " ").encode("utf-8") for t in tokens]
        for i in itertools.compress(range(n), map(TOKEN_BYTE.__eq__, token_types)):
            out[i] = _token_bytes(tokens[i], TOKEN_BYTE, True)
    else:
        codes = np.frombuffer("".join(tokens).encode("utf-32-le", "surrogatepass"), dtype="<u4")
        byte_of = _BYTE_OF_CODE[np.minimum(codes, len(_BYTE_OF_CODE) - 1)]
        raw = byte_of.astype(np.uint8).tobytes()
        ends = list(itertools.accumulate(map(len, tokens)))
        out = [raw[a:b] for a, b in zip([0, *ends], ends)]
        for i in {bisect.bisect_right(ends, at) for at in np.flatnonzero(byte_of < 0).tolist()}:
            out[i] = _token_bytes(tokens[i], token_types[i], False)
    for i in itertools.compress(range(n), map(_LITERAL_KINDS.__contains__, token_types)):
        out[i] = tokens[i].encode("utf-8")
    return out


# --- parsed metadata ---------------------------------------------------------------

def _tuple_of(kind: type, values: Iterable[Any]) -> tuple[Any, ...]:
    # Metadata arrays are nearly always of the right type already: checking the types is
    # about twice as fast as converting every element of a 50K-entry array.
    values = tuple(values)
    return values if set(map(type, values)) <= {kind} else tuple(map(kind, values))


@dataclass(frozen=True)
class VocabSpec:
    """The tokenizer part of a GGUF file's metadata, validated."""

    model: str                       # "gpt2" (byte-level BPE) or "llama" (SentencePiece BPE)
    pre: str | None                  # pre-tokenizer name, byte-level only
    tokens: tuple[str, ...]
    token_types: tuple[int, ...]
    scores: tuple[float, ...] | None
    merges: tuple[str, ...] | None
    bos_id: int | None
    eos_id: int | None
    eot_id: int | None
    eom_id: int | None
    unk_id: int | None
    add_bos: bool
    add_space_prefix: bool

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any]) -> "VocabSpec":
        model = meta.get(KEY_MODEL)
        if model is None:
            raise TokenizerError(f"GGUF metadata has no {KEY_MODEL!r}: no tokenizer in this file")
        model = str(model)
        if model not in ("gpt2", "llama"):
            raise TokenizerError(
                f"unsupported tokenizer model {model!r} ({KEY_MODEL}); supported: 'gpt2' (byte-level BPE), "
                "'llama' (SentencePiece BPE)"
            )
        tokens = meta.get(KEY_TOKENS)
        if not tokens:
            raise TokenizerError(f"GGUF metadata has no {KEY_TOKENS!r}")
        tokens = _tuple_of(str, tokens)
        n = len(tokens)
        types = meta.get(KEY_TOKEN_TYPE)
        types = _tuple_of(int, types) if types is not None else (TOKEN_NORMAL,) * n
        if len(types) != n:
            raise TokenizerError(f"{KEY_TOKEN_TYPE} has {len(types)} entries for {n} tokens")
        scores = meta.get(KEY_SCORES)
        scores = _tuple_of(float, scores) if scores is not None else None
        if scores is not None and len(scores) != n:
            raise TokenizerError(f"{KEY_SCORES} has {len(scores)} entries for {n} tokens")
        merges = meta.get(KEY_MERGES)
        merges = _tuple_of(str, merges) if merges is not None else None

        pre = meta.get(KEY_PRE)
        pre = str(pre) if pre is not None else None
        if model == "gpt2":
            if merges is None:
                raise TokenizerError(f"byte-level BPE vocabulary without {KEY_MERGES!r}")
            name = pre if pre is not None else "default"
            if name not in PRE_TOKENIZER_SPLITS:
                raise TokenizerError(
                    f"unknown pre-tokenizer {name!r} ({KEY_PRE}); known: {', '.join(sorted(PRE_TOKENIZER_SPLITS))}"
                )
        elif scores is None and merges is None:
            raise TokenizerError(f"SentencePiece vocabulary without {KEY_SCORES!r} (and no merges)")

        def token_id(key: str) -> int | None:
            value = meta.get(key)
            if value is None:
                return None
            value = int(value)
            if not 0 <= value < n:
                raise TokenizerError(f"{key} = {value} is outside the vocabulary (0..{n - 1})")
            return value

        add_bos = meta.get(KEY_ADD_BOS)
        add_space = meta.get(KEY_ADD_SPACE_PREFIX)
        return cls(
            model=model,
            pre=pre,
            tokens=tokens,
            token_types=types,
            scores=scores,
            merges=merges,
            bos_id=token_id(KEY_BOS),
            eos_id=token_id(KEY_EOS),
            eot_id=token_id(KEY_EOT),
            eom_id=token_id(KEY_EOM),
            unk_id=token_id(KEY_UNK),
            # SentencePiece models want BOS unless told otherwise (llama.cpp and
            # transformers agree); byte-level ones say so explicitly when they do.
            add_bos=bool(add_bos) if add_bos is not None else model == "llama",
            add_space_prefix=bool(add_space) if add_space is not None else model == "llama",
        )


# --- building the BPE backends ------------------------------------------------------

def _split_merge(merge: str) -> tuple[str, str]:
    # A merge is "left right"; search from index 1 so a left part that is itself a
    # space (possible in SentencePiece vocabularies) survives.
    cut = merge.find(" ", 1)
    if cut < 0:
        raise TokenizerError(f"malformed merge {merge!r} in {KEY_MERGES}")
    return merge[:cut], merge[cut + 1:]


# One merge per line: the first character, then up to the first space, then the rest.
_MERGE_LINE = re.compile(r"^(.[^ \n]*) (.*)$", re.MULTILINE)


def split_merges(merges: Sequence[str]) -> list[tuple[str, str]]:
    """Each "left right" merge as (left, right), cut at the first space after the first
    character; `TokenizerError` names a merge that has no such space.

    A vocabulary has ~50K merges: one regular-expression pass over them all, joined by
    newlines, does the cutting without a Python call per merge.  It stands only when no
    merge holds a newline and every merge matched; otherwise each merge is cut on its own,
    which also finds the malformed one.
    """
    joined = "\n".join(merges)
    if joined.count("\n") == len(merges) - 1:
        pairs = _MERGE_LINE.findall(joined)
        if len(pairs) == len(merges):
            return pairs
    return [_split_merge(m) for m in merges]


def _vocab_dict(tokens: Sequence[str]) -> dict[str, int]:
    # Later duplicates win, matching llama.cpp's text -> id table.
    return dict(zip(tokens, range(len(tokens))))


def spm_merges_from_scores(
    tokens: Sequence[str], scores: Sequence[float], mergeable: Sequence[bool]
) -> list[tuple[str, str]]:
    """Merges equivalent to SentencePiece BPE: merge the pair whose joined token scores highest.

    Every split of a mergeable token into two vocabulary tokens is a merge; merges
    are ranked by the joined token's score (best first), ties by token id. BPE with
    these ranks picks, at each step, the adjacent pair whose concatenation is the
    best-scoring token, leftmost first, which is SentencePiece's rule.
    """
    # A text's id is its last occurrence's (_vocab_dict); it joins merges where that id may.
    joinable = {text for text, tid in _vocab_dict(tokens).items() if mergeable[tid]}
    # One token's merges rank by their left part, which for cuts of one text is the cut's
    # length: so sorting the tokens and cutting each from the left gives the ranked list.
    order = sorted((tid for tid, text in enumerate(tokens) if mergeable[tid] and len(text) >= 2),
                   key=lambda tid: (-scores[tid], tid))
    merges: list[tuple[str, str]] = []
    for tid in order:
        text = tokens[tid]
        for cut in range(1, len(text)):
            left, right = text[:cut], text[cut:]
            if left in joinable and right in joinable:
                merges.append((left, right))
    return merges


def _word_splitter(pre: str) -> _pre.PreTokenizer:
    if pre not in PRE_TOKENIZER_SPLITS:
        raise TokenizerError(f"unknown pre-tokenizer {pre!r}; known: {', '.join(sorted(PRE_TOKENIZER_SPLITS))}")
    return _pre.Sequence([_pre.Split(Regex(p), behavior="isolated") for p in PRE_TOKENIZER_SPLITS[pre]])


def pre_tokenize(pre: str, text: str) -> list[str]:
    """The words that pre-tokenizer `pre` cuts `text` into (before byte-level spelling)."""
    return [word for word, _ in _word_splitter(pre).pre_tokenize_str(text)]


def _byte_level_backend(spec: VocabSpec) -> _Backend:
    merges = split_merges(spec.merges or ())
    name = spec.pre if spec.pre is not None else "default"
    bpe = _models.BPE(
        vocab=_vocab_dict(spec.tokens),
        merges=merges,
        ignore_merges=name in _IGNORE_MERGES,
    )
    backend = _Backend(bpe)
    backend.pre_tokenizer = _pre.Sequence(
        [_word_splitter(name), _pre.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    return backend


def _spm_backend(spec: VocabSpec) -> _Backend:
    if spec.merges is not None:
        merges = split_merges(spec.merges)
        vocab = _vocab_dict(spec.tokens)
    else:
        mergeable = [t == TOKEN_NORMAL for t in spec.token_types]
        merges = spm_merges_from_scores(spec.tokens, spec.scores or (), mergeable)
        # Only normal tokens may come out of the BPE: control and byte tokens are
        # reached through special-token splitting and byte fallback, never by merging.
        vocab = {t: i for i, t in enumerate(spec.tokens) if spec.token_types[i] in (TOKEN_NORMAL, TOKEN_BYTE)}
    unk = spec.tokens[spec.unk_id] if spec.unk_id is not None else None
    if unk is not None:
        vocab.setdefault(unk, spec.unk_id)
    bpe = _models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    # No normalizer or pre-tokenizer: spaces are mapped to "▁" before encoding, and
    # SentencePiece does not cut text into words.
    return _Backend(bpe)


# --- the tokenizer ------------------------------------------------------------------

class Tokenizer:
    """Encode and decode text for one GGUF vocabulary (see the module docstring)."""

    def __init__(self, spec: VocabSpec):
        self.spec = spec
        self.n_vocab = len(spec.tokens)
        self.bos_id = spec.bos_id
        self.eos_id = spec.eos_id
        self.add_bos = spec.add_bos
        self._spm = spec.model == "llama"
        self._backend = _spm_backend(spec) if self._spm else _byte_level_backend(spec)

        types, ids = spec.token_types, range(self.n_vocab)
        self._control = frozenset(itertools.compress(ids, map(TOKEN_CONTROL.__eq__, types)))
        self._special = frozenset(itertools.compress(ids, map({TOKEN_CONTROL, TOKEN_USER_DEFINED}.__contains__, types)))
        eos = {i for i in (spec.eos_id, spec.eot_id, spec.eom_id) if i is not None}
        eos |= {i for i in self._control if spec.tokens[i] in END_OF_TURN_TEXTS}
        self.eos_ids: frozenset[int] = frozenset(eos)

        # Of two special tokens starting at the same place ("<|im_start|>" vs a hypothetical
        # "<|im") the longer one wins.
        def alternation(ids: Iterable[int]) -> re.Pattern[str] | None:
            pattern = spellings_pattern(spec.tokens[i] for i in ids)
            return re.compile(pattern) if pattern else None

        self._special_re = alternation(self._special)
        self._user_re = alternation(i for i in self._special if i not in self._control)
        self._special_id = {spec.tokens[i]: i for i in sorted(self._special)}
        self.prompt_text = PromptText(spec.tokens[i] for i in self._control)
        self._bytes = vocabulary_bytes(spec.tokens, types, self._spm)
        # No token spells more bytes than this, so a text of n bytes has at least
        # ceil(n / max_token_bytes) tokens: a size check that needs no tokenizing. SentencePiece's
        # space prefix only adds bytes; at least 1 keeps the bound defined for odd vocabularies.
        self.max_token_bytes: int = max(1, max(map(len, self._bytes), default=1))

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> "Tokenizer":
        return cls(VocabSpec.from_metadata(meta))

    # -- encoding --

    def encode(self, text: str, special: bool = False) -> list[int]:
        """Token ids for `text`; `special=True` turns control-token text into its id."""
        return self._encode_pieces(self._split_special(text, special))

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids for prompt text: unescaped control spellings become control tokens,
        everything else (escaped spellings included) is text. Equal to `encode(text,
        special=True)` for text without the escape character."""
        def pieces() -> Iterable[tuple[str, int | None]]:
            for piece, is_control in self.prompt_text.split(text):
                if is_control:
                    yield piece, self._special_id[piece]
                else:
                    yield from self._split_special(piece, False)
        return self._encode_pieces(pieces())

    def escape(self, text: str) -> str:
        """Prompt text that tokenizes as `text` itself, control spellings included."""
        return self.prompt_text.escape(text)

    def decode_prompt(self, ids: Iterable[int]) -> str:
        """The prompt text of `ids`: control tokens as themselves, the rest escaped, so that
        `encode_prompt(decode_prompt(ids))` gives the ids back wherever `encode` would."""
        def pieces() -> Iterable[tuple[str, bool]]:
            run: list[int] = []
            at_start = True  # `decode` drops the space prefix of the very first token only
            for i in ids:
                i = int(i)
                if i in self._control:
                    if run:
                        yield self.decode(run) if at_start else self._decode_bytes(run), False
                        run = []
                    yield self.spec.tokens[i], True
                    at_start = False
                else:
                    run.append(i)
            if run:
                yield self.decode(run) if at_start else self._decode_bytes(run), False
        return self.prompt_text.escape_tokens(pieces())

    def _decode_bytes(self, ids: list[int]) -> str:
        out = bytearray()
        for i in ids:
            self._check_id(i)
            out += self._bytes[i]
        return out.decode("utf-8", errors="replace")

    def _encode_pieces(self, pieces: Iterable[tuple[str, int | None]]) -> list[int]:
        ids: list[int] = []
        after_special = True  # the start of the text counts as "after a special token"
        for piece, token_id in pieces:
            if token_id is not None:
                ids.append(token_id)
                after_special = True
                continue
            ids.extend(self._encode_plain(piece, prefix=after_special))
            after_special = False
        return ids

    def _split_special(self, text: str, special: bool) -> Iterable[tuple[str, int | None]]:
        pattern = self._special_re if special else self._user_re
        if pattern is None:
            if text:
                yield text, None
            return
        pos = 0
        for m in pattern.finditer(text):
            if m.start() > pos:
                yield text[pos:m.start()], None
            yield m.group(), self._special_id[m.group()]
            pos = m.end()
        if pos < len(text):
            yield text[pos:], None

    def _encode_plain(self, text: str, prefix: bool) -> list[int]:
        if self._spm:
            if prefix and self.spec.add_space_prefix:
                text = " " + text
            text = text.replace(" ", SPM_SPACE)
        return self._backend.encode(text, add_special_tokens=False).ids

    # -- decoding --

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes this token contributes to decoded text."""
        return self._bytes[token_id]

    def is_control(self, token_id: int) -> bool:
        return token_id in self._control

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text for `ids`. Invalid UTF-8 (a cut multi-byte character) becomes U+FFFD.

        `skip_special` drops control tokens. For SentencePiece vocabularies with a
        space prefix, the one space that `encode` put in front of the text is removed
        again, so `decode(encode(text)) == text`.
        """
        out = bytearray()
        first = True
        for i in ids:
            i = int(i)
            self._check_id(i)
            if skip_special and i in self._control:
                continue
            b = self._bytes[i]
            if first and self._spm and self.spec.add_space_prefix and i not in self._special and b.startswith(b" "):
                b = b[1:]
            first = False
            out += b
        return out.decode("utf-8", errors="replace")

    def piece(self, token_id: int) -> str:
        """The token's text as stored in the vocabulary (byte-level spelling included)."""
        self._check_id(token_id)
        return self.spec.tokens[token_id]

    def _check_id(self, token_id: int) -> None:
        if not 0 <= token_id < self.n_vocab:
            raise IndexError(f"token id {token_id} outside the vocabulary (0..{self.n_vocab - 1})")


class TextStream:
    """Turns generated token ids into text as it becomes complete.

    `push(id)` returns only whole characters: the bytes of a character split across
    tokens (byte-fallback tokens, emoji spelled as several byte-level tokens) are
    held back until the character is complete. Bytes that can never form valid
    UTF-8 come out as U+FFFD. `flush()` returns what is left (an unfinished
    character as U+FFFD) and resets the stream.

    Unlike `Tokenizer.decode`, no leading space is removed: a stream carries a
    continuation, where a token's leading "▁" is a real space.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = False):
        self._tok = tokenizer
        self._skip_special = skip_special
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        token_id = int(token_id)
        self._tok._check_id(token_id)
        if self._skip_special and self._tok.is_control(token_id):
            return ""
        return self._decoder.decode(self._tok.token_bytes(token_id))

    def flush(self) -> str:
        text = self._decoder.decode(b"", final=True)
        self._decoder.reset()
        return text
