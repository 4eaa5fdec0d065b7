"""The engine's Protocols (engine/protocols.py) hold for the real classes and for the test fake.

`isinstance` against a runtime_checkable Protocol only sees that the members exist; each
method's parameters (names, kinds, which have defaults) are compared here too, so a fake
cannot drift from the engine without a test failing.  Runs on a tiny random model.
"""
from __future__ import annotations

import dataclasses
import inspect

import pytest

import engine
from engine.protocols import EngineAPI, ModelLike, Network, SessionLike

from engine_fakes import CHATML, FAKE_ENGINE, FakeModel


def _params(fn) -> list[tuple[str, object, bool]]:
    sig = inspect.signature(fn)
    return [(p.name, p.kind, p.default is not inspect.Parameter.empty)
            for p in sig.parameters.values() if p.name != "self"]


def signature_mismatches(proto: type, obj: object) -> list[str]:
    """Methods of `proto` whose parameters `obj`'s differ from (properties and attributes: presence only)."""
    out = []
    for name, member in vars(proto).items():
        if name.startswith("_") or not inspect.isfunction(member):
            continue
        impl = getattr(type(obj), name, None) or getattr(obj, name)
        if _params(impl) != _params(member):
            out.append(f"{type(obj).__name__}.{name}{inspect.signature(impl)} vs {inspect.signature(member)}")
    return out


def conforms(proto: type, obj: object) -> None:
    assert isinstance(obj, proto), f"{obj!r} lacks members of {proto.__name__}"
    assert signature_mismatches(proto, obj) == []


@pytest.fixture(scope="module")
def real_model(tiny_gguf):
    return engine.load_model(tiny_gguf("llama", "Q4_1"), ctx=128)


def test_the_engine_package_is_an_engine_api():
    assert isinstance(engine, EngineAPI)
    assert (engine.BatchScheduler, engine.GenRequest) == (engine.batch.BatchScheduler, engine.batch.GenRequest)


def test_real_model_session_and_network_conform(real_model):
    conforms(ModelLike, real_model)
    for session in (real_model.new_session(), real_model.new_sessions(2)[1]):
        session.sync([1, 2, 3])  # isinstance reads `logits`, which an empty session does not have
        conforms(SessionLike, session)
    conforms(Network, real_model.net)


@pytest.mark.parametrize("kw", [{}, {"vocab": CHATML, "n_ctx": 1024}, {"thinking": True}])
def test_fake_model_and_session_conform(kw):
    model = FakeModel(**kw)
    conforms(ModelLike, model)
    conforms(SessionLike, model.new_session())


def test_fake_engine_mirrors_the_engine_types():
    assert isinstance(FAKE_ENGINE, EngineAPI)
    real = [f.name for f in dataclasses.fields(engine.SamplingParams)]
    assert [f.name for f in dataclasses.fields(FAKE_ENGINE.SamplingParams)] == real
    for name in ("Sampler", "BatchScheduler"):
        assert _params(getattr(FAKE_ENGINE, name)) == _params(getattr(engine, name)), name
    for name in ("submit", "step", "run"):
        assert _params(getattr(FAKE_ENGINE.BatchScheduler, name)) == _params(getattr(engine.BatchScheduler, name))
    assert FAKE_ENGINE.GenRequest is engine.GenRequest
    assert issubclass(FAKE_ENGINE.Cancelled, Exception)


def test_a_signature_drift_is_caught():
    class Drifted(FakeModel):
        def prompt_ids(self, text: str, special: bool = True) -> list[int]:
            return []

    assert signature_mismatches(ModelLike, Drifted()) and not signature_mismatches(ModelLike, FakeModel())


def test_fake_session_follows_the_script_and_the_engine_rules():
    model = FakeModel("ab", vocab=CHATML, n_ctx=16)
    s = model.new_session()
    ids = model.tokenize("<|im_start|>user\nhi", special=True)
    assert s.sync(ids) == 0 and s.sync(ids) == len(ids) - 1  # like the engine: the last token again
    greedy = FAKE_ENGINE.SamplingParams()
    out = []
    while (tok := s.sample(greedy)) not in model.eos_ids:
        out.append(tok)
        s.eval(tok)
    assert model.detokenize(out) == "ab"
    payload = s.save_payload()
    other = model.new_session()
    other.load_payload(payload)
    assert other.tokens == s.tokens and int(other.logits.argmax()) == model.eos_id
    s.truncate(len(ids))
    assert s.sample(greedy) == ord("a")
    s.eval(ord("x"))  # a forced token does not consume the script
    assert s.sample(greedy) == ord("a")
    with pytest.raises(ValueError):
        s.sync(list(range(17)))


@pytest.mark.parametrize("temperature,top_p", [(1e-300, 1.0), (0.7, 1e-300), (5e-324, 5e-324)])
def test_the_fake_sampler_survives_the_parameters_the_real_one_survives(temperature, top_p):
    import torch

    logits = torch.linspace(-3.0, 3.0, 50)
    for make in (engine.Sampler, FAKE_ENGINE.Sampler):
        params = (engine.SamplingParams if make is engine.Sampler else FAKE_ENGINE.SamplingParams)(
            temperature=temperature, top_p=top_p, seed=1)
        assert make(params)(logits) == 49
