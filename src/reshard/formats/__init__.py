"""File formats: bytes <-> tensor index.

``registry`` is the one list of byte formats (``ckpt``, ``safetensors``, and any ``register``ed one),
each one object of the ``protocol.Format`` protocol. Each format is a reader that returns a
:class:`~reshard.formats.base.TensorIndex` (names, dtypes, shapes and byte ranges over a memory map,
zero-copy) and a writer that first computes a
:class:`~reshard.formats.base.ByteLayout` (where every framing byte and every tensor's data goes)
so that executors can fill tensor data in place, in any order, without holding a tensor whole.
"""

__all__: list[str] = []  # the submodules are the interface
