"""`python -m pipeline serve`: an OpenAI-compatible API over the pipeline, live streams over HTTP and
the viewer page (static/), in one process (server.py) or on Ray Serve (ray_app.py).

    options.py     what the server allows (bind address, API key, --allow-dir, size limits)
    media.py       where a request's video comes from (file://, uploads, http(s)://, data:, rtsp://)
    engine.py      one VLM behind one batcher + one ARR-COC model; a request = runners.run / runners.live
    streams.py     live streams over HTTP (runners.live in a thread, events for followers)
    openai_api.py  chat-completions request parsing and response shapes
    app.py         the FastAPI routes, errors, API key and metrics middleware
    metrics.py     Prometheus text
"""
