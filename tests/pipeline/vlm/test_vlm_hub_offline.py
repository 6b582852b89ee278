"""A Hub id without a reachable Hub: one line in seconds when the model is not cached, the cached
snapshot when it is; never Hugging Face's half a minute of logged retries.

Each case runs load_vlm in a subprocess whose HF_HOME is an empty (or hand-made) cache in tmp_path
and whose HF_ENDPOINT is a closed loopback port, so nothing reaches the network."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2] / "live"))
from live_servers import free_port  # noqa: E402

REPO = Path(__file__).parents[3]
SCRIPT = """
import sys, time
from pipeline.vlm import VLMLoadError, load_vlm
start = time.monotonic()
try:
    vlm = load_vlm(sys.argv[1], device="cpu", dtype="float32")
    print(f"loaded {vlm.family}")
except VLMLoadError as e:
    print(e, file=sys.stderr)
print(f"{time.monotonic() - start:.2f}")
"""


def load_offline(spec: str, hf_home: Path) -> tuple[list[str], list[str], float]:
    """(stdout lines, stderr lines, seconds load_vlm took) of load_vlm(spec) with the Hub unreachable."""
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}"}
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        env.pop(name, None)
    done = subprocess.run([sys.executable, "-c", SCRIPT, spec], capture_output=True, text=True, timeout=60,
                          cwd=REPO, env=env)
    assert done.returncode == 0, done.stderr
    out = done.stdout.splitlines()
    return out[:-1], done.stderr.splitlines(), float(out[-1])


def test_uncached_model_fails_in_seconds_with_one_line(tmp_path):
    out, err, seconds = load_offline("arrcoc-no-such-org/no-such-vlm", tmp_path / "hf")
    assert out == [] and len(err) == 1, err
    assert err[0].startswith("VLM 'arrcoc-no-such-org/no-such-vlm' is not in the local Hugging Face cache")
    assert str(tmp_path / "hf") in err[0] and "cannot be reached: connection refused" in err[0]
    assert seconds < 10.0


def test_cached_model_loads_from_the_cache_without_retries(tmp_path):
    from pipeline.vlm.loading import build_tiny_vlm

    # the Hub cache's layout: models--ORG--NAME/snapshots/REV/<files>, refs/main naming REV
    repo = tmp_path / "hf" / "hub" / "models--arrcoc-test--tiny-vlm"
    snapshot = repo / "snapshots" / ("0" * 40)
    tiny = build_tiny_vlm("qwen2_vl")
    tiny.model.save_pretrained(snapshot)
    tiny.tokenizer.save_pretrained(snapshot)
    (snapshot / "preprocessor_config.json").write_text(json.dumps({"resample": 3}))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    out, err, seconds = load_offline("arrcoc-test/tiny-vlm", tmp_path / "hf")
    assert out == ["loaded qwen2_vl"] and not any("Retrying" in line for line in err), err
    assert seconds < 10.0
