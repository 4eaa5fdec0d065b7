"""--data-pull: the C table reader and the atomic fetch, against a local HTTP server."""

import functools
import json
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import pytest

from ds4eval.cases import case as cs
from ds4eval.cases import datapull

CORE_C = r'''
#include <stdio.h>
/* A table in the shape of the upstream one; "}," inside strings must not confuse the reader. */
typedef struct { const char *source; } eval_case;
static const eval_case eval_cases[] = {
    {
        .source = "Toy MC",
        .id = "mc-1",
        .domain = "Colours",
        .title = "Sky",
        .question = "Which colour is the sky? Note: \"}, {\" is just text.\n"
        "Second line with caf\303\251 and \xe2\x82\xac.",
        .choice[0] = "green",
        .choice[1] = "blue",   // trailing comment
        .answer = "B",
    },
    {
        .source = "COMPSEC",
        .id = "cs-1",
        .question = "Which line?",
        .answer = "3,13-15",
    },
    {
        .source = "Toy int",
        .id = "int-1",
        .question = "2+2?",
        .answer = "4",
    },
};
int main(void) { char buf[4] = {0}; return printf("%s\n", buf); }
'''

HARD_C = r'''
#include "ds4_eval_cases.h"
const eval_source eval_hard_sources[] = {
    {"Toy", "https://example.invalid/toy", "CC0-1.0"},
};
const size_t eval_hard_source_count = sizeof(eval_hard_sources) / sizeof(eval_hard_sources[0]);
const eval_case eval_hard_cases[] = {
    {
        .source = "Toy hard",
        .id = "r-1",
        .question = "Half of 25?",
        .answer = "25/2",
        .alias[0] = "12.5",
        .answer_kind = EVAL_ANSWER_RATIONAL,
        .suites = EVAL_SUITE_HARD | EVAL_SUITE_HARD_SMOKE,
        .max_tokens = 4096,
    },
    {
        .source = "Toy hard",
        .id = "s-1",
        .question = "List.",
        .answer = "1,3,5",
        .answer_kind = EVAL_ANSWER_ORDERED_SEQUENCE,
        .suites = EVAL_SUITE_HARD,
        .max_tokens = 16000,
    },
};
'''


def test_parse_core_table_infers_kinds_and_decodes_escapes():
    objs = datapull.parse_c_tables(CORE_C)
    assert [(o["id"], o["answer_kind"], o["suites"]) for o in objs] == [
        ("mc-1", "choice", ["core"]), ("cs-1", "line_set", ["core"]), ("int-1", "integer", ["core"])]
    q = objs[0]["question"]
    assert q == 'Which colour is the sky? Note: "}, {" is just text.\nSecond line with café and €.'
    assert objs[0]["choices"] == ["green", "blue"]
    assert all(cs.parse_case(o) for o in objs)


def test_parse_hard_table_flags_aliases_and_max_tokens():
    objs = datapull.parse_c_tables(HARD_C)
    assert objs[0]["aliases"] == ["12.5"] and objs[0]["answer_kind"] == "rational"
    assert objs[0]["suites"] == ["hard", "hard-smoke"] and objs[0]["max_tokens"] == 4096
    assert objs[1]["answer_kind"] == "ordered_sequence"


def test_bad_tables_are_errors():
    with pytest.raises(datapull.CParseError):
        datapull.parse_c_tables('const eval_case t[] = { { .id = "x", .question = "q" } };')
    with pytest.raises(datapull.CParseError):
        datapull.parse_c_tables('const eval_case t[] = { { .id = "x", .question = "q", .answer = "1", '
                                '.suites = EVAL_SUITE_BOGUS } };')


@pytest.fixture
def http_dir(tmp_path):
    root = tmp_path / "www"
    root.mkdir()
    handler = functools.partial(SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *a: None
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
    yield root, f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_pull_writes_data_files_atomically(http_dir, tmp_path):
    root, url = http_dir
    (root / "ds4_eval.c").write_text(CORE_C, encoding="utf-8")
    (root / "ds4_eval_cases.c").write_text(HARD_C, encoding="utf-8")
    out = tmp_path / "data"
    written = datapull.pull(url, out)
    assert sorted((p.name, n) for p, n in written) == [("core.jsonl", 3), ("hard.jsonl", 2)]
    core = cs.load_file(out / "core.jsonl")
    assert not core.problems and [c.id for c in core.cases] == ["mc-1", "cs-1", "int-1"]
    assert sorted(p.name for p in out.iterdir()) == ["core.jsonl", "hard.jsonl"]  # no temp files left
    # A failing pull (one table missing) leaves the previous files untouched.
    before = (out / "core.jsonl").read_bytes()
    (root / "ds4_eval_cases.c").unlink()
    (root / "ds4_eval.c").write_text(CORE_C.replace('"4"', '"5"'), encoding="utf-8")
    with pytest.raises(datapull.PullError, match="HTTP 404"):
        datapull.pull(url, out)
    assert (out / "core.jsonl").read_bytes() == before
    assert sorted(p.name for p in out.iterdir()) == ["core.jsonl", "hard.jsonl"]
    json.loads((out / "hard.jsonl").read_text().splitlines()[0])
