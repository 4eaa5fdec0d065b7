"""Settings of tool calling, one field per server flag. The server's own config embeds this record.

tool_syntax            --tool-syntax                 syntax name; None picks it from the model (registry.detect_syntax)
tool_memory_max_ids    --tool-memory-max-ids         ids kept by the exact replay memory
tool_memory_max_bytes  (fixed 512 MiB unless set)    total UTF-8 bytes of remembered text
disable_exact_tool_replay  --disable-exact-tool-replay   re-render every call canonically
It only validates and builds objects; it parses no command line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from server.tools.registry import get_syntax
from server.tools.replay import DEFAULT_MAX_BYTES, DEFAULT_MAX_IDS, ReplayMemory


@dataclass(frozen=True)
class ToolsConfig:
    tool_syntax: Optional[str] = None
    tool_memory_max_ids: int = DEFAULT_MAX_IDS
    tool_memory_max_bytes: int = DEFAULT_MAX_BYTES
    disable_exact_tool_replay: bool = False

    def __post_init__(self):
        if self.tool_syntax is not None:
            get_syntax(self.tool_syntax)  # raises ValueError naming the known syntaxes
        if self.tool_memory_max_ids < 0:
            raise ValueError("--tool-memory-max-ids must be >= 0")
        if self.tool_memory_max_bytes < 0:
            raise ValueError("tool memory byte limit must be >= 0")

    def new_memory(self) -> ReplayMemory:
        return ReplayMemory(self.tool_memory_max_ids, self.tool_memory_max_bytes,
                            enabled=not self.disable_exact_tool_replay)
