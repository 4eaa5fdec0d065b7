"""The base file of `ds4-bench kld`: a reference stack's top-K log-probs over a corpus.

Format: a numpy `.npz` archive (zip of `.npy` members, deflate-compressed), written atomically
(temporary file in the target's directory, renamed into place):

  header           uint8 [n]   UTF-8 JSON object (below)
  tokens           int32 [N]   every window's token ids, windows back to back (BOS included)
  window_starts    int64 [W+1] window w is tokens[window_starts[w]:window_starts[w+1]]
  top_ids          uint16 [P, K] (int32 when the vocabulary exceeds 65,536 ids)  the base's top-K
                               ids at each of the P scored positions, best first (-1 pads in int32)
  top_logprobs     float32 [P, K]  their log-probs (nats)
  lse              float32 [P]     log-sum-exp of the raw logits (NaN when the stack does not know it)
  target_logprobs  float32 [P]     log-prob of the token that follows the position

A window of n tokens has n - 1 scored positions (the distributions after tokens 0..n-2; the
next token of the last one lies outside the window), so P = N - W.  Log-probs stay float32:
float16's spacing near log-prob -4 is 0.004, an error in a KL divergence of the order of the
entropy times 2^-11 (about 1e-3 nats), ten times the divergence of the fast path being
measured.  Only the ids shrink (uint16).  About 200 bytes a position at K = 32.

Header keys: format ("ds4eval-kld-base"), version (1), corpus (name, sha256 of its UTF-8 text,
passes), tokens_sha256 (of the int32 token bytes), tokenizer_sha256 (engine.tokenizer identity
of the GGUF's tokenizer.ggml.* keys, or null when the stack cannot say), ctx, k, n_windows,
n_positions, stack (the stack's own description: kind, model, weights, kv_type, device, url),
created (UTC, ISO 8601).  `check_compatible` refuses a base made from another corpus, context
or tokenizer, one line per reason.
It does not run stacks or compute statistics.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from ds4bench.kldstats import Scores
from ds4eval.atomicfile import atomic_open

FORMAT = "ds4eval-kld-base"
VERSION = 1


class BaseFileError(ValueError):
    """The base file cannot be read or does not fit this run; the message says why."""


def tokens_sha256(tokens: np.ndarray) -> str:
    return hashlib.sha256(np.asarray(tokens, dtype="<i4").tobytes()).hexdigest()


@dataclass(frozen=True)
class BaseData:
    header: dict[str, Any]
    tokens: np.ndarray
    window_starts: np.ndarray
    scores: Scores

    @property
    def windows(self) -> list[list[int]]:
        s = self.window_starts
        return [self.tokens[s[i]: s[i + 1]].tolist() for i in range(len(s) - 1)]

    @property
    def window_lengths(self) -> list[int]:
        """Scored positions per window."""
        return [int(n) - 1 for n in np.diff(self.window_starts)]


def write_base(path: str | os.PathLike, header: dict[str, Any], windows: list[list[int]], scores: Scores) -> BaseData:
    tokens = np.asarray([t for w in windows for t in w], dtype=np.int32)
    starts = np.concatenate([[0], np.cumsum([len(w) for w in windows])]).astype(np.int64)
    if len(scores) != len(tokens) - len(windows):
        raise ValueError(f"{len(scores)} scored positions for {len(tokens)} tokens in {len(windows)} windows")
    ids = scores.top_ids
    id_type = np.uint16 if ids.size == 0 or (ids.min() >= 0 and ids.max() < 65536) else np.int32
    head = {**header, "format": FORMAT, "version": VERSION, "tokens_sha256": tokens_sha256(tokens),
            "k": int(ids.shape[1]), "n_windows": len(windows), "n_positions": len(scores)}
    arrays = {"header": np.frombuffer(json.dumps(head, sort_keys=True).encode(), dtype=np.uint8),
              "tokens": tokens, "window_starts": starts, "top_ids": ids.astype(id_type),
              "top_logprobs": scores.top_logprobs.astype(np.float32), "lse": scores.lse.astype(np.float32),
              "target_logprobs": scores.target_logprobs.astype(np.float32)}
    with atomic_open(path, "wb") as f:
        np.savez_compressed(f, **arrays)
    return BaseData(head, tokens, starts, scores)


def read_base(path: str | os.PathLike) -> BaseData:
    try:
        with np.load(path, allow_pickle=False) as z:
            header = json.loads(bytes(z["header"]).decode())
            if header.get("format") != FORMAT or header.get("version") != VERSION:
                raise BaseFileError(f"{path}: not a {FORMAT} file of version {VERSION}")
            ids = z["top_ids"]
            top_ids = ids.astype(np.int64)
            if ids.dtype == np.int32:
                top_ids[ids < 0] = -1
            scores = Scores(top_ids, z["top_logprobs"], z["lse"], z["target_logprobs"])
            tokens, starts = z["tokens"], z["window_starts"]
    except BaseFileError:
        raise
    except Exception as e:  # noqa: BLE001 -- numpy, zipfile and json each raise their own types
        raise BaseFileError(f"{path}: cannot read a base file ({type(e).__name__}: {e})") from None
    if len(starts) < 2 or starts[-1] != len(tokens) or len(scores) != len(tokens) - (len(starts) - 1) \
            or tokens_sha256(tokens) != header.get("tokens_sha256"):
        raise BaseFileError(f"{path}: its arrays do not match its header")
    return BaseData(header, tokens, starts, scores)


def check_compatible(header: dict[str, Any], *, corpus_sha256: str, passes: int, ctx: int,
                     tokenizer_sha256: str | None) -> list[str]:
    """Reasons a candidate run cannot be compared with this base (empty: it can).  A tokenizer the
    candidate cannot name (None) is not checked here; the caller says so."""
    out = []
    corpus = header.get("corpus") or {}
    if corpus.get("sha256") != corpus_sha256 or corpus.get("passes") != passes:
        out.append(f"the base was made from another corpus ({corpus.get('name')}, {corpus.get('passes')} passes)")
    if header.get("ctx") != ctx:
        out.append(f"the base was made with --ctx {header.get('ctx')}, not {ctx}")
    base_tok = header.get("tokenizer_sha256")
    if tokenizer_sha256 is not None and base_tok is not None and base_tok != tokenizer_sha256:
        out.append("the base was made with another tokenizer")
    return out
