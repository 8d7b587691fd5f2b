"""The operations: one module per operation sharing one run path and one tensor pipeline.

``transform`` (and its Checkpoint 2.0 additions, ``checkpoint2``), ``by_rank`` (one destination
rank's file), ``unify``, ``split``, ``convert`` (with ``pairs``, its file pairs) and ``recrypt``
each plan their run and hand the plan to ``run`` (destination check, lock, superseded outputs,
execute, manifest, report); every planning input goes through ``tensors`` first (filters, then
dequantize/quantize, then casts, then maps). ``options`` holds the option values they take.
``reshard.api`` is the documented façade over these modules; the faces (CLI, drop-in,
auto-transform) build the option values and call the façade.
"""

__all__: list[str] = []
