"""Gather, scoring and compaction over vLLM's paged KV cache (torch reference paths for now)."""
