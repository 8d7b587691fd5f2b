"""The operations: one module per operation (transform, unify, split, convert, ...) sharing one run path.

``reshard.api`` is the documented façade over these modules; the faces (CLI, drop-in, auto-transform)
build the option objects of ``reshard.ops.options`` and call the façade.
"""
