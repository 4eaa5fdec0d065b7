"""Tokenizer endpoints in vLLM's form: `POST /tokenize`, `POST /detokenize`, `GET /tokenizer_info`.

They let a client count and build prompts with the served model's own tokenizer (for
example lm-evaluation-harness with `tokenizer_backend=remote`, which sends token-id prompts
to `/v1/completions`).

- `/tokenize` takes either `{"prompt": text, "add_special_tokens": true}` (a raw prompt,
  special-token text such as `<|im_end|>` parsed to its id, BOS added when the model adds
  one and `add_special_tokens` is true) or `{"messages": [...], "add_generation_prompt": true,
  "tools": [...]}` (rendered as `/v1/chat/completions` renders it). By default the ids are
  the ones the server would evaluate for that prompt (BOS added where the model adds one and
  the text does not start with it); `add_special_tokens: false` gives the bare tokenization
  of the text. It answers `{"count",
  "max_model_len", "tokens", "token_strs"}`; `token_strs` (the text of each token) only with
  `return_token_strs`, else null.
- `/detokenize` takes `{"tokens": [ids]}` and answers `{"prompt": text}`; an id outside the
  vocabulary is a 400.
- `/tokenizer_info` answers what a client needs to mirror the tokenizer: `bos_token`,
  `eos_token`, `pad_token`, `chat_template`, `model_max_length`, `vocab_size`.

Pure translation between request bodies and the model's tokenizer: no HTTP objects (routes
live in `server.endpoints`), no inference.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from server.apibase import StrictModel
from server.api_openai import ChatMessage, ToolDef
from server.errors import ApiError
from server.prompting import ToolCalling, prompt_ids
from server.tools.apis import messages_from_openai, tools_from_openai


class TokenizeRequest(StrictModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ToolDef] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[int] = Field(max_length=2**20)


def token_text(model: Any, token_id: int) -> str:
    """A token's own text, special tokens included (the vocabulary entry where the model has one)."""
    vocab = (getattr(model, "metadata", None) or {}).get("tokenizer.ggml.tokens")
    if vocab is not None and 0 <= token_id < len(vocab):
        return str(vocab[token_id])
    return model.detokenize([token_id])


def tokenize(model: Any, calling: ToolCalling, req: TokenizeRequest) -> dict[str, Any]:
    if (req.prompt is None) == (req.messages is None):
        raise ApiError(400, "give exactly one of prompt and messages", param="prompt")
    if req.messages is not None:
        if not req.add_generation_prompt:
            raise ApiError(400, "add_generation_prompt: only true is supported (the prompt is rendered "
                                "as /v1/chat/completions renders it)", param="add_generation_prompt")
        specs = tools_from_openai([t.model_dump(exclude_none=True) for t in req.tools or []])
        rendered = calling.render(model, messages_from_openai([m.model_dump(exclude_none=True)
                                                               for m in req.messages]), specs)
        text = rendered.text
    else:
        assert req.prompt is not None
        text = req.prompt
    add = True if req.add_special_tokens is None else req.add_special_tokens
    ids = prompt_ids(model, text) if add else model.tokenize(text, special=True)
    return {"count": len(ids), "max_model_len": model.n_ctx, "tokens": ids,
            "token_strs": [token_text(model, t) for t in ids] if req.return_token_strs else None}


def detokenize(model: Any, req: DetokenizeRequest) -> dict[str, Any]:
    bad = [t for t in req.tokens if not 0 <= t < model.n_vocab]
    if bad:
        raise ApiError(400, f"tokens: token id {bad[0]} is outside the vocabulary (0..{model.n_vocab - 1})",
                       param="tokens")
    return {"prompt": model.detokenize(list(req.tokens))}


def tokenizer_info(model: Any) -> dict[str, Any]:
    meta = getattr(model, "metadata", None) or {}
    bos = model.bos_id
    return {"tokenizer_class": "ds4eval", "bos_token": token_text(model, bos) if bos is not None else None,
            "eos_token": token_text(model, model.eos_id) if model.eos_id is not None else None,
            "pad_token": None, "chat_template": meta.get("tokenizer.chat_template"),
            "model_max_length": model.n_ctx, "vocab_size": model.n_vocab}
