"""``python -m omni_stream.server``: the server over FakeBackend (a chirp, no model), for client
development and protocol checks. The real backend is served by ``omni-stream serve``."""

from __future__ import annotations

import argparse
import logging

from omni_stream.server.app import run_server
from omni_stream.server.fake_backend import FakeBackend
from omni_stream.server.settings import add_arguments, from_args


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m omni_stream.server", description=__doc__)
    add_arguments(p)
    p.add_argument("--frame-delay", type=float, default=0.02,
                   help="seconds per fake 80 ms frame (0.08: real time)")
    p.add_argument("--max-streams", type=int, default=None, help="stream slots (default: no cap)")
    p.add_argument("--max-queue", type=int, default=16,
                   help="requests that may wait for a slot; more get 429 at once")
    p.add_argument("--queue-timeout", type=float, default=10.0,
                   help="seconds a queued request waits before it gets 503")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    backend = FakeBackend(frame_delay=a.frame_delay, max_streams=a.max_streams,
                          max_queue=a.max_queue, queue_timeout=a.queue_timeout)
    run_server(backend, a.host, a.port, from_args(a))


if __name__ == "__main__":
    main()
