"""`vllm-lifeguard check URL`: what a deployment of vLLM (and of the lifeguard in front of it) gets wrong in its
lifecycle, as a matrix of hazards (vLLM RFC #45585's RL matrix, and this project's "200 lie" catalogue).

One module per concern: `client` (HTTP with a deadline on every call), `target` (what is at a URL), `column`
(the engine's state and restoring it between rows), `scenarios` (what each row does and how it judges),
`matrix` (the rows), `run` (both columns), `report` (terminal, JSON, Markdown), `html` (the page), `cli` (the
command). A client of vLLM and of a lifeguard, never on the proxy's own path.
May import: front (the route table), gpu (the readers), lifecycle (reading a reset's answer), observe (the admin
token a command-line client sends), upstream (the wording of a transport failure), errors, and the package version.
Door: cli (the command).
"""
