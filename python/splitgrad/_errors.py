"""splitgrad's exception and warning types.

Argument errors subclass both the precise built-in type (ValueError, TypeError) and RuntimeError,
which is what PyTorch's own operators raise, so either ``except`` clause catches them.
"""


class ArgumentError(ValueError, RuntimeError):
    """An argument has the wrong shape, size or value (the message says expected and actual)."""


class DTypeError(TypeError, RuntimeError):
    """An argument has the wrong dtype (the message says expected and actual)."""


class MainGradError(ArgumentError):
    """fuse_wgrad_accumulation=True without a valid ``param.main_grad``."""


class PendingWgradError(RuntimeError):
    """Deferred wgrad work is pending where it must not be (policy ``"error"``)."""


class PendingWgradWarning(UserWarning):
    """Deferred wgrad work is pending where it should not be (policy ``"warn"``)."""
