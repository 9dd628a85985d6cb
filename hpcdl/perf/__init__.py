"""Benchmarks and scaling tools."""
