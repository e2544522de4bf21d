"""omni-stream on a Ray cluster (Ray Serve): ``omni-stream serve --ray ADDRESS``.

- ``replica``: the Serve deployment. Each replica is one whole omni-stream server (the aiohttp
  app, its pipeline's stage processes, its profile measured on its node); the replica's ASGI
  ingress forwards every request and WebSocket to that app on the same node, so the cluster speaks
  exactly the single-server API, from the same code.
- ``router``: Serve's request router for it, ranking replicas by free real-time capacity.
- ``registry``: one actor on the head node: the voice store every replica reads (persisted on
  the head's disk), the replica directory /metrics and /health aggregate over, and the
  replicas' pipeline records it reaps killed replicas by.
- ``reap``: what a killed replica leaves on its node (stage processes, shared-memory
  segments) and its removal.
- ``launch``: connect to (or start) Ray, deploy, serve until Ctrl-C, tear down.
- ``autoscale``: Serve's autoscaling policy on real-time capacity in use.
- ``forward``: the ASGI -> aiohttp forwarding (HTTP streams and WebSockets, bytes unchanged).
- ``entry``: the middleware in Serve's proxy that keeps the single server's error contract.
- ``aggregate``: the cluster-wide /health and /metrics.

Needs the ``cluster`` extra (``pip install omni-stream[cluster]``); nothing outside this
package imports ray.
"""
