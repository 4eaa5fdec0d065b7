"""The registry of tool-call syntaxes and the rule that picks one for a loaded model.

`detect_syntax` looks at the chat template first (it says what the model was trained to write), then at the model's
architecture and name; an explicit override (`--tool-syntax`) wins over all of them. It reads only the strings it is
given: it does not open model files.
"""

from __future__ import annotations

from typing import Optional, Union

from server.tools.dsml import Dsml
from server.tools.hermes import Hermes
from server.tools.syntax_base import Syntax
from server.tools.xmlish import Glm, QwenXml

SYNTAXES: dict[str, Syntax] = {s.name: s for s in (Hermes(), Dsml(), Glm(), QwenXml())}
DEFAULT_SYNTAX = "hermes"


def get_syntax(syntax: Union[str, Syntax]) -> Syntax:
    """The syntax object for a name (or the object itself). Raises ValueError naming the known syntaxes."""
    if isinstance(syntax, Syntax):
        return syntax
    try:
        return SYNTAXES[syntax]
    except KeyError:
        raise ValueError(f"unknown tool syntax {syntax!r} (known: {', '.join(sorted(SYNTAXES))})") from None


def detect_syntax(model_name: str = "", architecture: str = "", chat_template: str = "",
                  override: Optional[str] = None) -> str:
    """The name of the syntax the model writes.

    Order: `override`; markers in the chat template (DSML tags -> dsml, `<arg_key>` -> glm, `<function=` with
    `<parameter=` -> qwen-xml, `<tool_call>` -> hermes); then architecture/name hints (deepseek -> dsml, glm -> glm,
    qwen3-coder -> qwen-xml); else hermes, the format most small instruct models were tuned on."""
    if override:
        return get_syntax(override).name
    t = chat_template or ""
    if "DSML" in t:
        return "dsml"
    if "<arg_key>" in t:
        return "glm"
    if "<function=" in t and "<parameter=" in t:
        return "qwen-xml"
    if "<tool_call>" in t:
        return "hermes"
    hint = f"{architecture} {model_name}".lower().replace("_", "-")
    if "deepseek" in hint:
        return "dsml"
    if "glm" in hint:
        return "glm"
    if "qwen3-coder" in hint or "qwen3coder" in hint:
        return "qwen-xml"
    return DEFAULT_SYNTAX
