"""Talking to vLLM and reading what it answers.

Owns: the aiohttp control client (`vllm_client.VllmClient`: lifecycle and read-only calls), the raw keep-alive
pool the data plane forwards on (`pool`) and what forwarding to one vLLM needs (`forwarding.Upstream`), a transport
failure in words (`failures`), reading vLLM's refusals, its elastic-EP gate and its flags (`observation`).
Decides nothing about what an answer means for the engine: that is `lifecycle/`.
May import: errors, tasks.
Door: vllm_client, pool, forwarding, failures, refusals, elastic_ep, observation.
"""
