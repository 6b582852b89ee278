"""The batch on Ray Data (a local Ray instance) writes the same per-video results as the local path."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from pipeline.runners.batch import make_plan, run_batch  # noqa: E402
from pipeline.config import PipelineConfig  # noqa: E402
from pipeline.configio import load_config  # noqa: E402
from arr_coc._validate import ConfigError  # noqa: E402
from pipeline.runners.ray_batch import run_ray_batch  # noqa: E402
from sinks import store_location  # noqa: E402
from sinks import ZarrStore, read_stream, validate_store  # noqa: E402
from evaluation.fixtures import write_fixture  # noqa: E402
from sources.msrvtt import load_msrvtt  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[2] / "live"))
from live_servers import free_port  # noqa: E402

pytestmark = pytest.mark.slow  # a local Ray instance takes ~20 s to start and tear down


@pytest.fixture(scope="module")
def local_ray():
    # one logical GPU (none is real): actors that ask for a share of it run on the CPU
    ray.init(num_cpus=2, num_gpus=1, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_ray_path_matches_local_path(tmp_path, local_ray):
    root = tmp_path / "ds"
    write_fixture(root, videos=3, questions_per_video=2, seconds=0.8, height=64, width=96)
    (root / "videos/all/video7012.mp4").unlink()  # a missing video is skipped on both paths
    cfg = load_config(PipelineConfig, None, ["runtime.vlm=tiny-random", "runtime.device=cpu", "vlm.max_new_tokens=3"])
    plan = make_plan(load_msrvtt(root))
    local = run_batch(plan, tmp_path / "local.zarr", cfg, progress=False)
    # two actor calls (videos 7010-7011 in work at once in one, the missing 7012 in the other)
    distributed = run_ray_batch(plan, f"file://{tmp_path / 'ray.zarr'}", cfg, address="local", workers=3,
                                progress=False, videos_per_task=2)
    assert distributed.backend == "ray (2 CPU actors)"    # not 3: an actor without a call would idle
    assert (local.count("done"), local.count("missing")) == (distributed.count("done"), distributed.count("missing")) \
        == (2, 1)
    assert validate_store(tmp_path / "ray.zarr") == []
    # the actors' per-stage busy times come back with their rows
    stages = ["decode", "texture", "realize", "vlm", "sink"]
    assert (list(distributed.to_dict()["stage_busy_per_video_s"])
            == list(local.to_dict()["stage_busy_per_video_s"]) == stages)
    ids = ZarrStore.open(tmp_path / "local.zarr", mode="r").stream_ids()
    assert ids == ZarrStore.open(tmp_path / "ray.zarr", mode="r").stream_ids() == ["video7010", "video7011"]
    for sid in ids:
        a, b = read_stream(tmp_path / "local.zarr", sid), read_stream(tmp_path / "ray.zarr", sid)
        assert b["attrs"]["complete"] is True
        for name in ("pts", "frame_index", "tokens", "relevance", "scene_change"):
            np.testing.assert_array_equal(a[name], b[name], err_msg=f"{sid} {name}")
        for name in ("question", "text", "tokens_kept", "tokens_full"):
            assert a["answers"][name].tolist() == b["answers"][name].tolist(), f"{sid} answers/{name}"
    again = run_ray_batch(plan, tmp_path / "ray.zarr", cfg, address="local", workers=2, progress=False)
    assert again.backend == "ray (1 CPU actor)"           # three videos, four in flight: one call
    assert again.count("skipped") == 2 and again.count("done") == 0


def test_actors_share_each_gpu_and_answer_as_the_local_path(tmp_path, local_ray):
    """--processes 2 on Ray: two actors on the (one, logical) GPU, half of it each, started with
    actor_env (an MPS daemon's variables); their stream groups equal the local path's."""
    root = tmp_path / "ds"
    write_fixture(root, videos=2, questions_per_video=2, seconds=0.6, height=64, width=96)
    cfg = load_config(PipelineConfig, None, ["runtime.vlm=tiny-random", "runtime.device=auto", "vlm.max_new_tokens=3"])
    plan = make_plan(load_msrvtt(root))
    local = run_batch(plan, tmp_path / "local.zarr", cfg, progress=False)

    def factory(device):                                     # runs in each actor
        import os

        import ray as ray_in_actor

        from pipeline.vlm.loading import load_answerer
        assert os.environ.get("ARRCOC_TEST_ENV") == "mps-pipe", "actor_env did not reach the actor"
        assert len(ray_in_actor.get_gpu_ids()) == 1, "the actor holds no share of a GPU"
        return load_answerer(cfg, device)
    shared = run_ray_batch(plan, tmp_path / "ray.zarr", cfg, address="local", progress=False, videos_per_task=1,
                           per_gpu=2, actor_env={"ARRCOC_TEST_ENV": "mps-pipe"}, vlm_factory=factory)
    assert shared.backend == "ray (2 1/2-GPU actors)"
    assert shared.count("done") == local.count("done") == 2
    for sid in ("video7010", "video7011"):
        a, b = read_stream(tmp_path / "local.zarr", sid), read_stream(tmp_path / "ray.zarr", sid)
        np.testing.assert_array_equal(a["tokens"], b["tokens"], err_msg=sid)
        assert a["answers"]["text"].tolist() == b["answers"]["text"].tolist(), sid


@pytest.mark.parametrize("gpus, use_gpu, per_gpu, workers, tasks, actors", [
    (2, True, 1, None, 100, 2),        # one per GPU
    (2, True, 6, None, 100, 12),       # six on each of two GPUs
    (4, True, 3, None, 5, 5),          # never more than the calls the plan makes
    (2, True, 6, 3, 100, 3),           # --workers counts them all
    (0, False, 6, None, 100, 1),       # on CPU: one
    (2, True, 2, None, 0, 1),          # an empty plan: still one (the store is made)
])
def test_actor_count(gpus, use_gpu, per_gpu, workers, tasks, actors):
    from pipeline.runners.ray_batch import actor_count

    assert actor_count(gpus, use_gpu, per_gpu, workers, tasks) == actors


def test_processes_per_gpu_must_be_positive(tmp_path):
    cfg = load_config(PipelineConfig, None, ["runtime.vlm=tiny-random", "runtime.device=cpu"])
    with pytest.raises(ConfigError, match=r"--processes \(actors per GPU\) must be >= 1, got 0"):
        run_ray_batch([], tmp_path / "x.zarr", cfg, address="local", per_gpu=0)


def test_videos_per_task_must_be_positive(tmp_path):
    cfg = load_config(PipelineConfig, None, ["runtime.vlm=tiny-random", "runtime.device=cpu"])
    with pytest.raises(ConfigError, match="--videos-per-task must be >= 1, got 0"):
        run_ray_batch([], tmp_path / "x.zarr", cfg, address="local", videos_per_task=0)


def test_store_urls(tmp_path):
    assert store_location(f"file://{tmp_path}/x.zarr") == tmp_path / "x.zarr"
    assert store_location("s3://bucket/x.zarr") == "s3://bucket/x.zarr"                # fsspec URLs go to FsspecStore


def test_a_head_node_that_does_not_answer_fails_within_the_connect_timeout(monkeypatch):
    import socket

    from pipeline.runners import ray_batch

    def silent(address, timeout):
        assert address == ("10.1.2.3", 6379) and timeout == ray_batch.CONNECT_TIMEOUT_S
        raise TimeoutError("timed out")

    monkeypatch.setattr(socket, "create_connection", silent)
    with pytest.raises(ConfigError, match=r"at --ray ray://10\.1\.2\.3:6379: no answer in 5 s$"):
        ray_batch._check_reachable("ray://10.1.2.3:6379")


def test_a_listening_head_node_passes_the_reachability_check():
    import socket

    from pipeline.runners.ray_batch import _check_reachable

    with socket.create_server(("127.0.0.1", 0)) as server:
        _check_reachable(f"127.0.0.1:{server.getsockname()[1]}")   # no error
    _check_reachable("not-an-address")                              # left to Ray


def test_auto_checks_the_ray_address_variable(monkeypatch):
    from pipeline.runners.ray_batch import connect

    port = free_port()                                      # nothing listens there
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    with pytest.raises(ConfigError,
                       match=rf"at --ray auto \(127\.0\.0\.1:{port}, from RAY_ADDRESS\): Connection refused"):
        connect("auto")
