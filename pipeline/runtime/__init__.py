"""What the streaming graph (pipeline/core) and the VLM engine (pipeline/vlm) share, below both:
host <-> device helpers (cuda), socket directories (sockets), and the request and answer types
the graph hands the engine (requests)."""
