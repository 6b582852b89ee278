"""pipeline.vlm.server: one VLM process answers several clients' videos as the same VLM answers them
in-process, batches what the clients send together, and its failures reach every client as one
clear error."""
from __future__ import annotations

import functools
import threading

import numpy as np
import pytest
from conftest import make_frames, random_keep

from pipeline.vlm_config import VLMConfig
from pipeline.vlm.loading import build_tiny_vlm
from pipeline.runtime.requests import WindowQuestions
from pipeline.vlm.remote import VLMProcessError
from pipeline.vlm.server import ServerAddress, SharedVLM, VLMServer

CONFIG = VLMConfig(max_new_tokens=5, encode="kept")
FACTORY = functools.partial(build_tiny_vlm, "qwen2_vl", config=CONFIG)


def failing_factory():
    raise FileNotFoundError("no weights at /nowhere")


@pytest.fixture(scope="module")
def server():
    with VLMServer(FACTORY, max_batch=8) as server:
        yield server


def jobs(vlm) -> list[WindowQuestions]:
    out = []
    for seed in range(4):
        frames = make_frames(4, 84, 112, seed=seed)
        keep = None if seed == 0 else random_keep(vlm, frames, seed=seed + 10)
        out.append(WindowQuestions(frames, keep, [f"what moves {seed}?", "which colour?"][: 1 + seed % 2]))
    return out


def summary(answers: list[list]) -> list[list[tuple]]:
    return [[(r.text, r.tokens_kept, r.tokens_full) for r in video] for video in answers]


def test_clients_get_the_answers_of_the_vlm_in_process(server):
    local = FACTORY()                                                        # same seed, same weights
    work = jobs(local)
    want = summary([local.answer_windows([job])[0] for job in work])
    clients = [SharedVLM(server.address) for _ in range(2)]
    try:
        assert clients[0].geometry == local.geometry and clients[0].config == local.config
        got: dict[int, list] = {}

        def ask(i: int) -> None:                                             # videos in flight, two clients
            got[i] = clients[i % 2].answer_windows([work[i]])[0]
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(work))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert summary([got[i] for i in range(len(work))]) == want
        # one call with several videos: each its own request, answers back in order
        assert summary(clients[1].answer_windows(work[::-1])) == want[::-1]
        counters = clients[0].counters
        assert sum(counters["batch_sizes"]) == 2 * len(work)                  # every video went through its batcher
        assert counters["vlm"]["decoders"] >= 1
    finally:
        for c in clients:
            c.close()
    # their readers ended with them: one left reading a closed descriptor number took the bytes of
    # the next connection given that number
    assert not any(c._reader.is_alive() for c in clients)
    with pytest.raises(VLMProcessError, match="closed"):
        clients[0].answer_windows(work[:1])
    clients[0].close()                                                       # twice: nothing to do


def test_an_answers_error_reaches_its_client_and_the_server_goes_on(server):
    client = SharedVLM(server.address)
    try:
        frames = make_frames(2, 56, 84)
        with pytest.raises(ValueError, match="keep map shape"):              # the error itself, as in-process
            client.answer_windows([WindowQuestions(frames, np.ones((2, 5, 5), dtype=np.int64), ["q?"])])
        assert client.answer_windows([WindowQuestions(frames, None, ["q?"])])[0][0].text is not None
    finally:
        client.close()


def test_a_wrong_key_or_no_server_is_one_error(server, tmp_path):
    with pytest.raises(VLMProcessError, match="refused this process's key"):
        SharedVLM(ServerAddress(server.address.path, b"not the key"))
    with pytest.raises(VLMProcessError, match="cannot reach the shared VLM"):
        SharedVLM(ServerAddress(str(tmp_path / "none.sock"), b"k"))
    with pytest.raises(VLMProcessError, match="ARRCOC_VLM_AUTHKEY"):
        ServerAddress.from_env(str(tmp_path / "none.sock"))


def test_a_long_temporary_directory_still_gives_a_usable_socket(tmp_path, monkeypatch):
    """TMPDIR deep enough that its socket path would not fit a Unix socket: the server moves to /tmp."""
    import tempfile
    from pathlib import Path

    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    with VLMServer(FACTORY, max_batch=2) as server:
        assert len(server.address.path) < 108 and Path(server.address.path).parent.parent == Path("/tmp")
        client = SharedVLM(server.address)
        try:
            assert client.answer_windows([WindowQuestions(make_frames(2, 56, 84), None, ["q?"])])[0][0].text is not None
        finally:
            client.close()


def test_a_factory_that_fails_raises_its_error():
    with pytest.raises(FileNotFoundError, match="no weights at /nowhere"):
        VLMServer(failing_factory, max_batch=2)


def test_a_server_that_dies_fails_the_waiting_and_later_calls():
    server = VLMServer(FACTORY, max_batch=2)
    client = SharedVLM(server.address)
    try:
        frames = make_frames(2, 56, 84)
        assert client.answer_windows([WindowQuestions(frames, None, ["q?"])])[0][0].text is not None
        server._process.kill()
        server._process.join(10)
        with pytest.raises(VLMProcessError, match="shared VLM process"):
            for _ in range(50):                                              # until the reader has seen it go
                client.answer_windows([WindowQuestions(frames, None, ["q?"])])
    finally:
        client.close()
        server.close()
