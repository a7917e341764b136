# SPDX-License-Identifier: Apache-2.0
"""Gather, scoring, selection and compaction operations over paged KV caches, with no knowledge of
vLLM or of policies (block tables, ragged rows and plain tensors in, tensors out).

:mod:`.torch_ops` is each operation in torch: the specification the other implementations are
tested against, and the implementation the CPU engine runs in production. :mod:`.triton_ops`
(Triton) and :mod:`.cuda_ops` (CUDA C++, ``csrc/``) implement the same operations; :mod:`.ops`
picks one per device (``KVEVICT_KERNELS``)."""
