"""The Ray object store's use, read from outside a run (tests/test_soak.py).

    python -m tests.object_store_probe GCS_ADDRESS [INTERVAL_S]

prints one JSON line per interval until its stdin closes: ``used`` (bytes in use), ``objects``
(objects held), ``primary`` (bytes of primary copies), ``fallback`` (bytes in the filesystem
fallback), ``spilled`` (bytes spilled so far). It asks the node's raylet for the same store
statistics ``ray memory --stats-only`` prints (``FormatGlobalMemoryInfo``), in a process of its
own: it joins no cluster as a driver and changes nothing in the test process's Ray. A cluster
started with token auth needs its ``RAY_AUTH_MODE`` and ``RAY_AUTH_TOKEN`` in this environment.
"""

from __future__ import annotations

import json
import sys
import threading
import time


def main(gcs_address: str, interval_s: float) -> None:
    from ray._raylet import Config

    Config.initialize("")  # the auth mode from the environment (Ray caches it at import)
    from ray._private.internal_api import get_memory_info_reply, get_state_from_address

    for attempt in range(30):  # the GCS may still be starting when the raylet's process is seen
        try:
            state = get_state_from_address(gcs_address)
            raylet = next(n for n in state.node_table() if n["Alive"])
            break
        except Exception:
            if attempt == 29:
                raise
            time.sleep(1.0)
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    while not stop.is_set():
        try:
            s = get_memory_info_reply(state, raylet["NodeManagerAddress"], raylet["NodeManagerPort"],
                                      timeout_seconds=10).store_stats
            line = {"t": time.time(), "used": s.object_store_bytes_used, "objects": s.num_local_objects,
                    "primary": s.object_store_bytes_primary_copy, "fallback": s.object_store_bytes_fallback,
                    "spilled": s.spilled_bytes_total}
        except Exception as e:  # the cluster going away at the run's end: say so, keep polling until told to stop
            line = {"t": time.time(), "error": f"{type(e).__name__}: {str(e)[:200]}"}
        print(json.dumps(line), flush=True)
        stop.wait(interval_s)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 1.0)
