"""Gradient compression for the wire, as Horovod's ``hvd.Compression``, written once: a
framework's module says only how it tells floating-point tensors and casts them."""


class NoneCompressor:
    """Sends tensors as they are."""

    @staticmethod
    def compress(tensor):
        """Returns ``tensor`` and no context."""
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        """Returns ``tensor``."""
        return tensor


class CastCompressor:
    """Sends floating-point tensors as ``wire`` (a framework's dtype); a subclass gives
    ``wire``, ``floating(tensor)`` and ``cast(tensor, dtype)``."""

    wire = None

    @classmethod
    def compress(cls, tensor):
        """Casts a floating-point ``tensor`` to ``wire``; the context is its dtype."""
        if cls.floating(tensor) and tensor.dtype != cls.wire:
            return cls.cast(tensor, cls.wire), tensor.dtype
        return tensor, None

    @classmethod
    def decompress(cls, tensor, ctx):
        """Casts ``tensor`` back to the dtype ``compress`` saw."""
        return tensor if ctx is None else cls.cast(tensor, ctx)
