"""Tests for engine.tokenizer.

Unmarked tests build tiny GGUF-like metadata by hand (a byte-level BPE vocabulary and a
SentencePiece vocabulary) and need no weights. `reference` tests compare against
transformers: on synthetic GGUF files written to a temporary directory, and (with
`model`) on the embedded SmolLM2 GGUF.
"""

from __future__ import annotations

import copy
import random
import re

import pytest

from engine.tokenizer import (
    BYTE_TO_CHAR,
    PRE_TOKENIZER_SPLITS,
    TOKEN_BYTE,
    TOKEN_CONTROL,
    TOKEN_NORMAL,
    TOKEN_UNKNOWN,
    TOKEN_USER_DEFINED,
    TextStream,
    Tokenizer,
    TokenizerError,
    pre_tokenize,
    split_merges,
    spm_merges_from_scores,
    vocabulary_bytes,
)

# --- synthetic byte-level vocabulary ------------------------------------------------

BL_SPECIALS = [("<|endoftext|>", TOKEN_CONTROL), ("<|im_start|>", TOKEN_CONTROL), ("<|im_end|>", TOKEN_CONTROL),
               ("<|eot|>", TOKEN_CONTROL), ("<think>", TOKEN_USER_DEFINED)]
# Merges over the byte alphabet ("Ġ" is a space). "😀" is F0 9F 98 80: only its first two
# bytes merge, so the emoji takes three tokens and a stream must hold bytes back.
_EMOJI = "".join(BYTE_TO_CHAR[b] for b in "😀".encode())
BL_MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld", "1 2", "12 3",
             f"{_EMOJI[0]} {_EMOJI[1]}", "Ã ©"]


def byte_level_meta(pre: str | None = "gpt2", **overrides):
    tokens = [t for t, _ in BL_SPECIALS] + [BYTE_TO_CHAR[b] for b in range(256)]
    types = [k for _, k in BL_SPECIALS] + [TOKEN_NORMAL] * 256
    for m in BL_MERGES:
        tokens.append(m.replace(" ", ""))
        types.append(TOKEN_NORMAL)
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": list(BL_MERGES),
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 0,
        "tokenizer.ggml.eot_token_id": 3,
        "tokenizer.ggml.add_bos_token": False,
    }
    if pre is not None:
        meta["tokenizer.ggml.pre"] = pre
    meta.update(overrides)
    return meta


@pytest.fixture(scope="module")
def bl():
    return Tokenizer.from_gguf_metadata(byte_level_meta())


def tid(tok: Tokenizer, text: str) -> int:
    return tok.spec.tokens.index(text)


def test_byte_level_merges(bl):
    assert bl.encode("hello world") == [tid(bl, "hello"), tid(bl, "Ġworld")]
    assert [bl.piece(i) for i in bl.encode("hello world")] == ["hello", "Ġworld"]
    assert bl.encode("") == []


def test_byte_level_roundtrip_any_text(bl):
    rng = random.Random(1)
    alphabet = "ab hello\t\n\r\u00a0é日😀'!?<>|_" + "".join(chr(c) for c in (0x0, 0x7F, 0x2028, 0xFEFF))
    for _ in range(300):
        s = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        assert bl.decode(bl.encode(s)) == s


def test_special_tokens_only_with_special(bl):
    text = "<|im_start|>hello<|im_end|>"
    assert bl.encode(text, special=True) == [1, tid(bl, "hello"), 2]
    plain = bl.encode(text)
    assert 1 not in plain and 2 not in plain
    assert bl.decode(plain) == text
    assert bl.decode(bl.encode(text, special=True)) == text


def test_user_defined_tokens_always_whole(bl):
    think = tid(bl, "<think>")
    assert bl.encode("<think>hello", special=False) == [think, tid(bl, "hello")]
    assert bl.encode("<think>hello", special=True) == [think, tid(bl, "hello")]


def test_decode_skip_special(bl):
    ids = bl.encode("<|im_start|>hello<|im_end|><think>", special=True)
    assert bl.decode(ids, skip_special=True) == "hello<think>"  # user-defined text is content


def test_eos_ids_and_flags(bl):
    # eos (0), eot from metadata (3), and "<|im_end|>" as a ChatML end of turn (2).
    assert bl.eos_ids == frozenset({0, 2, 3})
    assert (bl.bos_id, bl.eos_id, bl.add_bos) == (1, 0, False)
    assert bl.n_vocab == len(BL_SPECIALS) + 256 + len(BL_MERGES)


def test_pretokenizer_decides_digit_merges():
    gpt2 = Tokenizer.from_gguf_metadata(byte_level_meta("gpt2"))
    smollm = Tokenizer.from_gguf_metadata(byte_level_meta("smollm"))
    assert [gpt2.piece(i) for i in gpt2.encode("123")] == ["123"]
    assert [smollm.piece(i) for i in smollm.encode("123")] == ["1", "2", "3"]


@pytest.mark.parametrize(("pre", "text", "words"), [
    ("gpt2", "I'm  ok 123\n", ["I", "'m", " ", " ok", " 123", "\n"]),
    ("smollm", "a  12", ["a", "  ", "1", "2"]),
    ("starcoder", "x1", ["x", "1"]),
    ("llama-bpe", "DON'T 12345\n\n  x", ["DON", "'T", " ", "123", "45", "\n\n", " ", " x"]),
    ("llama3", "\tword", ["\tword"]),
    ("qwen2", "ab 123", ["ab", " ", "1", "2", "3"]),
    ("deepseek-v3", "日本 1234!abc", ["日本", " ", "123", "4", "!abc"]),
    ("deepseek-llm", "Hi, 日本\n42", ["Hi", ",", " ", "日本", "\n", "42"]),
])
def test_pre_tokenizer_words(pre, text, words):
    assert pre_tokenize(pre, text) == words


def test_every_pre_tokenizer_builds_and_roundtrips():
    text = "Hello, World! I'm 2024: 日本語 😀\t\r\n  x_y=1.5e-3 ÀÉ Ωmega"
    for pre in PRE_TOKENIZER_SPLITS:
        tok = Tokenizer.from_gguf_metadata(byte_level_meta(pre))
        assert tok.decode(tok.encode(text)) == text, pre
        assert "".join(pre_tokenize(pre, text)) == text, pre


def test_text_stream_holds_partial_characters(bl):
    ids = bl.encode("hello😀é")
    assert len(ids) == 1 + 3 + 1  # emoji in three tokens, é merged into one
    stream = TextStream(bl)
    outputs = [stream.push(i) for i in ids]
    assert outputs == ["hello", "", "", "😀", "é"]
    assert stream.flush() == ""


def test_text_stream_flush_and_invalid_bytes(bl):
    stream = TextStream(bl)
    first_two = bl.encode("😀")[:1]
    assert stream.push(first_two[0]) == ""
    assert stream.flush() == "\ufffd"
    # After a flush the stream starts clean.
    assert stream.push(tid(bl, "hello")) == "hello"
    lone_continuation = tid(bl, BYTE_TO_CHAR[0x80])
    assert stream.push(lone_continuation) == "\ufffd"


def test_text_stream_special_tokens(bl):
    stream = TextStream(bl, skip_special=True)
    assert stream.push(2) == ""
    assert TextStream(bl).push(2) == "<|im_end|>"


def test_bad_ids(bl):
    with pytest.raises(IndexError, match="outside the vocabulary"):
        bl.decode([bl.n_vocab])
    with pytest.raises(IndexError):
        bl.piece(-1)
    with pytest.raises(IndexError):
        TextStream(bl).push(10**6)


@pytest.mark.parametrize(("overrides", "message"), [
    ({"tokenizer.ggml.pre": "made-up-pre"}, r"unknown pre-tokenizer 'made-up-pre'"),
    ({"tokenizer.ggml.model": "bert"}, r"unsupported tokenizer model 'bert'"),
    ({"tokenizer.ggml.merges": None}, r"without 'tokenizer.ggml.merges'"),
    ({"tokenizer.ggml.tokens": []}, r"no 'tokenizer.ggml.tokens'"),
    ({"tokenizer.ggml.token_type": [1, 1]}, r"token_type has 2 entries"),
    ({"tokenizer.ggml.eos_token_id": 10**6}, r"eos_token_id = 1000000 is outside"),
])
def test_metadata_errors(overrides, message):
    meta = byte_level_meta()
    for key, value in overrides.items():
        if value is None:
            meta.pop(key)
        else:
            meta[key] = value
    with pytest.raises(TokenizerError, match=message):
        Tokenizer.from_gguf_metadata(meta)


def test_missing_tokenizer_model():
    with pytest.raises(TokenizerError, match="no 'tokenizer.ggml.model'"):
        Tokenizer.from_gguf_metadata({})


def test_split_merges_cuts_at_the_first_space_after_the_first_character():
    merges = ["h e", "  x", "▁ ▁▁", "a b c", "Ġ Ġ", "x ", "é 日😀"]
    assert split_merges(merges) == [("h", "e"), (" ", "x"), ("▁", "▁▁"), ("a", "b c"), ("Ġ", "Ġ"), ("x", ""),
                                    ("é", "日😀")]
    # A newline inside a merge is kept as part of it, like any other character.
    assert split_merges(["a\nb c", "d e\n"]) == [("a\nb", "c"), ("d", "e\n")]
    assert split_merges([]) == []
    for bad in (["ab"], ["a b", " "], ["a b", ""], ["a b", "c\nd"]):
        with pytest.raises(TokenizerError, match="malformed merge"):
            split_merges(bad)


def test_vocabulary_bytes():
    alphabet = "".join(BYTE_TO_CHAR[b] for b in range(256))
    tokens = ["", alphabet, "Ġhello", "<|im_end|>", "Ġ日", " \x85\xad", "é", "<unk>", "\u0143"]
    types = [TOKEN_NORMAL, TOKEN_NORMAL, TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_NORMAL, TOKEN_NORMAL,
             TOKEN_USER_DEFINED, TOKEN_UNKNOWN, TOKEN_NORMAL]
    assert vocabulary_bytes(tokens, types, spm=False) == [
        b"", bytes(range(256)), b" hello", b"<|im_end|>",
        b" " + "日".encode(),  # characters outside the byte alphabet are kept as UTF-8
        b" \xc2\x85\xc2\xad", "é".encode(), b"<unk>", b"\xad"]
    tokens = ["▁hello", "<0x41>", "<0xZZ>", "<s>", "<0x0A>", "a▁▁b", ""]
    types = [TOKEN_NORMAL, TOKEN_BYTE, TOKEN_BYTE, TOKEN_CONTROL, TOKEN_NORMAL, TOKEN_NORMAL, TOKEN_NORMAL]
    assert vocabulary_bytes(tokens, types, spm=True) == [b" hello", b"A", b"<0xZZ>", b"<s>", b"<0x0A>", b"a  b", b""]


# --- synthetic SentencePiece vocabulary ------------------------------------------------

SPM_WORDS = ["▁", "h", "e", "l", "o", "w", "r", "d", "a", "b",  # single characters
             "he", "ll", "▁h", "▁w", "or", "ld", "hell", "▁hell", "▁hello", "▁wor", "▁world", "ab", "▁ab"]


def spm_meta(**overrides):
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + SPM_WORDS
    types = [TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_CONTROL] + [TOKEN_BYTE] * 256 + [TOKEN_NORMAL] * len(SPM_WORDS)
    # Longer pieces score higher, as in trained vocabularies; scores are distinct.
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [len(w) * 10.0 - i * 0.01 for i, w in enumerate(SPM_WORDS)]
    meta = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }
    meta.update(overrides)
    return meta


@pytest.fixture(scope="module")
def spm():
    return Tokenizer.from_gguf_metadata(spm_meta())


def pieces(tok, ids):
    return [tok.piece(i) for i in ids]


def test_spm_encode_with_space_prefix(spm):
    assert pieces(spm, spm.encode("hello world")) == ["▁hello", "▁world"]
    assert pieces(spm, spm.encode(" hello")) == ["▁", "▁hello"]  # the user's space is kept
    assert spm.add_bos and spm.spec.add_space_prefix  # SentencePiece defaults


def test_spm_byte_fallback_and_decode(spm):
    ids = spm.encode("hé")
    assert pieces(spm, ids) == ["▁h", "<0xC3>", "<0xA9>"]
    assert spm.decode(ids) == "hé"
    for s in ["hello world", " lead", "trail ", "a  b", "日本 😀", "", "ab\nab"]:
        assert spm.decode(spm.encode(s)) == s


def test_spm_special_tokens_and_prefix_after_them(spm):
    ids = spm.encode("<s>hello</s>", special=True)
    assert pieces(spm, ids) == ["<s>", "▁hello", "</s>"]
    assert 1 not in spm.encode("<s>hello")
    assert spm.decode(ids) == "<s> hello</s>"
    assert spm.decode(ids, skip_special=True) == "hello"
    assert spm.eos_ids == frozenset({2})


def test_spm_without_space_prefix():
    tok = Tokenizer.from_gguf_metadata(spm_meta(**{"tokenizer.ggml.add_space_prefix": False}))
    assert pieces(tok, tok.encode("hello world")) == ["hell", "o", "▁world"]
    assert tok.decode(tok.encode("hello world")) == "hello world"


def test_spm_text_stream_byte_fallback(spm):
    stream = TextStream(spm)
    out = [stream.push(i) for i in spm.encode("hé😀")]
    assert out == [" h", "", "é", "", "", "", "😀"]  # a stream keeps the leading space


def test_spm_merges_follow_scores():
    tokens = ["a", "b", "c", "ab", "bc", "abc"]
    scores = [0, 0, 0, 1.0, 2.0, 3.0]
    merges = spm_merges_from_scores(tokens, scores, [True] * 6)
    assert merges == [("a", "bc"), ("ab", "c"), ("b", "c"), ("a", "b")]


def test_spm_merges_equal_the_ranking_of_every_split_by_score():
    """Against the rule written out (every split of a mergeable token into two mergeable ones,
    ranked by the joined token's score, then its id, then the left part) on a random vocabulary
    with duplicate spellings, ties and tokens that may not merge."""
    rng = random.Random(3)
    tokens = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 5))) for _ in range(300)]
    scores = [float(rng.randint(-5, 5)) for _ in tokens]
    mergeable = [rng.random() < 0.85 for _ in tokens]
    index = {t: i for i, t in enumerate(tokens)}
    ranked = sorted((-scores[tid], tid, text[:cut], text[cut:])
                    for tid, text in enumerate(tokens) if mergeable[tid]
                    for cut in range(1, len(text))
                    if text[:cut] in index and text[cut:] in index
                    and mergeable[index[text[:cut]]] and mergeable[index[text[cut:]]])
    assert spm_merges_from_scores(tokens, scores, mergeable) == [(a, b) for _, _, a, b in ranked]


def test_spm_requires_scores():
    meta = spm_meta()
    del meta["tokenizer.ggml.scores"]
    with pytest.raises(TokenizerError, match="without 'tokenizer.ggml.scores'"):
        Tokenizer.from_gguf_metadata(meta)


# --- reference: transformers on synthetic GGUF files -------------------------------------

def _write_gguf(path, meta: dict) -> None:
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("llama.context_length", 64)
    w.add_uint32("llama.embedding_length", 8)
    w.add_uint32("llama.block_count", 1)
    w.add_uint32("llama.feed_forward_length", 16)
    w.add_uint32("llama.attention.head_count", 1)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_tokenizer_model(meta["tokenizer.ggml.model"])
    if "tokenizer.ggml.pre" in meta:
        w.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_types(meta["tokenizer.ggml.token_type"])
    if "tokenizer.ggml.scores" in meta:
        w.add_token_scores(meta["tokenizer.ggml.scores"])
    if "tokenizer.ggml.merges" in meta:
        w.add_token_merges(meta["tokenizer.ggml.merges"])
    w.add_bos_token_id(meta["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
    if "tokenizer.ggml.add_space_prefix" in meta:
        w.add_add_space_prefix(meta["tokenizer.ggml.add_space_prefix"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _hf_from_meta(tmp_path, meta):
    from transformers import AutoTokenizer

    path = tmp_path / "vocab.gguf"
    _write_gguf(path, meta)
    return AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)


def _random_texts(rng: random.Random, alphabet: list[str], count: int, max_len: int = 40) -> list[str]:
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, max_len))) for _ in range(count)]


@pytest.mark.reference
@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "gpt2"])
def test_byte_level_matches_transformers(tmp_path, pre):
    meta = byte_level_meta(pre)
    ours = Tokenizer.from_gguf_metadata(meta)
    ref = _hf_from_meta(tmp_path, meta)
    alphabet = list("hello wrd123\t\n\r'sSTmM.,!?") + ["é", "日", "😀", "\u00a0", "<|im_end|>", "<think>", "  ", "'ll"]
    for s in _random_texts(random.Random(7), alphabet, 300):
        assert ours.encode(s, special=True) == ref.encode(s, add_special_tokens=False), repr(s)
        assert ours.encode(s) == ref.encode(s, add_special_tokens=False, split_special_tokens=True), repr(s)


@pytest.mark.reference
def test_spm_matches_transformers(tmp_path):
    meta = spm_meta()
    ours = Tokenizer.from_gguf_metadata(meta)
    ref = _hf_from_meta(tmp_path, meta)
    alphabet = list("helowrdab \n") + ["é", "日", "😀", "hello", " world", "ab"]
    compared = 0
    for s in _random_texts(random.Random(3), alphabet, 300):
        # transformers adds no prefix to text that already starts with a space, unlike
        # SentencePiece (see engine.tokenizer's docstring): compare only where both agree.
        if s.startswith(" "):
            continue
        assert ours.encode(s) == ref.encode(s, add_special_tokens=False), repr(s)
        compared += 1
    assert compared > 200


# --- reference: the embedded model ---------------------------------------------------------

@pytest.fixture(scope="module")
def smol(smollm2_metadata):
    return Tokenizer.from_gguf_metadata(smollm2_metadata)


@pytest.fixture(scope="module")
def smol_refs(smollm2_hf_tokenizer):
    """(transformers as it loads the GGUF, the same with SmolLM2's own pre-tokenizer).

    SmolLM2's tokenizer.json splits every digit off before the GPT-2 byte-level split
    (`Digits(individual_digits=True)`, then `ByteLevel(use_regex=True)`), which is what
    the GGUF's `pre = "smollm"` names. transformers' GGUF loader does not know "smollm"
    and uses the plain GPT-2 split, which differs only where a run of two or more
    whitespace characters precedes a digit. The second tokenizer restores the model's
    own pre-tokenizer and is the exact reference.
    """
    from tokenizers import pre_tokenizers

    raw = smollm2_hf_tokenizer
    hub = copy.deepcopy(raw)  # the session's tokenizer is shared: change a copy
    hub.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    # The change stayed on the copy: the shared tokenizer still splits spaces before a digit its own way.
    assert raw.encode("a  12", add_special_tokens=False) != hub.encode("a  12", add_special_tokens=False)
    return raw, hub


CURATED = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "I'm sure they'll say it's fine, don't you think? We've seen it. I'd CAN'T",
    "  leading and trailing spaces  ",
    "tabs\tand\t\ttabs, newlines\n\n\nand CRLF\r\nlines\r\n",
    "multiple     internal      spaces",
    "digits 0 12 345 6789 3.14159 1,000,000 2024-11-30 v1.2.3 0x1F",
    "runs  1\n 2\t 3   4",
    "日本語のテキスト、中文字符，한국어 텍스트",
    "emoji 😀👍🏽👨‍👩‍👧‍👦 🇫🇷 ✨ done",
    "Café naïve résumé façade Ångström Ωmega αβγ Привет مرحبا שלום नमस्ते",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < 10; ++i) { printf(\"%d\\n\", i); }",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>x<file_sep>y<|im_end|",
    "zero\u200bwidth\u00a0nbsp\u3000ideographic\u2028line sep\ufeffbom",
    "\u0000\u0001\u007f control chars",
    "$$\\int_0^1 x^2\\,dx = \\frac{1}{3}$$ and <b>html</b> &amp; 'quotes' \"double\"",
    "   ",
    "\n",
    "",
    "a" * 500 + " " + "ab" * 300,
]


def _random_smol_texts(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    alphabet = (list("abcXYZ019 \t\n\r'.,;:!?-_()[]{}<>|/\\\"#=+*") +
                ["é", "ß", "日", "本", "😀", "👍🏽", "\u200d", "\u00a0", "ا", "Ω", "ﬁ", "१", "\u3000",
                 "<|im_end|>", "<|im_start|>", "<|endoftext|>", "'s", "'LL", "  ", " the", "ing", "\r\n"])
    return _random_texts(rng, alphabet, count, max_len=60)


@pytest.mark.model
@pytest.mark.reference
def test_smollm2_matches_reference_exactly(smol, smol_refs):
    _, hub = smol_refs
    texts = CURATED + _random_smol_texts(1500, seed=11)
    compared_ids = 0
    for s in texts:
        ref_special = hub.encode(s, add_special_tokens=False)
        ref_plain = hub.encode(s, add_special_tokens=False, split_special_tokens=True)
        assert smol.encode(s, special=True) == ref_special, repr(s)
        assert smol.encode(s) == ref_plain, repr(s)
        assert smol.decode(smol.encode(s)) == s, repr(s)
        assert smol.decode(ref_special) == hub.decode(ref_special), repr(s)
        compared_ids += len(ref_special) + len(ref_plain)
    assert compared_ids > 50_000


@pytest.mark.model
@pytest.mark.reference
def test_smollm2_matches_transformers_gguf_loader(smol, smol_refs):
    """Against transformers' own GGUF loading: identical except whitespace runs before digits."""
    raw, _ = smol_refs
    texts = CURATED + _random_smol_texts(1500, seed=12)
    differing = []
    for s in texts:
        if smol.encode(s, special=True) != raw.encode(s, add_special_tokens=False):
            differing.append(s)
    assert all(re.search(r"\s\s\d", s) for s in differing), [s for s in differing if not re.search(r"\s\s\d", s)]
    assert len(differing) < len(texts) // 4


@pytest.mark.model
def test_smollm2_vocabulary_facts(smol):
    assert smol.n_vocab == 49152
    assert (smol.bos_id, smol.eos_id, smol.add_bos) == (1, 2, False)
    assert smol.eos_ids == frozenset({0, 2})  # <|endoftext|> and <|im_end|>
    assert smol.encode("<|im_start|>user\n", special=True)[0] == 1
    assert smol.piece(smol.encode(" hello")[0]) == "Ġhello"
    stream = TextStream(smol)
    ids = smol.encode("Grüße 👨‍👩‍👧 日本")
    assert "".join(stream.push(i) for i in ids) + stream.flush() == "Grüße 👨‍👩‍👧 日本"
