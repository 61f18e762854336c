"""recps benchmarks: `python -m benchmarks.<name>`; results go to benchmarks/RESULTS.md."""
