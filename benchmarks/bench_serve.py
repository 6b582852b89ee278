"""Serving benchmark: N concurrent clients asking `python -m pipeline serve` about a video on loopback.

    python3 benchmarks/bench_serve.py                                   # CPU, tiny-random, 1/8/32 clients
    python3 benchmarks/bench_serve.py --device cuda --arch qwen2-vl-2b  # GPU, full-size random weights
    python3 benchmarks/bench_serve.py --save                            # also write benchmarks/results/...
    python3 benchmarks/bench_serve.py --flood 64 --duration 600         # admission under a flood (issue 40)

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

--flood N: N clients at once against the server's limits (--max-concurrent, a small
--max-storage-gb and --retention-s), every --upload-every'th request an upload and a question about
it: a 429 is waited out as its Retry-After says, then retried. Reported: the p50/p95 latency of
admitted requests, the share of 429s, other errors, and the process' RSS and the server's disk
(store + uploads) before, at most and after the flood, which must stay under the storage cap.
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
from functools import partial
from pathlib import Path
from typing import Callable

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
    per_file_mb = min(8.0, args.max_storage_gb * 1024 / 4)
    limits = {} if not args.flood else dict(max_upload_mb=per_file_mb, max_fetch_mb=per_file_mb,
                                            max_storage_gb=args.max_storage_gb, retention_s=args.retention_s,
                                            request_timeout_s=args.request_timeout_s)
    options = ServeOptions(allow_dirs=(allowed,), store=str(store), max_concurrent=args.max_concurrent, **limits)
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


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return float("nan")


def disk_bytes(*paths: Path) -> int:
    """Bytes of the files under paths (files removed while walking are skipped)."""
    total = 0
    for root in paths:
        for dirpath, _, names in os.walk(root):
            for name in names:
                try:
                    total += os.stat(os.path.join(dirpath, name)).st_size
                except FileNotFoundError:
                    pass
    return total


def upload_and_ask(url: str, video: Path, question: str) -> float:
    """POST /v1/files the video, then ask about the upload; the latency of both."""
    start, boundary = time.perf_counter(), "benchb0undary"
    form = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{video.name}\"\r\n"
            f"Content-Type: video/mp4\r\n\r\n").encode() + video.read_bytes() + f"\r\n--{boundary}--\r\n".encode()
    request = urllib.request.Request(f"{url}/v1/files", data=form, method="POST",
                                     headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})
    with urllib.request.urlopen(request, timeout=600) as response:
        file_id = json.loads(response.read())["id"]
    body = json.dumps({"messages": [{"role": "user", "content": [
        {"type": "file", "file": {"file_id": file_id}}, {"type": "text", "text": question}]}]}).encode()
    ask(url, body)
    return time.perf_counter() - start


def flood(url: str, body: bytes, video: Path, clients: int, duration_s: float, upload_every: int,
          disk: Callable[[], int]) -> dict:
    """clients closed loops for duration_s; a 429 waits its Retry-After. Sampled every second: RSS, disk."""
    latencies, errors, refused, full = [], [], [0], [0]
    samples = {"rss_mb": [], "disk_bytes": []}
    lock = threading.Lock()
    deadline = time.perf_counter() + duration_s
    done = threading.Event()

    def client(k: int) -> None:
        n = 0
        while time.perf_counter() < deadline:
            n += 1
            start = time.perf_counter()
            try:
                if upload_every and (n + k) % upload_every == 0:
                    upload_and_ask(url, video, "what moves?")
                else:
                    ask(url, body)
                with lock:
                    latencies.append(time.perf_counter() - start)
            except urllib.error.HTTPError as e:
                if e.code == 507:               # storage full while other uploads are being written
                    with lock:
                        full[0] += 1
                    time.sleep(1.0)
                    continue
                if e.code != 429:
                    with lock:
                        errors.append(f"HTTP {e.code}: {e.read()[:120]!r}")
                    continue
                with lock:
                    refused[0] += 1
                wait = float(e.headers.get("Retry-After", "1"))
                time.sleep(min(wait, max(0.0, deadline - time.perf_counter())))
            except (OSError, RuntimeError, ValueError, KeyError) as e:
                with lock:
                    errors.append(str(e).splitlines()[0] if str(e) else type(e).__name__)

    def sampler() -> None:
        while not done.wait(1.0):
            samples["rss_mb"].append(rss_mb())
            samples["disk_bytes"].append(disk())
    watcher = threading.Thread(target=sampler, daemon=True)
    watcher.start()
    start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    done.set()
    watcher.join()
    ms = np.array(latencies) * 1000
    attempts = len(latencies) + refused[0] + full[0] + len(errors)
    return {"clients": clients, "wall_s": round(wall, 1), "admitted": len(latencies), "refused_429": refused[0],
            "share_429": round(refused[0] / attempts, 4) if attempts else None, "refused_507": full[0],
            "admitted_per_s": round(len(latencies) / wall, 3),
            "latency_p50_ms": round(float(np.percentile(ms, 50)), 1) if len(ms) else None,
            "latency_p95_ms": round(float(np.percentile(ms, 95)), 1) if len(ms) else None,
            "errors": len(errors), "error_examples": sorted(set(errors))[:3],
            "rss_mb_max": max(samples["rss_mb"], default=None),
            "disk_bytes_max": max(samples["disk_bytes"], default=None),
            "rss_mb_by_minute": samples["rss_mb"][::60], "disk_bytes_by_minute": samples["disk_bytes"][::60]}


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
    p.add_argument("--flood", type=int, metavar="N", help="instead: N clients against the server's limits (see above)")
    p.add_argument("--upload-every", type=int, default=8, metavar="K",
                   help="--flood: every K'th request uploads its video first (0: never; default: %(default)s)")
    p.add_argument("--max-storage-gb", type=float, default=0.004,
                   help="--flood: the server's cap (default: %(default)g)")
    p.add_argument("--retention-s", type=float, default=300.0, help="--flood: the server's (default: %(default)g)")
    p.add_argument("--request-timeout-s", type=float, default=120.0,
                   help="--flood: the server's (default: %(default)g)")
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
    disk = partial(disk_bytes, work / "serve.zarr", engine.media.uploads)
    try:
        for _ in range(2):
            ask(server.url, body)                           # warm up: first-call allocations, caches
        if args.flood:
            before = {"rss_mb": rss_mb(), "disk_bytes": disk()}
            row = flood(server.url, body, video, args.flood, args.duration, args.upload_every, disk)
            rows.append({**row, "rss_mb_before": before["rss_mb"], "rss_mb_after": rss_mb(),
                         "disk_bytes_before": before["disk_bytes"], "disk_bytes_after": disk(),
                         "storage_cap_bytes": engine.options.max_storage_bytes,
                         "evicted_by_retention": engine.retention.evicted})
            print(json.dumps(rows[-1]), flush=True)
            counts = []
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
              "flood": None if not args.flood else {
                  "clients": args.flood, "upload_every": args.upload_every, "max_storage_gb": args.max_storage_gb,
                  "retention_s": args.retention_s, "request_timeout_s": args.request_timeout_s},
              "load_average_1m_after": round(os.getloadavg()[0], 2), "rows": rows}
    if args.flood:
        r = rows[0]
        print(f"flood of {r['clients']}: {r['admitted']} admitted (p50 {r['latency_p50_ms']} ms, p95 "
              f"{r['latency_p95_ms']} ms), {r['share_429']:.1%} answered 429, {r['errors']} errors; RSS "
              f"{r['rss_mb_before']} -> {r['rss_mb_after']} MB (max {r['rss_mb_max']}); "
              f"disk {r['disk_bytes_before']} -> "
              f"{r['disk_bytes_after']} bytes (max {r['disk_bytes_max']}, cap {r['storage_cap_bytes']})")
    print(f"{'clients':>7} {'requests':>8} {'req/s':>7} {'p50 ms':>8} {'p95 ms':>8} {'errors':>6} {'VLM batch':>9}")
    for r in rows[1 if args.flood else 0:]:
        print(f"{r['clients']:>7} {r['requests']:>8} {r['requests_per_s']:>7.2f} {r['latency_p50_ms'] or 0:>8.0f} "
              f"{r['latency_p95_ms'] or 0:>8.0f} {r['errors']:>6} {r['vlm_batch_mean'] or 0:>9.2f}")
    out = Path(args.out) if args.out else (ROOT / "benchmarks" / "results" / f"bench_serve_{device.type}.json"
                                           if args.save else None)
    if out is not None:
        write_result(result, out)
    over_cap = args.flood and rows[0]["disk_bytes_max"] is not None and \
        rows[0]["disk_bytes_max"] > rows[0]["storage_cap_bytes"]
    return 1 if any(r["errors"] for r in rows) or over_cap else 0


if __name__ == "__main__":
    sys.exit(main())
