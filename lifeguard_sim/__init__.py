"""A lifecycle-faithful stand-in for vLLM 0.32's, 0.33's and 0.34's HTTP server, with fault injection.

Layers, each module one concern, each importing only those listed before it:

* ``versions``  -- what differs between the vLLM releases (``--vllm-version``).
* ``faults``    -- parses ``OP:KIND[@N|@pP]`` specs and decides, per call, which fault fires.
* ``memory``    -- simulated GPU memory (weights, KV pool, overhead, host backups) and the atomic ``--gpu-file``
  writer.
* ``settings``  -- the frozen ``SimSettings`` every other part is handed.
* ``textgen``   -- a deterministic toy tokenizer and token stream (normal, garbled, degenerate).
* ``prefix_cache``, ``checkpoint``, ``fault_tolerance`` -- the prefix cache and the KV connector's offload tier, 0.34's
  checkpoint states, 0.34's fault-tolerance status.
* ``errors``    -- vLLM's error bodies (OpenAI envelope, FastAPI validation, plain strings).
* ``scheduler`` -- tracked requests, the pause state, and weight-version spans.
* ``engine_core`` -- the engine's state with no HTTP: sleep tags, pause state, weights, caches, counters and the
  ``violations`` list, the fault-aware frame operations run in, process death and restart.
* ``engine``    -- the operations on it (sleep, pause, weights, LoRA, elastic EP, checkpoint). Everything observable
  is decided in these two.
* ``metrics``   -- renders the engine's numbers as vLLM's Prometheus text.
* ``routes_*``  -- aiohttp handlers that only translate HTTP to engine calls and back.
* ``app``       -- ``create_sim_app``: wiring, the dead-process behaviour, shutdown.
* ``cli``       -- ``vllm-lifeguard sim``.
"""
