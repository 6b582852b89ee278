"""A loopback RTSP server for the live tests: a moving test pattern as H.264 over RTSP.

Runs under the system Python (/usr/bin/python3), which has GStreamer's introspection bindings
(Debian: python3-gi, gir1.2-gst-rtsp-server-1.0, gstreamer1.0-plugins-{base,good,ugly}); the
project's venv Python cannot import them. Prints "READY rtsp://127.0.0.1:PORT/MOUNT" on stdout
once it listens, then serves until SIGTERM / SIGINT.

    /usr/bin/python3 tests/live/rtsp_server.py --port 8554 --mount cam --size 160x120 --fps 20
"""
import argparse
import signal
import sys

import gi

gi.require_version("Gst", "1.0")
gi.require_version("GstRtspServer", "1.0")
from gi.repository import GLib, Gst, GstRtspServer  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--mount", action="append", default=None, help="mount point (repeatable)")
    p.add_argument("--size", default="160x120")
    p.add_argument("--fps", type=int, default=20)
    args = p.parse_args()
    width, height = (int(v) for v in args.size.split("x"))
    Gst.init(None)
    missing = [e for e in ("videotestsrc", "x264enc", "rtph264pay") if Gst.ElementFactory.find(e) is None]
    if missing:
        print(f"MISSING GStreamer elements: {', '.join(missing)}", flush=True)
        return 3
    server = GstRtspServer.RTSPServer()
    server.set_address("127.0.0.1")
    server.set_service(str(args.port))
    mounts = server.get_mount_points()
    for mount in args.mount or ["cam"]:
        factory = GstRtspServer.RTSPMediaFactory()
        # is-live: frames come at the real frame rate; a keyframe every second so a (re)connecting
        # client starts decoding within a second.
        factory.set_launch(
            f"( videotestsrc is-live=true pattern=ball ! video/x-raw,width={width},height={height},"
            f"framerate={args.fps}/1 ! x264enc tune=zerolatency speed-preset=ultrafast key-int-max={args.fps} "
            f"bitrate=500 ! rtph264pay name=pay0 pt=96 config-interval=1 )")
        factory.set_shared(True)
        mounts.add_factory(f"/{mount}", factory)
    if server.attach(None) == 0:
        print(f"FAILED to listen on 127.0.0.1:{args.port}", flush=True)
        return 4
    loop = GLib.MainLoop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        GLib.unix_signal_add(GLib.PRIORITY_DEFAULT, sig, loop.quit)
    for mount in args.mount or ["cam"]:
        print(f"READY rtsp://127.0.0.1:{args.port}/{mount}", flush=True)
    loop.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
