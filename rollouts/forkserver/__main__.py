"""`python -m rollouts.forkserver SOCKET PARENT_PID PADDING [MODULE ...]`: `server.main`."""

from rollouts.forkserver.server import main

main()
