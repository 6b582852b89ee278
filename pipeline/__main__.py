import signal
import sys

from .commands.cli import main

code = main()
# the command is over and its store closed: a late Ctrl-C / SIGTERM must not change how it exits
for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, signal.SIG_IGN)
sys.exit(code)
