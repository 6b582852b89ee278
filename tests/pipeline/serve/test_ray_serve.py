"""The same app on Ray Serve (a local Ray instance): an ingress replica and an autoscaled VLM
deployment answer through OpenAI's client as the single-process server does; two stream groups
(two fake "GPUs", on the CPU) run the live streams, each new one on the least-loaded group."""
from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

pytest.importorskip("ray.serve", reason="needs ray[serve]")
openai = pytest.importorskip("openai", reason="the API tests speak through OpenAI's client (pip install openai)")

sys.path.insert(0, str(Path(__file__).parents[2] / "live"))
from live_servers import free_port  # noqa: E402
from serve_client import call, sse  # noqa: E402

pytestmark = pytest.mark.slow  # a local Ray instance and four replicas take ~40 s to start and tear down


@pytest.fixture(scope="module")
def ray_server(videos, tmp_path_factory):
    import ray
    from ray import serve

    from pipeline.config import DecodeConfig, PipelineConfig, RuntimeConfig
    from pipeline.serve import ray_app
    from pipeline.serve.options import ServeOptions
    from pipeline.vlm_config import VLMConfig

    cfg = PipelineConfig(runtime=RuntimeConfig(device="cpu", vlm="tiny-random", batch_size=8, model_weights="none"),
                         vlm=VLMConfig(max_new_tokens=6), decode=DecodeConfig(process=False))
    port = free_port()
    options = ServeOptions(port=port, allow_dirs=(videos.allowed,),
                           store=str(tmp_path_factory.mktemp("ray_serve") / "serve.zarr"))
    from pipeline.runners.ray_batch import REPO

    # a CPU slot for each replica (ingress, VLM, two stream groups) whatever this machine has
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})
    try:
        ray_app.start(cfg, options, address="local", replicas=(1, 2), stream_groups=2)
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def test_answers_streams_and_concurrent_clients_on_ray_serve(ray_server, videos):
    api = openai.OpenAI(base_url=f"{ray_server}/v1", api_key="unused", max_retries=0, timeout=120)
    assert [m.id for m in api.models.list()] == ["tiny-random"]
    messages = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": videos.small.as_uri()}},
                                             {"type": "text", "text": "what moves?"}]}]
    reply = api.chat.completions.create(model="tiny-random", messages=messages)
    assert reply.choices[0].finish_reason == "stop" and 0 < reply.usage.tokens_kept < reply.usage.tokens_full
    assert reply.model_extra["arrcoc"]["frames"] == 24

    chunks = list(api.chat.completions.create(model="tiny-random", messages=messages, stream=True,
                                              stream_options={"include_usage": True}, extra_body={"every": 1.0}))
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) == 3
    assert chunks[-1].usage.tokens_kept > 0

    replies: list = []
    threads = [threading.Thread(target=lambda: replies.append(api.chat.completions.create(
        model="tiny-random", messages=messages))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(replies) == 3 and all(r.usage.tokens_kept > 0 for r in replies)

    with pytest.raises(openai.PermissionDeniedError):      # the ingress enforces the same rules
        api.chat.completions.create(model="tiny-random", messages=[{"role": "user", "content": [
            {"type": "video_url", "video_url": {"url": (videos.outside / "secret.mp4").as_uri()}},
            {"type": "text", "text": "q"}]}])


def test_live_streams_spread_over_the_stream_groups_and_answer(ray_server, videos):
    from types import SimpleNamespace

    server = SimpleNamespace(url=ray_server)
    started = []
    for question in ("what moves?", "where is it?", "what changes?", "what is left?"):
        status, stream = call(server, "POST", "/v1/streams", {"source": videos.small.as_uri(), "question": question,
                                                              "every": 1.0}, key=None)
        assert status == 201, stream
        started.append(stream)
    assert sorted(s["group"] for s in started) == [0, 0, 1, 1]           # the least-loaded group each time
    for stream in started:
        events = list(sse(server, stream["events"], key=None, timeout=120))
        assert events[-1][0] == "end" and events[-1][1]["reason"] == "source_ended", events[-1]
        answers = [d for kind, d, _ in events if kind == "answer"]
        assert answers and all(d["stream"] == stream["id"] and d["question"] == stream["question"] for d in answers)
    status, listing = call(server, "GET", "/v1/streams", key=None)
    assert sorted(s["id"] for s in listing["data"]) == sorted(s["id"] for s in started)
    status, h = call(server, "GET", f"/v1/homunculus/{started[-1]['id']}", key=None)   # a group wrote it
    assert status == 200 and h["frames"] > 0 and h["answers"]
