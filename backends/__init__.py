"""Adapters that fit the array-API core to each framework's own protocol.

Installed as ``fismo_core.backends``. Each adapter calls the core for the
algorithm and never re-implements it.
"""
