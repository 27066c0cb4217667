"""Benchmarks: flashtile side by side with torch's SDPA backends, measured in one run."""
