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
  and raises `FeatureMissing` (one line) when a required feature is missing.
It knows nothing of the runs that use it: each consumer passes its own `capabilities.Need`s.
"""

from __future__ import annotations

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


def probe_or_stop(url: str, needs: Sequence[Need], model: str | None = None, api_key: str | None = None,
                  budget_s: float = DEFAULT_BUDGET_S, transport: httpx.BaseTransport | None = None) -> list[str]:
    """Probe what `needs` names; raise FeatureMissing for a required feature that is missing,
    else return the notes (one line each)."""
    if not needs:
        return []
    result = run_probe(url, list(dict.fromkeys(n.feature for n in needs)), model, api_key, budget_s, transport)
    stop, notes = check(needs, result.findings)
    if stop:
        raise FeatureMissing(f"the server at {result.url} lacks what this run needs: {stop} ({NO_PROBE_HINT})")
    return notes


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
