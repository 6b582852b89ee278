"""Whose is it: with API keys, each upload and live stream belongs to the key that made it, and only
that key lists, reads, uses or deletes it (another key gets the 404 of a thing that does not exist).
An owner is a short digest of the key, never the key; without keys every request is the one owner "".
"""
from __future__ import annotations

import hashlib
from typing import Any

OWNER = "arrcoc_owner"      # the request state's key (set by app.Guard once the API key matched)


def owner_of(key: str | None) -> str:
    return "" if key is None else hashlib.sha256(key.encode()).hexdigest()[:16]


def request_owner(request: Any) -> str:
    """The owner of a Starlette request ("" without API keys)."""
    return request.scope.get("state", {}).get(OWNER, "")
