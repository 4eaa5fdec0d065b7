"""Count tokens of a server's prompt and reply with a model's own tokenizer (`--tokenizer GGUF`).

Contract
- `TokenCounter.from_gguf(path)` reads only the GGUF's metadata (tokenizer and chat template,
  no weights) through the engine's public GGUF, tokenizer and chat-template modules.
- `prompt_tokens(system, question)` renders the two messages with the model's chat template
  (generation prompt included) and counts the ids, adding BOS where the model adds one;
  `output_tokens(text)` counts the reply text, with the `<think>`/`</think>` wrappers that
  ds4-eval put around the reasoning stream removed (the server never sampled them as text).
- `rendered_prompt(system, question)` is the prompt as those ids (`ds4eval.run.provenance.
  RenderedPrompt`): the trace's prompt_sha256 and rendered prompt for a server run, equal to the
  engine's for the same file and template, so that two stacks' runs line up case by case. It is
  ds4-eval's rendering with the model's own template, which is what a server that renders the
  GGUF's template (ds4-server, llama.cpp) feeds its model.
- The counts re-tokenize text, so they can differ by a token or so from the ids the server
  sampled; they are meant for servers that send no usage, where the alternative is no count.
It does not talk to servers and does not decide when counting is needed (the backend does).
"""

from __future__ import annotations

from ds4eval.cases.extract import THINK_CLOSE, THINK_OPEN
from ds4eval.run.provenance import RenderedPrompt, token_pieces


class TokenCounter:
    def __init__(self, tokenizer, template=None):
        self.tokenizer, self.template = tokenizer, template

    @classmethod
    def from_gguf(cls, path: str) -> "TokenCounter":
        from engine.chat_template import ChatTemplate
        from engine.gguf_file import read_gguf
        from engine.tokenizer import Tokenizer

        meta = read_gguf(path).metadata
        template = ChatTemplate.from_gguf_metadata(meta) if "tokenizer.chat_template" in meta else None
        return cls(Tokenizer.from_gguf_metadata(meta), template)

    def prompt_ids(self, system: str, question: str) -> list[int]:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        if self.template is not None:
            ids = self.tokenizer.encode(self.template.render(messages, add_generation_prompt=True), special=True)
        else:
            ids = self.tokenizer.encode(system, special=False) + self.tokenizer.encode(question, special=False)
        if self.tokenizer.add_bos and self.tokenizer.bos_id is not None and (not ids or ids[0] != self.tokenizer.bos_id):
            ids = [self.tokenizer.bos_id] + ids
        return ids

    def prompt_tokens(self, system: str, question: str) -> int:
        return len(self.prompt_ids(system, question))

    def text_stream(self):
        """The tokenizer's incremental decoder (what `provenance.token_pieces` reads pieces from)."""
        from engine.tokenizer import TextStream

        return TextStream(self.tokenizer)

    def rendered_prompt(self, system: str, question: str) -> RenderedPrompt:
        ids = self.prompt_ids(system, question)
        return RenderedPrompt.of(ids, token_pieces(self, ids))

    def output_tokens(self, text: str) -> int:
        text = text.replace(THINK_OPEN, "").replace(THINK_CLOSE, "")
        return len(self.tokenizer.encode(text, special=False)) if text else 0
