"""A lifecycle-faithful stand-in for vLLM 0.32's HTTP server, with fault injection.

Layers, each module one concern, each importing only those listed before it:

* ``settings``  -- the frozen ``SimSettings`` every other part is handed.
* ``faults``    -- parses ``OP:KIND[@N|@pP]`` specs and decides, per call, which fault fires.
* ``memory``    -- simulated GPU memory (weights, KV pool, overhead) and the atomic ``--gpu-file`` writer.
* ``textgen``   -- a deterministic toy tokenizer and token stream (normal, garbled, degenerate).
* ``engine``    -- the engine model with no HTTP: sleep tags, pause state, weights, held requests,
  counters and the ``violations`` list. Everything observable is decided here.
* ``errors``    -- vLLM's error bodies (OpenAI envelope, FastAPI validation, plain strings).
* ``metrics``   -- renders the engine's numbers as vLLM's Prometheus text.
* ``routes_*``  -- aiohttp handlers that only translate HTTP to engine calls and back.
* ``app``       -- ``create_sim_app``: wiring, the dead-process behaviour, shutdown.
* ``cli``       -- ``vllm-lifeguard sim``.
"""
