"""Decoding constraints at the token level: `server.constraints` through `server.jobs.TokenDecoder`.

A byte-level fake vocabulary and random logits stand in for a model: whatever the logits
prefer, a JSON-schema constraint must yield a document that parses and validates (a
property over hypothesis-generated schemas), and the tool-call opening must be the syntax's
own. No weights are loaded.
"""
from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server.constraints import (MAX_MESSAGE_CHARS, MAX_SCHEMA_BYTES, MAX_SCHEMA_MEMBERS, GrammarConstraint, brief, grammar_error,
                                json_grammar, literal_choice, required_cycle, schema_members, schema_problem,
                                unpack_mask)
from server.jobs import Finished, GenerationRequest, Job, TextDelta, TokenDecoder
from server.tools.records import ToolCall
from server.tools.registry import SYNTAXES
from server_fake_engine import FAKE_ENGINE, FakeModel

# Random logits favour the characters that close things, so most documents end well within the budget.
CLOSERS = b'"}],0123456789'


def run_decoder(model, new_constraint, *, seed: int, budget: int = 400, temperature: float = 1.0):
    """(text, finish reason) of one generation decoded from random logits under the constraint."""
    req = GenerationRequest(prompt_text="", prompt_ids=(1,), max_tokens=budget, new_constraint=new_constraint)
    events = []
    job = Job(1, req, events.append)
    decoder = TokenDecoder(model, job)
    gen = torch.Generator().manual_seed(seed)
    bias = torch.zeros(model.n_vocab)
    bias[list(CLOSERS)] = 3.0
    sampler = FAKE_ENGINE.Sampler(FAKE_ENGINE.SamplingParams(temperature=temperature, seed=seed), model.eos_ids)
    for _ in range(budget):
        logits = torch.randn(model.n_vocab, generator=gen) * 2 + bias
        if not decoder.accept(decoder.choose(logits, sampler)):
            break
    decoder.finish("length")
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    return text, next(e for e in events if isinstance(e, Finished)).finish_reason


def json_constraint(schema):
    grammar = json_grammar(schema)
    return lambda model, _splitter: GrammarConstraint(model, grammar)


NAMES = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=6)
LEAVES = st.one_of(
    st.just({"type": "string"}), st.just({"type": "integer"}), st.just({"type": "number"}),
    st.just({"type": "boolean"}),
    st.lists(st.one_of(NAMES, st.integers(-50, 50), st.booleans()), min_size=1, max_size=4, unique=True)
    .map(lambda values: {"enum": values}))


def _object(props):
    return st.lists(st.sampled_from(sorted(props)), unique=True).map(
        lambda req: {"type": "object", "properties": props, "required": req, "additionalProperties": False})


SCHEMAS = st.recursive(
    LEAVES,
    lambda inner: st.one_of(
        inner.map(lambda s: {"type": "array", "items": s, "maxItems": 3}),
        st.dictionaries(NAMES, inner, min_size=1, max_size=3).flatmap(_object)),
    max_leaves=6)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schema=SCHEMAS, seed=st.integers(0, 2**16))
def test_output_under_a_schema_parses_and_validates(schema, seed):
    model = FakeModel()
    text, reason = run_decoder(model, json_constraint(schema), seed=seed)
    if reason == "length":  # a document cut by the token limit need not parse
        return
    assert reason == "stop"
    jsonschema.validate(json.loads(text), schema)


def test_most_generations_complete_within_the_budget():
    model = FakeModel()
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"},
                                               "tags": {"type": "array", "items": {"enum": ["a", "b"]}}},
              "required": ["name", "n"]}
    outcomes = [run_decoder(model, json_constraint(schema), seed=s) for s in range(10)]
    done = [json.loads(t) for t, r in outcomes if r == "stop"]
    assert len(done) >= 8
    for doc in done:
        jsonschema.validate(doc, schema)


def test_json_object_without_schema_is_an_object_and_ends_with_stop():
    text, reason = run_decoder(FakeModel(), json_constraint(None), seed=3)
    assert reason == "stop" and isinstance(json.loads(text), dict)


def test_the_document_end_is_the_finish_not_eos():
    # A required property and an enum value: the fake's greedy choice is forced all the way.
    schema = {"type": "object", "properties": {"k": {"enum": ["yes"]}}, "required": ["k"]}
    text, reason = run_decoder(FakeModel(), json_constraint(schema), seed=0, temperature=0.0)
    assert (text, reason) == ('{"k": "yes"}', "stop")


def test_the_token_limit_cuts_a_document_with_length():
    text, reason = run_decoder(FakeModel(), json_constraint({"type": "array", "items": {"type": "string"}}),
                               seed=1, budget=3)
    assert reason == "length" and len(text) <= 3


def test_mask_unpacking_is_little_endian_per_word():
    words = np.array([1 | (1 << 31), 1 << 2], dtype="<u4").tobytes()
    mask = unpack_mask(words, 40)
    assert mask.nonzero().flatten().tolist() == [0, 31, 34]


def test_grammar_errors_are_reported_not_raised():
    assert grammar_error(json_grammar({"type": "object"})) is None
    assert grammar_error(json_grammar({"type": "frobnicate"}))


@pytest.mark.parametrize("syntax", sorted(SYNTAXES))
def test_call_prefix_is_how_the_syntax_renders_a_call(syntax):
    s = SYNTAXES[syntax]
    rendered = s.render_calls([ToolCall(id="c1", name="get_weather", arguments={"city": "Paris"})])
    assert rendered.startswith(s.call_prefix("get_weather"))


def test_an_opening_choice_picks_among_names_then_releases():
    model = FakeModel()
    texts = [SYNTAXES["hermes"].call_prefix(n) for n in ("get_weather", "get_time")]
    c = GrammarConstraint(model, literal_choice(texts), release=True)
    taken = []
    while (step := c.decide()) is not None:
        token = step.forced if step.forced is not None else int(step.allowed.nonzero()[-1])
        c.advance(token)
        taken.append(token)
    assert bytes(taken).decode() in texts and not c.complete


# --- both inference loops on a tiny random model: each row keeps its own constraint -----------

# Finite documents: whatever a random model prefers, each ends within the token budget.
FINITE = [
    {"type": "object", "properties": {"a": {"enum": ["x", "yy"]}, "b": {"type": "boolean"}},
     "required": ["a", "b"], "additionalProperties": False},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 2},
    {"type": "object", "properties": {"k": {"type": "array", "items": {"enum": [1, 2, 3]}, "maxItems": 2}},
     "required": ["k"], "additionalProperties": False},
]


@pytest.mark.parametrize("n_slots", [1, 3])
def test_each_request_follows_its_own_schema_in_both_loops(tiny_model, n_slots):
    tiny = tiny_model
    import queue

    from server.prompting import prompt_ids
    from server.jobs import SamplingSpec
    from server.worker import InferenceWorker

    w = InferenceWorker(tiny, n_slots=n_slots)
    w.start()
    try:
        queues, jobs = [], []
        for i, schema in enumerate(FINITE):
            text = tiny.render_chat([{"role": "user", "content": f"answer number {i}"}])
            r = GenerationRequest(prompt_text=text, prompt_ids=tuple(prompt_ids(tiny, text)), max_tokens=80,
                                  sampling=SamplingSpec(temperature=0.9, seed=i), new_constraint=json_constraint(schema))
            q: queue.Queue = queue.Queue()
            jobs.append(w.submit(r, q.put))
            queues.append(q)
        for job, q, schema in zip(jobs, queues, FINITE):
            events = []
            while not events or not isinstance(events[-1], Finished):
                events.append(q.get(timeout=60))
            assert events[-1].finish_reason == "stop"
            jsonschema.validate(json.loads("".join(e.text for e in events if isinstance(e, TextDelta))), schema)
            assert job.stats.n_constrained > 0
    finally:
        w.stop()
    if n_slots > 1:
        assert sorted(j.stats.slot for j in jobs) == [0, 1, 2]


# --- schema checks before any grammar work ---------------------------------------------------

@pytest.mark.parametrize("schema,cycle", [
    ({"$ref": "#/$defs/n", "$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}},
                                           "required": ["c"]}}}, ["#/$defs/n", "properties/c", "#/$defs/n"]),
    ({"type": "array", "minItems": 1, "items": {"$ref": "#"}}, ["#", "items", "#"]),
    ({"allOf": [{"$ref": "#/definitions/a"}], "definitions": {"a": {"allOf": [{"$ref": "#"}]}}},
     ["#", "allOf/0", "#/definitions/a", "allOf/0", "#"]),
])
def test_a_cycle_through_required_members_is_found(schema, cycle):
    assert required_cycle(schema) == cycle
    assert "no finite JSON document matches the schema" in schema_problem(schema)


@pytest.mark.parametrize("schema", [
    {"$ref": "#/$defs/n", "$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}}}},
    {"type": "array", "items": {"$ref": "#"}},  # an empty array ends it
    {"anyOf": [{"type": "null"}, {"type": "object", "properties": {"c": {"$ref": "#"}}, "required": ["c"]}]},
    {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a", "missing"]},
    {"$ref": "https://example.com/remote"},
    None,
])
def test_finite_schemas_pass(schema):
    assert schema_problem(schema) is None


def test_the_size_limit_counts_compact_json():
    fits = {"enum": ["x" * (MAX_SCHEMA_BYTES - 20)]}
    assert schema_problem(fits) is None
    assert "(MAX_SCHEMA_BYTES)" in schema_problem({"enum": ["x" * MAX_SCHEMA_BYTES]})


def test_the_members_limit_counts_properties_and_alternatives_everywhere():
    def obj(n: int) -> dict:
        return {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(n)}}

    assert schema_problem(obj(MAX_SCHEMA_MEMBERS)) is None
    assert "(MAX_SCHEMA_MEMBERS)" in schema_problem(obj(MAX_SCHEMA_MEMBERS + 1))
    # Spread over nested objects, $defs and anyOf branches, they add up.
    half = MAX_SCHEMA_MEMBERS // 2
    spread = {"$defs": {"d": obj(half)}, "anyOf": [obj(half - 2), {"type": "null"}]}
    assert schema_problem(spread) is None  # half + (half - 2) properties + 2 alternatives
    spread["anyOf"].append({"type": "integer"})
    assert "(MAX_SCHEMA_MEMBERS)" in schema_problem(spread)
    assert schema_members(spread) == MAX_SCHEMA_MEMBERS + 1


def test_a_huge_schema_is_refused_by_its_members_before_it_is_serialised(monkeypatch):
    """10,000 properties (about 0.3 MB): refused on the members count, which stops at the limit,
    without serialising the schema to measure its size."""
    import server.constraints as constraints

    huge = {"type": "object", "properties": {f"field{i:05d}": {"type": "string"} for i in range(10_000)}}
    monkeypatch.setattr(constraints.json, "dumps", lambda *a, **k: pytest.fail("the schema was serialised"))
    assert "(MAX_SCHEMA_MEMBERS)" in constraints.schema_problem(huge)


def test_grammar_messages_are_one_short_line():
    state_dump = "parser error: Too many items (limit 50000)\n<state>\nTokens: ...\n" + "x" * 5000
    assert brief(state_dump) == "parser error: Too many items (limit 50000)"
    assert len(brief("y" * 5000)) == MAX_MESSAGE_CHARS


def test_a_grammar_engine_failure_while_decoding_ends_the_generation_cleanly(caplog):
    """The recursion check is bypassed here: the engine itself meets such a grammar. The request
    ends with a finish reason and one short warning, never an exception (a 500)."""
    recursive = {"$ref": "#/$defs/n", "$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}},
                                                      "required": ["c"]}}}
    made = []

    def new_constraint(model, splitter):
        made.append(GrammarConstraint(model, json_grammar(recursive)))
        return made[-1]

    with caplog.at_level("WARNING", logger="ds4.server.constraints"):
        text, reason = run_decoder(FakeModel(), new_constraint, seed=1, budget=600)
    # The engine meets its limit at the first token ("Too many items"): one line, no parser state.
    assert made[0].failure is not None and "Too many items" in made[0].failure
    assert reason == "stop" and text == "{"
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "gave up" in lines[0] and "\n" not in lines[0] and "<state>" not in lines[0]
