# SPDX-License-Identifier: Apache-2.0
"""Test helpers that ship with the package: offline test models and a ``vllm serve`` runner."""
