"""Live streams over two stream groups on Ray Serve (a local Ray instance, two fake "GPUs": the
groups run on the CPU): each new stream lands on the least-loaded group, every stream answers, and
the chat requests are answered by the groups' VLMs (no VLM deployment beside them)."""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve", reason="needs ray[serve]")

sys.path.insert(0, str(Path(__file__).parents[2] / "live"))
from live_servers import free_port  # noqa: E402
from serve_client import call, chat_body, sse  # noqa: E402

pytestmark = pytest.mark.slow  # a local Ray instance and three replicas take ~40 s to start and tear down


@pytest.fixture(scope="module")
def grouped_server(videos, tmp_path_factory):
    import ray
    from ray import serve

    from pipeline.config import DecodeConfig, PipelineConfig, RuntimeConfig
    from pipeline.runners.ray_batch import REPO
    from pipeline.serve import ray_app
    from pipeline.serve.options import ServeOptions
    from pipeline.vlm_config import VLMConfig

    cfg = PipelineConfig(runtime=RuntimeConfig(device="cpu", vlm="tiny-random", batch_size=8, model_weights="none"),
                         vlm=VLMConfig(max_new_tokens=6), decode=DecodeConfig(process=False))
    port = free_port()
    options = ServeOptions(port=port, allow_dirs=(videos.allowed,),
                           store=str(tmp_path_factory.mktemp("ray_groups") / "serve.zarr"))
    # a CPU slot for each replica (the ingress, two stream groups) whatever this machine has
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})
    try:
        ray_app.start(cfg, options, address="local", replicas=(1, 1), stream_groups=2)
        yield SimpleNamespace(url=f"http://127.0.0.1:{port}")
    finally:
        serve.shutdown()
        ray.shutdown()


def test_live_streams_spread_over_the_groups_and_answer(grouped_server, videos):
    # the 6.4 s demo clip, not the 2.4 s small one: a stream that ends before the last is placed no
    # longer counts against its group (on a loaded 2-core machine four starts took that long)
    started = []
    for question in ("what moves?", "where is it?", "what changes?", "what is left?"):
        status, stream = call(grouped_server, "POST", "/v1/streams",
                              {"source": videos.demo.as_uri(), "question": question, "every": 1.0}, key=None)
        assert status == 201, stream
        started.append(stream)
    assert sorted(s["group"] for s in started) == [0, 0, 1, 1]           # the least-loaded group each time
    for stream in started:
        events = list(sse(grouped_server, stream["events"], key=None, timeout=120))
        assert events[-1][0] == "end" and events[-1][1]["reason"] == "source_ended", events[-1]
        answers = [d for kind, d, _ in events if kind == "answer"]
        assert answers and all(d["stream"] == stream["id"] and d["question"] == stream["question"] for d in answers)
    status, listing = call(grouped_server, "GET", "/v1/streams", key=None)
    assert sorted(s["id"] for s in listing["data"]) == sorted(s["id"] for s in started)
    status, h = call(grouped_server, "GET", f"/v1/homunculus/{started[-1]['id']}", key=None)   # a group wrote it
    assert status == 200 and h["frames"] > 0 and h["answers"]


def test_chat_requests_are_answered_by_the_groups(grouped_server, videos):
    status, reply = call(grouped_server, "POST", "/v1/chat/completions", chat_body(videos.small.as_uri()), key=None,
                         timeout=120)
    assert status == 200, reply
    assert reply["choices"][0]["finish_reason"] == "stop" and 0 < reply["usage"]["tokens_kept"]
    status, models = call(grouped_server, "GET", "/v1/models", key=None)
    assert [m["id"] for m in models["data"]] == ["tiny-random"]
