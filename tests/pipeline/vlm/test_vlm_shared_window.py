"""Questions about one window share its prefill (VLM._prefill_shared): the window is prefilled once
and copied to every row, each question after it, with the padding between them masked. That must
change nothing: the same greedy tokens and logits as prefilling every question's whole prefix, and
as recomputing each row without a cache, with padding rows and reused caches."""
from dataclasses import replace

import pytest
import torch

from conftest import make_frames, random_keep, rewrap
from test_vlm_static_decode import assert_steps_close

QUESTIONS = ["a?", "what colour is the car on the left of the road?", "who is talking?",
             "is it raining in this video or is the sun shining?", "how many?"]


def question_prefixes(vlm, keep_seed: int | None, n: int = len(QUESTIONS), T: int = 4):
    frames = make_frames(T, 84, 112, seed=40 + T)
    keep = None if keep_seed is None else random_keep(vlm, frames, seed=keep_seed)
    merged = vlm.encoder.merged_tokens([frames])[0]
    window = vlm.window_prefix(frames, keep, merged)
    return [vlm.question_prefix(window, q) for q in QUESTIONS[:n]]


def unshared(prefixes):
    return [replace(p, window=None) for p in prefixes]


@pytest.mark.parametrize("keep_seed", [None, 3])          # every token, and pruned
@pytest.mark.parametrize("n", [5, 2])                     # 5: padding rows (bucket 8); 2: a full bucket
@torch.no_grad()
def test_shared_window_equals_whole_prefixes(vlm, keep_seed, n):
    prefixes = question_prefixes(vlm, keep_seed, n)
    calls = []
    original = vlm.pool._prefill_shared
    vlm.pool._prefill_shared = lambda *a: calls.append(a[2]) or original(*a)
    try:
        shared = vlm.generate(prefixes, max_new_tokens=6, return_logits=True)
    finally:
        del vlm.pool._prefill_shared
    assert len(calls) == 1 and calls[0] == [prefixes[0].window]      # the shared path ran, over the window
    whole = vlm.generate(unshared(prefixes), max_new_tokens=6, return_logits=True)
    assert torch.equal(shared.tokens, whole.tokens) and shared.lengths == whole.lengths
    assert_steps_close(shared.step_logits, whole.step_logits)
    for b, prefix in enumerate(prefixes):
        reference = vlm.generator.logits_without_cache(prefix, shared.tokens[b, :5])   # (6, V)
        assert_steps_close([s[b] for s in shared.step_logits], list(reference))


@torch.no_grad()
def test_unpadded_shapes_without_graphs(vlm):
    """cuda_graphs off: the window and the questions are not padded, the rows not bucketed."""
    plain = rewrap(vlm, cuda_graphs=False)
    prefixes = question_prefixes(plain, 5, 3)
    n = prefixes[0].window.embeds.shape[0]
    suffix = max(p.embeds.shape[0] for p in prefixes) - n
    assert plain.pool._shared_shape(n, suffix, 3) == (n, suffix, 3, False)
    assert vlm.pool._shared_shape(n, suffix, 3)[:3] == (-(-n // 64) * 64, -(-suffix // 16) * 16, 4)
    out = plain.generate(prefixes, max_new_tokens=4, return_logits=True)
    whole = plain.generate(unshared(prefixes), max_new_tokens=4, return_logits=True)
    assert torch.equal(out.tokens, whole.tokens)
    assert_steps_close(out.step_logits, whole.step_logits)


@torch.no_grad()
def test_cache_reuse_across_windows_and_layouts(vlm):
    """One decoder serves a shared call, a whole-prefix call and a shared call over another window
    (the suffix slots start elsewhere): nothing a call leaves in the cache reaches the next."""
    first = question_prefixes(vlm, 1, 4, T=4)
    second = question_prefixes(vlm, None, 3, T=2)
    want = [vlm.generate(unshared(p), max_new_tokens=5).tokens for p in (first, second, first)]
    got = [vlm.generate(p, max_new_tokens=5).tokens for p in (first, second, first)]
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def three_windows(vlm):
    """Prefixes over three windows (pruned, every token, another size), interleaved, not in runs."""
    specs = [(make_frames(4, 84, 112, seed=50), 6, QUESTIONS[:2]),
             (make_frames(2, 84, 112, seed=51), None, QUESTIONS[2:5]),
             (make_frames(6, 56, 84, seed=52), 7, QUESTIONS[1:2])]
    groups = []
    for frames, seed, questions in specs:
        keep = None if seed is None else random_keep(vlm, frames, seed=seed)
        window = vlm.window_prefix(frames, keep, vlm.encoder.merged_tokens([frames])[0])
        groups.append(vlm.question_prefixes(window, questions))
    order = [(1, 0), (0, 0), (2, 0), (1, 1), (0, 1), (1, 2)]
    return [groups[g][i] for g, i in order]


@torch.no_grad()
def test_several_windows_equal_whole_prefixes(vlm):
    prefixes = three_windows(vlm)
    shared = vlm.generate(prefixes, max_new_tokens=5, return_logits=True)
    whole = vlm.generate(unshared(prefixes), max_new_tokens=5, return_logits=True)
    assert torch.equal(shared.tokens, whole.tokens)
    assert_steps_close(shared.step_logits, whole.step_logits)


@pytest.mark.cuda
@torch.no_grad()
def test_graph_replay_equals_eager(cuda_pair):
    graphed, eager = cuda_pair
    for keep_seed, n, T in [(2, 5, 4), (None, 3, 2), (4, 5, 4)]:    # the third replays the first's graphs
        prefixes = question_prefixes(graphed, keep_seed, n, T)
        got = graphed.generate(prefixes, max_new_tokens=6, return_logits=True)
        want = eager.generate(unshared(prefixes), max_new_tokens=6, return_logits=True)
        assert torch.equal(got.tokens, want.tokens)
        assert_steps_close(got.step_logits, want.step_logits, atol=1e-4, rtol=1e-3)
    prefixes = three_windows(graphed)
    got = graphed.generate(prefixes, max_new_tokens=6, return_logits=True)
    want = eager.generate(unshared(prefixes), max_new_tokens=6, return_logits=True)
    assert torch.equal(got.tokens, want.tokens)
    assert_steps_close(got.step_logits, want.step_logits, atol=1e-4, rtol=1e-3)
    decoders = list(graphed.pool._decoders.values())
    assert any(("window", 1, 64) in d.prefill_graphs for d in decoders)
    assert any(("window", 3, 64) in d.prefill_graphs for d in decoders)
    assert any(any(isinstance(k, tuple) and k[0] == "suffix" for k in d.prefill_graphs) for d in decoders)
