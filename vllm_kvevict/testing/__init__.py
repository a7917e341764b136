"""Test helpers that ship with the package: offline test models and a ``vllm serve`` runner."""
