"""`make bench`: the performance table of docs/performance.md (benchmarks/README.md says how to run each part)."""
