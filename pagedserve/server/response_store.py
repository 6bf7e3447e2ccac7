"""Responses kept for ``previous_response_id`` and ``GET /v1/responses/{id}``: the last few, in memory."""

from __future__ import annotations

from collections import OrderedDict

from pagedserve.server.errors import APIError


class ResponseStore:
    """The last ``size`` responses made with ``store`` on, each with the conversation that led to it and its
    output as chat messages, so that a request naming it continues that conversation. Lost at restart; a
    chain's every response holds its whole conversation, so memory grows with size times its length."""

    def __init__(self, size: int):
        self.size = size
        self.kept: OrderedDict[str, tuple[dict, list[dict]]] = OrderedDict()

    def put(self, response: dict, conversation: list[dict]) -> None:
        self.kept[response["id"]] = (response, conversation)
        while len(self.kept) > self.size:
            self.kept.popitem(last=False)

    def get(self, rid: str, param: str | None = None) -> tuple[dict, list[dict]]:
        """(the response, its conversation with its output) or a 404 that says why it may be gone."""
        if rid in self.kept:
            return self.kept[rid]
        why = (f"this server keeps its last {self.size} stored responses" if self.size else
               "this server keeps no responses (start it with --max-stored-responses N to keep some)")
        raise APIError(404, f"No response with id '{rid}' is stored here: {why}. Send the whole conversation in "
                            f"input instead.", "NotFoundError", param)

    def delete(self, rid: str) -> None:
        self.get(rid)
        del self.kept[rid]
