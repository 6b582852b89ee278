"""The same app on Ray Serve (a local Ray instance): an ingress replica and an autoscaled VLM
deployment answer through OpenAI's client as the single-process server does."""
from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

pytest.importorskip("ray.serve", reason="needs ray[serve]")
openai = pytest.importorskip("openai", reason="the API tests speak through OpenAI's client (pip install openai)")

sys.path.insert(0, str(Path(__file__).parents[2] / "live"))
from live_servers import free_port  # noqa: E402

pytestmark = pytest.mark.slow  # a local Ray instance and two replicas take ~30 s to start and tear down


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
    try:
        ray_app.start(cfg, options, address="local", replicas=(1, 2))
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
