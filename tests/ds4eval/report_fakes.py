"""Hand-made trace records for the report tests: a run with sources, thinking and hostile text,
a pair of runs with flips, and repeated runs."""

from __future__ import annotations

from ds4eval.run import trace as tr
from ds4eval.verdict import compare

HOSTILE = '</script><img src=x onerror="alert(1)">&amp;'


def rec(i: int, status: str = "PASSED", picked: str | None = "4", *, source: str = "alpha", expected: str = "4",
        output: str | None = None, **kw) -> tr.TraceRecord:
    fields = dict(
        index=i, source=source, id=f"c{i}", status=status, picked=picked, expected=expected,
        answer_kind="integer", domain="math", suite="toy", model="Toy 1B", backend="engine", prompt_tokens=20,
        gen_tokens=10 + 3 * i, elapsed_s=0.5, temperature=0.0, case_hash=f"sha256:{i:064x}", max_tokens=128,
        prompt_sha256=f"{i:064x}", model_sha256="ab" * 32, chat_template_sha256="cd" * 32,
        bos_eos="add_bos=no bos=1 eos=2", device="cpu", kv_type="float16", extractor_version="e1",
        ds4eval_version="0.1.0", git_commit="f" * 40, system_prompt="Be brief.", question_prompt=f"What is {i}?",
        model_output=output if output is not None else (f"Answer: {picked}" if picked else "I do not know"))
    fields.update(kw)
    return tr.TraceRecord(**fields)


def run_records(n: int = 12) -> list[tr.TraceRecord]:
    """Two sources, a third of the cases failing, one with thinking, one hostile."""
    out = []
    for i in range(1, n + 1):
        failed = i % 3 == 0
        out.append(rec(i, "FAILED" if failed else "PASSED", "5" if failed else "4",
                       source="alpha" if i <= n // 2 else "beta"))
    out[0].model_output = "<think>Two and two make four, says THINKING-TEXT.</think>\nAnswer: 4"
    out[0].thinking, out[0].think_close = True, "natural"
    out[1].question_prompt = f"Is this safe? {HOSTILE}"
    out[1].model_output = f"<think>{HOSTILE}</think>Answer: 4 {HOSTILE}"
    out[1].picked = HOSTILE
    out.append(rec(n + 1, "ERROR", None, source="beta", error="boom", output=""))
    return out


def flip_pair(n: int = 10) -> tuple[list[tr.TraceRecord], list[tr.TraceRecord]]:
    """BASE passes every case; NEW fails c2 (wrong answer) and c3 (no answer) and changes lengths."""
    base = [rec(i, source="alpha" if i % 2 else "beta") for i in range(1, n + 1)]
    new = [rec(i, source="alpha" if i % 2 else "beta", gen_tokens=40 + i) for i in range(1, n + 1)]
    new[1] = rec(2, "FAILED", "7", source="beta", output="<think>hmm NEW-THINKING</think>Answer: 7")
    new[2] = rec(3, "FAILED", None, source="alpha", output="<think>never closed")
    return base, new


def trace_text(records) -> str:
    return "".join(map(tr.format_record, records))


def comparison(base, new, **kw) -> compare.Comparison:
    return compare.compare(compare.read_run(trace_text(base), "base.trace"),
                           compare.read_run(trace_text(new), "new.trace"), **kw)


def repeated_records(k: int = 3) -> list[tr.TraceRecord]:
    """Sampled repeats: a stable pass, a stable fail and a flaky case; plus a greedy case whose
    outputs differ between repeats (non-deterministic)."""
    out = []
    for r in range(k):
        out.append(rec(1, repeat=r, temperature=0.7, seed=10 + r, source="rep"))
        out.append(rec(2, "FAILED", "5", repeat=r, temperature=0.7, seed=10 + r, source="rep"))
        flaky = "PASSED" if r % 2 == 0 else "FAILED"
        out.append(rec(3, flaky, "4" if flaky == "PASSED" else "6", repeat=r, temperature=0.7, seed=10 + r,
                       source="rep"))
    return out


def greedy_nondeterministic(k: int = 3) -> list[tr.TraceRecord]:
    outs = ["So the sum is 4.\nAnswer: 4"] * (k - 1) + ["So the total is 5.\nAnswer: 5"]
    return [rec(7, "PASSED" if "4" in o else "FAILED", "4" if "4" in o else "5", repeat=r, output=o, source="gamma")
            for r, o in enumerate(outs)]


def counted_repeats(counts: dict[str, int], k: int = 5) -> list[tr.TraceRecord]:
    """Sampled repeats of source "s": case id -> how many of its k repeats pass (the first ones)."""
    out = []
    for n, (cid, passes) in enumerate(counts.items(), start=1):
        for r in range(k):
            ok = r < passes
            out.append(rec(n, "PASSED" if ok else "FAILED", "4" if ok else "5", source="s", id=cid, repeat=r,
                           temperature=0.7, seed=1 + r))
    return out
