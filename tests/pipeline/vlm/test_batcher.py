"""VLMBatcher's gathering, with an answer function in place of a VLM."""
from types import SimpleNamespace

from pipeline.vlm.batcher import VLMBatcher

VLM = SimpleNamespace(config=SimpleNamespace(max_batch=4, max_wait_s=0.0))


def echo(items):
    return [f"answer {x}" for x in items]


def test_max_batch_and_the_wait_bound_a_batch():
    with VLMBatcher(VLM, max_batch=2, max_wait_s=0.3, answer=echo) as b:
        futures = [b.submit(x) for x in "abc"]
        assert [f.result(timeout=10) for f in futures] == ["answer a", "answer b", "answer c"]
    # two at most a batch (the first waits up to 0.3 s for the second); the third goes alone
    assert b.batch_sizes == [2, 1]
    assert [len(t.queued_s) for t in b.timings] == [2, 1]
