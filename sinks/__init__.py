"""Output sinks: the zarr store (its public schema declared in sinks.schema), the homunculus
overlay video / contact sheet, and flat exports of a store's answers and scene changes."""
from sinks.export import EXPORT_FORMATS, export_store
from sinks.overlay import FrameLabel, OverlayWriter, contact_sheet, render_homunculus
from sinks.schema import FORMAT
from sinks.zarr_store import (ReplacedStream, SinkError, StreamWriter, ZarrStore, read_stream, store_location,
                              validate_store, validate_stream_id)

__all__ = ["FORMAT", "SinkError", "ZarrStore", "StreamWriter", "ReplacedStream", "read_stream", "store_location",
           "validate_store", "validate_stream_id", "OverlayWriter", "FrameLabel", "contact_sheet",
           "render_homunculus", "EXPORT_FORMATS", "export_store"]
