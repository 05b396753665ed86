"""The ``hsdp`` command line: ``python -m hsdp COMMAND`` (also installed as ``hsdp``).

One module per command (:mod:`hsdp.cli.generate`), and what commands share: reading a
pipeline folder without loading it (:mod:`hsdp.cli.folder`), writing frames
(:mod:`hsdp.cli.media`), starting ranks (:mod:`hsdp.cli.ranks`) and the run report
(:mod:`hsdp.cli.report`). Nothing here imports torch or diffusers at module level.
"""
