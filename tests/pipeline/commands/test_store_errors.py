"""A store that cannot be written (here: a full disk while a run takes its stream's lock) is bad
output like an unwritable --out: one line naming the store, exit 2, never a bare OSError (issue 41)."""
from __future__ import annotations

import errno
import os

from pipeline.commands.cli import main
from sources.synthetic import Shot, render_clip, write_video


def test_a_full_disk_while_locking_the_stream_exits_2_naming_the_store(capsys, tmp_path, monkeypatch):
    import sinks.stream_lock as stream_lock

    def full(target, data, atomic=False):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(target))

    video = write_video(tmp_path / "clip.mp4", render_clip([Shot("static", 6)], height=64, width=64, seed=0).frames,
                        fps=25)
    monkeypatch.setattr(stream_lock, "write_file", full)
    store = tmp_path / "out.zarr"
    code = main(["run", str(video), "--query", "q", "--out", str(store), "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.strip().splitlines() == [f"error: cannot lock stream 'clip' of {store} ({store / '.locks/clip.lock'}): "
                                        f"No space left on device"]
