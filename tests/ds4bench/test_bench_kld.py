"""ds4-bench kld without real weights: the statistics against brute force over small random
distributions, the base file, windows, the OpenAI-endpoint stack against a fake HTTP server on
127.0.0.1, and the command line on a tiny random GGUF."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from ds4bench import cli
from ds4bench import kld
from ds4bench import kldstats as ks
from ds4bench.kldfile import BaseFileError, check_compatible, read_base, write_base
from ds4bench.kldstacks import OpenAIStack, StackError, parse_prompt_logprobs, reduce_chunk
from engine.synthetic import RandomModelSpec, write_random_gguf


def random_logits(rng, t, v, scale=3.0):
    return rng.normal(scale=scale, size=(t, v))


def partition_kl_brute(base_logits, cand_logits, ids):
    """KL over the singletons `ids` and one bucket of the rest, by explicit sums over the vocabulary."""
    out = []
    for b, c, s in zip(base_logits, cand_logits, ids):
        p, q = np.exp(b - b.max()), np.exp(c - c.max())
        p, q = p / p.sum(), q / q.sum()
        rest = np.ones(p.size, dtype=bool)
        rest[s] = False
        kl = float(sum(p[i] * np.log(p[i] / q[i]) for i in s))
        pr, qr = p[rest].sum(), q[rest].sum()
        out.append(kl + (pr * np.log(pr / qr) if pr > 0 else 0.0))
    return np.array(out)


# ---------------------------------------------------------------- statistics


@pytest.mark.parametrize("v,k", [(7, 7), (40, 5), (300, 32)])
def test_topk_plus_rest_kl_matches_brute_force_and_bounds_the_full_kl(v, k):
    rng = np.random.default_rng(v)
    base, cand = random_logits(rng, 20, v), None
    cand = base + rng.normal(scale=0.3, size=base.shape)
    b = ks.scores_from_logits(base, rng.integers(0, v, 20), k)
    c = ks.scores_from_logits(cand, rng.integers(0, v, 20), k, probe=b.top_ids)
    got = ks.position_kl(b.top_logprobs, c.probe_logprobs)
    np.testing.assert_allclose(got, partition_kl_brute(base, cand, b.top_ids), rtol=1e-9, atol=1e-12)
    full = ks.full_kl(base, cand)
    assert np.all(got <= full + 1e-12)
    if k == v:
        np.testing.assert_allclose(got, full, rtol=1e-9, atol=1e-12)


def test_unknown_candidate_entries_fall_into_the_rest_bucket():
    rng = np.random.default_rng(3)
    base = random_logits(rng, 10, 50)
    cand = base + rng.normal(scale=0.5, size=base.shape)
    b = ks.scores_from_logits(base, np.zeros(10, int), 8)
    c = ks.scores_from_logits(cand, np.zeros(10, int), 8, probe=b.top_ids)
    partial = c.probe_logprobs.copy()
    partial[:, 4:] = np.nan  # the candidate only knows the first four of the base's ids
    got = ks.position_kl(b.top_logprobs, partial)
    np.testing.assert_allclose(got, partition_kl_brute(base, cand, b.top_ids[:, :4]), rtol=1e-9)
    assert np.all(got <= ks.position_kl(b.top_logprobs, c.probe_logprobs) + 1e-12)


def test_identical_stacks_give_zero_kl_and_ratio_one():
    rng = np.random.default_rng(0)
    logits = random_logits(rng, 130, 64)
    tg = rng.integers(0, 64, 130)
    b = ks.scores_from_logits(logits, tg, 16)
    c = ks.scores_from_logits(logits, tg, 16, probe=b.top_ids)
    s, kl = ks.summarize(b, c, [64, 66])
    assert s.kl_max == 0 and s.flips == 0 and s.first_flip is None and s.rms_dp == 0
    assert s.ppl_ratio.value == pytest.approx(1.0) and s.ppl_ratio.low == pytest.approx(1.0)
    assert s.same_top.value == 1.0 and s.positions == 130 and s.windows == 2


def test_summary_figures_against_direct_computation():
    rng = np.random.default_rng(5)
    n, v = 400, 30
    base = random_logits(rng, n, v)
    cand = base + rng.normal(scale=0.4, size=base.shape)
    tg = rng.integers(0, v, n)
    b = ks.scores_from_logits(base, tg, 10)
    c = ks.scores_from_logits(cand, tg, 10, probe=b.top_ids)
    s, kl = ks.summarize(b, c, [150, 250], tie_gap=0.2)
    lpb, _ = ks.log_softmax(base)
    lpc, _ = ks.log_softmax(cand)
    tb, tc = lpb[np.arange(n), tg], lpc[np.arange(n), tg]
    assert s.ppl_base == pytest.approx(np.exp(-tb.mean()))
    assert s.ppl_cand == pytest.approx(np.exp(-tc.mean()))
    assert s.ppl_ratio.value == pytest.approx(s.ppl_cand / s.ppl_base)
    assert s.ppl_ratio.low <= s.ppl_ratio.value <= s.ppl_ratio.high
    assert s.kl_mean.low <= s.kl_mean.value <= s.kl_mean.high
    assert s.kl_median == pytest.approx(np.median(kl)) and s.kl_max == pytest.approx(kl.max())
    assert s.kl_p99 == pytest.approx(np.percentile(kl, 99))
    assert s.rms_dp == pytest.approx(np.sqrt(np.mean((np.exp(tc) - np.exp(tb)) ** 2)))
    top_b, top_c = base.argmax(1), cand.argmax(1)
    flips = top_b != top_c
    srt = np.sort(lpb, axis=1)
    gap = srt[:, -1] - srt[:, -2]
    assert s.flips == flips.sum() and s.near_ties == (flips & (gap < 0.2)).sum()
    assert s.real_flips == s.flips - s.near_ties
    first = int(np.argmax(flips))
    assert s.first_flip.position == first and s.first_flip.base_top == top_b[first]
    assert (s.first_flip.window, s.first_flip.offset) == ((0, first) if first < 150 else (1, first - 150))
    assert s.same_top.value == pytest.approx(1 - flips.mean())


def test_bootstrap_is_deterministic_and_blocks_stay_inside_windows():
    assert ks.block_ids([3, 130], block=64).tolist() == [0, 0, 0] + [1] * 64 + [2] * 64 + [3, 3]
    x = np.random.default_rng(1).random(500)
    one = ks.bootstrap_ratio(x, np.ones(500), ks.block_ids([500], 50))
    assert one == ks.bootstrap_ratio(x, np.ones(500), ks.block_ids([500], 50))
    assert one[0] < x.mean() < one[1]


def test_torch_reduction_matches_the_numpy_reference():
    rng = np.random.default_rng(2)
    logits = random_logits(rng, 9, 100).astype(np.float32)
    tg = rng.integers(0, 100, 9)
    probe = rng.integers(0, 100, (9, 6))
    probe[0, 0] = -1
    ref = ks.scores_from_logits(logits, tg, 12, probe)
    got = reduce_chunk(torch.from_numpy(logits), tg.tolist(), 12, probe)
    np.testing.assert_array_equal(got.top_ids, ref.top_ids)
    # The reference normalises in float64; engine.logprobs sums float32 exponentials (within 3e-7).
    for a, b in ((got.top_logprobs, ref.top_logprobs), (got.lse, ref.lse), (got.target_logprobs, ref.target_logprobs)):
        np.testing.assert_allclose(a, b, rtol=0, atol=5e-7)
    assert np.isnan(got.probe_logprobs[0, 0])
    np.testing.assert_allclose(got.probe_logprobs[1:], ref.probe_logprobs[1:], atol=5e-7)


# ---------------------------------------------------------------- windows and the base file


def test_windows_start_with_bos_and_drop_an_empty_tail():
    assert kld.make_windows(list(range(7)), 4, 99) == [[99, 0, 1, 2], [99, 3, 4, 5], [99, 6]]
    assert kld.make_windows(list(range(5)), 4, None) == [[0, 1, 2, 3]]  # [4] alone scores nothing


def test_base_file_round_trip_and_refusals(tmp_path):
    rng = np.random.default_rng(4)
    windows = [[1, 5, 7, 9], [1, 2, 3]]
    s = ks.scores_from_logits(random_logits(rng, 5, 40), [5, 7, 9, 2, 3], 6)
    header = {"corpus": {"name": "c", "sha256": "abc", "passes": 1, "tokens": None}, "tokenizer_sha256": "tok",
              "ctx": 4, "stack": {"kind": "engine"}}
    path = tmp_path / "base.kld"  # any name: the archive is written through a file object
    write_base(path, header, windows, s)
    back = read_base(path)
    assert back.windows == windows and back.window_lengths == [3, 2]
    assert back.header["k"] == 6 and back.header["n_positions"] == 5
    np.testing.assert_array_equal(back.scores.top_ids, s.top_ids)
    np.testing.assert_array_equal(back.scores.top_logprobs, s.top_logprobs.astype(np.float32))
    with np.load(path) as z:
        assert z["top_ids"].dtype == np.uint16 and z["top_logprobs"].dtype == np.float32
    assert check_compatible(back.header, corpus_sha256="abc", passes=1, ctx=4, tokenizer_sha256="tok") == []
    assert check_compatible(back.header, corpus_sha256="abc", passes=1, ctx=4, tokenizer_sha256=None) == []
    reasons = check_compatible(back.header, corpus_sha256="x", passes=2, ctx=8, tokenizer_sha256="other")
    assert len(reasons) == 3
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(BaseFileError):
        read_base(tmp_path / "junk.npz")
    with pytest.raises(ValueError):
        write_base(tmp_path / "bad.npz", header, [[1, 2]], s)
    assert not list(tmp_path.glob(".bad*"))  # nothing half-written left behind


# ---------------------------------------------------------------- OpenAI-compatible endpoint

class BigramModel:
    """A tiny random model: the next-token logits depend on the last token only."""

    def __init__(self, vocab=48, seed=11):
        self.table = np.random.default_rng(seed).normal(scale=2.5, size=(vocab, vocab))

    def logits(self, window):
        return self.table[np.asarray(window[:-1])]


def echo_response(model, prompt, k, by_text=False):
    lp, _ = ks.log_softmax(model.table[np.asarray(prompt)])
    tops, tok = [None], [None]
    for t in range(1, len(prompt)):
        row = lp[t - 1]
        best = np.argsort(-row)[:k]
        key = (lambda i: f"t{i}") if by_text else (lambda i: f"token_id:{i}")
        tops.append({key(int(i)): float(row[i]) for i in best})
        tok.append(float(row[prompt[t]]))
    return {"choices": [{"text": "", "logprobs": {"tokens": [f"token_id:{i}" for i in prompt],
                                                  "token_logprobs": tok, "top_logprobs": tops}}]}


# How the fake server answers what it does not take: None takes everything.
LIMITS: dict[str, object] = {}


@pytest.fixture()
def fake_server():
    model, seen = BigramModel(), []
    LIMITS.clear()

    class Handler(BaseHTTPRequestHandler):
        def refuse(self, status, message):
            data = json.dumps({"error": {"message": message}}).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append(body)
            if self.path != "/v1/completions":
                self.send_response(404)
                self.end_headers()
                return
            if LIMITS.get("text_only") and not isinstance(body["prompt"], str):
                return self.refuse(500, "Input should be a valid string")
            if body["logprobs"] > LIMITS.get("logprobs", 10**6):
                return self.refuse(400, LIMITS.get("message", "logprobs: Input should be less than or equal to "
                                                             f"{LIMITS['logprobs']}"))
            data = json.dumps(echo_response(model, body["prompt"], body["logprobs"])).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", model, seen
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_openai_stack_reads_prompt_logprobs(fake_server):
    url, model, seen = fake_server
    stack = OpenAIStack(url, served_model="m")
    window = [3, 7, 1, 1, 40, 2]
    try:
        ref = ks.scores_from_logits(model.logits(window), window[1:], 48, probe=np.tile(np.arange(48), (5, 1)))
        got = stack.score(window, 48, np.tile(np.arange(48), (5, 1)))
        np.testing.assert_array_equal(got.top_ids, ref.top_ids)
        np.testing.assert_allclose(got.top_logprobs, ref.top_logprobs, atol=1e-12)
        np.testing.assert_allclose(got.target_logprobs, ref.target_logprobs, atol=1e-12)
        np.testing.assert_allclose(got.probe_logprobs, ref.probe_logprobs, atol=1e-12)
        assert np.isnan(got.lse).all()
        body = seen[-1]
        assert body["prompt"] == window and body["echo"] is True and body["max_tokens"] == 0
        assert body["logprobs"] == 48 and body["model"] == "m"
    finally:
        stack.close()


def test_openai_candidate_with_a_short_top_list_against_an_engine_like_base(fake_server):
    """A base with the exact distribution, a candidate that sees only its top 5: the base's ids
    outside them are unknown and go to the rest bucket; identical models still give KL ~ 0."""
    url, model, _ = fake_server
    windows = [[1, 4, 9, 16, 25, 36, 2, 5], [1, 6, 6, 3]]
    base = ks.concat_scores([ks.scores_from_logits(model.logits(w), w[1:], 8) for w in windows])
    probes = [base.top_ids[:7], base.top_ids[7:]]
    stack = OpenAIStack(url)
    try:
        cand = ks.concat_scores([stack.score(w, 5, p) for w, p in zip(windows, probes)])
    finally:
        stack.close()
    s, kl = ks.summarize(base, cand, [7, 3])
    assert s.known_share < 1 and s.flips == 0
    assert s.kl_max == pytest.approx(0.0, abs=1e-12) and s.ppl_ratio.value == pytest.approx(1.0)


@pytest.mark.parametrize("limits,asked,fitted", [
    ({}, 32, [1, 32]),
    ({"logprobs": 20}, 32, [1, 32, 20]),  # the limit the refusal names
    ({"logprobs": 5, "message": "bad request"}, 32, [1, 32, 20, 5]),  # OpenAI's documented limits, tried in turn
])
def test_the_openai_stack_fits_its_top_k_to_the_servers_limit_before_any_work(fake_server, limits, asked, fitted):
    url, _, seen = fake_server
    LIMITS.update(limits)
    stack = OpenAIStack(url)
    try:
        assert stack.fit_top_k([3, 7, 1, 1, 40, 2, 9, 9, 9, 9], asked) == fitted[-1]
    finally:
        stack.close()
    assert [b["logprobs"] for b in seen] == fitted
    assert all(b["prompt"] == [3, 7, 1, 1, 40, 2, 9, 9] for b in seen)  # the run's own kind of request


@pytest.mark.parametrize("limits,fragment", [
    ({"text_only": True}, "does not score a token-id prompt, which kld sends (HTTP 500: "),
    ({"logprobs": 0, "message": "no"}, "does not score a token-id prompt"),
])
def test_an_endpoint_that_cannot_take_what_kld_sends_is_one_stack_error(fake_server, limits, fragment):
    url, _, _ = fake_server
    LIMITS.update(limits)
    stack = OpenAIStack(url)
    try:
        with pytest.raises(StackError, match=fragment.replace("(", r"\(")):
            stack.fit_top_k([3, 7, 1], 32)
    finally:
        stack.close()


def test_limits_named_in_errors():
    from ds4bench.kldstacks import limit_in_error
    assert limit_in_error("logprobs: Input should be less than or equal to 20", 32) == 20
    assert limit_in_error("`logprobs` must be at most 5", 32) == 5
    assert limit_in_error("logprobs must be <= 20", 8) is None  # no limit below what was asked
    assert limit_in_error("HTTP 500 at 12:30", 32) is None


def test_openai_text_keys_need_a_tokenizer_and_bad_replies_are_stack_errors():
    doc = echo_response(BigramModel(), [1, 2, 3], 4, by_text=True)
    stack = OpenAIStack.__new__(OpenAIStack)
    stack._by_text = {}
    with pytest.raises(StackError, match="--tokenizer"):
        parse_prompt_logprobs(doc, [1, 2, 3], 4, None, stack.token_id)
    stack._by_text = {f"t{i}": i for i in range(48)}
    got = parse_prompt_logprobs(doc, [1, 2, 3], 4, None, stack.token_id)
    assert got.top_ids.shape == (2, 4)
    with pytest.raises(StackError, match="logprobs"):
        parse_prompt_logprobs({"choices": [{"text": ""}]}, [1, 2, 3], 4, None, stack.token_id)
    with pytest.raises(StackError, match="2 of 3"):
        short = echo_response(BigramModel(), [1, 2], 4)
        parse_prompt_logprobs(short, [1, 2, 3], 4, None, stack.token_id)
    with pytest.raises(StackError, match="http"):
        OpenAIStack("127.0.0.1:9")


# ---------------------------------------------------------------- command line on a tiny GGUF


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return write_random_gguf(tmp_path_factory.mktemp("kld") / "tiny.gguf", RandomModelSpec(seed=3, n_ctx=256))


def invoke(args):
    return CliRunner().invoke(cli.main, args)


def one_error(result) -> str:
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ds4-bench: error: "), result.output
    return lines[0]


def test_cli_base_then_candidate_then_refusals(tiny, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 12, encoding="utf-8")
    base = tmp_path / "base.npz"
    common = ["-m", tiny, "--corpus", str(corpus), "--ctx", "32", "--top-k", "8", "--weights", "float32"]
    r = invoke(["kld", "--save-base", str(base), *common])
    assert r.exit_code == 0, r.output
    assert "wrote" in r.output and base.is_file()
    out_csv, out_json = tmp_path / "w.csv", tmp_path / "s.json"
    r = invoke(["kld", "--base", str(base), *common, "--csv", str(out_csv), "--json", str(out_json)])
    assert r.exit_code == 0, r.output
    doc = json.loads(out_json.read_text())
    # The same stack again: equal logits, so KL is only the float32 storage of the base's log-probs.
    assert doc["summary"]["kl_max"] < 5e-7 and doc["summary"]["flips"] == 0
    assert doc["summary"]["positions"] == read_base(base).header["n_positions"]
    rows = out_csv.read_text().splitlines()
    assert rows[0].split(",") == list(kld.CSV_COLUMNS) and len(rows) == 1 + doc["summary"]["windows"]
    packed = invoke(["kld", "--base", str(base), *common[:-2], "--weights", "packed", "--kv-type", "f16"])
    assert packed.exit_code == 0, packed.output
    assert "KL mean" in packed.output
    assert "ctx" in one_error(invoke(["kld", "--base", str(base), *common[:4], "--ctx", "16", "--top-k", "8"]))
    other = tmp_path / "other.txt"
    other.write_text("something else entirely", encoding="utf-8")
    assert "corpus" in one_error(invoke(["kld", "--base", str(base), "-m", tiny, "--corpus", str(other),
                                         "--ctx", "32"]))
    assert "exactly one" in one_error(invoke(["kld", "-m", tiny]))
    assert "cannot read" in one_error(invoke(["kld", "--base", str(corpus), "-m", tiny]))
    r = invoke(["kld", "--base", str(base), "--stack", "openai", "--corpus", str(corpus), "--ctx", "32"])
    assert r.exit_code == 2 and "--url" in one_error(r)
    r = invoke(["kld", "--base", str(base), "--stack", "llamacpp", "--weights", "float32", "-m", tiny,
                "--corpus", str(corpus), "--ctx", "32"])
    assert r.exit_code == 2 and "engine stack" in one_error(r)


def test_the_llamacpp_stack_without_its_extra_is_a_one_line_error(tiny, tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_llama_cpp(name, *args, **kwargs):
        if name == "llama_cpp":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_llama_cpp)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 12, encoding="utf-8")
    r = invoke(["kld", "--save-base", str(tmp_path / "b.npz"), "--stack", "llamacpp", "-m", tiny,
                "--corpus", str(corpus), "--ctx", "32"])
    assert r.exit_code != 0 and "llamacpp" in one_error(r) and not (tmp_path / "b.npz").exists()


def test_the_shipped_corpus_is_packaged_and_mixed():
    name, text = kld.corpus_text(None)
    assert name == kld.CORPUS_NAME and len(text) > 15000
    for marker in ("def ", "#include", "marché", "Werkstatt", "huerto", "火车站", "| day |"):
        assert marker in text


@pytest.fixture()
def ds4_server(tiny):
    """ds4-server on the tiny GGUF, on a free loopback port (its logprobs limit is OpenAI's 20)."""
    import socket
    import time

    import uvicorn

    from engine import load_model
    from server.app import create_app
    from server.config import ServerConfig

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(load_model(tiny), ServerConfig()), host="127.0.0.1",
                                           port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def test_kld_against_ds4_server_fits_top_k_32_to_its_limit_of_20(tiny, ds4_server, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 4, encoding="utf-8")
    common = ["--corpus", str(corpus), "--ctx", "32"]
    served = ["--stack", "openai", "--url", ds4_server, "--tokenizer", tiny]
    base = tmp_path / "base.npz"
    r = invoke(["kld", "--save-base", str(base), *served, *common, "--top-k", "32"])
    assert r.exit_code == 0, r.output
    assert "note: --top-k 32 lowered to 20" in r.output and read_base(base).header["k"] == 20
    engine_base = tmp_path / "engine.npz"
    assert invoke(["kld", "--save-base", str(engine_base), "-m", tiny, *common, "--top-k", "32"]).exit_code == 0
    r = invoke(["kld", "--base", str(engine_base), *served, *common])
    assert r.exit_code == 0, r.output
    assert "at most 20 of the base's 32 log-probs" in r.output and "KL mean" in r.output
