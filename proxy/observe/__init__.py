"""What the proxy tells operators: metrics, logs, the unknown-route labels and the `status` command.

Owns: the Prometheus registry and every series (`metrics`, `request_metrics`), the log set-up (`logs`), counting
routes no table classifies (`unknown_routes`), `vllm-lifeguard status` (`status_cli`) and the admin token a
command-line client sends (`admin_token`). Decides nothing.
May import: nothing of the proxy.
Door: metrics, version_metrics (the weight versions' families), logs, unknown_routes, status_cli (the command),
admin_token (what a command-line client sends).
"""
