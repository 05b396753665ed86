"""The engine: sharding modules into flat units, the hooks and the schedule that
gather them, the precision policy, dtypes, tracing and the parallel config.

Over the world (``hsdp.world``); it reaches a framework only through the adapter
protocol and registry (``hsdp.adapters``).
"""
