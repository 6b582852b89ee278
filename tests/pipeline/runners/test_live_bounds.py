"""`live`'s other user-given numbers, bounded by what they mean (issue 41: "bound every user-given
number"; `--every` is test_live_faults.py's): a --duration past a year and a --metrics-every that
is no status period are one line, exit 2, before anything is loaded or written, and so is a source
URL that is not one. They used to be accepted: from ~1e10 s the --duration timer's wait overflowed in
its thread (a traceback on stderr, and --duration was then ignored), --metrics-every 1e-300 printed
status lines as fast as it could, and `http://cam:99999/` was "error: ValueError: ...", exit 1."""
from __future__ import annotations

from pathlib import Path

import pytest

from arr_coc._validate import ConfigError
from pipeline.commands.cli import main
from pipeline.core.live_stages import DURATION_MAX_S, LiveOptions
from sources import SourceError
from sources.live import parse_source
from sources.synthetic import Shot, render_clip, write_video


@pytest.fixture(scope="module")
def clip(tmp_path_factory) -> Path:
    """2 s at 25 fps."""
    return write_video(tmp_path_factory.mktemp("bounds") / "two.mp4",
                       render_clip([Shot("pan", 50, speed=1.0)], height=64, width=64, seed=4).frames, fps=25)


def live(capsys, tmp_path: Path, *args: str) -> tuple[int, list[str]]:
    code = main(["live", *args, "--query", "q", "--vlm", "none", "--device", "cpu", "--out", str(tmp_path / "o.zarr"),
                 "--set", "runtime.model_weights=none"])
    return code, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize("option, message", [
    (["--duration", "1e10"], "--duration=10000000000.0 s is out of range: at most 3.1536e+07 s (a year"),
    (["--duration", "1e308"], "--duration=1e+308 s is out of range"),
    (["--metrics-every", "1e-300"], "--metrics-every=1e-300 is out of range; allowed: [0.1, 86400.0]"),
    (["--metrics-every", "1e10"], "--metrics-every=10000000000.0 is out of range"),
])
def test_numbers_that_mean_nothing_are_one_line(capsys, tmp_path, clip, option, message):
    code, err = live(capsys, tmp_path, str(clip), "--realtime", *option)
    assert code == 2 and len(err) == 1 and err[0].startswith(f"error: {message}"), err
    assert not (tmp_path / "o.zarr").exists()


def test_the_longest_duration_and_the_shortest_status_period_run(capsys, tmp_path, clip):
    code, err = live(capsys, tmp_path, str(clip), "--realtime", "--duration", str(DURATION_MAX_S),
                     "--metrics-every", "0.1")
    assert code == 0, err
    assert not any("Traceback" in line or "Error" in line for line in err), err
    assert LiveOptions(duration_s=DURATION_MAX_S, metrics_every_s=86_400.0).duration_s == DURATION_MAX_S
    with pytest.raises(ConfigError, match="--duration"):
        LiveOptions(duration_s=DURATION_MAX_S * 1.001)


@pytest.mark.parametrize("url, words", [
    ("http://user:hunter2@[::1/x.ts", "invalid live source URL 'http://user:***@[::1/x.ts': Invalid IPv6 URL"),
    ("http://cam:99999/x.ts", "invalid live source URL 'http://cam:99999/x.ts': Port out of range"),
    ("rtsp://cam:abc/x", "invalid live source URL 'rtsp://cam:abc/x': Port could not be cast"),
])
def test_a_url_that_is_not_one_is_one_line(capsys, tmp_path, url, words):
    with pytest.raises(SourceError, match="invalid live source URL"):
        parse_source(url)
    code, err = live(capsys, tmp_path, url)
    assert code == 2 and len(err) == 1 and err[0].startswith(f"error: {words}"), err
    assert "hunter2" not in " ".join(err) and not (tmp_path / "o.zarr").exists()
