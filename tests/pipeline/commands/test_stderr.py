"""What a command prints on stderr when it is piped (a log, CI, `2> file`): its own lines, no
library's progress bars between them."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from sources.synthetic import Shot, render_clip, write_video

ROOT = Path(__file__).resolve().parents[3]


def test_a_piped_run_with_the_shipped_model_prints_no_progress_bars(tmp_path):
    video = write_video(tmp_path / "clip.mp4", render_clip([Shot("moving_object", 10)], height=64, width=96,
                                                            seed=1).frames, fps=10)
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_DISABLE_PROGRESS_BARS"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-m", "pipeline", "run", str(video), "--query", "what color is it?",
                           "--vlm", "arrcoc-synth-qa", "--device", "cpu", "--out", str(tmp_path / "o.zarr")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "Loading weights" not in proc.stderr and "\r" not in proc.stderr, proc.stderr
