import signal
import sys

try:
    from .commands.cli import main
except KeyboardInterrupt:          # Ctrl-C before the command began: nothing was written
    sys.exit(130)

code = main()
# the command is over and its store closed: a late Ctrl-C / SIGTERM must not change how it exits
for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, signal.SIG_IGN)
sys.exit(code)
