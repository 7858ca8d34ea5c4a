"""torchft's lighthouse, served until this process is ended: ``python ember/lighthouse.py HOST:PORT``.

``ember run --replica-groups`` runs this file by its path, so that nothing of Ember or torch is imported: the
lighthouse is a Rust server in torchft's extension module, which is loaded alone (importing the ``torchft``
package would import torch, seconds at every start).
"""

from __future__ import annotations

import importlib.util
import signal
import sys
from importlib import metadata

#: A replica group that sends no heartbeat for this long is taken for dead: its peers wait that long after it fails.
HEARTBEAT_TIMEOUT_MS = 2000
#: How long a quorum waits for groups that have started but not asked for it yet.
JOIN_TIMEOUT_MS = 5000


def serve(bind: str) -> None:
    distribution = metadata.distribution("torchft-nightly")
    extension = next(file for file in distribution.files or [] if str(file).startswith("torchft/_torchft."))
    spec = importlib.util.spec_from_file_location("torchft._torchft", str(distribution.locate_file(extension)))
    assert spec is not None and spec.loader is not None
    torchft = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(torchft)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the groups; the launcher then ends this process
    server = torchft.LighthouseServer(bind=bind, min_replicas=1, join_timeout_ms=JOIN_TIMEOUT_MS,
                                      quorum_tick_ms=100, heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS)  # fmt: skip
    while server is not None:  # until a signal ends the process
        signal.pause()


if __name__ == "__main__":
    serve(sys.argv[1])
