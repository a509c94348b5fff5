"""One multi-process launch per pytest run, shared by the tests of a module.

Under pytest-xdist every worker that runs a test of the module would start its own launch;
the workers share this run's base directory, so the first one launches and the others wait
for its files (the directory is new for every pytest run: nothing stale is reused).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Callable

from filelock import FileLock


def launch_once(tmp_path_factory, name: str, launch: Callable[[Path], None]) -> Path:
    """The folder in which ``launch(folder)`` has run exactly once in this pytest run."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        out = tmp_path_factory.getbasetemp().parent / f"{name}_shared"
    else:
        out = tmp_path_factory.mktemp(name)
    out.mkdir(exist_ok=True)
    with FileLock(str(out / "launch.lock")):
        if not (out / "done").exists():
            launch(out)
            (out / "done").write_text("ok")
    return out


def free_port() -> int:
    """A TCP port on the loopback that is free now, for a launch's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
