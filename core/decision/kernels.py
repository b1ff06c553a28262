"""Which implementation transformers picked for the linear-attention kernels of a model type.

transformers 5.x does not define `is_fast_path_available`: each kernel is a module-level function wrapped by
`use_kernel_func_from_hub_with_fallback`, which chose the fla / causal-conv1d implementation when the model module was imported, or kept the torch
reference. We read that choice from the wrapper; when the wrapper's shape is unknown we fall back to
checking that the kernel packages import.
"""
from __future__ import annotations

import importlib
import inspect

KERNELS = {   # kernel -> the package that provides the fast version
    "chunk_gated_delta_rule": "fla",
    "fused_recurrent_gated_delta_rule": "fla",
    "causal_conv1d_fn": "causal_conv1d",
    "causal_conv1d_update": "causal_conv1d",
}


def _chosen_implementation(fn) -> tuple[str, object] | None:
    """-> (kernel name, chosen implementation) for a fallback wrapper, else None."""
    seen = 0
    while fn is not None and seen < 5:
        try:
            nonlocals = inspect.getclosurevars(fn).nonlocals
        except TypeError:
            return None
        if "implementation" in nonlocals and "torch_function" in nonlocals:
            torch_fn = nonlocals["torch_function"]
            name = torch_fn.__name__.removeprefix("torch_").replace("recurrent_gated", "fused_recurrent_gated")
            return name, nonlocals["implementation"]
        fn, seen = getattr(fn, "__wrapped__", None), seen + 1
    return None


def modeling_module_name(model) -> str:
    """The transformers modeling module of a model class, or of a model type name ("qwen3_5")."""
    if isinstance(model, str):
        return f"transformers.models.{model}.modeling_{model}"
    return model.__module__


def linear_attention_kernels(model) -> dict[str, str]:
    """kernel name -> "fla", "causal_conv1d" or "torch" for a transformers model class (or model type name)."""
    try:
        modeling = importlib.import_module(modeling_module_name(model))
    except ImportError:
        return {}
    found: dict[str, str] = {}
    for value in vars(modeling).values():
        if not callable(value) or not inspect.isfunction(value):
            continue
        chosen = _chosen_implementation(value)
        if chosen and chosen[0] in KERNELS:
            name, impl = chosen
            module = getattr(impl, "__module__", "") or ""
            found[name] = KERNELS[name] if module.split(".")[0] == KERNELS[name] else "torch"
    present = [n for n in KERNELS if any(hasattr(modeling, a) for a in
                                         (n, "torch_" + n, n.replace("fused_recurrent", "torch_recurrent")))]
    if not found:
        for name in present:
            package = KERNELS[name]
            try:
                importlib.import_module(package)
                found[name] = package
            except Exception:
                found[name] = "torch"
    return found

