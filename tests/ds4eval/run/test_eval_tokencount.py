"""--tokenizer: counting a server's prompt and reply with a GGUF's tokenizer (random tiny GGUF)."""

import pytest

from ds4eval.run.tokencount import TokenCounter
from engine.synthetic import RandomModelSpec, write_random_gguf


@pytest.fixture(scope="module")
def counter(tmp_path_factory):
    return TokenCounter.from_gguf(str(write_random_gguf(tmp_path_factory.mktemp("tok") / "t.gguf",
                                                        RandomModelSpec(seed=3))))


def test_counts_follow_the_tokenizer(counter):
    text = "Answer: 4 because two and two make four."
    assert counter.output_tokens(text) == len(counter.tokenizer.encode(text))
    assert counter.output_tokens("") == 0
    # The thinking wrappers were added by ds4-eval around the reasoning stream: not counted.
    assert counter.output_tokens("<think>hm</think>" + text) == counter.output_tokens("hm" + text)


def test_prompt_counts_include_the_chat_template(counter):
    bare = len(counter.tokenizer.encode("sys")) + len(counter.tokenizer.encode("What is 2 + 2?"))
    assert counter.prompt_tokens("sys", "What is 2 + 2?") > bare
