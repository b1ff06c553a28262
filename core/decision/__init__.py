"""The decision side of core: the StartLux-Decision scorer and its prompt format."""
from . import jevfmt
from .jevfmt import MAX_OPTIONS, FormatError, PromptTooLong, check_tokenizer, from_systemone, render_ids
from .kernels import fast_kernels_active, linear_attention_kernels
from .scorer import DecisionValidationError, SlowKernelsError, StartLuxDecision, padded_length

__all__ = ["DecisionValidationError", "FormatError", "MAX_OPTIONS", "PromptTooLong", "SlowKernelsError",
           "StartLuxDecision", "check_tokenizer", "fast_kernels_active", "from_systemone", "jevfmt",
           "linear_attention_kernels", "padded_length", "render_ids"]
