"""Where engines meet: several engines on shared GPUs, of this proxy or of other pods on the node.

Owns: the arbiter (who may wake where, and room made before a wake), the swap rules (sans-IO memory admission) and
the node's GPU lock files. Each engine's own lifecycle stays with its coordinator (`lifecycle/`).
May import: lifecycle, config, gpu, observe, errors.
Door: arbiter, gpu_lock.
"""
