"""Tool calling and thinking: model syntaxes, a streaming parser with repair, and exact replay. Pure text processing.

This package imports no engine and does no I/O, so it is tested without weights. The server wires it up: render
the conversation (`render_conversation`), generate, feed the generated text to a `ToolCallParser`, sample at
temperature 0 while `parser.in_structure` is True, and map the result onto its API (`server.tools.apis`).

Syntaxes (`SYNTAXES`, chosen by `detect_syntax(model_name, architecture, chat_template, override)`):
    hermes    <tool_call>{"name": ..., "arguments": {...}}</tool_call>
    dsml      <｜DSML｜tool_calls><｜DSML｜invoke name="..."><｜DSML｜parameter name="..." string="true|false">
    glm       <tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value></tool_call>
    qwen-xml  <tool_call><function=name><parameter=key>value</parameter></function></tool_call>
Each syntax object renders `render_tools(specs)`, `render_calls(calls)`, `render_results(results)` and
`render_assistant(content, calls)`; all JSON it writes is `canonical_json` (insertion order, ", " and ": ",
characters as themselves). Payloads escape only their own closing delimiter (`DelimiterEscaper`).

Parsing (rules in `server.tools.parser`):
    parse_tool_output(syntax, text, *, tools=None, starts_in_thinking=False, finish_reason="stop") -> ParseResult
        .content (visible text), .reasoning (thinking text), .tool_calls (ToolCall: .id, .name, .arguments dict,
        .arguments_json, .raw exact block text, .repaired), .finish_reason ("tool_calls" | "stop" | "length"),
        .repaired, .malformed, .raw
    parser = ToolCallParser(syntax, tools=None, starts_in_thinking=False, id_prefix="call_")
        parser.feed(chunk) -> [ContentDelta | ReasoningDelta | ToolCallStart | ToolCallArgumentsDelta | ToolCallEnd]
        parser.in_structure  True inside tool syntax outside argument values: sample at temperature 0 there
        parser.in_thinking   True inside a thinking block
        parser.finish(finish_reason) -> ParseResult (its .events are the events produced by finish itself)
    For any chunking of the same text the final result is the same, and the deltas concatenate to it.

Replay (`ReplayMemory`, built by `ToolsConfig.new_memory()`): after a turn that made calls, the server calls
`memory.remember([call ids], exact turn text)`; `render_conversation(..., memory=memory)` then writes that text back
for the turn when the client returns the same calls, and counts replayed / rerendered / missing calls.

Grammars (`server.tools.grammar`): `calls_grammar(syntax, tools, max_calls)`, the Lark text of whole calls as the
syntax writes them, arguments fitting the tools' schemas (what a forced call is decoded under).

API mapping (`server.tools.apis`): tools_from_openai/anthropic/responses, messages_from_openai/anthropic/responses,
ID_PREFIX; the responses themselves are built by the server's API modules.
"""

from server.tools.canonical import DelimiterEscaper, canonical_json, new_call_id
from server.tools.config import ToolsConfig
from server.tools.parser import ToolCallParser, parse_tool_output
from server.tools.records import (
    ContentDelta, Event, Message, ParseResult, ReasoningDelta, ToolCall, ToolCallArgumentsDelta, ToolCallEnd,
    ToolCallStart, ToolResult, ToolSpec)
from server.tools.registry import DEFAULT_SYNTAX, SYNTAXES, detect_syntax, get_syntax
from server.tools.render import RenderedConversation, order_results, render_conversation
from server.tools.replay import ReplayMemory
from server.tools.syntax_base import Syntax

__all__ = [
    "DelimiterEscaper", "canonical_json", "new_call_id", "ToolsConfig", "ToolCallParser", "parse_tool_output",
    "ContentDelta", "Event", "Message", "ParseResult", "ReasoningDelta", "ToolCall", "ToolCallArgumentsDelta",
    "ToolCallEnd", "ToolCallStart", "ToolResult", "ToolSpec", "DEFAULT_SYNTAX", "SYNTAXES", "detect_syntax",
    "get_syntax", "RenderedConversation", "order_results", "render_conversation", "ReplayMemory", "Syntax",
]
