"""The decision side of core: the StartLux-Decision scorer and its prompt format.

Names are loaded on first use, so that the torch-free modules (`protocol`, `config`, `jevfmt`, `synthetic`)
import without torch: the Ingress parses requests with `jevfmt` into `protocol`'s records and never runs a
model.
"""
import importlib

_WHERE = {
    "DecisionConfig": "config",
    "FormatError": "jevfmt", "MAX_OPTIONS": "jevfmt", "QuestionTooLong": "jevfmt", "check_tokenizer": "jevfmt",
    "from_systemone": "jevfmt", "render_ids": "jevfmt",
    "linear_attention_kernels": "kernels",
    "DecisionValidationError": "protocol", "SlowKernelsError": "scorer", "StartLuxDecision": "scorer",
    "padded_length": "scorer",
}
__all__ = sorted(_WHERE) + ["jevfmt"]


def __getattr__(name: str):
    if name == "jevfmt":
        return importlib.import_module(".jevfmt", __name__)
    if name not in _WHERE:
        raise AttributeError(f"module 'core.decision' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
