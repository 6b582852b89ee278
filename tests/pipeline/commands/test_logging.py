"""The CLI decides what the library modules' loggers show: our packages' info and warnings on
stderr at default verbosity ("warning: ..." lines as before), debug with -v, nothing from
third-party loggers, and no duplicate lines when main() runs again in one process."""
from __future__ import annotations

import logging

import pytest

from pipeline.commands import cli


@pytest.fixture(autouse=True)
def restore_loggers():
    saved = {name: (logging.getLogger(name).level, list(logging.getLogger(name).handlers)) for name in cli.PACKAGES}
    yield
    for name, (level, handlers) in saved.items():
        logger = logging.getLogger(name)
        logger.setLevel(level)
        logger.handlers[:] = handlers


def test_default_verbosity_shows_info_and_warnings_as_one_line_each(capsys):
    cli._configure_logging(verbose=False)
    cli._configure_logging(verbose=False)                        # a second main() in this process
    logging.getLogger("pipeline.runners.batch").warning("skipped %s: %s", "video7", "not found")
    logging.getLogger("pipeline.serve.server").info("serving tiny-random on http://127.0.0.1:8000/")
    logging.getLogger("sinks.zarr_store").debug("a detail")
    logging.getLogger("some_library").warning("not ours")
    err = capsys.readouterr().err
    assert err == "warning: skipped video7: not found\nserving tiny-random on http://127.0.0.1:8000/\n"


def test_verbose_shows_debug(capsys):
    cli._configure_logging(verbose=True)
    logging.getLogger("sources.live").debug("reconnect attempt 3")
    assert capsys.readouterr().err == "reconnect attempt 3\n"


def test_main_configures_it(capsys, tmp_path):
    assert cli.main(["export", str(tmp_path / "missing.zarr"), "--format", "jsonl"]) == 2
    capsys.readouterr()
    logging.getLogger("pipeline.runners.run").warning("a note")
    assert capsys.readouterr().err == "warning: a note\n"
