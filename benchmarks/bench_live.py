"""Live serving benchmark: 1, 4 and 16 concurrent 720p30 streams through `pipeline.runners.live` on one GPU.

    python3 benchmarks/bench_live.py --device cuda                  # GPU: streams 1,4,16 + 10-minute soak
    python3 benchmarks/bench_live.py --quick                        # CPU smoke test (small, short)

Streams are served from loopback over HTTP as MPEG-TS (benchmarks/loopback.py: one H.264 clip
encoded at start-up, remuxed with PyAV and paced at its real frame rate, looped; it says why not
RTSP). Each client gets its own connection and its own paced copy. The server runs in a process of
its own by default, as cameras are outside the pipeline's process (--server thread: inside it, as
before 2026-11-29, where its senders shared the measured process's interpreter lock).

The VLM is the Qwen2-VL-2B architecture with random weights (nothing is downloaded), answering
every --every seconds per stream through one VLMBatcher; random weights stop at random, so EOS
is disabled and every answer decodes exactly --new-tokens tokens.

Reported per stream count: processed fps per stream (frames written / s), input fps, drop share,
answer latency p50/p95 (last frame arrival of the window -> answer ready), answers/s, in steady state
(after --warmup s) and over the first --cold-seconds from the first frame taken (the cold start:
warm-up should make both alike), with the CUDA graphs captured after the first frame (their labels,
from runtime.cuda.LEDGER: a warm start has none) and what warm-up captured before it. Targets:
16 streams at the full 30 fps through the front end, answer latency p95 <= 500 ms at 4 streams.
The soak runs one stream for --soak seconds and compares process RSS and CUDA memory at the
end with minute one (target: within 5%).

`--gpus N` measures live capacity over N GPUs: each stream count is spread over N copies of this
benchmark, one per GPU (CUDA_VISIBLE_DEVICES=i; on the CPU, N processes), each stream on the
least-loaded one (pipeline/serve/placement.py), as `serve --ray --stream-groups N` places them;
their answers' latencies are pooled. `capacity` is the most streams whose p95 stays within
--p95-target-ms at full frame rate: compare it between --gpus 1 and --gpus 2.

    python3 benchmarks/bench_live.py --streams 16,20,24,28 --soak 0 --gpus 1
    python3 benchmarks/bench_live.py --streams 32,40,48,56 --soak 0 --gpus 2
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import platform
import sys
import threading
import time
from dataclasses import fields, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.common import busy_share, cpu_times, fixed_query, git_commit, host_topology, scratch_result  # noqa: E402
from benchmarks.loopback import TSServer, TSServerProcess, encode_clip  # noqa: E402
from pipeline.config import PipelineConfig, RuntimeConfig  # noqa: E402
from pipeline.configio import load_config  # noqa: E402
from pipeline.core.live_stages import LiveOptions  # noqa: E402
from pipeline.runners.live import run_live  # noqa: E402
from pipeline.core.live_status import snapshot  # noqa: E402
from pipeline.runtime.cuda import FIRST_FRAME, LEDGER  # noqa: E402
from pipeline.vlm_config import VLMConfig  # noqa: E402
from sources.live import LiveConfig, percentile  # noqa: E402


def build_vlm(arch: str, device: torch.device, vlm_cfg: VLMConfig):
    """Qwen2-VL architecture with random weights (or the tiny one for --quick), EOS disabled."""
    from pipeline.vlm.builtin import arch_config, build_model, build_tokenizer, tiny_config
    from pipeline.vlm.loading import _wrap

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tokenizer = build_tokenizer("bytes" if arch == "tiny" else "english")
    config = tiny_config("qwen2_vl", tokenizer) if arch == "tiny" else arch_config(arch, tokenizer)
    model = build_model(config, device=device, dtype=dtype)
    vlm = _wrap(model, tokenizer, "qwen2_vl", f"{arch} (random weights)", vlm_cfg, {}, "random weights (benchmark)")
    vlm.eos_ids = torch.empty(0, dtype=torch.long, device=device)   # every answer decodes new_tokens
    return vlm


def load_settings(args, new_tokens: int) -> PipelineConfig:
    """The bench's VLM settings (answers of new_tokens, batches of up to 16 requests), then --set."""
    overrides = [f"vlm.max_new_tokens={new_tokens}", "vlm.max_batch=16", "vlm.max_wait_s=0.01", *args.overrides]
    return load_config(PipelineConfig, None, overrides)


def pipeline_config(vlm, args, device: torch.device) -> PipelineConfig:
    # Speed does not depend on the relevance weights' values: the initial ones need no weights file.
    untrained = {"model_weights": "none"} if "model_weights" in {f.name for f in fields(RuntimeConfig)} else {}
    return replace(args.settings, runtime=replace(args.settings.runtime, device=device.type, vlm=vlm.name,
                                                  batch_size=args.batch_size, **untrained), vlm=vlm.config)


T_START = time.monotonic()


def note(message: str) -> None:
    """A progress line on stderr, stamped with the seconds since start: a run cut by an outer time
    limit still says how far it got (warm-up, waiting for the sources, measuring, shutting down)."""
    print(f"bench_live [{time.monotonic() - T_START:6.1f} s] {message}", file=sys.stderr, flush=True)


def live_config(args) -> LiveConfig:
    """The capture settings of every run: --buffer frames per source, --decoder, --decode-threads, 10 s
    to open or stall."""
    return LiveConfig(buffer_frames=args.buffer, open_timeout_s=10.0, read_timeout_s=10.0,
                      decode_threads=args.decode_threads, decoder=args.decoder,
                      capture_processes=args.capture_processes)


def live_options(args) -> LiveOptions:
    """Answers every --every s, no periodic metrics, the switch interval and warm-up asked for."""
    return LiveOptions(every_s=args.every, metrics_every_s=3600.0, switch_interval_ms=args.switch_interval_ms,
                       stagger=args.stagger, warm_up=args.warm_up)


def measure(urls: list[str], vlm, args, device: torch.device, out: Path) -> dict:
    """One live run over `urls`; metrics over the `args.seconds` after `args.warmup` seconds."""
    graphs: list = []
    stop = threading.Event()
    marks: dict = {}

    def mark():
        sink, sources = graphs[0].stages[-1], graphs[0].stages[0].sources   # the capture stage's sources
        # the first snapshot after every source began: begin() forgets the drops before it (with
        # --warmup 0 a snapshot taken earlier made the run's drop count negative)
        began = time.monotonic()
        note(f"{len(urls)} streams: the graph is up, waiting for every source's first frame")
        while any(getattr(src, "began_at", 0) is None for src in sources) and time.monotonic() - began < 60:
            time.sleep(0.01)
        note(f"{len(urls)} streams: sources began after {time.monotonic() - began:.1f} s; "
             f"{args.warmup:g} s of warm-up, then {args.seconds:g} s measured")
        time.sleep(args.warmup)
        marks["t0"], marks["s0"] = time.monotonic(), snapshot(sources, sink.counters)
        marks["cpu0"] = (time.process_time(), cpu_times())
        marks["lat0"] = {sid: len(c.answer_latency) for sid, c in sink.counters.items()}
        time.sleep(args.seconds)
        marks["t1"], marks["s1"] = time.monotonic(), snapshot(sources, sink.counters)
        marks["cpu1"] = (time.process_time(), cpu_times())
        marks["lat"] = [lat for sid, c in sink.counters.items() for lat in list(c.answer_latency)[marks["lat0"][sid]:]]
        marks["frame_lat"] = [lat for c in sink.counters.values() for lat in list(c.frame_latency)[-64:]]
        batcher = next(s.batcher for s in graphs[0].stages if hasattr(s, "batcher"))
        marks["batches"] = [b for b in list(batcher.timings) if marks["t0"] <= b.started <= marks["t1"]]
        note(f"{len(urls)} streams: measured, stopping the run")
        stop.set()

    up = threading.Event()

    def setup_progress(every_s: float = 15.0) -> None:
        """Until the graph is up: every every_s, the graphs captured so far and the machine's CPU use
        (a slow start says whether it is capturing slowly or waiting)."""
        last = cpu_times()
        while not up.wait(every_s):
            now = cpu_times()
            share = busy_share(last, now)
            busy = f", host CPU {100 * share:.0f}% busy" if share is not None else ""
            note(f"{len(urls)} streams: setting up, {len(LEDGER.entries(started, 'capture'))} graphs captured{busy}")
            last = now

    def on_graph(graph):
        faulthandler.cancel_dump_traceback_later()
        up.set()
        graphs.append(graph)
        threading.Thread(target=mark, daemon=True).start()

    answered: list[tuple[float, float]] = []            # (time.monotonic() in the sink, latency_s)
    cfg = pipeline_config(vlm, args, device)
    started = LEDGER.mark("bench_live run")
    note(f"{len(urls)} streams: starting the live run (warm-up captures first)")
    if args.start_dump_s > 0:   # where a run that never starts waits: every thread's stack, once
        note(f"{len(urls)} streams: every thread's stack on stderr if not up in {args.start_dump_s:g} s")
        faulthandler.dump_traceback_later(args.start_dump_s, exit=False, file=sys.stderr)
    threading.Thread(target=setup_progress, daemon=True).start()
    try:
        result = run_live(urls, "what is moving, and where?", out, cfg, live=live_config(args),
                          options=live_options(args), stop=stop, on_graph=on_graph,
                          vlm=vlm, status_out=open(os.devnull, "w"), query_embedding=fixed_query(),
                          on_answer=lambda item: answered.append((time.monotonic(), item.latency_s)))
    finally:
        faulthandler.cancel_dump_traceback_later()
        up.set()
    note(f"{len(urls)} streams: the run ended")
    span = marks["t1"] - marks["t0"]
    s0, s1 = marks["s0"]["streams"], marks["s1"]["streams"]
    per = {sid: {"fps_processed": (s1[sid]["frames_out"] - s0[sid]["frames_out"]) / span,
                 "fps_in": (s1[sid]["frames_in"] - s0[sid]["frames_in"]) / span,
                 "dropped": s1[sid]["dropped"] - s0[sid]["dropped"],
                 "answers": s1[sid]["answers"] - s0[sid]["answers"]} for sid in s1}
    fps = [p["fps_processed"] for p in per.values()]
    frames_in = sum(s1[sid]["frames_in"] - s0[sid]["frames_in"] for sid in s1)
    return {"streams": len(urls), "seconds": round(span, 1),
            "fps_processed_per_stream_mean": round(float(np.mean(fps)), 2),
            "fps_processed_per_stream_min": round(float(np.min(fps)), 2),
            "fps_in_per_stream_mean": round(float(np.mean([p["fps_in"] for p in per.values()])), 2),
            "dropped": int(sum(p["dropped"] for p in per.values())),
            "drop_share": round(sum(p["dropped"] for p in per.values()) / max(1, frames_in), 4),
            "answers": int(sum(p["answers"] for p in per.values())),
            **cpu_use(marks["cpu0"], marks["cpu1"], span),
            "answer_latency_p50_ms": round(percentile(marks["lat"], 50) * 1e3, 1),
            "answer_latency_p95_ms": round(percentile(marks["lat"], 95) * 1e3, 1),
            **latency_parts(marks["batches"], marks["frame_lat"]),
            # every answer's latency, for pooling over GPUs (--gpus N; only when asked: it is long)
            **({"answer_latencies_ms": [round(v * 1e3, 1) for v in marks["lat"]]} if args.keep_latencies else {}),
            # cumulative over the runs so far: decoders made, evicted, graphs captured
            "vlm_counters": dict(getattr(vlm, "counters", {})),
            # encode: kept: cells through the tower and reused from the streams' caches (cumulative)
            "kept_counters": dict(vlm.kept_encoder.counters) if hasattr(vlm, "kept_encoder") else {},
            **cold_start(started, answered, args.cold_seconds, result.warm_up)}


def cpu_use(before: tuple, after: tuple, span: float) -> dict:
    """CPU cores the pipeline's process kept busy over the measured span, and the machine's busy
    share (every process: the loopback server, a VLM process of its own, the rest of the host)."""
    out = {"cpu_cores_pipeline": round((after[0] - before[0]) / span, 2)}
    if (share := busy_share(before[1], after[1])) is not None:
        out["host_cpu_busy_share"] = round(share, 3)
    return out


def cold_start(started: float, answered: list[tuple[float, float]], seconds: float, warm_up) -> dict:
    """The first `seconds` from the first frame taken: answer latency p50/p95 of the answers ready
    then, and the graphs captured after the first frame (LEDGER; a VLM in a process of its own
    captures in that process, not counted here) and before it (warm-up and the front end's)."""
    first = LEDGER.first_mark(FIRST_FRAME, started)
    if first is None:
        return {"cold_seconds": seconds, "cold_answers": 0}
    cold = [lat for t, lat in answered if t < first + seconds]
    late = LEDGER.entries(first, "capture")
    def ms(q):
        return round(percentile(cold, q) * 1e3, 1) if cold else None
    return {"cold_seconds": seconds, "cold_answers": len(cold),
            "cold_latency_p50_ms": ms(50), "cold_latency_p95_ms": ms(95),
            "first_answer_s": round(answered[0][0] - first, 2) if answered else None,
            "captures_before_first_frame": len([e for e in LEDGER.entries(started, "capture") if e.t < first]),
            "warm_up": None if warm_up is None else {"graphs": warm_up.graphs, "shapes": warm_up.shapes,
                                                     "seconds": round(warm_up.seconds, 2)},
            "captures_after_first_frame": len(late),
            "captures_after_first_frame_s": round(sum(e.seconds for e in late), 3),
            "captures_after_first_frame_labels": [f"+{e.t - first:.1f}s {e.label}" for e in late[:64]],
            "shapes_after_first_frame": [e.label for e in LEDGER.entries(first, "shape")][:64]}


def latency_parts(batches: list, frame_latency: list[float]) -> dict:
    """Where an answer's latency goes: window complete -> submitted to the VLM (the front end and
    the VLM stage's turn), submitted -> its batch starts (queued behind other batches), the batch's
    VLM call; and a frame's arrival -> written (the last 64 of each stream)."""
    def ms(values, q):
        values = [v for v in values if v == v]                                # NaN: arrival unknown
        return round(percentile(values, q) * 1e3, 1) if values else None
    ready = [v for b in batches for v in b.ready_s]
    queued = [v for b in batches for v in b.queued_s]
    calls = [b.answer_s for b in batches]
    return {"batches": len(batches), "batch_size_mean": round(float(np.mean([len(b.queued_s) for b in batches])), 2)
            if batches else None,
            "submit_delay_p50_ms": ms(ready, 50), "submit_delay_p95_ms": ms(ready, 95),
            "queued_p50_ms": ms(queued, 50), "queued_p95_ms": ms(queued, 95),
            "vlm_call_p50_ms": ms(calls, 50), "vlm_call_p95_ms": ms(calls, 95),
            "frame_latency_p50_ms": ms(frame_latency, 50), "frame_latency_p95_ms": ms(frame_latency, 95)}


def soak(url: str, vlm, args, device: torch.device, out: Path) -> dict:
    """One stream for args.soak seconds; memory sampled every few seconds."""
    samples: list[tuple[float, float, float]] = []
    stop = threading.Event()
    period = max(1.0, min(10.0, args.soak / 60))

    def sample():
        t0 = time.monotonic()
        while not stop.wait(period):
            cuda = torch.cuda.memory_allocated() / 2**20 if device.type == "cuda" else 0.0
            samples.append((time.monotonic() - t0, rss_mb(), cuda))
            if samples[-1][0] >= args.soak:
                stop.set()

    cfg = pipeline_config(vlm, args, device)
    threading.Thread(target=sample, daemon=True).start()
    run_live([url], "what is moving, and where?", out, cfg,
             live=live_config(args),
             options=live_options(args), stop=stop, vlm=vlm,
             status_out=open(os.devnull, "w"), query_embedding=fixed_query())
    if not samples:
        raise SystemExit(f"bench_live: the soak ended before its first memory sample ({period:g} s)")
    minute = min(60.0, args.soak / 5)   # "minute one" (scaled down for --quick)
    early = [s for s in samples if s[0] <= minute]
    first = early[-1] if early else samples[0]   # a soak of a few seconds: its first sample
    last = samples[-1]
    return {"seconds": round(last[0], 1), "reference_s": round(first[0], 1),
            "rss_mb_ref": round(first[1], 1), "rss_mb_end": round(last[1], 1),
            "rss_change": round(last[1] / first[1] - 1, 4),
            "cuda_mb_ref": round(first[2], 1), "cuda_mb_end": round(last[2], 1),
            "cuda_change": round(last[2] / first[2] - 1, 4) if first[2] else 0.0,
            "rss_mb_max": round(max(s[1] for s in samples), 1)}


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="CPU smoke test: 320x180@15, tiny VLM, short runs")
    p.add_argument("--streams", default=None,
                   help="comma-separated stream counts (default 1,4,16; quick 1,2; none: soak only)")
    p.add_argument("--seconds", type=float, default=None, help="measured seconds per count (default 30; quick 6)")
    p.add_argument("--warmup", type=float, default=None, help="seconds before measuring (default 10; quick 3)")
    p.add_argument("--soak", type=float, default=None, help="soak seconds, 0 to skip (default 600; quick 20)")
    p.add_argument("--cold-seconds", type=float, default=10.0,
                   help="the cold start: answer latency over this many seconds from the first frame (default 10)")
    p.add_argument("--every", type=float, default=2.0)
    p.add_argument("--new-tokens", type=int, default=None, help="answer length in tokens (default 16; quick 4)")
    p.add_argument("--batch-size", type=int, default=16,
                   help="frames per batch through the GPU stages (runtime default)")
    p.add_argument("--buffer", type=int, default=16, help="newest frames kept per source (live default)")
    p.add_argument("--switch-interval-ms", type=float, default=None,
                   help="LiveOptions.switch_interval_ms: the interpreter's thread switch interval (default: the live "
                        "default)")
    p.add_argument("--decoder", choices=("pyav", "nvdec"), default=LiveConfig.decoder,
                   help="LiveConfig.decoder: the streams decoded by PyAV on the CPU or by the GPU's NVDEC")
    p.add_argument("--capture-processes", type=int, default=None, metavar="N",
                   help="LiveConfig.capture_processes: capture the streams in N worker processes, 0: threads "
                        "(default: the pipeline's, 4 processes from 16 streams on)")
    p.add_argument("--decode-threads", type=int, default=LiveConfig.decode_threads,
                   help="LiveConfig.decode_threads: FFmpeg threads per stream "
                        "(default %(default)s; 0: FFmpeg's choice)")
    p.add_argument("--stagger", action=argparse.BooleanOptionalAction, default=LiveOptions.stagger,
                   help="spread the streams' answer times over the period (LiveOptions.stagger; default on)")
    p.add_argument("--warm-up", action=argparse.BooleanOptionalAction, default=None,
                   help="capture every graph before the first frame (LiveOptions.warm_up; default: on CUDA); "
                        "--no-warm-up shows the cold start")
    p.add_argument("--vlm-process", action="store_true",
                   help="the VLM in a process of its own (LiveOptions.vlm_process; pipeline/vlm/remote.py)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config override, e.g. vlm.encode=kept (repeatable; as on the CLI)")
    p.add_argument("--gpus", type=int, default=1, metavar="N",
                   help="spread each stream count over N GPUs, one process each, every stream on the "
                        "least-loaded one (default 1: this process)")
    p.add_argument("--p95-target-ms", type=float, default=1000.0,
                   help="answer latency p95 that `capacity` holds to (default %(default)g)")
    p.add_argument("--server", choices=("process", "thread"), default="process",
                   help="the loopback streams' server: a process of its own (default) or threads of this one")
    p.add_argument("--start-dump-s", type=float, default=120.0,
                   help="print every thread's stack if a run's graph is not up this many seconds after it starts "
                        "(0: never; default %(default)g)")
    p.add_argument("--keep-latencies", action="store_true", help=argparse.SUPPRESS)   # set for --gpus' processes
    p.add_argument("--out", default=None,
                   help="results JSON (default: $TMPDIR/arrcoc-bench/bench_live_<device>.json; name "
                        "benchmarks/results/... to commit a result)")
    args = p.parse_args(argv)
    if args.gpus < 1:
        p.error(f"--gpus must be >= 1, got {args.gpus}")
    if args.gpus > 1:
        return spread_over_gpus(args, list(sys.argv[1:] if argv is None else argv))
    command = " ".join(["python3 benchmarks/bench_live.py", *(sys.argv[1:] if argv is None else argv)])
    quick = args.quick
    w, h, fps = (320, 180, 15) if quick else (1280, 720, 30)
    streams = args.streams or ("1,2" if quick else "1,4,16")
    counts = [] if streams == "none" else [int(c) for c in streams.split(",")]  # none: the soak only
    args.seconds = args.seconds or (6.0 if quick else 30.0)
    args.warmup = args.warmup if args.warmup is not None else (3.0 if quick else 10.0)
    args.soak = args.soak if args.soak is not None else (20.0 if quick else 600.0)
    if 0 < args.soak < 2:
        p.error(f"--soak {args.soak:g}: 0 (no soak) or at least 2 seconds (memory is sampled every second)")
    new_tokens = args.new_tokens or (4 if quick else 16)
    device = torch.device(args.device)
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench_live_{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    clip = encode_clip(work / "clip.ts", w, h, fps, seconds=4.0)
    server = TSServerProcess(clip) if args.server == "process" else TSServer(clip)
    note(f"clip encoded ({w}x{h}@{fps}), serving it on loopback")
    args.settings = load_settings(args, new_tokens)
    arch = "tiny" if quick else "qwen2-vl-2b"
    if args.vlm_process:                                  # the same VLM, built in a process of its own
        from functools import partial

        from pipeline.vlm.remote import RemoteVLM
        vlm = RemoteVLM(partial(build_vlm, arch, device, args.settings.vlm))
    else:
        vlm = build_vlm(arch, device, args.settings.vlm)
    note(f"VLM built ({arch} on {device})")
    out = Path(args.out) if args.out else scratch_result(f"bench_live_{device.type}{'_quick' if quick else ''}.json")
    out.parent.mkdir(parents=True, exist_ok=True)

    def write(rows: list[dict], soak_row: dict | None, complete: bool) -> None:
        """The results so far: written after every count, so a run cut short keeps the counts it finished."""
        result = {"command": command, "commit": git_commit(), "gpus": 1, "complete": complete,
                  "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
                  "torch": torch.__version__, "stream": f"{w}x{h}@{fps} H.264 MPEG-TS over loopback HTTP",
                  "server": args.server,
                  "vlm": vlm.name, "overrides": args.overrides, "switch_interval_ms": args.switch_interval_ms,
                  "vlm_process": args.vlm_process, "stagger": args.stagger, "warm_up": args.warm_up,
                  "decode_threads": args.decode_threads, "decoder": args.decoder,
                  "capture_processes": args.capture_processes,
                  "every_s": args.every, "new_tokens": new_tokens, "batch_size": args.batch_size,
                  "rows": rows, "soak": soak_row, "host": host_topology(),
                  "capacity": capacity(rows, args.p95_target_ms, fps),
                  "targets": {"fps_at_16": fps, "answer_p95_ms_at_4": 500, "soak_memory_change": 0.05}}
        tmp = out.with_name(out.name + ".part")
        tmp.write_text(json.dumps(result, indent=2) + "\n")
        tmp.replace(out)

    rows, soak_row = [], None
    try:
        for n in counts:
            row = measure([server.url(i) for i in range(n)], vlm, args, device, work / f"live{n}.zarr")
            row["capture_workers"] = live_config(args).capture_workers(n)   # 0: threads
            rows.append(row)
            print(json.dumps(row), flush=True)
            write(rows, None, complete=False)
        soak_row = soak(server.url(999), vlm, args, device, work / "soak.zarr") if args.soak > 0 else None
        if soak_row:
            print(json.dumps({"soak": soak_row}), flush=True)
    finally:
        server.close()
        if args.vlm_process:
            vlm.close()
    write(rows, soak_row, complete=True)
    print_table(rows, soak_row)
    print(f"wrote {out}")
    return 0


def capacity(rows: list[dict], p95_target_ms: float, fps: float, min_share: float = 0.95) -> dict:
    """The most streams of `rows` answered at p95 <= p95_target_ms with every stream processed at
    >= min_share of its frame rate (None if no count did)."""
    held = [r["streams"] for r in rows if r["answer_latency_p95_ms"] <= p95_target_ms
            and r["fps_processed_per_stream_min"] >= min_share * fps]
    return {"streams": max(held) if held else None, "p95_target_ms": p95_target_ms, "min_fps": min_share * fps}


def split_streams(total: int, gpus: int) -> list[int]:
    """Streams per GPU when `total` streams start one after another, each on the least-loaded GPU."""
    from pipeline.serve.placement import Placement

    placement = Placement(gpus)
    for i in range(total):
        placement.place(f"s{i}")
    return placement.counts()


def _child_argv(argv: list[str], streams: int, out: Path) -> list[str]:
    """This command line for one GPU's share: its stream count, no soak, its own JSON, raw latencies."""
    drop = {"--gpus", "--streams", "--out", "--soak"}
    rest, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in drop:
            skip = True
        elif a.split("=", 1)[0] not in drop:
            rest.append(a)
    return [sys.executable, str(Path(__file__).resolve()), *rest, "--streams", str(streams), "--soak", "0",
            "--out", str(out), "--keep-latencies"]


def child_devices(gpus: int, visible: str | None) -> list[str]:
    """CUDA_VISIBLE_DEVICES of each GPU's process: the i-th device this process sees (its own
    CUDA_VISIBLE_DEVICES where set: with "2,3" the processes run on GPUs 2 and 3, not 0 and 1)."""
    seen = [d.strip() for d in (visible or "").split(",") if d.strip()]
    return (seen or [str(g) for g in range(gpus)])[:gpus]


def spread_over_gpus(args, argv: list[str]) -> int:
    """Each stream count over args.gpus processes at once (CUDA_VISIBLE_DEVICES=i each), rows pooled."""
    import subprocess

    if args.device.startswith("cuda") and torch.cuda.device_count() < args.gpus:
        raise SystemExit(f"bench_live: --gpus {args.gpus}, but {torch.cuda.device_count()} CUDA GPUs are visible")
    fps = 15 if args.quick else 30
    counts = [int(c) for c in (args.streams or ("2" if args.quick else "32")).split(",")]
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench_live_gpus_{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    visible = child_devices(args.gpus, os.environ.get("CUDA_VISIBLE_DEVICES"))
    rows = []
    for n in counts:
        shares = split_streams(n, args.gpus)
        procs = []
        for g, k in enumerate(shares):
            if k == 0:
                continue
            env = {**os.environ, **({"CUDA_VISIBLE_DEVICES": visible[g]} if args.device.startswith("cuda") else {})}
            procs.append((g, subprocess.Popen(_child_argv(argv, k, work / f"n{n}_gpu{g}.json"), env=env,
                                              stdout=subprocess.DEVNULL)))
        codes = [(g, p.wait()) for g, p in procs]
        failed = [g for g, code in codes if code != 0]
        if failed:
            raise SystemExit(f"bench_live: the process of GPU {failed[0]} failed at {n} streams")
        parts = [json.loads((work / f"n{n}_gpu{g}.json").read_text()) for g, _ in procs]
        rows.append(pool_rows([part["rows"][0] for part in parts], shares))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "per_gpu"}), flush=True)
    result = {"command": " ".join(["python3 benchmarks/bench_live.py", *argv]), "commit": git_commit(),
              "gpus": args.gpus, "device": parts[0]["device"], "torch": torch.__version__,
              "stream": parts[0]["stream"], "vlm": parts[0]["vlm"], "overrides": args.overrides,
              "every_s": args.every, "rows": rows, "host": host_topology(),
              "capacity": capacity(rows, args.p95_target_ms, fps)}
    out = Path(args.out) if args.out else scratch_result(f"bench_live_{args.device}_gpus{args.gpus}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print_table(rows, None)
    print(f"capacity at p95 <= {args.p95_target_ms:g} ms over {args.gpus} GPUs: "
          f"{result['capacity']['streams']} streams")
    print(f"wrote {out}")
    return 0


def pool_rows(parts: list[dict], shares: list[int]) -> dict:
    """One row of several GPUs' rows of the same moment: counts summed, latencies pooled, the
    slowest stream's frame rate; `per_gpu` keeps each one's (without its raw latencies)."""
    latencies = [v for part in parts for v in part["answer_latencies_ms"]]
    frames_in = sum(part["fps_in_per_stream_mean"] * part["streams"] * part["seconds"] for part in parts)
    dropped = sum(part["dropped"] for part in parts)
    streams = sum(part["streams"] for part in parts)

    def ms(q):
        return round(percentile(latencies, q), 1) if latencies else None
    return {"streams": streams, "streams_per_gpu": shares, "seconds": min(part["seconds"] for part in parts),
            "fps_processed_per_stream_mean": round(sum(p["fps_processed_per_stream_mean"] * p["streams"]
                                                       for p in parts) / streams, 2),
            "fps_processed_per_stream_min": min(p["fps_processed_per_stream_min"] for p in parts),
            "fps_in_per_stream_mean": round(sum(p["fps_in_per_stream_mean"] * p["streams"] for p in parts) / streams,
                                            2),
            "dropped": dropped, "drop_share": round(dropped / max(1.0, frames_in), 4),
            "answers": sum(p["answers"] for p in parts),
            "answer_latency_p50_ms": ms(50), "answer_latency_p95_ms": ms(95),
            **{k: None for k in ("batch_size_mean", "submit_delay_p95_ms", "queued_p95_ms", "vlm_call_p95_ms",
                                 "frame_latency_p95_ms")},
            "per_gpu": [{k: v for k, v in p.items() if k != "answer_latencies_ms"} for p in parts]}


def print_table(rows: list[dict], soak_row: dict | None) -> None:
    for r in rows:
        if r.get("cold_answers"):
            print(f"{r['streams']:>7} streams, first {r['cold_seconds']:g} s from the first frame: {r['cold_answers']} "
                  f"answers, p50 {r['cold_latency_p50_ms']:.0f} ms, p95 {r['cold_latency_p95_ms']:.0f} ms; "
                  f"{r['captures_after_first_frame']} graphs captured after the first frame")
    print(f"{'streams':>7} {'fps/stream':>10} {'min':>6} {'in':>6} {'drop%':>6} {'answers':>7} {'p50 ms':>7} "
          f"{'p95 ms':>7}"
          f" {'batch':>5} {'submit p95':>10} {'queued p95':>10} {'call p95':>8} {'frame p95':>9}")
    for r in rows:
        print(f"{r['streams']:>7} {r['fps_processed_per_stream_mean']:>10.1f} "
              f"{r['fps_processed_per_stream_min']:>6.1f} "
              f"{r['fps_in_per_stream_mean']:>6.1f} {100 * r['drop_share']:>6.1f} {r['answers']:>7} "
              f"{r['answer_latency_p50_ms']:>7.0f} {r['answer_latency_p95_ms']:>7.0f} "
              f"{r['batch_size_mean'] or 0:>5.1f} "
              f"{r['submit_delay_p95_ms'] or 0:>10.0f} {r['queued_p95_ms'] or 0:>10.0f} "
              f"{r['vlm_call_p95_ms'] or 0:>8.0f} "
              f"{r['frame_latency_p95_ms'] or 0:>9.0f}")
    if soak_row:
        print(f"soak {soak_row['seconds']:.0f} s: RSS {soak_row['rss_mb_ref']:.0f} -> {soak_row['rss_mb_end']:.0f} MB "
              f"({100 * soak_row['rss_change']:+.1f}%), CUDA {soak_row['cuda_mb_ref']:.0f} -> "
              f"{soak_row['cuda_mb_end']:.0f} MB ({100 * soak_row['cuda_change']:+.1f}%)")


if __name__ == "__main__":
    sys.exit(main())
