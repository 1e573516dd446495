"""One engine's lifecycle: what the proxy holds true about it, and the one coordinator that changes it.

Owns: `Engine` (engine.py), the one door `front/` and `sharing/` call; the states and their machine, the record
(sans-IO), the rules table, parsed lifecycle calls and worker RPCs, the coordinator and the operations it runs under
its lock (sleep and wake, the weight updates, one call to vLLM), the verifier of every 200, the gate and the requests
in flight, the prefix cache's partition, the state file, the reconcile loop and the policies. Knows nothing of other
engines (`sharing/`) or of client connections (`front/`).
May import: upstream, config, gpu, observe, errors, tasks.
Door: engine (`Engine`, the one door); the vocabulary: states, parsed_calls, outcome, gate (the ticket),
rules (the sleep tags, staleness, wake targets), prefix_cache (reading a reset's answer), weight_version (the
vouched version and its spans, which every inference answer names), vllm_release (which release an engine is).
"""
