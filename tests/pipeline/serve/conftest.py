"""One server for the serve tests: tiny-random VLM, tiny generated videos, an API key, small limits,
uvicorn in a thread on a free loopback port (started once, on first use)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest

from pipeline.config import DecodeConfig, PipelineConfig, RuntimeConfig
from pipeline.vlm_config import VLMConfig
from sources.synthetic import Shot, default_demo_clip, render_clip, write_video

from serve_client import API_KEY, OTHER_KEY  # this directory's helpers

DEMO_FPS = 25


@dataclass
class Videos:
    allowed: Path               # the server's --allow-dir
    outside: Path               # a directory it must not read
    small: Path                 # 24 frames, 96x128, a cut at 1.2 s
    demo: Path                  # default_demo_clip (cuts at frames 40, 80, 120), 120x160
    demo_cuts_s: tuple[float, ...]
    text: Path                  # not a video


@pytest.fixture(scope="session")
def videos(tmp_path_factory) -> Videos:
    root = tmp_path_factory.mktemp("serve_videos")
    allowed, outside = root / "allowed", root / "outside"
    allowed.mkdir()
    outside.mkdir()
    small = write_video(allowed / "small.mp4", render_clip([Shot("moving_object", 12, speed=2.0), Shot("pan", 12)],
                                                           height=96, width=128, seed=1).frames, fps=10)
    clip = default_demo_clip(height=120, width=160)
    demo = write_video(allowed / "demo.mp4", clip.frames, fps=DEMO_FPS)
    write_video(outside / "secret.mp4", render_clip([Shot("static", 8)], height=96, width=128, seed=2).frames, fps=10)
    os.symlink(outside / "secret.mp4", allowed / "link.mp4")      # a symlink that leads out
    text = allowed / "notes.txt"
    text.write_text("not a video\n")
    return Videos(allowed, outside, small, demo, tuple(c / DEMO_FPS for c in clip.cuts), text)


@pytest.fixture(scope="session")
def server(videos, tmp_path_factory) -> Iterator[Any]:
    from pipeline.serve.app import create_app
    from pipeline.serve.options import ServeOptions
    from pipeline.serve.server import BackgroundServer, build_engine

    store = tmp_path_factory.mktemp("serve_store")
    cfg = PipelineConfig(runtime=RuntimeConfig(device="cpu", vlm="tiny-random", batch_size=8, model_weights="none"),
                         vlm=VLMConfig(max_new_tokens=6), decode=DecodeConfig(process=False))
    options = ServeOptions(allow_dirs=(videos.allowed,), api_key=API_KEY, api_keys=(OTHER_KEY,),
                           store=str(store / "serve.zarr"),
                           max_upload_mb=0.5, max_fetch_mb=0.5, live_window_s=1.0, fetch_timeout_s=5.0)
    engine = build_engine(cfg, options)
    background = BackgroundServer(create_app(engine)).start()
    background.engine = engine
    yield background
    background.stop()
