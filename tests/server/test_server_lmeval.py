"""lm-evaluation-harness as a client of ds4-server on the embedded model, end to end.

Two tiny tasks the test writes itself (task YAML + local jsonl; no dataset or model hub):
a multiple-choice task through `local-completions` (loglikelihoods from /v1/completions with
echo + logprobs, token-id prompts built with the server's own tokenizer through /tokenize:
`tokenizer_backend=remote`) and a generation task through `local-chat-completions`. The
loglikelihoods lm-eval reports must equal the engine's own in-process log-softmax, also for
answers that end the model's turn (end-of-sequence as the generated token).
Skipped where lm-eval is not installed (`make setup-lmeval`).
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from server.app import create_app
from server.config import ServerConfig
from server_support import live_server

pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed (make setup-lmeval)")
pytestmark = [pytest.mark.model, pytest.mark.slow]

# Multiple-choice questions as rendered chat turns, each answer ending the model's turn: after
# most of them the model's greedy next token is end-of-sequence, which the server must score
# like any other generated token (lm-eval drops the last entry as the generated one).
MC_TURNS = [
    ("Name a primary colour. One word.", ["Red", "Blue", "Green", "Dog"], 0),
    ("What is two plus two? Answer with a number only.", ["4", "5", "four"], 0),
]
GEN_DOCS = [{"question": "What is the capital of France? Answer with one word.", "answer": "Paris"}]


def write_task(folder: Path, name: str, docs: list[dict], body: str) -> None:
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    (folder / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        f"test_split: test\ndoc_to_text: \"{{{{question}}}}\"\n{body}")


def run_lm_eval(tmp_path: Path, args: list[str]) -> list[dict]:
    """Run the lm_eval command line offline; its logged samples."""
    out = tmp_path / "out"
    env = os.environ | {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "-m", "lm_eval", *args, "--include_path", str(tmp_path),
                           "--output_path", str(out), "--log_samples"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (samples,) = glob.glob(str(out / "*" / "samples_*.jsonl"))
    return [json.loads(line) for line in Path(samples).read_text().splitlines()]


@pytest.fixture(scope="module")
def model():
    from engine import load_model
    return load_model()


@pytest.fixture(scope="module")
def server(model):
    with live_server(create_app(model, ServerConfig())) as srv:
        yield srv


def engine_loglikelihood(model, context: str, continuation: str) -> float:
    """What lm-eval's loglikelihood means, computed in process: the context's trailing
    whitespace moved to the continuation (as lm-eval does), the whole text tokenized, split
    after the context's tokens, the continuation's log-probs summed."""
    stripped = context.rstrip()
    context, continuation = stripped, context[len(stripped):] + continuation
    whole = model.tokenize(context + continuation, special=True)
    n_ctx = len(model.tokenize(context, special=True))
    logp = torch.log_softmax(model.new_session().extend_logits(whole[:-1]), dim=-1)
    return float(sum(logp[i - 1, whole[i]] for i in range(n_ctx, len(whole))))


def test_multiple_choice_loglikelihoods_equal_the_engines(tmp_path, server, model):
    docs = [{"question": model.render_chat([{"role": "user", "content": q}]), "choices": choices, "label": label}
            for q, choices, label in MC_TURNS]
    # The answer follows the rendered turn directly (lm-eval puts a space between by default).
    write_task(tmp_path, "ds4_mc", docs,
               "output_type: multiple_choice\ndoc_to_choice: \"{{choices}}\"\ndoc_to_target: label\n"
               "target_delimiter: \"\"\n"
               "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    samples = run_lm_eval(tmp_path, [
        "--model", "local-completions",
        "--model_args", f"base_url={server.base}/v1/completions,model=smollm2,tokenizer_backend=remote,"
                        "num_concurrent=1,max_retries=1",
        "--batch_size", "2", "--tasks", "ds4_mc"])
    assert len(samples) == len(docs)
    for sample in samples:
        for i, args in enumerate(sample["arguments"].values()):
            reported = float(sample["resps"][i][0][0])
            assert reported == pytest.approx(engine_loglikelihood(model, args["arg_0"], args["arg_1"]), abs=1e-4)


def test_chat_generation_task_gets_the_servers_greedy_answer(tmp_path, server):
    import openai

    write_task(tmp_path, "ds4_gen", GEN_DOCS,
               "output_type: generate_until\ndoc_to_target: \"{{answer}}\"\n"
               "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 8\n  do_sample: false\n"
               "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n")
    (sample,) = run_lm_eval(tmp_path, [
        "--model", "local-chat-completions",
        "--model_args", f"base_url={server.base}/v1/chat/completions,model=smollm2,num_concurrent=1,max_retries=1",
        "--apply_chat_template", "--tasks", "ds4_gen"])
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0)
    direct = client.chat.completions.create(model="smollm2", temperature=0, max_tokens=8, stop=["\n"],
                                            messages=[{"role": "user", "content": GEN_DOCS[0]["question"]}])
    assert sample["resps"][0][0] == direct.choices[0].message.content
    assert sample["resps"][0][0]
