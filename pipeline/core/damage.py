"""A video that damage stopped decoding early: what its stream records, and who counts it as done.

Such a stream, processed to the last frame that could be decoded, is finished but not complete
(the sink closes it with StreamWriter.close(damaged=True, truncated_at_s=...)).
`complete` stays false: the store does not hold the whole video, and a reader that knows only
`complete` must not take it for one (`run` and `live` say so on stderr). Two attrs say why and
where it stops:

    damaged: true
    truncated_at_s: pts of its last stored frame (s); null if none was stored

Nothing more can be decoded from the file, so a resumed batch does not redo it (it is *done*), and
`eval` scores its answers and reports how many came from damaged videos. A stream interrupted or
failed before the end of what could be decoded gets no such attrs: it is incomplete, and a resume
redoes it.
"""
from __future__ import annotations

from typing import Any

from sinks import SinkError


def is_damaged(attrs: dict[str, Any]) -> bool:
    """The stream (its attrs) was processed to where damage stopped decoding."""
    return attrs.get("damaged") is True and attrs.get("complete") is not True


def stream_damaged(store: Any, stream_id: str) -> bool:
    """The stream `stream_id` of `store` (a ZarrStore), which exists, was processed to where damage
    stopped decoding. Reads its attrs (a group a crash left half made is not)."""
    try:
        return is_damaged(store.read(stream_id)["attrs"])
    except (SinkError, OSError, KeyError, ValueError):
        return False


def damaged_streams(store: Any) -> set[str]:
    """Ids of the streams of `store` processed to where damage stopped decoding: with the complete
    ones, the streams there is nothing left to do for."""
    return {sid for sid in store.stream_ids() if not store.is_complete(sid) and stream_damaged(store, sid)}
