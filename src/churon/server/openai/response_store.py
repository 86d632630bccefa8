"""The responses a server keeps (`store`, on by default): for GET and DELETE /v1/responses/{id}, and
for a later request's `previous_response_id`, which continues the conversation they hold.

In memory and bounded: the least recently used goes first once MAX_STORED_RESPONSES are kept, so a
long-running server holds a fixed amount, and a client that never deletes cannot grow it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

MAX_STORED_RESPONSES = 1000


@dataclass
class StoredResponse:
    response: dict[str, Any]  # the Response object as sent
    # the conversation it ended, in chat-template form (ToolPlan's messages): its input (without its
    # `instructions`, which a continuation does not inherit) and its output
    messages: list[dict[str, Any]]


class ResponseStore:
    def __init__(self, capacity: int = MAX_STORED_RESPONSES):
        if capacity < 1:
            raise ValueError(f"response store capacity {capacity!r}: must be >= 1")
        self.capacity = capacity
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._responses)

    def put(self, stored: StoredResponse) -> None:
        id = stored.response["id"]
        self._responses[id] = stored
        self._responses.move_to_end(id)
        while len(self._responses) > self.capacity:
            self._responses.popitem(last=False)

    def get(self, id: str) -> StoredResponse | None:
        stored = self._responses.get(id)
        if stored is not None:
            self._responses.move_to_end(id)
        return stored

    def delete(self, id: str) -> bool:
        return self._responses.pop(id, None) is not None
