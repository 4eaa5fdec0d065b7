"""The flags of `ds4-eval`'s commands, each defined once as a click decorator.

Every option's parameter name is the name of the config field it fills (`ds4eval.config`), so a
command's parsed flags are its config's keyword arguments. The tuples at the end are the flag
sets that several commands (and the old single-command form, `ds4eval.cli.legacy`) share. This
module declares flags only: it builds no config and runs nothing.
"""

from __future__ import annotations

from typing import Callable

import click

from ds4eval.cases import case as cs
from ds4eval.config import ALLOWED_DIFFS, BACKENDS, COMPARE_FORMATS, DEFAULT_DATA_URL, DEFAULT_TOKENS, KV_TYPES

# ---------------------------------------------------------------- case selection

suite = click.option("--suite", default="sanity", show_default=True, type=click.Choice(cs.KNOWN_SUITES))
case_ids = click.option("--case-id", "case_ids", multiple=True, help="Run only this case id (repeatable).")
domains = click.option("--domain", "domains", multiple=True, help="Run only this domain (repeatable).")
sources = click.option("--source", "sources", multiple=True, help="Run only this source (repeatable).")
data_dir = click.option("--data-dir", type=click.Path(file_okay=False), help="Case data directory.")
shard = click.option("--shard", metavar="I/N|auto",
                     help="Run only shard I (0-based) of N of the selected cases, split by case identity; "
                          "auto: from a Slurm array job or a Kubernetes Indexed Job (docs/scaling.md).")

# ---------------------------------------------------------------- backend

backend = click.option("--backend", default="engine", show_default=True, type=click.Choice(BACKENDS))
model = click.option("-m", "--model", help="GGUF file for the engine backend (default: embedded model).")
ctx = click.option("--ctx", type=int, help="Context size.")
device = click.option("--device", default="cpu", show_default=True, help="Engine device.")
url = click.option("--url", help="Server base URL for --backend openai.")  # one endpoint (determinism)
urls = click.option("--url", "urls", multiple=True,
                    help="Server base URL for --backend openai (repeatable: the endpoints share the run).")
url_file = click.option("--url-file", type=click.Path(dir_okay=False),
                        help="File of server base URLs, one a line (# comments and blank lines ignored).")
allow_mixed_endpoints = click.option("--allow-mixed-endpoints", is_flag=True,
                                     help="Run on endpoints whose model, chat template or capabilities differ.")
endpoint_wait_s = click.option("--endpoint-wait", "endpoint_wait_s", type=float, default=60.0, show_default=True,
                               help="Seconds to re-probe when no endpoint is left before the run stops.")
api_key = click.option("--api-key", envvar="DS4EVAL_API_KEY", help="Bearer token for the server.")
served_model = click.option("--served-model", "--api-model", "served_model", help="Model name sent to the server.")
concurrency = click.option("--concurrency", type=int, default=1, show_default=True, help="Cases in flight (server).")
parallel = click.option("--parallel", type=int, default=None,
                        help="Engine backend: decode N cases together (batched), each from a fresh session.")
threads = click.option("--threads", type=int, default=None,
                       help="Engine backend: CPU threads (default: the cores other processes leave free).")
request_timeout_s = click.option("--request-timeout", "request_timeout_s", type=float, default=600.0,
                                 show_default=True)
request_extra = click.option("--request-extra", metavar="JSON",
                             help='Object merged into every request body (openai), e.g. \'{"repeat_penalty": 1.0}\'.')
chat_template_kwargs = click.option("--chat-template-kwargs", metavar="JSON",
                                    help="Object sent as chat_template_kwargs (openai), "
                                         "e.g. '{\"enable_thinking\": false}'.")
tokenizer = click.option("--tokenizer", type=click.Path(dir_okay=False),
                         help="GGUF whose tokenizer counts tokens when the server sends no usage (openai).")
model_file = click.option("--model-file", type=click.Path(dir_okay=False), metavar="GGUF",
                          help="The model file the server runs (openai): its SHA-256 goes into the trace.")
kv_type = click.option("--kv-type", type=click.Choice(KV_TYPES), default=None,
                       help="Engine KV cache type (default: f16 on CPU, bf16 on CUDA).")
batch_invariant = click.option("--batch-invariant", is_flag=True, default=False,
                               help="Engine backend: every token through one row's step, so answers do not "
                                    "depend on the batch, prefill chunks or cached prefixes (slower).")
warmup = click.option("--no-warmup", "warmup", is_flag=True, flag_value=False, default=True,
                      help="Engine backend: leave CUDA graph captures and kernel compiles to the cases that "
                           "meet them (default: met before the first case).")
no_probe = click.option("--no-probe", is_flag=True, help="Skip the capability probe before a run against a server.")
ray = click.option("--ray", metavar="[ADDRESS]", is_flag=False, flag_value="", default=None,
                   help="Spread the run over a Ray cluster (the `ray` extra), one task a shard; ADDRESS as "
                        "ray.init takes it (default: $RAY_ADDRESS or a local cluster). Needs --trace.")
ray_shards = click.option("--ray-shards", type=int, help="Shards of a --ray run (default: one per GPU or task slot).")

# ---------------------------------------------------------------- generation

tokens = click.option("-n", "--tokens", type=int, default=DEFAULT_TOKENS, show_default=True,
                      help="Generation budget per case.")
temperature = click.option("--temp", "temperature", type=float, default=0.0, show_default=True)
top_p = click.option("--top-p", type=float, default=1.0, show_default=True)
min_p = click.option("--min-p", type=float, default=0.0, show_default=True)
seed = click.option("--seed", type=int)
repeats = click.option("--repeats", type=int, default=1, show_default=True,
                       help="Run every case K times (seeds seed, seed+1, ...); reports flaky cases and pass@k.")
# One flag that clears a field: the config says what is on, the flag what the user turns off.
think = click.option("--nothink", "think", is_flag=True, flag_value=False, default=True,
                     help="Disable thinking mode.")

# ---------------------------------------------------------------- run output

plain = click.option("--plain", is_flag=True, help="Line-per-case output and a final report.")
trace = click.option("--trace", type=click.Path(dir_okay=False), help="Append a trace here.")
summary = click.option("--summary", type=click.Path(dir_okay=False), help="Write the JSON summary here.")
allow_errors = click.option("--allow-errors", is_flag=True,
                            help="Exit 0 even when cases ended ERROR/SKIPPED/STOPPED or did not run (else 3).")


def report(help: str):
    """--report FILE, with the help line of the command it belongs to."""
    return click.option("--report", type=click.Path(dir_okay=False), metavar="FILE", help=help)


step_log = click.option("--step-log", type=click.Path(dir_okay=False), metavar="FILE",
                        help="With --parallel: the engine's batched steps, a JSON line each, and their "
                             "summary on stderr.")

RUN_REPORT_HELP = "Write the report of the run (needs --trace): HTML, or markdown if FILE ends in .md."

# ---------------------------------------------------------------- compare

alpha = click.option("--alpha", type=float, default=0.05, show_default=True,
                     help="McNemar p below which a drop is a significant regression.")
strict = click.option("--strict", is_flag=True, help="Any pass->fail flip is a regression.")
compare_format = click.option("--format", "format", type=click.Choice(COMPARE_FORMATS), default="text",
                              show_default=True, help="Output format (html: the report page, see --report).")
allow_diff = click.option("--allow-diff", "allow_diff", multiple=True, type=click.Choice(ALLOWED_DIFFS),
                          help="Keep cases whose model, prompt or sampling differs (the change under test).")

# ---------------------------------------------------------------- data

data_url = click.option("--data-url", default=DEFAULT_DATA_URL, show_default=True,
                        help="Base URL the upstream case tables are fetched from.")

# ---------------------------------------------------------------- shared sets

CASE_SELECTION = (suite, case_ids, domains, sources, data_dir, shard)
BACKEND = (backend, model, ctx, device, urls, url_file, allow_mixed_endpoints, endpoint_wait_s, api_key, served_model,
           concurrency, parallel, threads, request_timeout_s, request_extra, chat_template_kwargs, tokenizer, model_file,
           kv_type, batch_invariant, warmup, no_probe)
SAMPLING = (tokens, temperature, top_p, min_p, seed, think)
OUTPUT = (plain, trace, summary, allow_errors, report(RUN_REPORT_HELP), step_log)

RUN = (*CASE_SELECTION, *BACKEND, *SAMPLING, repeats, *OUTPUT, ray, ray_shards)
"""Every flag of `ds4-eval run`, one per settable EvalConfig field."""
RETRY = (suite, data_dir, *BACKEND, *SAMPLING, *OUTPUT)
"""The run flags a retry takes: the trace decides which cases and how many repeats (RETRY_FROM_TRACE).
--suite names the suite the retried cases are recorded under, as in a run."""
COMPARE = (alpha, strict, compare_format, allow_diff)
"""The comparison's options (its inputs and --report are given by the command)."""


def with_flags(func: Callable, decorators: tuple[Callable, ...]) -> Callable:
    """`func` with the flags applied so that --help lists them in the order given."""
    for decorator in reversed(decorators):
        func = decorator(func)
    return func
