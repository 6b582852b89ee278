"""Output sinks: the zarr store (its public schema declared in sinks.schema) and the homunculus
overlay video / contact sheet."""
from sinks.overlay import OverlayWriter, contact_sheet, render_homunculus
from sinks.schema import FORMAT
from sinks.zarr_store import (ReplacedStream, SinkError, StreamWriter, ZarrStore, read_stream, store_location,
                              validate_store, validate_stream_id)

__all__ = ["FORMAT", "SinkError", "ZarrStore", "StreamWriter", "ReplacedStream", "read_stream", "store_location",
           "validate_store", "validate_stream_id", "OverlayWriter", "contact_sheet", "render_homunculus"]
