"""`serve` as a new user meets it: without the `serve` extra, and without --vlm."""
from __future__ import annotations

import sys

import pytest

from pipeline.commands.cli import main


@pytest.mark.parametrize("module", ["fastapi", "uvicorn"])
def test_without_the_serve_extra_one_line_names_it(capsys, monkeypatch, module):
    monkeypatch.setitem(sys.modules, module, None)       # what `import fastapi` meets where it is not installed
    code = main(["serve", "--vlm", "tiny-random", "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert f"({module} not installed)" in err and "pip install 'arr-coc-video[serve]'" in err


def test_without_a_vlm_it_names_the_shipped_model(capsys):
    code = main(["serve", "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "--vlm" in err and "arrcoc-synth-qa" in err
