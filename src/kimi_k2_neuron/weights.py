"""Single-pass, strict weight loading: checkpoint logical weights -> model parameters of the same name.

Strict in both directions (a missing parameter or an unexpected tensor is an error listing them) and checked
against config.json shapes before anything is copied. Each tensor is dequantized, sliced for this rank and
copied, then dropped, so peak memory is the model plus one weight.
"""

from __future__ import annotations

from torch import nn

from .checkpoint.source import WeightSource
from .errors import KimiInputError, listing
from .formats.layout import logical_shapes
from .progress import bar as progress_bar


def owned_params(model: nn.Module, prefix: str = ""):
    """name -> (module, param) for every parameter under `prefix`."""
    out = {}
    for mod_name, mod in model.named_modules():
        for p_name, p in mod.named_parameters(recurse=False):
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            if full.startswith(prefix):
                out[full] = (mod, p)
    return out


def full_shape(name: str, mod: nn.Module, param) -> tuple[int, ...]:
    """The checkpoint shape of parameter `name`: a weight sharded across ranks is stored whole (`full_shape`)."""
    return tuple(getattr(mod, "full_shape", param.shape)) if name.endswith(".weight") else tuple(param.shape)


def load_weights(model: nn.Module, source: WeightSource, prefix: str = "", progress: bool = False) -> None:
    params = owned_params(model, prefix)
    names = source.names(prefix)  # callers pass prefixes ending in "." so layer 1 never matches layer 10
    _check_names(source, names, params)
    for name in progress_bar(names, desc="loading weights", unit="tensor", disable=not progress, leave=False):
        mod, param = params[name]
        _check_shape(source, name, mod, param)
        full = source.get(name, param.dtype)
        ctx = getattr(mod, "ctx", None)
        shard_dim = getattr(mod, "shard_dim", None) if name.endswith(".weight") else None  # as in full_shape
        param.data.copy_(ctx.shard(full, shard_dim) if ctx is not None else full)


def _check_names(source: WeightSource, names: list[str], expected) -> None:
    """The checkpoint's tensor names against the ones `expected` holds: one line for the first kind of difference."""
    unexpected = [n for n in names if n not in expected]
    if unexpected:
        raise KimiInputError(f"{source.dir}: {len(unexpected)} tensor(s) the model has no place for: "
                             f"{listing(unexpected)}")
    missing = sorted(set(expected) - set(names))
    if missing:
        raise KimiInputError(f"{source.dir}: {len(missing)} tensor(s) missing from the checkpoint: "
                             f"{listing(missing)}")


def check_against_config(source: WeightSource) -> None:
    """Every logical weight's name and stored shape against what config.json describes (formats.layout), before
    any model is built: a config whose sizes the checkpoint does not hold (hidden_size 10^12) is one line naming a
    tensor, not an allocation of the model it describes."""
    want = logical_shapes(source.cfg)
    _check_names(source, source.names(), want)
    for name, shape in want.items():
        _check_stored(source, name, shape)


def _check_shape(source: WeightSource, name: str, mod, param) -> None:
    _check_stored(source, name, full_shape(name, mod, param))


def _check_stored(source: WeightSource, name: str, expected: tuple[int, ...]) -> None:
    w = source.weights[name]
    if w.kind == "int4":  # packed: the logical shape is stored in weight_shape, so that is the tensor to name
        named, says = w.raw[2], "says shape"
        shape_t = source.ckpt.get(named)
        if shape_t.dim() != 1:  # a [1, 2] tensor would make int() fail on a list
            raise KimiInputError(f"{source.ckpt.info(named).shard}: tensor {named} has shape "
                                 f"{list(shape_t.shape)}, expected a 1-D [out, in]")
        got = tuple(int(v) for v in shape_t.tolist())
    else:
        named, says = w.raw[0], "has shape"
        got = tuple(source.ckpt.info(named).shape)
    if got != expected:
        raise KimiInputError(f"{source.ckpt.info(named).shard}: tensor {named} {says} {list(got)}, "
                             f"expected {list(expected)} from config.json")
