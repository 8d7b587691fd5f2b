"""Executors run plans. ``local`` runs on this machine with threads; ``ray`` spreads files over a cluster."""

__all__: list[str] = []  # the submodules are the interface
