"""What an OpenAI-compatible server does with each request feature a run relies on. Pure.

Contract
- `FEATURES` is the registry: feature name -> `Feature`, whose `requests(model)` are the few
  cheap requests (`Probe`: endpoint "chat" or "completions", a JSON body, max_tokens 1 to 16)
  that tell the feature apart, and whose `judge(replies)` turns the answers (`Reply`, one per
  request, in order) into a `Finding`: supported, ignored (accepted, but the reply shows no
  effect: n=2 answered with one choice, echo without the prompt), rejected (a 4xx), failed (a
  5xx, a broken or inconsistent reply, no answer) or unverifiable (the effect cannot be seen
  here, e.g. a reply that does not vary with the seed at all).
- A `Reply` holds a non-streamed JSON document or the data chunks of a stream; `choices(reply)`
  merges either form into per-choice text, finish reason and log-probs, so a server that
  streams every answer is judged all the same.
- Consumers declare what they need as `Need(feature, required, why)`; `check(needs, findings)`
  gives the one-line reason to stop (a required feature ignored, rejected or failed) or None,
  and notes for the rest (an optional feature missing, a required one unverifiable).
- `render_table(findings)` is the table `ds4-eval --probe` prints.
It sends nothing (`run.probe` does) and never decides what a run needs (its consumer does).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

SUPPORTED, IGNORED, REJECTED, FAILED, UNVERIFIABLE = "supported", "ignored", "rejected", "failed", "unverifiable"
VERDICTS = (SUPPORTED, IGNORED, REJECTED, FAILED, UNVERIFIABLE)
MISSING = (IGNORED, REJECTED, FAILED)  # what stops a run that requires the feature

ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
SEEDS = (1234, 4321, 777)
SHORT_REPLY = "Answer yes or no: is the sky blue?"  # the embedded model answers it in 3 tokens
ECHO_PROMPT = "The quick brown fox jumps over"
IGNORE_EOS_TOKENS = 16


@dataclass(frozen=True)
class Probe:
    endpoint: str  # a key of ENDPOINTS
    body: dict[str, Any]


@dataclass(frozen=True)
class Reply:
    status: int = 0                              # HTTP status; 0: no answer (see error)
    doc: dict[str, Any] | None = None            # a non-streamed reply's JSON object
    chunks: tuple[dict[str, Any], ...] = ()      # a streamed reply's data chunks, in order
    streamed: bool = False
    done: bool = False                           # a stream that ended with [DONE]
    error: str = ""                              # why there is no usable answer; "" when there is


@dataclass(frozen=True)
class Finding:
    feature: str
    verdict: str
    detail: str


@dataclass(frozen=True)
class Feature:
    name: str
    what: str  # the request, in a few words (the table's second column)
    requests: Callable[[str | None], list[Probe]]
    judge: Callable[[Sequence[Reply]], Finding]


@dataclass(frozen=True)
class Need:
    feature: str
    required: bool  # a missing required feature stops the run; an optional one is a note
    why: str        # what the consumer uses it for, for the stop line or the note


@dataclass
class Choice:
    text: str = ""
    finish: str | None = None
    logprobs: Any = None
    pieces: list = field(default_factory=list)  # streamed log-probs, concatenated


FEATURES: dict[str, Feature] = {}


Verdict = tuple[str, str]  # (a VERDICTS entry, its detail)


def feature(name: str, what: str, requests: Callable[[str | None], list[Probe]]):
    """Register `judge` as the feature `name` (the order of registration is the table's order).

    `judge(replies)` reads replies that all came back usable and returns a `Verdict`; the
    registered `Feature.judge` first turns a request that got no usable answer into the
    finding (rejected for a 4xx, else failed), so no feature judges those itself."""
    def register(judge: Callable[[Sequence[Reply]], Verdict]):
        def judged(replies: Sequence[Reply]) -> Verdict:
            return _problem(name, replies) or Finding(name, *judge(replies))
        FEATURES[name] = Feature(name, what, requests, judged)
        return judge
    return register


# ---------------------------------------------------------------- reading replies

def choices(reply: Reply) -> dict[int, Choice]:
    """Per choice index: the text, finish reason and log-probs of a JSON reply or a stream."""
    out: dict[int, Choice] = {}
    if reply.doc is not None:
        for c in reply.doc.get("choices") or []:
            if not isinstance(c, dict):
                continue
            ch = out.setdefault(_index(c), Choice())
            msg = c.get("message")
            ch.text = (msg.get("content") or "") if isinstance(msg, dict) else str(c.get("text") or "")
            ch.finish, ch.logprobs = c.get("finish_reason"), c.get("logprobs")
        return out
    for chunk in reply.chunks:
        for c in chunk.get("choices") or []:
            if not isinstance(c, dict):
                continue
            ch = out.setdefault(_index(c), Choice())
            delta = c.get("delta")
            ch.text += (delta.get("content") or "") if isinstance(delta, dict) else str(c.get("text") or "")
            ch.finish = c.get("finish_reason") or ch.finish
            lp = c.get("logprobs")
            if isinstance(lp, dict) and isinstance(lp.get("content"), list):
                ch.pieces += lp["content"]
                ch.logprobs = {"content": ch.pieces}
            elif lp is not None:
                ch.logprobs = lp
    return out


def usage(reply: Reply) -> dict[str, Any] | None:
    if reply.doc is not None:
        u = reply.doc.get("usage")
        return u if isinstance(u, dict) else None
    found = [c["usage"] for c in reply.chunks if isinstance(c.get("usage"), dict)]
    return found[-1] if found else None


def _index(c: dict) -> int:
    i = c.get("index", 0)
    return i if isinstance(i, int) else -1


def _first(reply: Reply) -> Choice:
    return choices(reply).get(0) or Choice()


def _problem(feature_name: str, replies: Sequence[Reply]) -> Finding | None:
    """The finding when some request got no usable answer: rejected for a 4xx, else failed."""
    for r in replies:
        if 400 <= r.status < 500:
            return Finding(feature_name, REJECTED, f"HTTP {r.status}: {r.error}" if r.error else f"HTTP {r.status}")
        if r.error or r.status != 200:
            return Finding(feature_name, FAILED, r.error or f"HTTP {r.status}")
    return None


def _messages(text: str) -> list[dict[str, str]]:
    # A system and a user message, the shape of ds4-eval's own requests.
    return [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": text}]


def _chat(model: str | None, text: str, **fields: Any) -> Probe:
    body: dict[str, Any] = {"messages": _messages(text), "temperature": 0, **fields}
    if model:
        body["model"] = model
    return Probe("chat", body)


# ---------------------------------------------------------------- the features

@feature("streaming usage", "stream with stream_options.include_usage, max_tokens 2",
         lambda m: [_chat(m, SHORT_REPLY, max_tokens=2, stream=True, stream_options={"include_usage": True})])
def _stream_usage(replies: Sequence[Reply]) -> Verdict:
    r = replies[0]
    if not r.streamed:
        return IGNORED, "asked for a stream, got one JSON reply"
    if not r.done:
        return FAILED, "the stream ended without [DONE]"
    u = usage(r)
    if u is None:
        return IGNORED, "the stream carried no usage chunk"
    if not isinstance(u.get("completion_tokens"), int):
        return FAILED, f"the usage chunk has no completion_tokens: {u}"
    return (SUPPORTED, f"usage chunk: {u.get('prompt_tokens')} prompt + "
                       f"{u['completion_tokens']} completion tokens")


@feature("token counts", "usage of a reply, max_tokens 3", lambda m: [_chat(m, SHORT_REPLY, max_tokens=3)])
def _token_counts(replies: Sequence[Reply]) -> Verdict:
    u = usage(replies[0])
    if u is None:
        return IGNORED, "the reply has no usage"
    p, c, t = u.get("prompt_tokens"), u.get("completion_tokens"), u.get("total_tokens")
    if not isinstance(p, int) or not isinstance(c, int) or p <= 0 or not 0 <= c <= 3:
        return (FAILED, f"implausible usage for a short prompt and max_tokens 3: {p} prompt, "
                        f"{c} completion tokens")
    if t is not None and t != p + c:
        return FAILED, f"total_tokens {t} is not prompt_tokens {p} + completion_tokens {c}"
    return SUPPORTED, f"{p} prompt + {c} completion tokens" + ("" if t is None else f" = {t}")


@feature("logprobs", "logprobs with top_logprobs 2, max_tokens 2",
         lambda m: [_chat(m, SHORT_REPLY, max_tokens=2, logprobs=True, top_logprobs=2)])
def _logprobs(replies: Sequence[Reply]) -> Verdict:
    lp = _first(replies[0]).logprobs
    content = lp.get("content") if isinstance(lp, dict) else None
    if not content:
        return IGNORED, "the reply carries no log-probs"
    ok = [e for e in content if isinstance(e, dict) and isinstance(e.get("logprob"), (int, float))]
    if len(ok) != len(content):
        return FAILED, "a log-prob entry without a number"
    tops = [len(e.get("top_logprobs") or []) for e in ok]
    if not all(tops):
        return IGNORED, f"log-probs of {len(ok)} token(s) without top_logprobs"
    return SUPPORTED, f"{len(ok)} token(s), top {min(tops)}-{max(tops)} alternatives each"


@feature("echo", "completions: echo with logprobs 1, max_tokens 1",
         lambda m: [Probe("completions", {**({"model": m} if m else {}), "prompt": ECHO_PROMPT, "echo": True,
                                          "logprobs": 1, "max_tokens": 1, "temperature": 0})])
def _echo(replies: Sequence[Reply]) -> Verdict:
    ch = _first(replies[0])
    if not ch.text.startswith(ECHO_PROMPT):
        return IGNORED, f"the text does not start with the prompt: {ch.text[:40]!r}"
    lp = ch.logprobs if isinstance(ch.logprobs, dict) else {}
    tokens = lp.get("tokens") or []
    scored = lp.get("token_logprobs") or []
    if not scored:
        return IGNORED, "the prompt is echoed without its log-probs"
    if tokens and not "".join(map(str, tokens)).startswith(ECHO_PROMPT):
        return IGNORED, "the log-probs do not start at the prompt"
    if len(scored) < 3:
        return IGNORED, f"log-probs of {len(scored)} token(s): the prompt's are missing"
    return SUPPORTED, f"the prompt echoed with log-probs of {len(scored)} tokens"


@feature("seed", "sampled at temperature 1: seeds a, a, b, c; max_tokens 8",
         lambda m: [_chat(m, "Write a short random sentence.", max_tokens=8, temperature=1.0, top_p=1.0, seed=s)
                    for s in (SEEDS[0], *SEEDS)])
def _seed(replies: Sequence[Reply]) -> Verdict:
    same, *others = [_first(r).text for r in replies[1:]]
    first = _first(replies[0]).text
    if first != same:
        return IGNORED, f"two requests with seed {SEEDS[0]} gave different text"
    if all(o == first for o in others):
        return UNVERIFIABLE, "every seed gave the same text: the reply does not vary here"
    return SUPPORTED, "the same seed repeats its text, other seeds change it"


@feature("n", "n=2 at temperature 1, max_tokens 2",
         lambda m: [_chat(m, "Write a short random sentence.", max_tokens=2, temperature=1.0, n=2)])
def _n(replies: Sequence[Reply]) -> Verdict:
    got = sorted(choices(replies[0]))
    if got == [0, 1]:
        return SUPPORTED, "2 choices"
    if len(got) <= 1:
        return IGNORED, f"asked for 2 choices, got {len(got)}"
    return FAILED, f"asked for 2 choices, got indices {got}"


@feature("ignore_eos", f"a short reply with and without ignore_eos, max_tokens {IGNORE_EOS_TOKENS}",
         lambda m: [_chat(m, SHORT_REPLY, max_tokens=IGNORE_EOS_TOKENS),
                    _chat(m, SHORT_REPLY, max_tokens=IGNORE_EOS_TOKENS, ignore_eos=True)])
def _ignore_eos(replies: Sequence[Reply]) -> Verdict:
    plain, forced = (_reached(r) for r in replies)
    if forced[0]:
        if plain[0]:
            return UNVERIFIABLE, f"the reply runs to max_tokens {IGNORE_EOS_TOKENS} without it too"
        return SUPPORTED, f"{forced[1]} (without it: {plain[1]})"
    return IGNORED, f"the reply stopped early: {forced[1]}"


def _reached(reply: Reply) -> tuple[bool, str]:
    """Whether a reply ran to max_tokens (by usage, else by finish reason), and how far it ran."""
    u = usage(reply)
    count = u.get("completion_tokens") if u else None
    if isinstance(count, int):
        return count >= IGNORE_EOS_TOKENS, f"{count} of {IGNORE_EOS_TOKENS} tokens"
    finish = _first(reply).finish
    return finish == "length", f"finish_reason {finish}"


# ---------------------------------------------------------------- verdicts for a consumer

def check(needs: Sequence[Need], findings: Sequence[Finding]) -> tuple[str | None, list[str]]:
    """(the one-line reason to stop, or None; notes): a required feature that is ignored,
    rejected or failed stops; an optional one that is, or a required one that is unverifiable,
    is a note."""
    by = {f.feature: f for f in findings}
    stops, notes = [], []
    for need in needs:
        f = by.get(need.feature)
        if f is None or f.verdict == SUPPORTED:
            continue
        what = f"{need.feature} is {f.verdict} ({f.detail})"
        if need.required and f.verdict in MISSING:
            stops.append(f"{what}; needed {need.why}")
        else:
            notes.append(f"{what}; {'needed' if need.required else 'used'} {need.why}")
    return ("; ".join(stops) if stops else None), notes


def render_table(findings: Sequence[Finding]) -> str:
    from tabulate import tabulate

    rows = [[f.feature, f.verdict, f.detail] for f in findings]
    return tabulate(rows, headers=["feature", "verdict", "detail"], tablefmt="simple", disable_numparse=True)


def served_model_ids(payload: object) -> list[str]:
    """The model ids of a `GET /v1/models` answer (`{"data": [{"id": ...}, ...]}`), in its order;
    [] for anything else."""
    data = payload.get("data") if isinstance(payload, dict) else None
    if not isinstance(data, list):
        return []
    return [str(m["id"]) for m in data if isinstance(m, dict) and m.get("id")]


def api_root(url: str) -> str:
    """The server's root from a base URL that may end in /v1 or an endpoint path."""
    base = url.rstrip("/")
    for tail in ("/chat/completions", "/completions", "/models"):
        if base.endswith(tail):
            base = base[: -len(tail)]
            break
    return base[:-3] if base.endswith("/v1") else base
