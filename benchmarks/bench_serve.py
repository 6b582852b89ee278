"""Serving benchmark: N concurrent clients asking `python -m pipeline serve` about a video on loopback.

    python3 benchmarks/bench_serve.py                                   # CPU, tiny-random, 1/8/32 clients
    python3 benchmarks/bench_serve.py --device cuda --arch qwen2-vl-2b  # GPU, full-size random weights
    python3 benchmarks/bench_serve.py --save                            # also write benchmarks/results/...

The server is the real app (FastAPI + uvicorn in a thread of this process, one VLM behind one
batcher, one ARR-COC model); each client is a thread sending POST /v1/chat/completions with a
file:// video_url in a closed loop (the next request when the last answer is back) for --duration
seconds per client count. Reported per count: requests/s, latency p50/p95 (request sent -> whole
answer received), errors (must be 0) and the mean VLM batch (answers decoded together: requests
from different clients batched).

The video is generated (a moving square, a cut in the middle); nothing is downloaded. `--arch`
builds a full-size Qwen2-VL architecture with random weights and EOS off, as bench_live.py does, so
answers decode exactly --new-tokens tokens; the default `--vlm tiny-random` is the built-in smoke
model. Nothing is written unless --out or --save says where.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from common import device_name, write_result  # noqa: E402
from pipeline.configio import load_config  # noqa: E402
from pipeline.config import PipelineConfig  # noqa: E402
from sources.synthetic import Shot, render_clip, write_video  # noqa: E402


def start_server(args, allowed: Path, store: Path):
    from pipeline.serve.answering import LocalVLM
    from pipeline.serve.app import create_app
    from pipeline.serve.engine import Engine
    from pipeline.serve.options import ServeOptions
    from pipeline.serve.server import BackgroundServer, build_engine

    # as `serve` does: decode in a thread per request unless told otherwise (--set decode.process=true)
    overrides = [f"runtime.device={args.device}", "runtime.model_weights=none", "decode.process=false", *args.set]
    options = ServeOptions(allow_dirs=(allowed,), store=str(store), max_concurrent=args.max_concurrent)
    if args.arch:
        from bench_live import build_vlm   # full-size architecture, random weights, EOS off

        vlm = build_vlm(args.arch, torch.device(args.device), args.new_tokens)
        cfg = load_config(PipelineConfig, None, overrides + [f"runtime.vlm={args.arch}-random"])
        cfg = replace(cfg, vlm=vlm.config)
        engine = Engine(cfg, options, LocalVLM(vlm))
    else:
        cfg = load_config(PipelineConfig, None, overrides + [f"runtime.vlm={args.vlm}",
                                                             f"vlm.max_new_tokens={args.new_tokens}"])
        engine = build_engine(cfg, options)
    return BackgroundServer(create_app(engine)).start(), engine


def ask(url: str, body: bytes) -> float:
    """One request; its latency in seconds (raises on anything but a 200 with an answer)."""
    start = time.perf_counter()
    request = urllib.request.Request(f"{url}/v1/chat/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        reply = json.loads(response.read())
    if reply["choices"][0]["finish_reason"] != "stop":
        raise RuntimeError(f"unexpected reply {reply}")
    return time.perf_counter() - start


def measure(url: str, body: bytes, clients: int, duration_s: float, batches: list[int]) -> dict:
    latencies: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()
    deadline = time.perf_counter() + duration_s
    first_batch = len(batches)

    def client() -> None:
        while time.perf_counter() < deadline:
            try:
                seconds = ask(url, body)
                with lock:
                    latencies.append(seconds)
            except (OSError, urllib.error.URLError, RuntimeError, ValueError, KeyError) as e:
                with lock:
                    errors.append(str(e).splitlines()[0] if str(e) else type(e).__name__)
    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    sizes = batches[first_batch:]
    ms = np.array(latencies) * 1000
    return {"clients": clients, "requests": len(latencies), "wall_s": round(wall, 2),
            "requests_per_s": round(len(latencies) / wall, 3),
            "latency_p50_ms": round(float(np.percentile(ms, 50)), 1) if len(ms) else None,
            "latency_p95_ms": round(float(np.percentile(ms, 95)), 1) if len(ms) else None,
            "errors": len(errors), "error_examples": sorted(set(errors))[:3],
            "vlm_batches": len(sizes), "vlm_batch_mean": round(float(np.mean(sizes)), 2) if sizes else None}


def commit() -> str | None:
    import subprocess
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--vlm", default="tiny-random", help="VLM as --vlm names it (default: %(default)s)")
    p.add_argument("--arch", help="instead: a full-size architecture with random weights (e.g. qwen2-vl-2b)")
    p.add_argument("--clients", default="1,8,32", help="concurrent client counts (default: %(default)s)")
    p.add_argument("--duration", type=float, default=20.0, help="seconds per client count (default: %(default)s)")
    p.add_argument("--video", default="160x120@10x3", metavar="WxH@FPSxSECONDS",
                   help="the generated video each request asks about (default: %(default)s)")
    p.add_argument("--new-tokens", type=int, default=8, help="answer length cap in tokens (default: %(default)s)")
    p.add_argument("--max-concurrent", type=int, default=8, help="the server's --max-concurrent (default: %(default)s)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    p.add_argument("--out", help="write the JSON result here")
    p.add_argument("--save", action="store_true", help="write it to benchmarks/results/bench_serve_<device>.json")
    args = p.parse_args(argv)
    counts = [int(c) for c in args.clients.split(",")]
    size, _, timing = args.video.partition("@")
    width, height = (int(v) for v in size.split("x"))
    fps, seconds = (float(v) for v in timing.split("x"))

    load_before = round(os.getloadavg()[0], 2)    # other work on the machine skews every number
    work = Path(tempfile.mkdtemp(prefix="bench_serve_"))
    frames = int(fps * seconds)
    clip = render_clip([Shot("moving_object", frames // 2, speed=2.0), Shot("pan", frames - frames // 2)],
                       height=height, width=width, seed=0)
    video = write_video(work / "videos" / "clip.mp4", clip.frames, fps=int(fps))
    server, engine = start_server(args, video.parent, work / "serve.zarr")
    body = json.dumps({"messages": [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": video.as_uri()}},
        {"type": "text", "text": "what is moving, and where?"}]}]}).encode()
    batches = engine.service.batch_sizes()
    rows = []
    try:
        for _ in range(2):
            ask(server.url, body)                           # warm up: first-call allocations, caches
        for n in counts:
            row = measure(server.url, body, n, args.duration, batches)
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        server.stop()
    device = torch.device(args.device)
    result = {"command": " ".join(["python3", "benchmarks/bench_serve.py", *map(shlex.quote, sys.argv[1:])]),
              "measured_at_commit": commit(),
              "device": device_name(device), "cpus": os.cpu_count(), "torch": torch.__version__,
              "vlm": engine.service.name, "video": f"{width}x{height} at {fps:g} fps, {seconds:g} s, H.264",
              "new_tokens": args.new_tokens, "max_concurrent": args.max_concurrent,
              "vlm_max_batch": engine.service.config.max_batch, "duration_s_per_count": args.duration,
              "overrides": args.set, "load_average_1m_before": load_before,
              "load_average_1m_after": round(os.getloadavg()[0], 2), "rows": rows}
    print(f"{'clients':>7} {'requests':>8} {'req/s':>7} {'p50 ms':>8} {'p95 ms':>8} {'errors':>6} {'VLM batch':>9}")
    for r in rows:
        print(f"{r['clients']:>7} {r['requests']:>8} {r['requests_per_s']:>7.2f} {r['latency_p50_ms'] or 0:>8.0f} "
              f"{r['latency_p95_ms'] or 0:>8.0f} {r['errors']:>6} {r['vlm_batch_mean'] or 0:>9.2f}")
    out = Path(args.out) if args.out else (ROOT / "benchmarks" / "results" / f"bench_serve_{device.type}.json"
                                           if args.save else None)
    if out is not None:
        write_result(result, out)
    return 1 if any(r["errors"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
