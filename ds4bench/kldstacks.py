"""The stacks `ds4-bench kld` scores a corpus with: the seam, the engine, OpenAI-compatible endpoints.

`LogprobStack` is the seam: `score(window, k, probe)` returns `kldstats.Scores` for the
len(window) - 1 positions of one token window (teacher forcing: position t is the
distribution after window[t], its target window[t + 1]): the stack's top-k ids and
log-probs, the log-sum-exp where known, the targets' log-probs, and the log-probs at the ids
of `probe` ([len(window) - 1, Kp], the base's top-K; NaN where the stack cannot tell).
`tokenize(text)` gives the corpus ids (None when the stack has no tokenizer), `bos_id` the id
a window starts with (None: none), `tokenizer_sha256` its tokenizer's identity (None: unknown),
`describe()` what goes into a base file's header and the report, `fit_top_k(head, k)` the
most log-probs per position it returns (k for the in-process stacks, which see every logit).

Stacks, registered in `STACKS` (name -> factory taking the `KLDConfig`):
  engine  the in-process engine, any GGUF, `weights` (packed or float32), `kv_type`, device,
          loaded and run on one engine.threads.EngineThread: one session, reset per window, `Session.iter_extend_logits` in prefill chunks; each
          chunk's logits are reduced at once (engine.logprobs, the server's reduction too), so memory stays
          one chunk of logits.  Its candidate side is exact: every probe id is known.
  openai  any OpenAI-compatible server that returns prompt log-probs: POST /v1/completions with
          {"prompt": [token ids], "echo": true, "logprobs": k, "max_tokens": 0,
          "temperature": 0, "return_tokens_as_token_ids": true}; `choices[0].logprobs`
          gives `token_logprobs` (the targets; the first is null) and `top_logprobs`, one
          {token: log-prob} object per prompt token, keyed "token_id:N" (vLLM's form) or by
          token text, which `--tokenizer GGUF` maps back to ids (texts shared by several ids
          are dropped).  A probe id outside the server's top list is unknown (NaN) and falls
          into kldstats' rest bucket.  Without `--tokenizer` it cannot tokenize, so it can only
          be a candidate, scoring the base's stored windows.
  llamacpp  llama.cpp in process through llama-cpp-python (the optional `llamacpp` extra) on
          a GGUF (`-m`, default the embedded model): `Llama(logits_all=True)` without ggml's
          extra buffer types (repacked / AMX weights, which crash on an AMX CPU), one `eval` of
          the window's inputs, every position's logits read back and reduced like the engine's
          (numpy, kldstats.scores_from_logits).  Its candidate side is exact too.  It tokenizes
          with llama.cpp's own tokenizer; its tokenizer identity is the GGUF's, like the engine's.
Before scoring, `openai` probes the server (`ds4eval.run.probe`) for echo with log-probs
and stops with one line when the server ignores or rejects it (`--no-probe` skips that).
Its `fit_top_k` then sends what the run will send, on the first tokens of the first window:
a token-id prompt with one log-prob (a server that cannot score token ids, such as
llama-cpp-python's, stops the run with one line), then the K asked for; a refused K is
lowered to the limit the server's error names (`limit_in_error`: "less than or equal to 20"),
else to the first of OpenAI's documented limits (`LIMIT_GUESSES`) that the server takes.
ds4-server is reached through `openai` (`--url`) once its /v1/completions returns prompt
log-probs; a stack that starts its own server process would be one more factory in STACKS.
It computes no statistics and writes no files.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np

from ds4bench.kldstats import Scores
from ds4eval.run.capabilities import Need

if TYPE_CHECKING:
    from ds4bench.kld import KLDConfig


class StackError(RuntimeError):
    """A stack failed to score or answered in a form that cannot be read; the message says why."""


@runtime_checkable
class LogprobStack(Protocol):
    bos_id: int | None
    tokenizer_sha256: str | None

    def tokenize(self, text: str) -> list[int] | None: ...

    def describe(self) -> dict[str, Any]: ...

    def score(self, window: Sequence[int], k: int, probe: np.ndarray | None = None) -> Scores: ...

    def fit_top_k(self, head: Sequence[int], k: int) -> int:
        """The most log-probs per position (at most k) this stack returns for windows like
        `head` (the first tokens of the first window), found before any scoring; StackError
        (one line) when it cannot score such a window at all."""
        ...

    def close(self) -> None: ...


def tokenizer_identity(metadata: Mapping[str, Any]) -> str:
    """SHA-256 over a GGUF's tokenizer.ggml.* keys (vocabulary, merges, types, special ids, BOS rule)."""
    keys = sorted(k for k in metadata if k.startswith("tokenizer.ggml."))
    h = hashlib.sha256()
    for k in keys:
        h.update(k.encode())
        h.update(json.dumps(metadata[k], default=str, sort_keys=True).encode())
    return h.hexdigest()


# ---------------------------------------------------------------- engine

def reduce_chunk(logits: Any, targets: Sequence[int], k: int, probe: np.ndarray | None) -> Scores:
    """torch logits [T, V] -> Scores through engine.logprobs (the server's prompt log-probs use
    the same reduction); kldstats.scores_from_logits is its numpy reference."""
    from engine.logprobs import score_rows

    scored = score_rows(logits, targets, k)
    p_lp = None
    if probe is not None:
        import torch

        p = torch.as_tensor(np.asarray(probe, dtype=np.int64))
        p_lp = (logits.float().gather(1, p.clamp_min(0)).double() - scored.lse[:, None]).numpy()
        p_lp[np.asarray(probe) < 0] = np.nan
    return Scores(scored.top_ids.numpy().astype(np.int64), scored.top_logprobs.numpy(), scored.lse.numpy(),
                  scored.target_logprobs.numpy(), p_lp)


class EngineStack:
    """The in-process engine; `model` is a loaded engine.Model (any object with its session API).
    With `thread` (an engine.threads.EngineThread, the one that loaded the model) every window
    is scored on it and `close()` stops it."""

    def __init__(self, model: Any, weights: str, kv_type: str | None, thread: Any = None):
        self.model = model
        self.weights = weights
        self.kv_type = kv_type
        self.thread = thread
        self.session = model.new_session()
        meta = getattr(model, "metadata", {}) or {}
        self.tokenizer_sha256 = tokenizer_identity(meta) if meta else None
        self.bos_id = model.bos_id if getattr(model, "add_bos", False) else None

    def tokenize(self, text: str) -> list[int]:
        return self.model.tokenize(text)

    def describe(self) -> dict[str, Any]:
        import os

        return {"kind": "engine", "model": os.path.basename(str(self.model.path)), "weights": self.weights,
                "kv_type": str(self.model.kv_dtype).removeprefix("torch."), "device": str(self.model.device),
                "quant": getattr(self.model, "quant", None)}

    def score(self, window: Sequence[int], k: int, probe: np.ndarray | None = None) -> Scores:
        if self.thread is not None and not self.thread.is_current():
            return self.thread.call(self.score, window, k, probe)
        from ds4bench.kldstats import concat_scores

        window = [int(t) for t in window]
        self.session.reset()
        inputs, targets = window[:-1], window[1:]
        parts = []
        for start, logits in self.session.iter_extend_logits(inputs):
            end = start + logits.shape[0]
            pr = None if probe is None else probe[start: end]
            parts.append(reduce_chunk(logits, targets[start: end], k, pr))
        return concat_scores(parts)

    def fit_top_k(self, head: Sequence[int], k: int) -> int:
        return k  # every logit is at hand

    def close(self) -> None:
        self.session.reset()
        if self.thread is not None:
            self.thread.close()


def engine_stack(cfg: "KLDConfig") -> EngineStack:
    """Loaded and run on one engine thread (engine.threads: one OpenMP pool, and by default only
    the cores other processes leave free; `--threads` fixes the count)."""
    from engine import load_model
    from engine.threads import EngineThread

    thread = EngineThread("ds4-kld", threads=cfg.threads)
    try:
        model = thread.call(load_model, cfg.model, ctx=cfg.ctx, device=cfg.device, weights=cfg.weights,
                            kv_type=cfg.kv_type)
    except BaseException:
        thread.close()
        raise
    return EngineStack(model, cfg.weights, cfg.kv_type, thread)


# ---------------------------------------------------------------- OpenAI-compatible endpoints

TOKEN_ID_PREFIX = "token_id:"


def completion_body(window: Sequence[int], k: int, served_model: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {"prompt": [int(t) for t in window], "echo": True, "logprobs": int(k), "max_tokens": 0,
                            "temperature": 0, "return_tokens_as_token_ids": True}
    if served_model:
        body["model"] = served_model
    return body


# Log-prob counts tried, largest first, when a server refuses the one asked for and its error
# names no limit: OpenAI's documented maxima (20 for chat's top_logprobs, 5 for the legacy
# completions' logprobs), then one.
LIMIT_GUESSES = (20, 5, 1)
# The first tokens of a window that `fit_top_k` sends: enough for a few positions, cheap to score.
FIT_TOKENS = 8
_LIMIT_WORDS = re.compile(r"(?:less than or equal to|<=|at most|no more than|not exceed|up to|maximum(?: value)?"
                          r"(?: of| is)?|max(?:imum)?\s*[:=]?)\s*(\d+)", re.IGNORECASE)


def limit_in_error(text: str, asked: int) -> int | None:
    """Pure: the log-prob limit a server's refusal of `asked` names ("logprobs: Input should be
    less than or equal to 20", "... must be at most 5"); None when it names none below `asked`."""
    found = [int(m.group(1)) for m in _LIMIT_WORDS.finditer(text)]
    below = [n for n in found if 0 < n < asked]
    return below[0] if below else None


def parse_prompt_logprobs(doc: Any, window: Sequence[int], k: int, probe: np.ndarray | None,
                          token_id: Callable[[str], int | None]) -> Scores:
    """Pure: a /v1/completions echo response -> Scores for the window's len - 1 positions."""
    try:
        lp = doc["choices"][0]["logprobs"]
        token_lps, tops = lp["token_logprobs"], lp["top_logprobs"]
    except (KeyError, IndexError, TypeError):
        raise StackError("the response has no choices[0].logprobs with token_logprobs and top_logprobs "
                         "(does the server return prompt log-probs with echo?)") from None
    n = len(window)
    if len(token_lps) < n or len(tops) < n:
        raise StackError(f"the server returned log-probs for {min(len(token_lps), len(tops))} of {n} prompt tokens")
    T = n - 1
    top_ids = np.full((T, k), -1, dtype=np.int64)
    top_lp = np.full((T, k), -np.inf)
    tgt = np.empty(T)
    pr = None if probe is None else np.full(probe.shape, np.nan)
    for t in range(T):
        entry, target = tops[t + 1], token_lps[t + 1]
        if target is None or not isinstance(entry, dict):
            raise StackError(f"no log-probs for prompt token {t + 1}")
        known: dict[int, float] = {}
        for key, value in entry.items():
            tid = token_id(key)
            if tid is not None and value is not None:
                known[tid] = float(value)
        tgt[t] = float(target)
        known.setdefault(int(window[t + 1]), tgt[t])
        best = sorted(known.items(), key=lambda kv: -kv[1])[:k]
        for j, (tid, v) in enumerate(best):
            top_ids[t, j], top_lp[t, j] = tid, v
        if pr is not None:
            for j, tid in enumerate(probe[t]):
                v = known.get(int(tid))
                if v is not None and math.isfinite(v):
                    pr[t, j] = v
    return Scores(top_ids, top_lp, np.full(T, np.nan), tgt, pr)


class OpenAIStack:
    # What the capability probe checks first (ds4eval.run.capabilities): prompt log-probs through echo.
    NEEDS = (Need("echo", True, "to score the corpus from the prompt's log-probs (echo with logprobs)"),)

    def __init__(self, url: str, served_model: str | None = None, api_key: str | None = None,
                 tokenizer_gguf: str | None = None, timeout_s: float = 600.0, client: Any = None):
        import httpx

        self.url = url.rstrip("/")
        if not self.url.startswith(("http://", "https://")):
            raise StackError(f"--url must start with http:// or https://, not {url!r}")
        self.served_model = served_model
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = client or httpx.Client(timeout=timeout_s, headers=headers)
        self.tokenizer = None
        self.tokenizer_sha256: str | None = None
        self.bos_id: int | None = None
        self._by_text: dict[str, int] = {}
        if tokenizer_gguf:
            from engine.gguf_file import read_gguf
            from engine.tokenizer import Tokenizer

            meta = read_gguf(tokenizer_gguf).metadata
            self.tokenizer = Tokenizer.from_gguf_metadata(meta)
            self.tokenizer_sha256 = tokenizer_identity(meta)
            self.bos_id = self.tokenizer.bos_id if self.tokenizer.add_bos else None
            seen: dict[str, int] = {}
            n_vocab = len(meta.get("tokenizer.ggml.tokens") or [])
            for i in range(n_vocab):
                text = self.tokenizer.decode([i])
                seen[text] = -1 if text in seen else i
            self._by_text = {t: i for t, i in seen.items() if i >= 0}

    def token_id(self, key: str) -> int | None:
        if key.startswith(TOKEN_ID_PREFIX):
            try:
                return int(key[len(TOKEN_ID_PREFIX):])
            except ValueError:
                return None
        if not self._by_text:
            raise StackError("the server names tokens by text, not token_id:N: pass --tokenizer GGUF to map them")
        return self._by_text.get(key)

    def tokenize(self, text: str) -> list[int] | None:
        return None if self.tokenizer is None else self.tokenizer.encode(text)

    def describe(self) -> dict[str, Any]:
        return {"kind": "openai", "url": self.url, "model": self.served_model}

    def _post(self, window: Sequence[int], k: int) -> Any:
        import httpx

        try:
            return self.client.post(self.url + "/v1/completions", json=completion_body(window, k, self.served_model))
        except httpx.HTTPError as e:
            raise StackError(f"{self.url}: {type(e).__name__}: {e}") from None

    def _doc(self, r: Any) -> Any:
        if r.status_code != 200:
            raise StackError(f"{self.url}/v1/completions: HTTP {r.status_code}: {r.text[:200]}")
        try:
            return r.json()
        except ValueError:
            raise StackError(f"{self.url}/v1/completions: the reply is not JSON") from None

    def score(self, window: Sequence[int], k: int, probe: np.ndarray | None = None) -> Scores:
        return parse_prompt_logprobs(self._doc(self._post(window, k)), window, k, probe, self.token_id)

    def _takes(self, head: Sequence[int], k: int) -> tuple[bool, str]:
        """Whether the server scores `head` with k log-probs per position; else its refusal."""
        r = self._post(head, k)
        if r.status_code != 200:
            return False, f"HTTP {r.status_code}: {r.text[:200]}"
        parse_prompt_logprobs(self._doc(r), head, k, None, self.token_id)  # an unreadable reply stops it here
        return True, ""

    def fit_top_k(self, head: Sequence[int], k: int) -> int:
        head = list(head[:FIT_TOKENS])
        ok, why = self._takes(head, 1)
        if not ok:
            raise StackError(f"{self.url}/v1/completions does not score a token-id prompt, which kld sends ({why})")
        ok, why = self._takes(head, k)
        if ok:
            return k
        named = limit_in_error(why, k)
        for tried in ([named] if named is not None else []) + [g for g in LIMIT_GUESSES if g < k and g != named]:
            if self._takes(head, tried)[0]:
                return tried
        raise StackError(f"{self.url}/v1/completions refuses {k} log-probs per token and every smaller count "
                         f"tried ({why})")

    def close(self) -> None:
        self.client.close()


def openai_stack(cfg: "KLDConfig") -> OpenAIStack:
    """The stack, once the server answered the capability probe of echo with log-probs (unless
    --no-probe): a server that ignores echo would otherwise score garbage for the whole corpus."""
    if not cfg.url:
        raise StackError("--stack openai needs --url")
    if not cfg.no_probe:
        from ds4eval.run import probe as endpoint_probe

        try:
            for line in endpoint_probe.probe_or_stop(cfg.url, OpenAIStack.NEEDS, cfg.served_model, cfg.api_key):
                report_note(line)
        except (endpoint_probe.ProbeUnreachable, endpoint_probe.FeatureMissing) as e:
            raise StackError(str(e)) from None
    return OpenAIStack(cfg.url, cfg.served_model, cfg.api_key, cfg.tokenizer)


def report_note(line: str) -> None:
    import sys

    print(f"note: {line}", file=sys.stderr)


# ---------------------------------------------------------------- llama.cpp in process

class LlamaCppStack:
    """llama-cpp-python over one GGUF, every position's logits kept (`logits_all`)."""

    def __init__(self, path: str, ctx: int, threads: int, device: str = "cpu"):
        from ds4bench.runners import LLAMA_N_BATCH, import_llama_cpp, llama_offloads, load_llama
        from engine.gguf_file import read_gguf

        llama_cpp = import_llama_cpp()
        self.path = path
        offload = llama_offloads(llama_cpp, device)
        self.device = "cuda" if offload else "cpu"
        self.threads = threads
        meta = read_gguf(path).metadata
        self.tokenizer_sha256: str | None = tokenizer_identity(meta)
        # Without the extra buffer types: in llama-cpp-python 0.3.36 built for an AMX CPU,
        # ggml's AMX matmul crashes (SIGSEGV in ggml_backend_amx_mul_mat) on the embedded
        # model's Q4_1 weights; without them the plain CPU matmuls run.
        self.llm = load_llama(llama_cpp, extra_buffers=False, model_path=path, n_ctx=ctx, n_threads=threads,
                              n_threads_batch=threads, n_batch=min(LLAMA_N_BATCH, ctx), logits_all=True,
                              verbose=False, n_gpu_layers=-1 if offload else 0)
        add_bos = meta.get("tokenizer.ggml.add_bos_token", True)
        self.bos_id: int | None = int(self.llm.token_bos()) if add_bos else None
        self.version = getattr(llama_cpp, "__version__", None)

    def tokenize(self, text: str) -> list[int]:
        return [int(t) for t in self.llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)]

    def describe(self) -> dict[str, Any]:
        import os

        return {"kind": "llamacpp", "model": os.path.basename(self.path), "device": self.device,
                "threads": self.threads, "llama_cpp_python": self.version}

    def score(self, window: Sequence[int], k: int, probe: np.ndarray | None = None) -> Scores:
        from ds4bench.kldstats import scores_from_logits

        inputs, targets = [int(t) for t in window[:-1]], [int(t) for t in window[1:]]
        self.llm.reset()
        try:
            self.llm.eval(inputs)
        except (RuntimeError, ValueError) as e:
            raise StackError(f"llama.cpp could not evaluate a window of {len(inputs)} tokens: {e}") from None
        logits = np.asarray(self.llm.scores[: len(inputs)], dtype=np.float32)
        return scores_from_logits(logits, targets, k, probe)

    def fit_top_k(self, head: Sequence[int], k: int) -> int:
        return k  # every logit is at hand

    def close(self) -> None:
        close = getattr(self.llm, "close", None)
        if close is not None:
            close()


def llamacpp_stack(cfg: "KLDConfig") -> LlamaCppStack:
    from ds4bench.runners import LlamaCppMissing, default_threads
    from engine.model import default_model_path

    try:
        return LlamaCppStack(cfg.model or default_model_path(), cfg.ctx, cfg.threads or default_threads(), cfg.device)
    except LlamaCppMissing as e:
        raise StackError(str(e)) from None


STACKS: dict[str, Callable[["KLDConfig"], LogprobStack]] = {"engine": engine_stack, "openai": openai_stack,
                                                             "llamacpp": llamacpp_stack}
