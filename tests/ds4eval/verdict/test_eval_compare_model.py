"""`ds4-eval --compare` end to end on the embedded model: two greedy sanity runs that differ only in
their token budget (needs the weights: marked `model`)."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from ds4eval import cli
from ds4eval.cases.suites import load_suite
from ds4eval.config import EvalConfig
from ds4eval.run.provenance import file_sha256, split_tokens
from ds4eval.run.runner import Runner
from ds4eval.run.trace import read_trace

# A case that runs past 32 tokens at a 128-token budget (on this engine it names the right line
# within 32 tokens and a wrong one later), and two short ones that do not depend on the budget.
CASES = ("lines-c-out-of-bounds", "int-add-small", "choice-sky-colour")


@pytest.mark.model
@pytest.mark.slow
def test_budget_32_against_128_flips_exactly_the_cases_the_traces_say(tmp_path):
    import engine

    from ds4eval.run.backends.engine_backend import EngineBackend

    model = engine.load_model()
    backend = EngineBackend(model, engine)
    by_id = {c.id: c for c in load_suite("sanity", Path("/nonexistent"))}
    selected = [by_id[i] for i in CASES]
    paths = []
    for tokens in (32, 128):
        path = tmp_path / f"n{tokens}.trace"
        Runner(EvalConfig(tokens=tokens, temperature=0.0, trace=str(path)), selected, backend).run()
        paths.append(path)
    r = CliRunner().invoke(cli.main, ["--compare", *map(str, paths), "--format", "json"])
    assert r.exit_code in (0, 1), r.output
    out = json.loads(r.output)

    base = {x.id: x for x in read_trace(paths[0]).records}
    new = {x.id: x for x in read_trace(paths[1]).records}
    want = {(i, "pass->fail" if base[i].status == "PASSED" else "fail->pass", base[i].picked, new[i].picked)
            for i in CASES if base[i].status != new[i].status}
    got = {(f["id"], f["direction"], f["base_picked"], f["new_picked"]) for f in out["flips"]}
    assert got == want and want, (got, want)  # a 32-token budget cuts some of these answers off
    t = out["total"]
    assert (t["cases"], t["base_passed"], t["new_passed"]) == \
        (len(CASES), sum(x.status == "PASSED" for x in base.values()), sum(x.status == "PASSED" for x in new.values()))
    assert r.exit_code == (1 if out["regression"] else 0)
    # Only the budget differs: same model file, same rendered prompts, no warning.
    assert out["warnings"] == []
    assert [(d["field"], d["base"], d["new"]) for d in out["differences"]] == [("max_tokens", "32", "128")]
    sha = file_sha256(model.path)
    for x in list(base.values()) + list(new.values()):
        assert x.model_sha256 == sha and x.kv_type == "float16" and x.chat_template_sha256 not in ("", "none")
        assert x.prompt_sha256 == new[x.id].prompt_sha256
        assert len(split_tokens(x.rendered_prompt, x.rendered_token_ends)) == x.prompt_tokens
        assert x.rendered_prompt == backend.render(backend_job(x, by_id), False)


def backend_job(rec, by_id):
    """The job the runner built for a recorded case (only its prompts matter to `render`)."""
    from ds4eval.cases import prompts
    from ds4eval.run.runner import GenerationJob

    c = by_id[rec.id]
    return GenerationJob(index=0, case=c, system_prompt=prompts.system_prompt(),
                         question_prompt=prompts.question_prompt(c), max_tokens=rec.max_tokens, temperature=0.0,
                         top_p=1.0, min_p=0.0, seed=None, think=False, think_soft_reserve=0, think_hard_reserve=0)
