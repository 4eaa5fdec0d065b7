"""The ds4-eval subcommands: their help, their flags and configs, and the old single-command form
as an alias that reaches the same handler with the same config and prints the same output."""

import dataclasses
import json
import re

import click
import pytest
from click.testing import CliRunner
from openai_fakes import FakeOpenAI
from report_fakes import flip_pair, run_records, trace_text

from ds4eval import cli
from ds4eval.cli import app, legacy
from ds4eval.config import (RETRY_FROM_TRACE, RUN_ONLY_FIELDS, UNFLAGGED_RUN_FIELDS, CompareConfig, EvalConfig, ListConfig,
                            RetryConfig)
from ds4eval.run import trace as tr


def invoke(*args, env=None):
    return CliRunner().invoke(cli.main, [str(a) for a in args], env=env or {})


def click_command(name: str) -> click.Command:
    command = cli.main
    for word in name.split():
        command = command.commands[word]
    return command


# ---------------------------------------------------------------- help

def test_help_lists_every_subcommand_on_one_line_each():
    r = invoke("--help")
    assert r.exit_code == 0, r.output
    listed = r.output.split("Commands:\n", 1)[1].splitlines()
    top = list(dict.fromkeys(name.split()[0] for name in app.COMMANDS))
    assert [line.split()[0] for line in listed] == top  # registry order, no continuation lines
    assert "aliases" in r.output  # the old flags are named as still working
    r = invoke("data", "--help")
    assert r.exit_code == 0 and re.search(r"^  pull\s+Fetch the upstream case tables", r.output, re.M)


@pytest.mark.parametrize("name, has, lacks", [
    ("run", ["--suite", "--backend", "--tokens", "--nothink", "--report"], ["--alpha", "--regrade"]),
    ("retry", ["TRACE", "--backend", "--temp", "--trace"], ["--case-id", "--repeats", "--alpha"]),
    ("compare", ["BASE NEW", "--alpha", "--strict", "--format", "--allow-diff", "--report"], ["--tokens"]),
    ("regrade", ["TRACE", "--data-dir"], ["--report", "--suite"]),
    ("report", ["TRACE", "--report"], ["--trace", "--suite"]),
    ("grade", ["FILE"], ["--data-dir"]),
    ("list", ["--suite", "--case-id", "--domain", "--source", "--data-dir"], ["--backend"]),
    ("validate", ["--data-dir"], ["--suite"]),
    ("selftest", [], ["--data-dir"]),
    ("probe", ["--url", "--served-model", "--api-key"], ["--backend", "--no-probe"]),
    ("data pull", ["--data-url", "--data-dir"], ["--suite"]),
])
def test_each_subcommand_help_shows_its_own_flags(name, has, lacks):
    r = invoke(*name.split(), "--help")
    assert r.exit_code == 0, r.output
    assert r.output.startswith(f"Usage: ds4-eval {name} ")
    assert all(flag in r.output for flag in has), r.output
    assert not any(flag in r.output for flag in lacks), r.output


# ---------------------------------------------------------------- flags and configs

def _field_names(config_type: type) -> set[str]:
    """The fields a command's flags fill: a nested run config counts as its own fields."""
    names = set()
    for f in dataclasses.fields(config_type):
        if f.type in ("EvalConfig", EvalConfig):
            names |= _field_names(EvalConfig) - set(RETRY_FROM_TRACE) - set(RUN_ONLY_FIELDS)
        else:
            names.add(f.name)
    return names - set(UNFLAGGED_RUN_FIELDS)


@pytest.mark.parametrize("name", list(app.COMMANDS))
def test_every_flag_of_a_subcommand_fills_one_field_of_its_config(name):
    command = app.COMMANDS[name]
    params = [p.name for p in click_command(name).params if p.name != "help"]
    assert len(params) == len(set(params))
    assert set(params) == _field_names(command.config_type)
    assert dataclasses.is_dataclass(command.config_type) and command.config_type.__dataclass_params__.frozen


def test_the_old_form_has_every_old_flag():
    params = {p.name for p in legacy.command(app.execute).params if p.name != "help"}
    run_fields = set(f.name for f in dataclasses.fields(EvalConfig)) - set(UNFLAGGED_RUN_FIELDS)
    compare_options = {"alpha", "strict", "format", "allow_diff"}
    assert params == run_fields | set(legacy.MODES) | {"compare", "data_url"} | compare_options


def test_configs_are_not_changed_after_they_are_built():
    cfg = RetryConfig("old.trace", EvalConfig(repeats=1, temperature=0.7))
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.run.trace = "x"
    settings = cfg.run_settings(3)
    assert (settings.trace, settings.repeats, settings.temperature) == ("old.trace", 3, 0.7)
    assert cfg.run.trace is None and cfg.run.repeats == 1
    assert RetryConfig("old.trace", EvalConfig(trace="new.trace")).run_settings(1).trace == "new.trace"


@pytest.mark.parametrize("args", [
    ["compare", "a.trace", "b.trace", "--tokens", "5"],
    ["list", "--alpha", "0.1"],
    ["retry", "t.trace", "--case-id", "x"],
    ["retry", "t.trace", "--repeats", "2"],
    ["probe", "--url", "http://127.0.0.1:9", "--plain"],
    ["selftest", "--data-dir", "/tmp"],
    ["run", "--strict"],
    ["run", "--list-cases"],
    ["report", "t.trace", "--regrade", "t.trace"],
])
def test_a_subcommand_refuses_another_commands_flag_on_one_line(args):
    r = invoke(*args)
    assert r.exit_code == 2, r.output
    assert r.output.startswith("ds4-eval: error: No such option") and r.output.count("\n") == 1, r.output


@pytest.mark.parametrize("args, msg", [
    (["probe"], "Missing option '--url'"),
    (["probe", "--url", "localhost:1"], "--url must be an http:// or https:// URL"),
    (["compare", "a.trace"], "Missing argument 'NEW'"),
    (["run", "--suite", "bogus"], "Invalid value for '--suite'"),
    (["run", "--report", "x.html"], "--report needs --trace FILE for a run"),
    (["report", "t.trace", "--report", ""], "--report needs a file name"),
    (["compare", "a", "b", "--alpha", "1"], "--alpha must be in (0, 1)"),
    (["retry", "t.trace", "--backend", "openai"], "--backend openai needs --url"),
    (["nosuch"], "No such command 'nosuch'"),
    (["--no-such-flag"], "No such option"),
])
def test_bad_input_to_a_subcommand_is_one_line_exit_2(args, msg):
    r = invoke(*args)
    assert r.exit_code == 2 and msg in r.output, r.output
    assert r.output.startswith("ds4-eval: error: ") and r.output.count("\n") == 1 and "Traceback" not in r.output


# ---------------------------------------------------------------- the old form reaches the same handler

@pytest.fixture
def captured(monkeypatch):
    """Every handler replaced by one that records (command name, config) and exits 0."""
    seen = []
    for name, command in app.COMMANDS.items():
        def handler(config, name=name):
            seen.append((name, config))
            return 0
        monkeypatch.setitem(app.COMMANDS, name, dataclasses.replace(command, handler=handler))
    return seen


@pytest.mark.parametrize("new, old", [
    (["run"], []),
    (["run", "--suite", "sanity"], ["--suite", "sanity"]),
    (["run", "--plain", "--domain", "arithmetic", "--case-id", "a", "--case-id", "b", "-n", "64", "--temp", "0.7",
      "--seed", "3", "--repeats", "2", "--nothink", "--trace", "t", "--report", "r.md", "--allow-errors"],
     ["--plain", "--domain", "arithmetic", "--case-id", "a", "--case-id", "b", "-n", "64", "--temp", "0.7",
      "--seed", "3", "--repeats", "2", "--nothink", "--trace", "t", "--report", "r.md", "--allow-errors"]),
    (["run", "--backend", "openai", "--url", "http://h:1", "--api-model", "m", "--concurrency", "4", "--no-probe"],
     ["--backend", "openai", "--url", "http://h:1", "--api-model", "m", "--concurrency", "4", "--no-probe"]),
    (["retry", "t.trace", "--backend", "openai", "--url", "http://h:1", "--report", "r.html"],
     ["--retry-incomplete", "t.trace", "--backend", "openai", "--url", "http://h:1", "--report", "r.html"]),
    (["compare", "a", "b", "--format", "markdown", "--strict", "--alpha", "0.1", "--allow-diff", "model",
      "--report", "c.html"],
     ["--compare", "a", "b", "--format", "markdown", "--strict", "--alpha", "0.1", "--allow-diff", "model",
      "--report", "c.html"]),
    (["regrade", "t.trace", "--data-dir", "d"], ["--regrade", "t.trace", "--data-dir", "d"]),
    (["grade", "g.jsonl"], ["--grade-file", "g.jsonl"]),
    (["report", "t.trace", "--report", "r.md"], ["--report-from", "t.trace", "--report", "r.md"]),
    (["report", "t.trace"], ["--report-from", "t.trace"]),
    (["probe", "--url", "http://h:1", "--served-model", "m", "--api-key", "k"],
     ["--probe", "--url", "http://h:1", "--served-model", "m", "--api-key", "k"]),
    (["data", "pull", "--data-url", "http://h:1/x", "--data-dir", "d"],
     ["--data-pull", "--data-url", "http://h:1/x", "--data-dir", "d"]),
    (["selftest"], ["--self-test-extractors"]),
    (["list", "--suite", "hard-smoke", "--domain", "code", "--source", "s", "--data-dir", "d"],
     ["--list-cases", "--suite", "hard-smoke", "--domain", "code", "--source", "s", "--data-dir", "d"]),
    (["validate", "--data-dir", "d"], ["--validate-cases", "--data-dir", "d"]),
])
def test_the_old_form_is_translated_onto_the_subcommand(captured, new, old):
    r = invoke(*new)
    assert r.exit_code == 0 and r.output == "", r.output
    r = invoke(*old)
    assert r.exit_code == 0 and r.output == "", r.output
    (new_name, new_config), (old_name, old_config) = captured
    assert old_name == new_name and type(old_config) is type(new_config)
    if isinstance(new_config, RetryConfig):  # the old form carried the case selection to a retry, unused
        old_config = dataclasses.replace(old_config, run=dataclasses.replace(
            old_config.run, **{f: getattr(new_config.run, f) for f in RETRY_FROM_TRACE}))
    assert old_config == new_config


def test_a_bare_command_runs_the_sanity_suite(captured):
    assert invoke().exit_code == 0
    assert captured == [("run", EvalConfig())]


def test_the_translation_builds_the_subcommands_config_and_runs_nothing():
    def translated(*args):
        return legacy.command(lambda make: make()).main(list(args), standalone_mode=False)

    assert translated("--list-cases", "--suite", "core") == ("list", ListConfig(suite="core"))
    assert translated("--compare", "a", "b") == ("compare", CompareConfig("a", "b"))
    assert translated("--nothink", "--seed", "2") == ("run", EvalConfig(think=False, seed=2))


@pytest.mark.parametrize("args, msg", [
    (["--list-cases", "--self-test-extractors"], "give at most one of --list-cases, --validate-cases, "
                                                  "--self-test-extractors, --grade-file, --regrade, "
                                                  "--retry-incomplete, --data-pull, --report-from, --probe"),
    (["--compare", "a", "b", "--regrade", "t"], "--compare runs alone: it takes no other mode"),
    (["--probe"], "--probe needs --url"),
    (["--probe", "--url", "http://h:1", "--no-probe"], "--probe and --no-probe contradict each other"),
    (["--grade-file", "g", "--report", "r.html"], "--report applies to a run, --compare or --report-from"),
    (["--self-test-extractors", "--tokens", "0"], "--tokens must be positive"),
    (["--alpha", "0"], "--alpha must be in (0, 1)"),
])
def test_the_old_forms_refusals_are_kept(captured, args, msg):
    r = invoke(*args)
    assert r.exit_code == 2 and r.output == f"ds4-eval: error: {msg}\n", r.output
    assert captured == []


# ---------------------------------------------------------------- same output through either form

def _same(new, old, env=None):
    a, b = invoke(*new, env=env), invoke(*old, env=env)
    assert (a.exit_code, a.stdout, a.stderr) == (b.exit_code, b.stdout, b.stderr)
    return a


def test_offline_commands_print_what_the_old_flags_print(tmp_path):
    t = tmp_path / "run.trace"
    t.write_text(trace_text(run_records()), encoding="utf-8", newline="")
    base, new = flip_pair()
    a, b = tmp_path / "a.trace", tmp_path / "b.trace"
    a.write_text(trace_text(base), encoding="utf-8", newline="")
    b.write_text(trace_text(new), encoding="utf-8", newline="")
    g = tmp_path / "g.jsonl"
    g.write_text(json.dumps({"answer_kind": "integer", "answer": "5", "output": "Answer: 5"}) + "\n")
    assert _same(["selftest"], ["--self-test-extractors"]).exit_code == 0
    assert _same(["grade", g], ["--grade-file", g]).stdout.endswith('"picked": "5", "passed": true}\n')
    assert _same(["regrade", t], ["--regrade", t]).stdout.startswith("passed=")
    assert _same(["report", t], ["--report-from", t]).stdout.startswith("## ds4-eval report")
    for fmt in ("text", "markdown", "json"):
        r = _same(["compare", a, b, "--strict", "--format", fmt], ["--compare", a, b, "--strict", "--format", fmt])
        assert r.exit_code == 1 and r.stdout
    assert _same(["list", "--domain", "code"], ["--list-cases", "--domain", "code"]).exit_code == 0
    assert _same(["report", tmp_path / "none"], ["--report-from", tmp_path / "none"]).exit_code == 2
    assert _same(["probe", "--url", "http://127.0.0.1:9"], ["--probe", "--url", "http://127.0.0.1:9"]).exit_code == 1


def test_reports_written_by_either_form_are_the_same(tmp_path):
    t = tmp_path / "run.trace"
    t.write_text(trace_text(run_records()), encoding="utf-8", newline="")
    invoke("report", t, "--report", tmp_path / "new.md")
    invoke("--report-from", t, "--report", tmp_path / "old.md")
    assert (tmp_path / "new.md").read_text() == (tmp_path / "old.md").read_text() != ""


def test_validate_prints_what_validate_cases_prints(data_dir):
    r = _same(["validate", "--data-dir", data_dir], ["--validate-cases", "--data-dir", data_dir])
    assert r.exit_code == 0 and "all cases valid" in r.stdout


def _graded_lines(output: str) -> list[str]:
    return sorted(re.findall(r"(PASSED|FAILED)  (\S+)", output))


def test_run_and_retry_through_the_subcommands(tmp_path):
    with FakeOpenAI(reply=lambda q: "Answer: 5") as srv:
        server = ["--backend", "openai", "--url", srv.url]
        new_trace, old_trace = tmp_path / "new.trace", tmp_path / "old.trace"
        new = invoke("run", "--plain", *server, "--domain", "arithmetic", "--trace", new_trace)
        old = invoke("--plain", *server, "--domain", "arithmetic", "--trace", old_trace)
        assert new.exit_code == old.exit_code == 0, new.output
        assert _graded_lines(new.output) == _graded_lines(old.output) != []
        # Tear the last block of the new run's trace: retry runs that case again and appends it.
        data = new_trace.read_bytes()
        new_trace.write_bytes(data[:data.rindex(b"%%case 6 ") + 40])
        r = invoke("retry", new_trace, "--plain", *server)
        assert r.exit_code == 0 and "retrying 1 incomplete case(s)" in r.output, r.output
        assert [rec.index for rec in tr.read_trace(new_trace).records] == [1, 2, 3, 4, 5, 6]
        r = _same(["retry", new_trace, *server], ["--retry-incomplete", new_trace, *server])
        assert r.stdout == "nothing to retry: every case in the trace finished PASSED or FAILED\n"
        assert "case block 6 (sanity/) skipped" in r.stderr  # the torn block stays, and is named


def test_an_unreachable_server_exits_3_in_either_form():
    r = _same(["run", "--plain", "--backend", "openai", "--url", "http://127.0.0.1:9"],
              ["--plain", "--backend", "openai", "--url", "http://127.0.0.1:9"])
    assert r.exit_code == 3 and r.stderr == "ds4-eval: error: cannot reach the server at http://127.0.0.1:9: " \
                                           "connection refused\n"
