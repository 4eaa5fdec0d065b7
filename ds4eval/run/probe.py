"""Send the capability probe's requests to an OpenAI-compatible server (httpx) and judge them.

Contract
- `run_probe(url, features, model=None, api_key=None, budget_s=60)` sends each named feature's
  requests (`capabilities.FEATURES`) one after another and returns a `ProbeResult`: the model
  name used (given, else the first id of GET /v1/models, else none) and one `Finding` per
  feature, in the order asked. The whole probe stays within `budget_s` seconds: each request's
  timeout is what is left, and a feature reached after the time ran out is `unverifiable`.
- A server that cannot be reached at all, or refuses the API key (401/403), raises
  `ProbeUnreachable` with one line; every other answer, errors included, is a finding.
- Streamed and JSON answers are both read (whatever the request asked for), so the judges in
  `capabilities` see what the server really sent.
- `probe_or_stop(...)`: the probe a run makes before its first request; it returns the notes
  and raises `FeatureMissing` (one line) when a required feature is missing. `judge_needs(...)`
  is the same probe returning its verdict (`NeedsVerdict`: findings, the stop line or "", notes)
  instead of raising, for a run that probes several endpoints.
- Several endpoints (a run with --url given more than once): each is probed into an
  `EndpointCheck` (did it answer, its model ids, its chat template's SHA-256 where it exposes
  one through `GET /tokenizer_info` or `GET /props`, its findings); `differences(checks)` (pure)
  gives one line per thing the answering endpoints disagree on, and `settle(checks,
  allow_mixed)` (pure) decides which endpoints the run uses, the notes to print and the lines to
  stop with: an endpoint that does not answer is left out (the run stops only when none does),
  and a mixed set stops the run unless it is allowed.
It knows nothing of the runs that use it: each consumer passes its own `capabilities.Need`s.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Sequence

import httpx

from ds4eval.run import sse
from ds4eval.run.capabilities import (ENDPOINTS, FEATURES, UNVERIFIABLE, Finding, Need, Probe, Reply, api_root, check,
                                      served_model_ids)
from ds4eval.run.httperrors import error_message, reason

DEFAULT_BUDGET_S = 60.0  # before a run: a slow server leaves the last features unverified, not the run
TABLE_BUDGET_S = 300.0   # `ds4-eval --probe`, which asks for every feature
NO_PROBE_HINT = "--no-probe skips this check"


class ProbeUnreachable(RuntimeError):
    """The server did not answer at all, or refused the API key; the message is one line."""


class FeatureMissing(RuntimeError):
    """A feature the run requires is ignored, rejected or failed; the message is one line."""


@dataclass(frozen=True)
class ProbeResult:
    url: str
    model: str | None
    findings: tuple[Finding, ...]
    seconds: float


def run_probe(url: str, features: Sequence[str], model: str | None = None, api_key: str | None = None,
              budget_s: float = DEFAULT_BUDGET_S, transport: httpx.BaseTransport | None = None) -> ProbeResult:
    unknown = [f for f in features if f not in FEATURES]
    if unknown:
        raise ValueError(f"unknown feature(s): {', '.join(unknown)}")
    root = api_root(url)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    t0 = time.monotonic()
    deadline = t0 + budget_s
    findings = []
    with httpx.Client(headers=headers, transport=transport, timeout=httpx.Timeout(budget_s)) as client:
        if model is None:
            model = first_model(client, root, deadline)
        for name in features:
            feat = FEATURES[name]
            replies = []
            for probe in feat.requests(model):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                replies.append(_send(client, root, probe, left))
            if len(replies) < len(feat.requests(model)):
                findings.append(Finding(name, UNVERIFIABLE, f"not probed: the probe's {budget_s:g} s ran out"))
            else:
                findings.append(feat.judge(replies))
    return ProbeResult(root, model, tuple(findings), time.monotonic() - t0)


@dataclass(frozen=True)
class NeedsVerdict:
    findings: tuple[Finding, ...]
    stop: str          # the one line to stop with when a required feature is missing, else ""
    notes: tuple[str, ...]


def judge_needs(url: str, needs: Sequence[Need], model: str | None = None, api_key: str | None = None,
                budget_s: float = DEFAULT_BUDGET_S, transport: httpx.BaseTransport | None = None) -> NeedsVerdict:
    """Probe what `needs` names and judge it (ProbeUnreachable when the server does not answer)."""
    if not needs:
        return NeedsVerdict((), "", ())
    result = run_probe(url, list(dict.fromkeys(n.feature for n in needs)), model, api_key, budget_s, transport)
    stop, notes = check(needs, result.findings)
    line = f"the server at {result.url} lacks what this run needs: {stop} ({NO_PROBE_HINT})" if stop else ""
    return NeedsVerdict(result.findings, line, tuple(notes))


def probe_or_stop(url: str, needs: Sequence[Need], model: str | None = None, api_key: str | None = None,
                  budget_s: float = DEFAULT_BUDGET_S, transport: httpx.BaseTransport | None = None) -> list[str]:
    """Probe what `needs` names; raise FeatureMissing for a required feature that is missing,
    else return the notes (one line each)."""
    verdict = judge_needs(url, needs, model, api_key, budget_s, transport)
    if verdict.stop:
        raise FeatureMissing(verdict.stop)
    return list(verdict.notes)


# ---------------------------------------------------------------- several endpoints

MIXED_HINT = "--allow-mixed-endpoints runs them anyway"
TEMPLATE_PATHS = ("/tokenizer_info", "/props")  # vLLM and ds4-server; llama.cpp's server


@dataclass(frozen=True)
class EndpointCheck:
    """What the probe before a run found out about one endpoint."""

    url: str                          # as the user gave it
    error: str = ""                   # why it does not answer (one line), "" when it does
    models: tuple[str, ...] = ()      # the ids of its model list (none: it has no list)
    template_sha256: str = ""         # its chat template's SHA-256, "" when it does not expose it
    findings: tuple[Finding, ...] = ()
    stop: str = ""                    # a required feature is missing (the line to stop with)
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Settled:
    usable: tuple[EndpointCheck, ...]  # the endpoints the run uses, in the order given
    notes: tuple[str, ...]
    error: tuple[str, ...]             # the lines to stop the run with; () when it can go on


def template_sha256(client: httpx.Client, root: str, timeout_s: float = 10.0) -> str:
    """SHA-256 of the chat template the server at `root` exposes, "" when it exposes none."""
    for path in TEMPLATE_PATHS:
        try:
            resp = client.get(root + path, headers={"Accept": "application/json"}, timeout=timeout_s)
            doc = resp.json() if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            continue
        template = doc.get("chat_template") if isinstance(doc, dict) else None
        if isinstance(template, str) and template:
            return hashlib.sha256(template.encode("utf-8")).hexdigest()
    return ""


def differences(checks: Sequence[EndpointCheck]) -> list[str]:
    """One line per property the endpoints disagree on: their model ids, their chat template (among
    those that expose one) and each probed feature's verdict. Endpoints that do not know a value
    (no model list, no exposed template, not probed) take no part in its comparison."""
    out = []

    def compare(what: str, values: list[tuple[str, str]]) -> None:
        if len({v for _, v in values}) > 1:
            out.append(f"{what} differs: " + "; ".join(f"{url} {v}" for url, v in values))

    compare("served model", [(c.url, ", ".join(c.models)) for c in checks if c.models])
    compare("chat template", [(c.url, f"sha256 {c.template_sha256[:12]}") for c in checks if c.template_sha256])
    features = list(dict.fromkeys(f.feature for c in checks for f in c.findings))
    for feature in features:
        compare(f"capability {feature!r}", [(c.url, f.verdict) for c in checks for f in c.findings
                                             if f.feature == feature])
    return out


def settle(checks: Sequence[EndpointCheck], allow_mixed: bool) -> Settled:
    """Which endpoints a run uses and what to print (see the module docstring). One endpoint stops
    the run with its own line, exactly as a run against a single server always has."""
    answering = [c for c in checks if not c.error]
    if not answering:
        if len(checks) == 1:
            return Settled((), (), (checks[0].error,))
        return Settled((), (), (f"none of the {len(checks)} endpoints answers", *(c.error for c in checks)))
    notes = [f"{c.error}: left out of the run" for c in checks if c.error]
    stopped = [c for c in answering if c.stop]
    if len(stopped) == len(answering):
        return Settled((), tuple(notes), (stopped[0].stop,))
    diffs = differences(answering)
    if diffs and not allow_mixed:
        return Settled((), tuple(notes), (f"the endpoints differ ({MIXED_HINT}):", *diffs))
    notes += [f"mixed endpoints: {d}" for d in diffs]
    notes += [f"{c.stop}: left out of the run" for c in stopped]
    usable = tuple(c for c in answering if not c.stop)
    notes += list(dict.fromkeys(n for c in usable for n in c.notes))
    return Settled(usable, tuple(notes), ())


def first_model(client: httpx.Client, root: str, deadline: float) -> str | None:
    """The first model id the server at `root` lists, None when it lists none (or has no list);
    ProbeUnreachable when it cannot be reached or refuses the key."""
    try:
        resp = client.get(root + "/v1/models", timeout=max(0.1, deadline - time.monotonic()))
    except httpx.HTTPError as e:
        raise ProbeUnreachable(f"cannot reach the server at {root}: {reason(e)}") from None
    if resp.status_code in (401, 403):
        raise ProbeUnreachable(f"the server at {root} refused the request (HTTP {resp.status_code}); "
                               f"check --api-key")
    try:
        ids = served_model_ids(resp.json())
    except ValueError:
        return None
    return ids[0] if ids else None


def _send(client: httpx.Client, root: str, probe: Probe, timeout_s: float) -> Reply:
    url = root + ENDPOINTS[probe.endpoint]
    try:
        with client.stream("POST", url, json=probe.body, timeout=timeout_s) as resp:
            if "text/event-stream" in resp.headers.get("content-type", ""):
                return _read_stream(resp)
            resp.read()
    except httpx.ConnectError as e:
        raise ProbeUnreachable(f"cannot reach the server at {root}: {reason(e)}") from None
    except httpx.HTTPError as e:
        return Reply(error=f"{type(e).__name__}: {reason(e)}")
    if resp.status_code != 200:
        return Reply(resp.status_code, error=error_message(resp.text))
    try:
        doc = resp.json()
    except ValueError:
        return Reply(resp.status_code, error=f"the reply is not JSON: {resp.text[:80]!r}")
    if not isinstance(doc, dict):
        return Reply(resp.status_code, error="the reply is not a JSON object")
    return Reply(resp.status_code, doc=doc)


def _read_stream(resp: httpx.Response) -> Reply:
    chunks, done = [], False
    try:
        for line in resp.iter_lines():
            obj = sse.decode_data_line(line)
            if obj == sse.DONE:
                done = True
                break
            if obj is not None:
                chunks.append(obj)
    except sse.StreamFault as e:
        return Reply(resp.status_code, streamed=True, error=str(e))
    except httpx.HTTPError as e:
        return Reply(resp.status_code, streamed=True, error=f"{type(e).__name__}: {reason(e)}")
    if resp.status_code != 200:
        return Reply(resp.status_code, streamed=True, error="an error answered as a stream")
    return Reply(resp.status_code, chunks=tuple(chunks), streamed=True, done=done)
