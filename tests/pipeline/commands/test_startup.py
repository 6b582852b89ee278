"""`--help` and one-line input errors come before the model code loads: neither torch nor
transformers is imported for them (each costs seconds on a small machine)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
HEAVY = ("torch", "transformers")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return env


def _imported(*args: str) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Run `python -X importtime ARGS`; the process and the top-level modules it imported."""
    proc = subprocess.run([sys.executable, "-X", "importtime", *args], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=120)
    modules = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    return proc, modules


def test_importing_the_cli_and_building_its_parsers_loads_neither_torch_nor_transformers():
    code = ("import sys; import pipeline.commands.cli as cli; cli.build_parser(); "
            f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True,
                         check=True, timeout=120).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("args", [["--help"], ["run", "--help"], ["demo", "--help"], ["batch", "--help"]])
def test_help_loads_neither_torch_nor_transformers(args):
    proc, modules = _imported("-m", "pipeline", *args)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage:" in proc.stdout
    assert not modules & set(HEAVY), sorted(modules & set(HEAVY))


@pytest.mark.parametrize("args, message", [
    (["run", "missing.mp4", "--query", "q"], "error: missing.mp4: no such file"),
    (["run", "missing.mp4"], "the following arguments are required: --query"),
    (["export", "x.zarr", "--format", "xml"], "invalid choice: 'xml'"),
])
def test_input_errors_are_one_line_before_the_model_code_loads(args, message):
    proc, modules = _imported("-m", "pipeline", *args)
    errors = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]
    assert proc.returncode == 2 and len(errors) == 1 and message in errors[0], errors
    assert not modules & set(HEAVY), sorted(modules & set(HEAVY))


def test_the_parsers_choices_match_the_code_that_uses_them():
    """cli.py writes these out so that building the parsers stays light; they must not drift."""
    from pipeline.commands import cli
    from pipeline.runners.batch import DATASETS, IN_FLIGHT
    from sinks.export import EXPORT_FORMATS
    from sinks.overlay import COLOUR_BY

    assert (cli.DATASETS, cli.IN_FLIGHT, cli.EXPORT_FORMATS, cli.COLOUR_BY) == (
        DATASETS, IN_FLIGHT, EXPORT_FORMATS, COLOUR_BY)
