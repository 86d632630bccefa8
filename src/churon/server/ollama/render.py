"""Engine outputs in Ollama's shapes: the objects of a chat or generate stream, the last one's timings,
a message's tool calls (arguments as objects)."""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone
from typing import Any, Sequence

from churon.engine import CompletionOutput
from churon.tool_calls import ToolCall


def created_at() -> str:
    """RFC 3339 in UTC, as Ollama writes it ("2024-07-22T20:33:28.123648Z")."""
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def header(model: str) -> dict[str, Any]:
    return {"model": model, "created_at": created_at()}


def message(content: str, calls: Sequence[ToolCall] = ()) -> dict[str, Any]:
    out: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        out["tool_calls"] = [tool_call(c) for c in calls]
    return out


def tool_call(call: ToolCall) -> dict[str, Any]:
    return {"function": {"name": call.name, "arguments": json.loads(call.arguments)}}


def done_reason(output: CompletionOutput) -> str:
    return "length" if output.finish_reason == "length" else "stop"


class Timer:
    """A request's clock, in nanoseconds: started when the request arrived, marked once its model was ready."""

    def __init__(self):
        self.start = time.perf_counter_ns()
        self.load_duration = 0

    def loaded(self) -> None:
        self.load_duration = time.perf_counter_ns() - self.start

    def total(self) -> int:
        return time.perf_counter_ns() - self.start


def final_fields(output: CompletionOutput, timer: Timer) -> dict[str, Any]:
    """The last object's counts and durations: the prompt's tokens and the time to the first answer token
    (the engine's prefill), the answer's tokens and the time from the first to the last. Both run inside the
    request's total, after its load."""
    m = output.metrics
    return {
        "done": True,
        "done_reason": done_reason(output),
        "total_duration": timer.total(),
        "load_duration": timer.load_duration,
        "prompt_eval_count": len(output.prompt_token_ids),
        "prompt_eval_duration": int(m.prefill_seconds * 1e9),
        "eval_count": len(output.token_ids),
        "eval_duration": int(m.decode_seconds * 1e9),
    }
