"""`ds4-eval determinism` catches a server whose answers depend on the batch.

The real ds4-server over the embedded model (marked `model`), its network wrapped so that every
decoding step of more than one row promotes each row's runner-up token (the two best logits
swapped); one-row steps and prefill chunks are untouched (a prompt's last token that joins a
batched step as its row is not). A request alone, behind a cached prefix or
streamed therefore gets the model's own greedy answer, and one decoded beside others does not:
the run must say mixed and n=2 vary, at exactly the token where the reference's runner-up took
over, with the reference's own top-2 gap, classed real."""

import httpx
import pytest
import torch
from determinism_server import ds4_eval, serving

from ds4eval.determinism import prompts as own
from ds4eval.determinism.analysis import DEFAULT_MARGIN, read_result
from engine.device_sampling import StepLogits

pytestmark = pytest.mark.model

PROMPTS = 3
MAX_TOKENS = 10
RUN = ("--prompts", PROMPTS, "--repeats", 2, "--concurrency", 2, "--mixed-rounds", 1, "--max-tokens", MAX_TOKENS)


def swap_top2(rows: torch.Tensor) -> torch.Tensor:
    """A copy of `rows` [N, vocab] with each row's largest and second largest values exchanged."""
    out = rows.clone()
    top = torch.topk(rows, 2, dim=-1).indices
    r = torch.arange(rows.shape[0], device=rows.device)
    out[r, top[:, 0]], out[r, top[:, 1]] = rows[r, top[:, 1]], rows[r, top[:, 0]]
    return out


class RunnerUpWhenBatched:
    """Stands in for `model.net`: everything goes to the real network, except that the batched
    decoding step (`decode_started`, which engine.batch.decode_batch starts with several rows,
    and `decode`) returns each row with its runner-up promoted. `batched_steps` counts the
    steps it changed."""

    def __init__(self, net):
        self.net = net
        self.batched_steps = 0

    def __getattr__(self, name):
        return getattr(self.net, name)

    def decode(self, tokens, caches, eos_ids=frozenset()):
        step = self.net.decode(tokens, caches, eos_ids)
        if len(tokens) == 1:
            return step
        self.batched_steps += 1
        return StepLogits.of(swap_top2(step.rows), eos_ids)

    def decode_started(self, tokens, caches, eos_ids=frozenset()):
        step = self.decode(tokens, caches, eos_ids)
        return lambda: step


def test_swap_top2_exchanges_only_the_two_best_of_each_row():
    rows = torch.tensor([[0.5, 3.0, 2.0, -1.0], [5.0, 4.5, 4.75, 0.0]])
    assert swap_top2(rows).tolist() == [[0.5, 2.0, 3.0, -1.0], [4.75, 4.5, 5.0, 0.0]]
    assert rows.tolist()[0] == [0.5, 3.0, 2.0, -1.0]  # the input is left alone


@pytest.fixture(scope="module")
def served(embedded_path):
    from engine import load_model

    model = load_model(embedded_path)
    wrapper = RunnerUpWhenBatched(model.net)
    model.net = wrapper
    with serving(model, batched_session=4) as url:
        yield url, wrapper


@pytest.fixture(scope="module")
def run(served, tmp_path_factory):
    """The CLI's exit status and output, and the result file it wrote."""
    url, _ = served
    out = tmp_path_factory.mktemp("det") / "det.json"
    r = ds4_eval("determinism", "--backend", "openai", "--url", url, *RUN, "--expect", "invariant", "-o", out)
    return r, read_result(out.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def reference(served, run):
    """Each prompt's greedy answer requested alone (one row, untouched): for every generated
    token, the two best (token, logprob) pairs."""
    url, _ = served
    _, result = run
    tops = {}
    with httpx.Client(base_url=url, timeout=60) as client:
        for p in own.own_prompts(PROMPTS):
            body = {"model": result.stack["served_model"],
                    "messages": [{"role": "system", "content": p.system}, {"role": "user", "content": p.user}],
                    "max_tokens": MAX_TOKENS, "temperature": 0.0, "seed": 0, "logprobs": True, "top_logprobs": 2}
            r = client.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            tops[p.key] = [[(a["token"], a["logprob"]) for a in e["top_logprobs"]]
                           for e in r.json()["choices"][0]["logprobs"]["content"]]
    return tops


def test_the_run_is_not_invariant_and_the_cli_says_so(run):
    r, result = run
    assert r.exit_code == 1, r.output
    assert "NOT INVARIANT: varies under" in r.stdout and not result.invariant


def test_batched_conditions_vary_and_one_row_conditions_do_not(run, served):
    _, result = run
    verdicts = {v.condition: v.verdict for v in result.verdicts}
    assert set(verdicts) == {"alone", "mixed C=2", "prefix", "stream", "n=2", "max_tokens"}
    for one_row in ("alone", "prefix", "stream", "max_tokens"):
        assert verdicts[one_row] == "invariant", one_row
    # Three requests started together share decoding steps; n=2's two choices are two rows.
    assert verdicts["mixed C=2"] == "varies" and verdicts["n=2"] == "varies"
    assert served[1].batched_steps > 0


def test_each_divergence_is_the_reference_runner_up_with_its_gap_and_class(run, reference):
    _, result = run
    divergences = [o for o in result.outcomes if o.divergence is not None]
    assert {o.condition for o in divergences} == {"mixed C=2", "n=2"}
    for o in divergences:
        d = o.divergence
        (first, lp1), (second, lp2) = reference[o.prompt][d.index]
        # The first token too may differ: a prompt's last token can be a row of a batched step.
        assert o.unit == "token", o
        assert (d.reference, d.other) == (first, second), o
        assert d.gap == pytest.approx(lp1 - lp2, abs=1e-3), o
        # The swap moves a logit by the whole gap: classed by that gap against the stated margin.
        assert d.klass == ("real" if d.gap > DEFAULT_MARGIN else "near-tie"), o
