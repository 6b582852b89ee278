"""The whole suite: under pytest-xdist (`make test`: one worker per core) each worker, and every process
it starts, computes on one thread.

torch's CPU kernels use a thread per core by default (OpenMP, whose idle threads spin before they
sleep). N workers of N threads each on N cores keep N * N threads busy: measured on 2 loaded cores, a
training test took 5x the CPU and 5x the wall time at 2 threads than at 1. OMP_NUM_THREADS set by hand
wins; a plain `pytest` (one process, `make test-serial`) keeps torch's default.
"""
from __future__ import annotations

import os
import sys

if os.environ.get("PYTEST_XDIST_WORKER") and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"          # this worker's torch, and the processes the tests start
    if "torch" in sys.modules:                   # already imported (by a plugin): its pool is sized already
        sys.modules["torch"].set_num_threads(1)
