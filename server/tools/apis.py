"""Mapping the three HTTP APIs' conversations and tool definitions onto the package's records. Pure functions over
plain dicts.

OpenAI Chat messages (`tool_calls`, `tool` role), Anthropic content blocks (`tool_use`, `tool_result`, `thinking`),
Responses items (`function_call`, `function_call_output`, `reasoning`) and each API's tool definitions become
`Message` / `ToolSpec` records. This is the one place where a request's messages are checked beyond their schema:
shapes that cannot be mapped raise `ToolInputError` (a ValueError whose message is fit for a 400 response, `param`
naming the field). `ID_PREFIX` holds each API's prefix for generated call ids. This module does not validate
sampling fields, count tokens or build responses (the `server.api_*` modules answer in each API's shape).
"""

from __future__ import annotations

import json
from typing import Any, Optional

from server.tools.records import Message, ToolCall, ToolSpec

# Call-id prefixes per API: generated calls get `prefix + 24 base-62 characters` from the CSPRNG.
ID_PREFIX = {"openai": "call_", "anthropic": "toolu_", "responses": "call_"}


class ToolInputError(ValueError):
    """A client object that cannot be mapped; `param` names where it was found."""

    def __init__(self, message: str, param: str = ""):
        super().__init__(message)
        self.param = param


def _need(cond: bool, message: str, param: str) -> None:
    if not cond:
        raise ToolInputError(message, param)


def _text(content: Any, param: str, kinds: tuple[str, ...] = ("text",)) -> str:
    """Text of a string or of a list of text parts (other part types are refused)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    _need(isinstance(content, list), "content must be a string or a list of parts", param)
    pieces = []
    for j, part in enumerate(content):
        _need(isinstance(part, dict), "each content part must be an object", f"{param}[{j}]")
        _need(part.get("type") in kinds, f"content of type {part.get('type')!r} is not supported "
                                         f"(text only: {', '.join(kinds)})", f"{param}[{j}].type")
        _need(isinstance(part.get("text"), str), "a text part needs a 'text' string", f"{param}[{j}].text")
        pieces.append(part["text"])
    return "".join(pieces)


def _arguments(raw: Any, param: str) -> dict:
    """Arguments from a JSON string (OpenAI, Responses) or an object (Anthropic)."""
    if isinstance(raw, dict):
        return raw
    _need(isinstance(raw, str), "arguments must be a JSON string", param)
    if not raw.strip():
        return {}
    try:
        value = json.loads(raw)
    except ValueError as e:
        raise ToolInputError(f"arguments are not valid JSON: {e}", param) from None
    _need(isinstance(value, dict), "arguments must encode a JSON object", param)
    return value


def _spec(name: Any, description: Any, parameters: Any, param: str) -> ToolSpec:
    _need(isinstance(name, str) and bool(name), "tool name must be a non-empty string", param)
    _need(description is None or isinstance(description, str), "tool description must be a string", param)
    _need(parameters is None or isinstance(parameters, dict), "tool parameters must be a JSON schema object", param)
    return ToolSpec(name, description or "", parameters if parameters is not None else {})


# ---- tool definitions -------------------------------------------------------------------------------------------

def tools_from_openai(tools: Optional[list]) -> list[ToolSpec]:
    specs = []
    for i, t in enumerate(tools or []):
        p = f"tools[{i}]"
        _need(isinstance(t, dict) and t.get("type", "function") == "function" and isinstance(t.get("function"), dict),
              'each tool must be {"type": "function", "function": {...}}', p)
        f = t["function"]
        specs.append(_spec(f.get("name"), f.get("description"), f.get("parameters"), p))
    return specs


def tools_from_anthropic(tools: Optional[list]) -> list[ToolSpec]:
    specs = []
    for i, t in enumerate(tools or []):
        p = f"tools[{i}]"
        _need(isinstance(t, dict) and t.get("type", "custom") == "custom",
              "only custom tools (name, description, input_schema) are supported", p)
        specs.append(_spec(t.get("name"), t.get("description"), t.get("input_schema"), p))
    return specs


def tools_from_responses(tools: Optional[list]) -> list[ToolSpec]:
    specs = []
    for i, t in enumerate(tools or []):
        p = f"tools[{i}]"
        _need(isinstance(t, dict) and t.get("type") == "function", "only function tools are supported", p)
        specs.append(_spec(t.get("name"), t.get("description"), t.get("parameters"), p))
    return specs


# ---- conversation input -----------------------------------------------------------------------------------------

def messages_from_openai(messages: list) -> list[Message]:
    """OpenAI Chat messages (`developer` is a system message); calls without an id get `call_<i>_<j>`."""
    out = []
    for i, m in enumerate(messages):
        p = f"messages[{i}]"
        _need(isinstance(m, dict), "each message must be an object", p)
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise ToolInputError(f"unknown message role {role!r}", p + ".role")
        content = _text(m.get("content"), p + ".content")
        _need(role == "assistant" or not m.get("tool_calls"), "only assistant messages carry tool_calls",
              p + ".tool_calls")
        if role in ("system", "developer"):
            out.append(Message("system", content))
        elif role == "user":
            out.append(Message("user", content))
        elif role == "assistant":
            calls = []
            for j, c in enumerate(m.get("tool_calls") or []):
                cp = f"{p}.tool_calls[{j}]"
                _need(isinstance(c, dict) and isinstance(c.get("function"), dict), "tool call must have a function",
                      cp)
                f = c["function"]
                _need(isinstance(f.get("name"), str) and bool(f["name"]), "tool call needs a function name", cp)
                _need(isinstance(c.get("id", ""), str), "tool call id must be a string", cp)
                calls.append(ToolCall(c.get("id") or f"call_{i}_{j}", f["name"],
                                      _arguments(f.get("arguments", "{}"), cp)))
            reasoning = m.get("reasoning_content") or m.get("reasoning") or ""
            _need(isinstance(reasoning, str), "reasoning_content must be a string", p)
            out.append(Message("assistant", content, reasoning, calls))
        else:
            call_id = m.get("tool_call_id")
            _need(isinstance(call_id, str) and bool(call_id), "a tool message needs tool_call_id",
                  p + ".tool_call_id")
            out.append(Message("tool", content, tool_call_id=call_id))
    return out


def messages_from_anthropic(system: Any, messages: list) -> list[Message]:
    out = []
    if system:
        out.append(Message("system", _text(system, "system")))
    for i, m in enumerate(messages):
        p = f"messages[{i}]"
        _need(isinstance(m, dict) and m.get("role") in ("user", "assistant"), "role must be user or assistant", p)
        content = m.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        _need(isinstance(blocks, list), "content must be a string or a list of blocks", p + ".content")
        if m["role"] == "user":
            texts = []
            for j, b in enumerate(blocks):
                bp = f"{p}.content[{j}]"
                _need(isinstance(b, dict), "content block must be an object", bp)
                if b.get("type") == "tool_result":
                    _need(isinstance(b.get("tool_use_id"), str), "tool_result needs tool_use_id", bp)
                    out.append(Message("tool", _text(b.get("content"), bp + ".content"),
                                       tool_call_id=b["tool_use_id"], is_error=bool(b.get("is_error"))))
                else:
                    _need(b.get("type") == "text", f"content of type {b.get('type')!r} is not supported "
                                                   "(text and tool_result only)", bp + ".type")
                    _need(isinstance(b.get("text"), str), "a text block needs a 'text' string", bp + ".text")
                    texts.append(b["text"])
            if texts:
                out.append(Message("user", "".join(texts)))
        else:
            msg = Message("assistant")
            for j, b in enumerate(blocks):
                bp = f"{p}.content[{j}]"
                _need(isinstance(b, dict), "content block must be an object", bp)
                kind = b.get("type")
                if kind == "text":
                    _need(isinstance(b.get("text"), str), "a text block needs a 'text' string", bp + ".text")
                    msg.content += b["text"]
                elif kind == "thinking":
                    _need(isinstance(b.get("thinking"), str), "thinking block needs text", bp)
                    msg.reasoning += b["thinking"]
                elif kind == "redacted_thinking":
                    continue
                elif kind == "tool_use":
                    _need(isinstance(b.get("id"), str) and isinstance(b.get("name"), str) and bool(b["name"]),
                          "tool_use needs id and name", bp)
                    _need(isinstance(b.get("input", {}), dict), "tool_use input must be an object", bp)
                    msg.tool_calls.append(ToolCall(b["id"], b["name"], b.get("input", {})))
                else:
                    raise ToolInputError(f"unsupported assistant content block {kind!r}", bp)
            out.append(msg)
    return out


def messages_from_responses(instructions: Any, items: Any) -> list[Message]:
    out: list[Message] = []
    if instructions:
        _need(isinstance(instructions, str), "instructions must be a string", "instructions")
        out.append(Message("system", instructions))
    if isinstance(items, str):
        return out + [Message("user", items)]
    _need(isinstance(items, list), "input must be a string or a list of items", "input")
    pending_reasoning = ""

    def assistant() -> Message:
        # Calls and reasoning that follow an assistant message belong to the same turn.
        nonlocal pending_reasoning
        if not out or out[-1].role != "assistant":
            out.append(Message("assistant"))
        out[-1].reasoning += pending_reasoning
        pending_reasoning = ""
        return out[-1]

    text_kinds = ("input_text", "output_text", "text")
    for i, it in enumerate(items):
        p = f"input[{i}]"
        _need(isinstance(it, dict), "each input item must be an object", p)
        kind = it.get("type", "message")
        if kind == "message":
            role = it.get("role")
            _need(role in ("user", "assistant", "system", "developer"), f"unknown message role {role!r}",
                  p + ".role")
            text = _text(it.get("content"), p + ".content", text_kinds)
            if role == "assistant":
                if out and out[-1].role == "assistant" and not out[-1].tool_calls:
                    out[-1].content += text
                    out[-1].reasoning += pending_reasoning
                else:
                    out.append(Message("assistant", text, pending_reasoning))
                pending_reasoning = ""
            else:
                out.append(Message("system" if role == "developer" else role, text))
        elif kind == "function_call":
            _need(isinstance(it.get("call_id"), str) and isinstance(it.get("name"), str) and bool(it["name"]),
                  "function_call needs call_id and name", p)
            assistant().tool_calls.append(ToolCall(it["call_id"], it["name"], _arguments(it.get("arguments", ""), p)))
        elif kind == "function_call_output":
            _need(isinstance(it.get("call_id"), str), "function_call_output needs call_id", p)
            out.append(Message("tool", _text(it.get("output"), p + ".output", text_kinds),
                               tool_call_id=it["call_id"]))
        elif kind == "reasoning":
            parts = it.get("content") or it.get("summary") or []
            _need(isinstance(parts, list), "reasoning content must be a list", p)
            pending_reasoning += "".join(x.get("text", "") for x in parts if isinstance(x, dict))
        else:
            raise ToolInputError(f"unsupported input item type {kind!r}", p + ".type")
    return out
