"""Trace-time checks of hyper-parameters and extras: clear errors instead of NaN or garbage.

They run when a function is traced (before anything is compiled), on Python values; traced
hyper-parameters (passed as jit arguments) are not checked.
"""

import numbers


def _is_static(x):
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def check_unit(name, value):
    if _is_static(value) and not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must lie in [0, 1], got {value}")


def check_positive(name, value):
    if _is_static(value) and not value > 0:
        raise ValueError(f"{name} must be > 0, got {value}")


def check_choice(name, value, choices):
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def require(batch, field, who, what):
    """``batch.extras[field]`` or a ValueError naming the missing field and its shape."""
    if field not in batch.extras:
        have = sorted(batch.extras) or "none"
        raise ValueError(f"{who} needs extras['{field}'] ({what}); the batch has extras: {have}")
    return batch.extras[field]


def check_nonneg(name, value):
    """A scale whose sign would invert the method must be >= 0."""
    if _is_static(value) and not value >= 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
