"""How conv weights are named in a safetensors checkpoint: the rule the server loads by and the load tester's
``--verify`` reads by.

A conv layer is a key ``...layers.<i>.<anything>conv1d.weight`` of shape ``(dim, 1, width)`` or ``(dim, width)``
(Mamba/Mamba2/Nemotron-H ``backbone.layers.<i>.mixer.conv1d``, Qwen3-Next ``model.layers.<i>.linear_attn.conv1d``
and the like), with an optional ``conv1d.bias`` ``(dim,)`` beside it. Other keys are ignored.
"""

from __future__ import annotations

import re
from typing import Optional

CONV_WEIGHT_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:.*\.)?conv1d\.weight$")


def conv_layer_keys(keys) -> dict[int, tuple[str, Optional[str]]]:
    """``model layer index -> (weight key, bias key or None)`` for every conv layer among ``keys``.

    Raises ``ValueError`` when one layer has two conv weights.
    """
    keys = set(keys)
    found: dict[int, tuple[str, Optional[str]]] = {}
    for key in sorted(keys):
        m = CONV_WEIGHT_KEY.search(key)
        if m is None:
            continue
        layer = int(m.group(1))
        if layer in found:
            raise ValueError(f"weights: two conv1d weights for layer {layer}: {found[layer][0]} and {key}")
        bkey = key[: -len("weight")] + "bias"
        found[layer] = (key, bkey if bkey in keys else None)
    return dict(sorted(found.items()))
