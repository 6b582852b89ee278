"""ZarrStore.delete: a server's retention removes streams, never one a writer still owns."""
from __future__ import annotations

import pytest

from sinks import SinkError, ZarrStore, validate_store


def _open_stream(store: ZarrStore, stream_id: str):
    return store.stream(stream_id, source="a.mp4", query="q", fps=10.0, width=64, height=48, grid=(2, 3), vlm="none")


def test_delete_a_closed_stream_leaves_a_valid_store(tmp_path):
    store = ZarrStore.open(tmp_path / "s.zarr", config={})
    _open_stream(store, "keep").close(complete=True)
    _open_stream(store, "gone").close(complete=True)
    assert store.delete("gone") is True
    assert store.stream_ids() == ["keep"] and validate_store(store.path) == []
    assert store.delete("gone") is False
    assert not (tmp_path / "s.zarr" / ".staging").exists()


def test_a_stream_being_written_is_not_deleted(tmp_path):
    store = ZarrStore.open(tmp_path / "s.zarr", config={})
    writer = _open_stream(store, "busy")
    with pytest.raises(SinkError, match="being written"):
        store.delete("busy")
    writer.close(complete=False)
    assert store.delete("busy") is True and store.stream_ids() == []


def test_read_only_and_bad_ids(tmp_path):
    ZarrStore.open(tmp_path / "s.zarr", config={})
    with pytest.raises(SinkError, match="read-only"):
        ZarrStore.open(tmp_path / "s.zarr", mode="r").delete("x")
    with pytest.raises((SinkError, ValueError)):
        ZarrStore.open(tmp_path / "s.zarr").delete("../escape")
