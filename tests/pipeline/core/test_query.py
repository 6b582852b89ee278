"""pipeline.core.query: the shared MiniLM encoder."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

# In a fresh interpreter (nothing has imported transformers yet), eight threads ask for the encoder
# at once, as the first videos in flight of a batch shard whose VLM lives in another process do.
RACE = r'''
import threading
from pipeline.core.query import sentence_encoder
got, errors = [], []
start = threading.Barrier(8)
def ask():
    start.wait()
    try:
        got.append(sentence_encoder("cpu"))
    except Exception as e:
        errors.append(repr(e))
threads = [threading.Thread(target=ask) for _ in range(8)]
for t in threads: t.start()
for t in threads: t.join()
assert not errors, errors
assert len(got) == 8 and all(e is got[0] for e in got), "more than one encoder was built"
print(got[0].encode("a red square").shape)
'''


def test_threads_asking_at_once_share_one_encoder():
    done = subprocess.run([sys.executable, "-c", RACE], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "torch.Size([384])"
