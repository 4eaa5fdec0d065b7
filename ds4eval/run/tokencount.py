"""Count tokens of a server's prompt and reply with a model's own tokenizer (`--tokenizer GGUF`).

Contract
- `TokenCounter.from_gguf(path)` reads only the GGUF's metadata (tokenizer and chat template,
  no weights) through the engine's public GGUF, tokenizer and chat-template modules.
- `prompt_tokens(system, question)` renders the two messages with the model's chat template
  (generation prompt included) and counts the ids, adding BOS where the model adds one;
  `output_tokens(text)` counts the reply text, with the `<think>`/`</think>` wrappers that
  ds4-eval put around the reasoning stream removed (the server never sampled them as text).
- The counts re-tokenize text, so they can differ by a token or so from the ids the server
  sampled; they are meant for servers that send no usage, where the alternative is no count.
It does not talk to servers and does not decide when counting is needed (the backend does).
"""

from __future__ import annotations

from ds4eval.cases.extract import THINK_CLOSE, THINK_OPEN


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

    def prompt_tokens(self, system: str, question: str) -> int:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        if self.template is not None:
            ids = self.tokenizer.encode(self.template.render(messages, add_generation_prompt=True), special=True)
        else:
            ids = self.tokenizer.encode(system, special=False) + self.tokenizer.encode(question, special=False)
        if self.tokenizer.add_bos and self.tokenizer.bos_id is not None and (not ids or ids[0] != self.tokenizer.bos_id):
            ids = [self.tokenizer.bos_id] + ids
        return len(ids)

    def output_tokens(self, text: str) -> int:
        text = text.replace(THINK_OPEN, "").replace(THINK_CLOSE, "")
        return len(self.tokenizer.encode(text, special=False)) if text else 0
