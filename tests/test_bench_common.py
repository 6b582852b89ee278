"""benchmarks/common.py: the host description multi-GPU benchmark results record."""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import host_topology  # noqa: E402


def test_host_topology_names_cpus_and_numa_nodes():
    info = host_topology()
    assert info["cpus"] == os.cpu_count() and info["cpu"]
    if Path("/sys/devices/system/node/node0/cpulist").exists():              # Linux
        cpus = set()
        for text in info["numa_nodes"].values():                             # e.g. "0-15,32-47"
            for part in text.split(","):
                lo, _, hi = part.partition("-")
                cpus |= set(range(int(lo), int(hi or lo) + 1))
        assert len(cpus) >= 1 and "node0" in info["numa_nodes"]
    assert all(isinstance(line, str) for line in info.get("nvidia_smi_topo", []))
