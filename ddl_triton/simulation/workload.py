"""Workloads for the scale-out simulator: a model as a list of layers (params, forward MACs).

``load_layers("resnet50")`` reads ddl_triton/models/<name>.json (the tables in shared/data:
{name, params, fwd_macs} per layer, forward order, 224x224 input); a path works too.
``layers_from_module(module, input_shape)`` builds the same list from any ``torch.nn.Module``
by running it once on the meta device (no memory is allocated and nothing is computed):
each leaf module's parameters are counted, and its multiply-adds per sample estimated from
its output shape (convolutions and linear layers exactly; normalisation, activation and
pooling at one per output element; anything else as 0).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from ._data_files import named_file

MODELS = Path(__file__).with_name("models")


@dataclass(frozen=True)
class Layer:
    name: str
    params: int
    fwd_macs: int   # multiply-adds per sample, forward


def load_layers(name_or_path: str) -> list[Layer]:
    rows = json.loads(named_file(name_or_path, MODELS, ".json", "model").read_text())
    return [Layer(r["name"], int(r["params"]), int(r["fwd_macs"])) for r in rows]


def layers_from_module(module, input_shape: tuple[int, ...]) -> list[Layer]:
    """Layers of ``module`` (forward order) for one input of ``input_shape`` (without batch).

    Example: ``layers_from_module(torch.nn.Linear(10, 5), (10,))`` ->
    ``[Layer("", 55, 50)]`` (10*5 weights + 5 biases; 50 multiply-adds per sample)."""
    import copy

    import torch

    # A module built under ``with torch.device("meta"):`` is used as it is (no memory at all);
    # any other is copied to the meta device, leaving the caller's module untouched.
    meta = module if all(p.device.type == "meta" for p in module.parameters()) else copy.deepcopy(module).to("meta")
    out: list[Layer] = []

    def hook(mod, inputs, output, name):
        params = sum(p.numel() for p in mod.parameters(recurse=False))
        shape = output.shape if isinstance(output, torch.Tensor) else None
        per_sample = math.prod(shape[1:]) if shape is not None and len(shape) > 1 else 0
        if isinstance(mod, torch.nn.Conv2d):
            kh, kw = mod.kernel_size
            macs = per_sample * (mod.in_channels // mod.groups) * kh * kw
        elif isinstance(mod, torch.nn.Linear):
            macs = per_sample * mod.in_features
        elif isinstance(mod, (torch.nn.BatchNorm2d, torch.nn.ReLU, torch.nn.MaxPool2d, torch.nn.AdaptiveAvgPool2d,
                              torch.nn.AvgPool2d, torch.nn.LayerNorm, torch.nn.GELU)):
            macs = per_sample
        else:
            macs = 0
        if params or macs:
            out.append(Layer(name, params, macs))

    handles = [m.register_forward_hook(lambda mod, i, o, name=name: hook(mod, i, o, name))
               for name, m in meta.named_modules() if not list(m.children())]
    try:
        with torch.no_grad():
            meta(torch.empty((1,) + tuple(input_shape), device="meta"))
    finally:
        for h in handles:
            h.remove()
    return out
