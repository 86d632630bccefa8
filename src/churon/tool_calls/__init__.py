"""Tool calling, below the server and for each API that offers it: the neutral vocabulary (tool.py),
the syntaxes models write calls in (formats.py), the grammars that force calls (grammar.py), the
fallback for templates without tool support (fallback.py), the streaming parser (stream.py) and the
ToolPlan that puts them together for one request (plan.py)."""

from churon.tool_calls.plan import ToolPlan
from churon.tool_calls.tool import (
    TextDelta,
    Tool,
    ToolCall,
    ToolCallArguments,
    ToolCallError,
    ToolCallStart,
    ToolChoice,
)

__all__ = ["TextDelta", "Tool", "ToolCall", "ToolCallArguments", "ToolCallError", "ToolCallStart", "ToolChoice", "ToolPlan"]
