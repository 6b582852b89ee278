"""VLM stage benchmark: stock Qwen2-VL-family model (all visual tokens) vs ARR-COC token retention.

For each architecture (random weights from configs written in code; speed does not depend on the
weights, nothing is downloaded) and a 32-frame 448x448 window, reports per setting:
  front end (preprocess + vision tower + selection, also split), prefill, time to first token,
  decode tokens/s and peak GPU memory; and ARR-COC's own front end (texture arrays + relevance
  realization over the window, replayed as CUDA graphs as in a stream's steady state on CUDA, and
  eager) in ms and as a share of the VLM's time for the window
  (vision tower + prefill + decoded tokens; the issue's target: under 2%). Keep maps come from
  arr_coc.ARRCOC (untrained weights) when it
  imports and runs (its realized relevance, top-k per frame pair so the retention is exact at
  the token level), else from a deterministic relevance map; the JSON says which. Decoding runs
  from a static KV cache with each step replayed as a CUDA graph (--eager-decode: the same
  static-cache steps launched eagerly, and the prefill eager too, for comparison). The prefill is
  timed as generate() runs it: prefixes of up to VLMConfig.graph_prefill_max_tokens tokens (after
  left padding to a multiple of 64) replay a CUDA graph, longer ones run eagerly (--eager-prefill:
  every prefill eager and unpadded; each result row says which one ran, prefill_graph).
The LM runs through pipeline.vlm.text_model (VLMConfig.fast_lm) in every setting, so "stock" and
ARR-COC differ only in their tokens (prefill_x_stock: the speed-up from token selection alone); one
more row, "stock, HF forward", runs every token through transformers' own forward on the same
weights, the stock model as users run it without this pipeline (prefill_x_hf_stock).
Each retention runs twice (--encode both, the default): "arr-coc N%" with `vlm.encode: all` (the
vision tower on every patch, the kept tokens picked afterwards) and "arr-coc N%, kept" with
`vlm.encode: kept` (the tower on the kept cells only; Qwen2.5-VL: the windows holding them);
vision_cells counts the cells the tower encoded, ttft_x_stock the time-to-first-token speed-up.
Every setting gets the window as the VLM stages hand one over (runtime/cuda.py window_frames): on
CUDA stacked in page-locked memory, so the upload needs no host copy first (--pageable-frames: a
numpy array, which the preprocessor copies into page-locked memory before uploading).

    python benchmarks/bench_vlm.py                 # GPU: qwen2-vl-2b and qwen2.5-vl-7b, bf16
    python benchmarks/bench_vlm.py --tiny          # CPU smoke test with the tiny random models
    python benchmarks/bench_vlm.py --eager-decode  # GPU, decode steps (and prefill) without CUDA graphs
    python benchmarks/bench_vlm.py --eager-prefill # GPU, graph-replayed decode steps, eager prefill
    python benchmarks/bench_vlm.py --graph-prefill-max-tokens 4608  # GPU, every setting's prefill a graph
    python benchmarks/bench_vlm.py --hf-lm         # GPU, the LM's layers through HF's forward
                                                   #   instead of pipeline.vlm.text_model
    python benchmarks/bench_vlm.py --encode kept   # GPU, the ARR-COC rows with vlm.encode: kept only
    python benchmarks/bench_vlm.py --arch qwen3-vl-8b qwen3-vl-2b   # GPU, Qwen3-VL (and its transformers forward)

Qwen3-VL (--arch qwen3-vl-8b, qwen3-vl-2b; tiny-qwen3_vl with --tiny) runs through the same fast
engine (DeepStack features ride with the kept tokens); its rows add "stock, transformers forward":
every token through transformers' own Qwen3-VL forward (pipeline/vlm/hf_forward.py, what a user
runs without this pipeline, and what runs Qwen3-VL-MoE), ttft_x_hf_forward the speed-up over it.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import platform
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import host_topology, scratch_result  # noqa: E402
from pipeline.runtime.cuda import window_frames  # noqa: E402
from pipeline.vlm import hf, qwen3_vl  # noqa: E402
from pipeline.vlm.builtin import ARCHS, arch_config, build_model, build_tokenizer, tiny_config  # noqa: E402
from pipeline.vlm_config import VLMConfig  # noqa: E402
from pipeline.vlm.loading import _wrap  # noqa: E402
from pipeline.runtime.requests import AnswerRequest  # noqa: E402
QUESTION = "What is the person on the left doing with the red object?"
HF_STOCK = "stock, HF forward"         # every token, the LM through transformers' own forward (fast_lm off)
HF_FORWARD = "stock, transformers forward"   # Qwen3-VL: every token through transformers' whole forward


@contextlib.contextmanager
def stock_attention(vlm):
    """While inside: the LM's attention is transformers' own sdpa again (the engine registers its
    packed-GQA variant on the LM's config), so the transformers-forward row runs stock code only."""
    impl = hf.attention_implementation(vlm.lm.config)
    hf.set_attention_implementation(vlm.lm.config, "sdpa")
    try:
        yield
    finally:
        hf.set_attention_implementation(vlm.lm.config, impl)


def transformers_forward(vlm):
    """The same Qwen3-VL model and weights answered through transformers' own forward (HFForwardVLM)."""
    from pipeline.vlm.hf_forward import HFForwardVLM

    out = HFForwardVLM(vlm.model, vlm.tokenizer, family=vlm.family, name=vlm.name, config=vlm.config,
                       preprocessor=vlm.preprocessor)
    out.eos_ids = set()                          # a fixed count of decoded tokens
    return out


@contextlib.contextmanager
def encoding(vlm, encode: str, snap_windows: int = 0):
    """While inside: the VLM's prepare() encodes `encode` ("all" | "kept") patches, its kept tokens
    snapped to windows of `snap_windows` cells (vlm.snap_windows; 0: not)."""
    previous, vlm.config = vlm.config, replace(vlm.config, encode=encode, snap_windows=snap_windows)
    try:
        yield
    finally:
        vlm.config = previous


@contextlib.contextmanager
def hf_forward(vlm, on: bool):
    """While on: the VLM's LM through HF's own forward, as VLMConfig(fast_lm=False) runs it, on the
    same weights (its decoders, whose graphs were captured through the other forward, are dropped)."""
    if not on:
        yield
        return
    fast, vlm.pool._fast_lm = vlm.pool._fast_lm, None
    vlm.pool._decoders.clear()
    try:
        yield
    finally:
        vlm.pool._fast_lm = fast
        vlm.pool._decoders.clear()


def synthetic_window(T: int, H: int, W: int) -> np.ndarray:
    """Deterministic moving colour blobs over a gradient: (T, H, W, 3) uint8."""
    yy, xx = np.mgrid[0:H, 0:W].astype(np.float32)
    frames = []
    for t in range(T):
        cy, cx = H * (0.3 + 0.4 * np.sin(t / 5)), W * (0.3 + 0.4 * np.cos(t / 7))
        blob = np.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / (2 * (H / 10) ** 2))
        rgb = np.stack([blob * 255, yy / H * 200, xx / W * 200], -1)
        frames.append(rgb)
    return np.clip(np.stack(frames), 0, 255).astype(np.uint8)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, reps: int) -> tuple[float, object]:
    fn()                                                               # warm-up (kernels, allocator)
    times, out = [], None
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        out = fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def relevance_map(vlm, frames: np.ndarray, reps: int = 3) -> tuple[torch.Tensor, str, float, float]:
    """(T, gh, gw) relevance for the window, a note on where it came from, and the ARR-COC front
    end's own time for the window in ms (texture arrays + knowing -> realizing, median of reps):
    as a stream's steady state runs it (CUDA-graph replays on CUDA) and eager (NaN, NaN where
    arr_coc is unavailable)."""
    grid = vlm.geometry.grid(*frames.shape[1:3])
    try:
        from arr_coc.model import ARRCOC, ARRCOCConfig
        from arr_coc.realizing import RealizingConfig
        from benchmarks.common import fixed_query
        query = fixed_query(QUESTION).to(vlm.device)                      # (384,): the pipeline reads MiniLM's vector
        video = torch.as_tensor(frames, device=vlm.device).permute(0, 3, 1, 2)  # (T, 3, H, W) uint8
        torch.manual_seed(0)
        # redundancy off: it drops cells already seen unchanged, which would make the kept share
        # depend on the clip instead of the retention being benchmarked
        model = ARRCOC(ARRCOCConfig(realizing=RealizingConfig(redundancy=False)), query_dim=query.shape[-1])
        model = model.to(vlm.device).eval()
        with torch.no_grad():
            eager_s, (allocation, _) = timed(lambda: model(video, query, grid=grid), vlm.device, reps)
        arrcoc_s = graphed_frontend_s(model, video, query, grid, reps) if vlm.device.type == "cuda" else eager_s
        return (allocation.relevance.float(),
                "arr_coc.ARRCOC (untrained weights) realized relevance, top-k per frame pair",
                arrcoc_s * 1e3, eager_s * 1e3)
    except Exception as e:  # arr_coc missing or failing: still benchmark the VLM side
        note = f"top-k of a deterministic relevance map (arr_coc unavailable: {type(e).__name__}: {e})"
    T, (gh, gw) = frames.shape[0], grid
    yy, xx = torch.meshgrid(torch.linspace(-1, 1, gh), torch.linspace(-1, 1, gw), indexing="ij")
    t = torch.arange(T).float()[:, None, None]
    relevance = torch.exp(-((yy - 0.3 * torch.sin(t / 6)) ** 2 + (xx - 0.3 * torch.cos(t / 8)) ** 2) / 0.3)
    return relevance.to(vlm.device), note, float("nan"), float("nan")


@torch.inference_mode()
def graphed_frontend_s(model, video: torch.Tensor, query: torch.Tensor, grid: tuple[int, int], reps: int) -> float:
    """Seconds for one window through the front end as a stream's later batches run in the
    pipeline: texture + realize replayed as CUDA graphs (pipeline.core.frontend_graphs.FrontendGraphs)."""
    from pipeline.core.frontend_graphs import FrontendGraphs
    T, _, H, W = video.shape
    graphs = FrontendGraphs(model, grid, query)
    graphs.prepare(T, H, W)
    texture = model.extract(video, None, grid)                          # the stream's first batch: eager
    _, state, _ = model.realize(texture, query, None)
    last, marks = video[-1].clone(), torch.ones(T, dtype=torch.bool, device=video.device)
    stream = torch.cuda.Stream(video.device)

    def window():
        with torch.cuda.stream(stream):
            return graphs.realize(graphs.extract(video, last, stream), state, marks, stream)
    return timed(window, video.device, reps)[0]


def keep_maps(relevance: torch.Tensor, retentions: list[float], tp: int = 2) -> dict:
    """Exact token-level retention: the top-k cells of each frame pair (by the pair's max relevance)
    are kept in both frames, so each video token is kept or dropped as a whole."""
    T, gh, gw = relevance.shape
    if pad := -T % tp:
        relevance = torch.cat([relevance, relevance[-1:].expand(pad, -1, -1)])
    pair = relevance.view(-1, tp, gh * gw).amax(1)                          # (T', gh*gw)
    maps = {}
    for r in retentions:
        top = pair.topk(max(1, round(r * gh * gw)), dim=1).indices
        keep = torch.zeros_like(pair, dtype=torch.int64).scatter_(1, top, 1)  # (T', gh*gw)
        maps[r] = keep.repeat_interleave(tp, 0)[:T].view(T, gh, gw)
    return maps


@torch.no_grad()  # as VLM.prepare: without it the vision tower's activations stay alive for autograd
def bench_setting(vlm, frames, keep, new_tokens: int, reps: int, encode: str = "all",
                  scores: torch.Tensor | None = None, snap_windows: int = 0) -> dict:
    """One row. scores: pass 1's relevance, given to the VLM with snap_windows (the phases then
    time the snapped map; time to first token includes the snapping)."""
    with encoding(vlm, encode, snap_windows):
        return _bench_setting(vlm, frames, keep, new_tokens, reps, scores if snap_windows else None)


def _vision(vlm, pixels, grid, keep) -> tuple[torch.Tensor, int]:
    """The vision tower as vlm.prepare() runs it -> merged tokens (T', gh, gw, D), cells encoded."""
    if vlm.config.encode == "all":
        merged = vlm.encoder.vision(pixels, grid)[0]
        return merged, merged.shape[0] * merged.shape[1] * merged.shape[2]
    before = vlm.kept_encoder.counters["cells_encoded"]
    merged = vlm.kept_encoder.encode_pixels([pixels], [grid[0]], [keep])[0].dense()
    return merged, vlm.kept_encoder.counters["cells_encoded"] - before


def _bench_setting(vlm, frames, keep, new_tokens: int, reps: int, scores: torch.Tensor | None = None) -> dict:
    device = vlm.device
    req = AnswerRequest("bench", frames, keep, QUESTION, 0.0, frames.shape[0] / vlm.config.fps, scores=scores)
    if scores is not None:                            # the phases below take the map prepare() makes
        keep = vlm.prefixes.snapped(keep, scores)
    phases = {"preprocess": [], "vision": [], "selection": []}
    for _ in range(reps + 1):                        # the first round warms up
        marks = [time.perf_counter()]
        pixels, grid = vlm.encoder.preprocess([frames])
        sync(device)
        marks.append(time.perf_counter())
        merged, vision_cells = _vision(vlm, pixels, grid, keep)
        sync(device)
        marks.append(time.perf_counter())
        prefix = vlm.build_prefix(req, merged)
        sync(device)
        marks.append(time.perf_counter())
        for name, a, b in zip(phases, marks, marks[1:]):
            phases[name].append(b - a)
    pre_s, vis_s, sel_s = (statistics.median(v[1:]) for v in phases.values())
    front_s = pre_s + vis_s + sel_s

    def prefill():            # generate()'s own prefill (graph replay when the plan says so)
        return vlm.pool._prefill([prefix], new_tokens)[1]

    prefill_len, prefill_graph = vlm.pool._prefill_plan(prefix.embeds.shape[0])

    prefill_s, _ = timed(prefill, device, reps)
    ttft_s, _ = timed(lambda: vlm.generate(vlm.prepare([req]), max_new_tokens=1), device, reps)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    _, out = timed(lambda: vlm.generate(vlm.prepare([req]), max_new_tokens=new_tokens, timed=True), device, reps)
    n = out.lengths[0]
    decode_tps = (n - 1) / out.decode_s
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    return dict(encode=vlm.config.encode, vision_cells=vision_cells,
                tokens_kept=prefix.tokens_kept, tokens_full=prefix.tokens_full,
                retention_actual=prefix.tokens_kept / prefix.tokens_full, prefix_len=prefix.embeds.shape[0],
                prefill_len=prefill_len, prefill_graph=prefill_graph,
                preprocess_ms=pre_s * 1e3, vision_ms=vis_s * 1e3,
                selection_ms=sel_s * 1e3, front_end_ms=front_s * 1e3,
                prefill_ms=prefill_s * 1e3, ttft_ms=ttft_s * 1e3, decode_tokens=n, decode_tok_s=decode_tps,
                peak_mem_gib=peak)


def answer_ttft(vlm, frames, keep, scores, reps: int, pass2: bool) -> dict:
    """Time to first token through VLM.answer (one new token), the path the pipeline's stages take,
    with pass 2 on (keep: pass 1's candidates, candidate_factor times the budget; pass 2 keeps the
    budget among them by the question's attention) or off (keep: the budget), at the VLM's other
    settings (vlm.encode kept, kept_context 1 unless changed)."""
    from pipeline.vlm.passes import Passes
    kept = vlm.kept_encoder
    base, passes, encoder_state = vlm.config, vlm.passes, (kept.context, kept.whole_windows)
    vlm.config = replace(base, max_new_tokens=1, pass2="attention" if pass2 else "off")
    # the VLM's own kept-encoder settings, not the last bench_setting row's
    kept.context, kept.whole_windows = vlm.config.kept_context, vlm.config.kept_windows == "whole"
    vlm.passes = Passes(vlm) if vlm.config.multipass else None
    try:
        req = AnswerRequest("bench", frames, keep, QUESTION, 0.0, frames.shape[0] / vlm.config.fps, scores=scores)
        seconds, out = timed(lambda: vlm.answer([req]), vlm.device, reps)
    finally:
        vlm.config, vlm.passes = base, passes
        kept.context, kept.whole_windows = encoder_state
    return dict(answer_ttft_ms=seconds * 1e3, tokens_kept=out[0].tokens_kept, tokens_full=out[0].tokens_full,
                passes=out[0].passes)


def pass2_rows(vlm, frames, relevance, retentions: list[float], reps: int, keep_on: str) -> list[dict]:
    """--pass2: per retention, time to first token through VLM.answer single pass and with pass 2
    (candidates at candidate_factor times the retention), and the stock model through the same path."""
    factor = vlm.config.candidate_factor
    shares = sorted({*retentions, *(min(1.0, r * factor) for r in retentions)})
    maps = keep_maps(relevance, shares, vlm.geometry.temporal_patch_size)
    scores = relevance
    if keep_on == "host":
        maps, scores = {r: m.cpu().numpy() for r, m in maps.items()}, relevance.cpu().numpy()
    rows = [dict(setting="stock, answer()", retention=1.0, **answer_ttft(vlm, frames, None, None, reps, False))]
    for r in retentions:
        rows.append(dict(setting=f"arr-coc {int(r * 100)}%, answer()", retention=r,
                         **answer_ttft(vlm, frames, maps[r], scores, reps, False)))
        rows.append(dict(setting=f"arr-coc {int(r * 100)}%, pass 2 of {int(min(1.0, r * factor) * 100)}%, answer()",
                         retention=r, **answer_ttft(vlm, frames, maps[min(1.0, r * factor)], scores, reps, True)))
    for row in rows:
        row["answer_ttft_x_stock"] = rows[0]["answer_ttft_ms"] / row["answer_ttft_ms"]
        print(f"# {row['setting']}: {row['tokens_kept']} of {row['tokens_full']} tokens, {row['passes']} pass(es), "
              f"time to first token {row['answer_ttft_ms']:.1f} ms ({row['answer_ttft_x_stock']:.2f}x stock)",
              flush=True)
    return rows


def build_vlm(name: str, device: torch.device, dtype: torch.dtype, cfg: VLMConfig):
    # full-size architectures: English-word merges, so the prompt's text tokens cost what they do with Qwen's vocabulary
    tokenizer = build_tokenizer("bytes" if name.startswith("tiny-") else "english")
    if name in QWEN3_ARCHS:
        model_cfg = qwen3_vl.tiny_config(tokenizer) if name.startswith("tiny-") else qwen3_vl.arch_config(name,
                                                                                                          tokenizer)
        vlm = _wrap(build_model(model_cfg, device=device, dtype=dtype), tokenizer, model_cfg.model_type, name,
                    cfg, {}, "random weights (benchmark)")
        vlm.eos_ids = torch.empty(0, dtype=torch.long, device=device)   # a fixed count of decoded tokens
        return vlm
    if name.startswith("tiny-"):
        family = name.removeprefix("tiny-")
        model_cfg, family_name = tiny_config(family, tokenizer), family
    else:
        model_cfg = arch_config(name, tokenizer)
        family_name = model_cfg.model_type
    model = build_model(model_cfg, device=device, dtype=dtype)
    vlm = _wrap(model, tokenizer, family_name, name, cfg, {}, "random weights (benchmark)")
    # random weights emit EOS at random; decode speed is measured over a fixed token count
    vlm.eos_ids = torch.empty(0, dtype=torch.long, device=device)
    return vlm


QWEN3_ARCHS = qwen3_vl.ARCHS + ("tiny-qwen3_vl",)


@torch.no_grad()
def bench_hf_forward(vlm, frames, keep, new_tokens: int, reps: int) -> dict:
    """One row of a VLM answering through transformers' forward (Qwen3-VL): front end = the window
    (preprocess, the tower on every patch, selection, prompt), prefill = the first generated token,
    time to first token = both, decode tokens/s from the first token to the last of new_tokens."""
    device = vlm.device
    preprocess_s, _ = timed(lambda: vlm.preprocessor(frames, device), device, reps)
    vision_s, _ = timed(lambda: vlm.features(frames), device, reps)
    front_s, window = timed(lambda: vlm.window(frames, keep), device, reps)
    prompt = vlm.prompt(window, QUESTION)
    prefill_s, _ = timed(lambda: vlm.generate(prompt, max_new_tokens=1), device, reps)
    ttft_s, _ = timed(lambda: vlm.generate(vlm.prompt(vlm.window(frames, keep), QUESTION), max_new_tokens=1),
                      device, reps)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    decode_s = statistics.median(vlm.generate(prompt, max_new_tokens=new_tokens).decode_s for _ in range(reps))
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    n = len(vlm.generate(prompt, max_new_tokens=new_tokens).tokens)
    return dict(encode="all", vision_cells=window.tokens_full, tokens_kept=window.tokens_kept,
                tokens_full=window.tokens_full, retention_actual=window.tokens_kept / window.tokens_full,
                prefix_len=prompt.embeds.shape[0], prefill_len=prompt.embeds.shape[0], prefill_graph=False,
                preprocess_ms=preprocess_s * 1e3, vision_ms=(vision_s - preprocess_s) * 1e3,
                selection_ms=(front_s - vision_s) * 1e3, front_end_ms=front_s * 1e3, prefill_ms=prefill_s * 1e3,
                ttft_ms=ttft_s * 1e3, decode_tokens=n,
                decode_tok_s=(n - 1) / decode_s if n > 1 else float("nan"), peak_mem_gib=peak)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test with the tiny random models")
    ap.add_argument("--arch", nargs="+", default=None,
                    help=f"architectures (default: {', '.join(ARCHS)}; also {', '.join(QWEN3_ARCHS)})")
    ap.add_argument("--frames", type=int, default=None, help="frames per window (default 32; --tiny 4)")
    ap.add_argument("--size", type=int, default=None, help="frame side in pixels (default 448; --tiny 112)")
    ap.add_argument("--new-tokens", type=int, default=None, help="decoded tokens (default 64; --tiny 6)")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions (default 3; --tiny 1)")
    ap.add_argument("--retention", type=float, nargs="+", default=[0.5, 0.25, 0.1])
    ap.add_argument("--eager-decode", action="store_true", help="decode steps and prefill without CUDA graphs")
    prefill = ap.add_mutually_exclusive_group()
    prefill.add_argument("--eager-prefill", action="store_true",
                         help="prefill without CUDA graphs (decode steps keep theirs)")
    prefill.add_argument("--graph-prefill-max-tokens", type=int, default=VLMConfig.graph_prefill_max_tokens,
                         help="longest (padded) prefix prefilled by a CUDA graph (default %(default)s)")
    ap.add_argument("--hf-lm", action="store_true",
                    help="the LM's layers through HF's own forward (VLMConfig.fast_lm off)")
    ap.add_argument("--encode", choices=("all", "kept", "both"), default="both",
                    help="vlm.encode of the ARR-COC rows (default: both, one row each)")
    ap.add_argument("--kept-windows", choices=("whole", "cells", "both"), default="whole",
                    help="vlm.kept_windows of the kept rows (Qwen2.5-VL; default: whole; both: a row each)")
    ap.add_argument("--kept-context", type=int, nargs="+", default=[0], metavar="R",
                    help="vlm.kept_context of the kept rows (cells within R of a kept one encoded as context; "
                         "default 0; several: a row each)")
    ap.add_argument("--keep-on", choices=("host", "device"), default="host",
                    help="where the keep maps are handed over: host (numpy, as the pipeline's stages hand "
                         "them; the default) or device (a GPU tensor)")
    ap.add_argument("--snap-windows", action="store_true",
                    help="also kept rows with vlm.snap_windows at the model's attention window (Qwen2.5-VL: the "
                         "kept tokens gathered into whole windows, so none is encoded only to complete one)")
    ap.add_argument("--pageable-frames", action="store_true",
                    help="hand the window over as a numpy array (pageable), not stacked in page-locked memory")
    ap.add_argument("--pass2", action="store_true",
                    help="also time to first token through VLM.answer with pass 2 on (vlm.pass2=attention, pass 1 "
                         "keeping candidate_factor times each retention) against single pass and stock through the "
                         "same call, at the VLM's default settings (`pass2` in the JSON)")
    ap.add_argument("--device", default=None, help="default: cuda (cpu with --tiny)")
    ap.add_argument("--out", default=str(scratch_result("bench_vlm.json")),
                    help="JSON path (default: %(default)s; name benchmarks/results/... to commit a result)")
    args = ap.parse_args(argv)
    tiny = args.tiny
    device = torch.device(args.device or ("cpu" if tiny else "cuda"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_vlm: no CUDA GPU here; use --tiny for the CPU smoke test", file=sys.stderr)
        return 2
    archs = args.arch or (["tiny-qwen2_vl", "tiny-qwen2_5_vl"] if tiny else list(ARCHS))
    T, size = args.frames or (4 if tiny else 32), args.size or (112 if tiny else 448)
    new_tokens, reps = args.new_tokens or (6 if tiny else 64), args.reps or (1 if tiny else 3)
    dtype = torch.float32 if tiny else torch.bfloat16
    cfg = VLMConfig(max_pixels=max(size * size, 56 * 56), max_new_tokens=new_tokens, dtype=str(dtype)[6:],
                    cuda_graphs=not args.eager_decode,
                    graph_prefill_max_tokens=0 if args.eager_prefill else args.graph_prefill_max_tokens,
                    fast_lm=not args.hf_lm)
    frames = synthetic_window(T, size, size)
    window = window_frames(list(frames), device.type == "cuda" and not args.pageable_frames)
    results, answer_rows = [], []
    for arch in archs:
        t0 = time.perf_counter()
        vlm = build_vlm(arch, device, dtype, cfg)
        build_s = time.perf_counter() - t0
        relevance, source, arrcoc_ms, arrcoc_eager_ms = relevance_map(vlm, frames, reps)
        maps = keep_maps(relevance, args.retention, vlm.geometry.temporal_patch_size)
        if args.keep_on == "host":                  # as the pipeline's stages hand them over
            maps = {r: m.cpu().numpy() for r, m in maps.items()}
        modes = ["all", "kept"] if args.encode == "both" else [args.encode]
        if vlm.kept_encoder.window is not None and "kept" in modes and args.kept_windows != "whole":
            # Qwen2.5-VL: the kept cells only (vlm.kept_windows: cells), after or instead of whole windows
            modes = [m for m in modes if m != "kept" or args.kept_windows == "both"] + ["kept cells"]
        if vlm.kept_encoder.window is not None and "kept" in modes and args.snap_windows:
            modes.append("kept snapped")                   # whole windows of the snapped map
        # kept rows: one per --kept-context radius (vlm.kept_context: context cells encoded, then dropped)
        modes = [(m, c) for m in modes for c in (args.kept_context if m != "all" else [0])]
        settings = [("stock", None, "all", 0)] + [
            (f"arr-coc {int(r * 100)}%" + (f", {mode}" if mode != "all" else "") + (f", context {c}" if c else ""),
             maps[r], mode, c) for r in args.retention for mode, c in modes]
        if vlm.pool._fast_lm is not None:          # the real alternative: the stock model through HF's own forward
            settings.insert(0, (HF_STOCK, None, "all", 0))
        arch_rows = []
        for label, keep, mode, context in settings:
            vlm.kept_encoder.whole_windows = mode != "kept cells"
            vlm.kept_encoder.context = context
            snap = vlm.kept_encoder.window if mode == "kept snapped" else 0
            with hf_forward(vlm, label == HF_STOCK):
                r = bench_setting(vlm, window, keep, new_tokens, reps, mode.split()[0], relevance, snap)
            r["kept_windows"] = None if mode == "all" else ("cells" if mode == "kept cells" else "whole")
            r["snap_windows"] = snap
            r["kept_context"] = None if mode == "all" else context
            # the VLM's time for the window: vision tower + prefill + the decoded tokens
            vlm_ms = r["vision_ms"] + r["prefill_ms"] + 1e3 * (r["decode_tokens"] - 1) / r["decode_tok_s"]
            r.update(arch=arch, setting=label, keep_source=None if keep is None else source, build_s=build_s,
                     arrcoc_ms=None if keep is None else arrcoc_ms,
                     arrcoc_eager_ms=None if keep is None else arrcoc_eager_ms,
                     arrcoc_share_of_vlm=None if keep is None else arrcoc_ms / vlm_ms)
            arch_rows.append(r)
        if arch in QWEN3_ARCHS:       # the stock model through transformers' own Qwen3-VL forward
            with stock_attention(vlm):
                forward = bench_hf_forward(transformers_forward(vlm), window, None, new_tokens, reps)
            r = dict(forward, setting=HF_FORWARD,
                     arch=arch, keep_source=None, build_s=build_s, kept_windows=None, snap_windows=0,
                     kept_context=None, arrcoc_ms=None, arrcoc_eager_ms=None, arrcoc_share_of_vlm=None)
            arch_rows.insert(0, r)
        by_label = {r["setting"]: r for r in arch_rows}
        for r in arch_rows:           # prefill speed-ups over the stock rows of the same run
            r["prefill_x_stock"] = by_label["stock"]["prefill_ms"] / r["prefill_ms"]
            r["ttft_x_stock"] = by_label["stock"]["ttft_ms"] / r["ttft_ms"]
            hf = by_label.get(HF_STOCK)
            r["prefill_x_hf_stock"] = hf["prefill_ms"] / r["prefill_ms"] if hf else None
            forward = by_label.get(HF_FORWARD)
            r["ttft_x_hf_forward"] = forward["ttft_ms"] / r["ttft_ms"] if forward else None
        results += arch_rows
        if args.pass2:
            answer_rows += [dict(r, arch=arch) for r in pass2_rows(vlm, window, relevance, args.retention, reps,
                                                                    args.keep_on)]
        del vlm
        gc.collect()  # the VLM and its cached decoders (graphs, KV caches) reference each other
        if device.type == "cuda":
            torch.cuda.empty_cache()
            print(f"# after {arch}: {torch.cuda.memory_allocated(device) / 2**30:.2f} GiB still allocated", flush=True)
    print_table(results)
    import transformers
    report = dict(command=" ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
                  device=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
                  torch=torch.__version__, transformers=transformers.__version__, dtype=str(dtype),
                  frames=T, size=size, new_tokens=new_tokens, reps=reps,
                  frames_pinned=bool(device.type == "cuda" and not args.pageable_frames), keep_on=args.keep_on,
                  host=host_topology(),
                  cuda_graphs=cfg.cuda_graphs and device.type == "cuda",
                  graph_prefill_max_tokens=cfg.graph_prefill_max_tokens if cfg.cuda_graphs else 0,
                  fast_lm=cfg.fast_lm,
                  results=results, pass2=answer_rows or None)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    return 0


def print_table(rows: list[dict]) -> None:
    cols = [("arch", "{}"), ("setting", "{}"), ("tokens_kept", "{}"), ("tokens_full", "{}"), ("vision_cells", "{}"),
            ("preprocess_ms", "{:.1f}"), ("vision_ms", "{:.1f}"), ("selection_ms", "{:.1f}"),
            ("front_end_ms", "{:.1f}"), ("prefill_len", "{}"), ("prefill_graph", "{}"),
            ("prefill_ms", "{:.1f}"), ("prefill_x_stock", "{:.2f}"), ("prefill_x_hf_stock", "{:.2f}"), ("ttft_ms",
                                                                                                        "{:.1f}"),
            ("ttft_x_stock", "{:.2f}"), ("ttft_x_hf_forward", "{:.2f}"),
            ("decode_tok_s", "{:.1f}"), ("peak_mem_gib", "{:.2f}"), ("arrcoc_ms", "{:.1f}"),
            ("arrcoc_share_of_vlm", "{:.2%}")]
    cells = [[c for c, _ in cols]] + [["-" if r[c] is None else fmt.format(r[c]) for c, fmt in cols] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))


if __name__ == "__main__":
    sys.exit(main())
