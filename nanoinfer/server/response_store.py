"""The Responses API's stored responses (routes/responses.py): what `previous_response_id` and
GET /v1/responses/{id} read, held in this server process's memory. Behind --replicas each
replica holds its own; a response id names its replica, and the router sends a follow-up there
(Route.affinity)."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

STORED_RESPONSES = 1_000  # responses the Responses API keeps for previous_response_id and GET
STORED_BYTES = 128 << 20  # and their bytes, counted as StoredResponse.size


@dataclass(slots=True)
class StoredResponse:
    response: dict  # the response object, as GET /v1/responses/{id} returns it
    conversation: list[dict]  # the input items that led to it, then its output items: a follow-up's history
    size: int  # bytes charged: its response's JSON and its whole conversation's (items shared with
    # the response it continued are charged to both, so the sum bounds what the store keeps alive)


class ResponseStore:
    """The Responses API's stored responses, in memory: the least recently used are forgotten past
    `max_responses` of them or `max_bytes` in all (the one just stored always stays)."""

    def __init__(self, max_responses: int = STORED_RESPONSES, max_bytes: int = STORED_BYTES):
        self.max_responses, self.max_bytes = max_responses, max_bytes
        self.entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.bytes = 0

    def put(self, rid: str, stored: StoredResponse) -> None:
        self.delete(rid)
        self.entries[rid] = stored
        self.bytes += stored.size
        while len(self.entries) > 1 and (len(self.entries) > self.max_responses or self.bytes > self.max_bytes):
            _, old = self.entries.popitem(last=False)
            self.bytes -= old.size

    def get(self, rid: str) -> StoredResponse | None:
        stored = self.entries.get(rid)
        if stored is not None:
            self.entries.move_to_end(rid)
        return stored

    def delete(self, rid: str) -> bool:
        stored = self.entries.pop(rid, None)
        if stored is not None:
            self.bytes -= stored.size
        return stored is not None
