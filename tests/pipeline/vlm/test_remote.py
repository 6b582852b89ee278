"""pipeline.vlm.remote: the VLM in a spawned process answers what the same VLM answers in-process,
its errors reach the caller as one clear VLMProcessError, and a failed start or a dead process
says so."""
from __future__ import annotations

import functools

import numpy as np
import pytest
from conftest import make_frames, random_keep, request

from pipeline.vlm.batcher import VLMBatcher
from pipeline.vlm.config import VLMConfig
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
    assert remote.counters["cells_encoded"] > 0                             # the kept encoder's, from the child


def test_an_answers_error_names_it_and_the_process_goes_on(remote):
    frames = make_frames(2, 56, 84)
    with pytest.raises(VLMProcessError, match="ValueError: keep map shape"):
        remote.answer([request(frames, np.ones((2, 5, 5), dtype=np.int64))])
    assert remote.answer([request(frames)])[0].text is not None


def test_the_batcher_runs_it_unchanged(remote):
    with VLMBatcher(remote, max_batch=2, max_wait_s=0.2) as batcher:
        futures = [batcher.submit(request(make_frames(2, 56, 84, seed=s), stream=f"s{s}")) for s in range(3)]
        results = [f.result(timeout=120) for f in futures]
    assert len(results) == 3 and sum(batcher.batch_sizes) == 3


def test_a_factory_that_fails_is_one_clear_error():
    with pytest.raises(VLMProcessError, match="could not load its model: FileNotFoundError: no weights at /nowhere"):
        RemoteVLM(failing_factory)


def test_calls_after_close_fail_clearly():
    vlm = RemoteVLM(functools.partial(build_tiny_vlm, "qwen2_vl", config=CONFIG))
    vlm.close()
    with pytest.raises(VLMProcessError, match="closed"):
        vlm.answer([request(make_frames(2, 56, 84))])
