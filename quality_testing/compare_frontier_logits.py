"""Compare the engine's next-token logits with the stored references; exit 1 past a threshold.

    python -m quality_testing.compare_frontier_logits [--weights packed|float32] [--only ID ...]
                                                      [--server URL]

The engine runs in-process through its public session API, as the server uses it: for each
compared position p (ascending) `session.sync(ids[:p+1])` prefills the new tokens in the
engine's own chunks, reusing what the session already holds, and `session.logits` is the
vector compared. One session serves all cases in manifest order, so the long prompts, which
share their opening, also exercise prefix reuse.

Per case and position it reports max |Δlogit|, RMS Δlogit, KL(reference || engine), top-1
agreement, top-5/top-20 overlap and Δp of the reference's top token (see
quality_testing.metrics), then the mean and the worst over the set, as a tabulate table.
A case fails when any position crosses a manifest threshold (max_kl, max_abs_dlogit,
max_dp_top), when its top-1 agreement is below min_top1, or when the engine tokenizes the
prompt differently from the ids the reference was computed on (its logits are still
compared on the reference's ids). References made from another GGUF are refused.

With `--server URL` each case's frontier is also asked of a running ds4-server (or any
OpenAI-compatible server) through `/v1/completions` with the prompt as token ids,
`max_tokens=1`, `temperature=0` and `logprobs=20`: the top-20 alternatives, keyed by token
text, are compared with the reference's top tokens' texts (top-1 agreement, top-5/top-20
overlap, Δp of the reference's top token). The server part fails a case when the
reference's top token is missing from the server's top 20 or its |Δp| crosses max_dp_top.
The server must serve the same GGUF; nothing here can check that beyond the numbers.
It does not render references (see render_references).
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import click
import numpy as np
from tabulate import tabulate

from quality_testing import metrics as mx
from quality_testing import refset as rs


@dataclass(frozen=True)
class CompareConfig:
    """One comparison run; each field is one command-line flag."""

    model: str | None = None  # GGUF path; None: the embedded model
    weights: str = "packed"  # engine weight format under test
    device: str = "cpu"  # engine device
    manifest: str = str(rs.MANIFEST)  # manifest to read (references/ and prompts/ sit beside it)
    only: tuple[str, ...] = ()  # case ids; empty: all
    server: str | None = None  # base URL of a server to check the frontier's top-20 logprobs too


@dataclass(frozen=True)
class ServerStats:
    """The frontier as a server reports it, against the reference (texts stand for tokens)."""

    top1: float
    overlap5: float
    overlap20: float
    dp_top: float | None  # None: the reference's top token is not among the server's alternatives


def compare_top_texts(ref: np.ndarray, top: dict[str, float], text_of) -> ServerStats:
    """Pure: reference logits [n_vocab] vs a server's {token text: logprob} top list."""
    order = np.argsort(-ref.astype(np.float64))[:20]
    ref_texts = [text_of(int(i)) for i in order]
    eng = sorted(top, key=lambda t: top[t], reverse=True)
    p_ref = float(np.exp(mx.log_softmax(ref)[order[0]]))
    dp = float(np.exp(top[ref_texts[0]]) - p_ref) if ref_texts[0] in top else None
    return ServerStats(
        top1=1.0 if eng and eng[0] == ref_texts[0] else 0.0,
        overlap5=len(set(ref_texts[:5]) & set(eng[:5])) / 5,
        overlap20=len(set(ref_texts) & set(eng[:20])) / 20,
        dp_top=dp,
    )


def server_top_logprobs(url: str, ids: Sequence[int], k: int = 20, timeout: float = 300.0) -> dict[str, float]:
    import httpx

    body = {"prompt": list(ids), "max_tokens": 1, "temperature": 0, "logprobs": k}
    r = httpx.post(url.rstrip("/") + "/v1/completions", json=body, timeout=timeout)
    if r.status_code != 200:
        raise rs.RefSetError(f"server answered {r.status_code}: {r.text[:200]}")
    try:
        return dict(r.json()["choices"][0]["logprobs"]["top_logprobs"][0])
    except (KeyError, IndexError, TypeError, ValueError):
        raise rs.RefSetError("server reply has no completion top_logprobs") from None


@dataclass
class CaseResult:
    case: rs.RefCase
    positions: list[int]
    stats: list[mx.PositionStats]
    tokens_match: bool
    seconds: float
    failures: list[str] = field(default_factory=list)
    server: ServerStats | None = None

    @property
    def ok(self) -> bool:
        return not self.failures


def engine_logits_at(session: Any, ids: Sequence[int], positions: Sequence[int]) -> np.ndarray:
    """Engine logits [P, n_vocab] after each position, via session.sync on growing prefixes."""
    rows = []
    for p in sorted(positions):
        session.sync(list(ids[: p + 1]))
        rows.append(session.logits.float().cpu().numpy())
    return np.stack(rows)


def judge(case: rs.RefCase, stats: Sequence[mx.PositionStats], positions: Sequence[int], tokens_match: bool) -> list[str]:
    """Threshold crossings of one case, as short messages (empty: the case passes)."""
    out = []
    if not tokens_match:
        out.append("prompt tokenizes differently from the reference")
    for p, s in zip(positions, stats):
        if s.kl > case.max_kl:
            out.append(f"pos {p}: KL {s.kl:.4g} > {case.max_kl:g}")
        if s.max_abs > case.max_abs_dlogit:
            out.append(f"pos {p}: max|Δlogit| {s.max_abs:.3g} > {case.max_abs_dlogit:g}")
        if abs(s.dp_top) > case.max_dp_top:
            out.append(f"pos {p}: |Δp top| {abs(s.dp_top):.3g} > {case.max_dp_top:g}")
    top1 = float(np.mean([s.top1 for s in stats])) if stats else 1.0
    if top1 < case.min_top1:
        out.append(f"top-1 agreement {top1:.2f} < {case.min_top1:g}")
    return out


def compare_case(model: Any, session: Any, case: rs.RefCase, ref: rs.Reference, prompts_dir: Path) -> CaseResult:
    t0 = time.perf_counter()
    text = rs.prompt_text(rs.read_prompt_file(case.prompt, prompts_dir), model.render_chat)
    ids = [int(i) for i in ref.ids]
    tokens_match = model.prompt_ids(model.tokenize(text, special=True)) == ids
    positions = [int(p) for p in ref.positions]
    eng = engine_logits_at(session, ids, positions)
    stats = mx.compare_rows(ref.logits.astype(np.float32), eng, float16_ref=True)
    res = CaseResult(case, positions, stats, tokens_match, time.perf_counter() - t0)
    res.failures = judge(case, stats, positions, tokens_match)
    return res


def judge_server(case: rs.RefCase, st: ServerStats) -> list[str]:
    if st.dp_top is None:
        return ["server: the reference's top token is not in the server's top 20"]
    if abs(st.dp_top) > case.max_dp_top:
        return [f"server: |Δp top| {abs(st.dp_top):.3g} > {case.max_dp_top:g}"]
    return []


def run_compare(cfg: CompareConfig, echo=click.echo) -> list[CaseResult]:
    from engine import default_model_path, load_model

    path = cfg.model or default_model_path()
    manifest_path = Path(cfg.manifest)
    cases = rs.read_manifest(manifest_path, cfg.only)
    cases = [c for c in cases if not cfg.only or c.id in cfg.only]
    sha = rs.sha256_file(path)
    refs = {}
    for c in cases:  # refuse before spending time on the model
        refs[c.id] = rs.read_reference(manifest_path.parent / "references" / c.reference_file)
        rs.check_reference(c, refs[c.id], sha)
    need = max(len(r.ids) for r in refs.values())
    model = load_model(path, ctx=need, device=cfg.device, weights=cfg.weights)
    session = model.new_session()
    results = [compare_case(model, session, c, refs[c.id], manifest_path.parent / "prompts") for c in cases]
    if cfg.server:
        for r in results:
            ref = refs[r.case.id]
            top = server_top_logprobs(cfg.server, [int(i) for i in ref.ids])
            r.server = compare_top_texts(ref.logits[-1].astype(np.float32), top, lambda i: model.detokenize([i]))
            r.failures += judge_server(r.case, r.server)
    return results


def _f(x: float) -> str:
    return f"{x:.3g}"


def render_report(results: Sequence[CaseResult], weights: str) -> str:
    headers = ["case", "kind", "pos", "max|Δ|", "rms Δ", "KL", "top1", "top5", "top20", "Δp top", "status", "s"]
    rows = []
    for r in results:
        for i, (p, s) in enumerate(zip(r.positions, r.stats)):
            status = ("ok" if r.ok else "FAIL") if i == len(r.positions) - 1 else ""
            rows.append([r.case.id if i == 0 else "", r.case.kind if i == 0 else "", p, _f(s.max_abs), _f(s.rms),
                         _f(s.kl), int(s.top1), _f(s.overlap5), _f(s.overlap20), f"{s.dp_top:+.3g}", status,
                         f"{r.seconds:.1f}" if status else ""])
    all_stats = [s for r in results for s in r.stats]
    summary = mx.summarize(all_stats)
    for label, st in (("mean", summary.mean), ("worst", summary.max)):
        rows.append([label, "", summary.n, _f(st.max_abs), _f(st.rms), _f(st.kl), _f(st.top1), _f(st.overlap5),
                     _f(st.overlap20), f"{st.dp_top:+.3g}", "", ""])
    lines = [f"engine weights={weights} vs {results[0].case.reference} ({len(results)} cases, {summary.n} positions)",
             tabulate(rows, headers=headers, disable_numparse=True)]
    served = [r for r in results if r.server is not None]
    if served:
        srows = [[r.case.id, r.positions[-1], int(r.server.top1), _f(r.server.overlap5), _f(r.server.overlap20),
                  "missing" if r.server.dp_top is None else f"{r.server.dp_top:+.3g}"] for r in served]
        lines += ["server frontier (top-20 logprobs) vs reference",
                  tabulate(srows, headers=["case", "pos", "top1", "top5", "top20", "Δp top"], disable_numparse=True)]
    for r in results:
        for msg in r.failures:
            lines.append(f"FAIL {r.case.id}: {msg}")
    return "\n".join(lines)


@click.command()
@click.option("--model", default=None, help="GGUF file (default: the embedded model).")
@click.option("--weights", type=click.Choice(["packed", "float32"]), default="packed", show_default=True,
              help="Engine weight format to test.")
@click.option("--device", default="cpu", show_default=True, help="Engine device (cpu, cuda).")
@click.option("--manifest", default=str(rs.MANIFEST), show_default=True, help="Reference-set manifest.")
@click.option("--only", multiple=True, help="Compare only this case id (repeatable).")
@click.option("--server", default=None, help="Also check each frontier's top-20 logprobs from this server URL.")
def main(model, weights, device, manifest, only, server) -> None:
    """Compare engine logits with the stored references; exit 1 when a threshold is crossed."""
    cfg = CompareConfig(model=model, weights=weights, device=device, manifest=manifest, only=tuple(only),
                        server=server)
    t0 = time.perf_counter()
    try:
        results = run_compare(cfg)
    except (rs.RefSetError, OSError) as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    except Exception as e:  # ModelLoadError and the like: one line, no traceback
        click.echo(f"error: {type(e).__name__}: {e}", err=True)
        sys.exit(2)
    click.echo(render_report(results, weights))
    failed = [r.case.id for r in results if not r.ok]
    click.echo(f"{len(results) - len(failed)}/{len(results)} cases within thresholds "
               f"({time.perf_counter() - t0:.1f} s)")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
