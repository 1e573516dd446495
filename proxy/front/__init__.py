"""The front door: the data plane every request crosses.

Owns: the listening socket, reading each request once (llhttp), the one reading of its target, the route table and
the routing decision, the exchanges that forward a request to vLLM or answer it, held requests, the bytes the proxy
writes itself, the one error boundary, the admin token, readiness for routers, the status page, which engine serves
a model, and the set of engines one proxy guards. Owns no engine's state: it asks `lifecycle/` and `sharing/`.
May import: sharing, lifecycle, upstream, config, gpu, observe, errors, tasks, compiled (which build runs).
Door: dispatcher, engine_set, listener, model_directory, route_table, routing (for the wiring and `check`).
"""
