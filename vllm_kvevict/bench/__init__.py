"""Benchmarks: long-context quality under eviction, against the same engine without eviction."""
