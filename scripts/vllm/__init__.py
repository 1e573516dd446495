"""Tools around a real vLLM: its install for the real-vLLM suite, its launcher, the route scan of its wheel."""
