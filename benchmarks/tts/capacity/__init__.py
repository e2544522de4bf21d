"""capacity_bench.py's parts: the requests it offers (offers), the steady-load check (steady) and
its report (report). The CLI is benchmarks/tts/capacity_bench.py."""
