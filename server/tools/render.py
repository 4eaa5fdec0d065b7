"""Render an API-neutral conversation with tools into plain {"role", "content"} messages for the chat template.

What it does:
- Tool definitions are rendered by the syntax (canonical JSON) and placed before the client's system prompt, in the
  first leading system message (one is created when there is none).
- An assistant turn with calls becomes text: the exact remembered turn when the replay memory holds every call id
  of the turn under the same text and that text still parses to the same calls (names and arguments); otherwise its
  content followed by the calls rendered canonically.
- A run of consecutive tool results becomes one message in the syntax's result role, ordered like the calls of the
  assistant turn they answer (results for unknown ids keep their arrival order, after the known ones).
- Reasoning of earlier turns is not rendered on the canonical path (chat templates drop it too); a replayed turn
  holds exactly what the model wrote, thinking included.
It does not apply the chat template, tokenize, or validate API fields (see `server.tools.apis`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional, Union

from server.tools.parser import parse_tool_output
from server.tools.records import Message, ToolResult, ToolSpec
from server.tools.registry import get_syntax
from server.tools.replay import ReplayMemory
from server.tools.syntax_base import Syntax


@dataclass
class RenderedConversation:
    messages: list[dict]
    replayed: int = 0
    rerendered: int = 0
    missing: int = 0


def order_results(calls_order: list[str], results: list[ToolResult]) -> list[ToolResult]:
    """Results sorted into the order of the calls they answer; unknown ids last, in arrival order."""
    rank = {cid: i for i, cid in enumerate(calls_order)}
    return sorted(results, key=lambda r: rank.get(r.call_id, len(rank)))


def render_conversation(syntax: Union[str, Syntax], messages: list[Message], tools: Optional[list[ToolSpec]] = None,
                        memory: Optional[ReplayMemory] = None) -> RenderedConversation:
    s = get_syntax(syntax)
    tools = list(tools or [])
    out = RenderedConversation(messages=[])
    verified: dict[int, tuple] = {}  # id(text) -> parsed (name, arguments) pairs, parsed once per distinct text
    last_calls: list[str] = []
    i = 0
    while i < len(messages):
        m = messages[i]
        if m.role == "tool":
            run = []
            while i < len(messages) and messages[i].role == "tool":
                t = messages[i]
                run.append(ToolResult(t.tool_call_id, t.content, t.is_error, t.name))
                i += 1
            out.messages.append({"role": s.result_role, "content": s.render_results(order_results(last_calls, run))})
            continue
        if m.role == "assistant" and m.tool_calls:
            last_calls = [c.id for c in m.tool_calls]
            out.messages.append({"role": "assistant", "content": _assistant_text(s, m, tools, memory, out, verified)})
        else:
            out.messages.append({"role": m.role, "content": m.content})
        i += 1
    if tools:
        block = s.render_tools(tools)
        if out.messages and out.messages[0]["role"] == "system":
            first = out.messages[0]
            first["content"] = f"{block}\n\n{first['content']}" if first["content"] else block
        else:
            out.messages.insert(0, {"role": "system", "content": block})
    if memory is not None:
        memory.replayed += out.replayed
        memory.rerendered += out.rerendered
        memory.missing += out.missing
    return out


def _meaning(calls) -> list[tuple[str, str]]:
    """Calls compared by name and arguments, ignoring key order but not types (True is not 1)."""
    return [(c.name, json.dumps(c.arguments, sort_keys=True, ensure_ascii=False)) for c in calls]


def _assistant_text(s: Syntax, m: Message, tools: list[ToolSpec], memory: Optional[ReplayMemory],
                    out: RenderedConversation, verified: dict) -> str:
    n = len(m.tool_calls)
    if memory is None or not memory.enabled:
        out.rerendered += n
        return s.render_assistant(m.content, m.tool_calls)
    texts = [memory.lookup(c.id) for c in m.tool_calls]
    found = [t for t in texts if t is not None]
    out.missing += n - len(found)
    if len(found) == n and all(t is found[0] for t in found):
        text = found[0]
        key = id(text)
        if key not in verified:
            r = parse_tool_output(s, text, tools=tools)
            verified[key] = _meaning(r.tool_calls)
        if verified[key] == _meaning(m.tool_calls):
            out.replayed += n
            return text
    out.rerendered += len(found)
    return s.render_assistant(m.content, m.tool_calls)
