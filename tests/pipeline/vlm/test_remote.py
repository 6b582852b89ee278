"""pipeline.vlm.remote: the VLM in a spawned process answers what the same VLM answers in-process,
its errors reach the caller as one clear VLMProcessError, and a failed start or a dead process
says so."""
from __future__ import annotations

import functools

import numpy as np
import pytest
from conftest import make_frames, random_keep, request

from pipeline.vlm.batcher import VLMBatcher
from pipeline.vlm_config import VLMConfig
from pipeline.vlm.loading import build_tiny_vlm
from pipeline.vlm.remote import RemoteVLM, VLMProcessError

CONFIG = VLMConfig(max_new_tokens=6, encode="kept")


def failing_factory():
    raise FileNotFoundError("no weights at /nowhere")


@pytest.fixture(scope="module")
def remote():
    with RemoteVLM(functools.partial(build_tiny_vlm, "qwen2_vl", config=CONFIG)) as vlm:
        yield vlm


def test_answers_equal_the_in_process_vlms(remote):
    local = build_tiny_vlm("qwen2_vl", config=CONFIG)                      # same seed, same weights
    frames = [make_frames(4, 84, 112, seed=s) for s in (1, 2)]
    reqs = [request(frames[0]), request(frames[1], random_keep(local, frames[1], seed=3), "what is left?")]
    want, got = local.answer(reqs), remote.answer(reqs)
    assert [(r.text, r.tokens_kept, r.tokens_full) for r in got] == [(r.text, r.tokens_kept, r.tokens_full)
                                                                      for r in want]
    assert remote.geometry == local.geometry and remote.config == local.config
    assert remote.prefix_length("q?", 10) == local.prefix_length("q?", 10)
    assert remote.kept_encoder.counters["cells_encoded"] > 0                # the kept encoder's, from the child
    assert "decoders" in remote.counters and "cells_encoded" not in remote.counters   # each where a VLM has it


def test_an_answers_error_names_it_and_the_process_goes_on(remote):
    frames = make_frames(2, 56, 84)
    with pytest.raises(ValueError, match="keep map shape"):                  # the error itself, as in-process
        remote.answer([request(frames, np.ones((2, 5, 5), dtype=np.int64))])
    assert remote.answer([request(frames)])[0].text is not None


def test_the_batcher_runs_it_unchanged(remote):
    with VLMBatcher(remote, max_batch=2, max_wait_s=0.2) as batcher:
        futures = [batcher.submit(request(make_frames(2, 56, 84, seed=s), stream=f"s{s}")) for s in range(3)]
        results = [f.result(timeout=120) for f in futures]
    assert len(results) == 3 and sum(batcher.batch_sizes) == 3


def unpicklable_failure():
    class Local(Exception):                                                  # a local class does not pickle
        pass
    raise Local("broken in a way only the child knows")


def test_a_factory_that_fails_raises_its_error():
    with pytest.raises(FileNotFoundError, match="no weights at /nowhere"):
        RemoteVLM(failing_factory)
    with pytest.raises(VLMProcessError, match="could not load its model: Local: broken in a way only the child"):
        RemoteVLM(unpicklable_failure)


def test_a_bad_model_spec_is_the_cli_error_it_is_in_process(tmp_path):
    """`live --vlm-process --vlm /nowhere`: the same one-line VLMLoadError, no traceback."""
    import subprocess
    import sys
    from pathlib import Path

    video = tmp_path / "v.mp4"
    from sources.synthetic import Shot, render_clip, write_video
    write_video(video, render_clip([Shot("pan", 10)], height=64, width=64, seed=0).frames, fps=10)
    done = subprocess.run([sys.executable, "-m", "pipeline", "live", str(video), "--realtime", "--query", "q",
                           "--vlm", str(tmp_path / "nowhere"), "--vlm-process", "--duration", "5",
                           "--out", str(tmp_path / "o.zarr")], cwd=Path(__file__).resolve().parents[3],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "nowhere" in errors[0], done.stderr[-1500:]


def test_calls_after_close_fail_clearly():
    vlm = RemoteVLM(functools.partial(build_tiny_vlm, "qwen2_vl", config=CONFIG))
    vlm.close()
    with pytest.raises(VLMProcessError, match="closed"):
        vlm.answer([request(make_frames(2, 56, 84))])
