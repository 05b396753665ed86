"""The world: the process group, the mesh, the NCCL bootstrap and the launcher.

The lowest layer of hsdp: it imports only the C core (``hsdp._C``) and itself.
"""
