"""The ``memlens`` command line: one small module per subcommand (see ``main.py``)."""
