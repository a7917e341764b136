# SPDX-License-Identifier: Apache-2.0
"""Benchmarks: long-context quality under eviction, against the same engine without eviction."""
