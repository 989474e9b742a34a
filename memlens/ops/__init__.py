"""The service layer: one function per question a user asks, answered once for every face.

The terminal (``memlens.cli``), the dashboard (``memlens_app``), the MCP server and the framework
integrations import this package and the renderers (``memlens.reporters``, ``memlens.figures``),
never each other. Each function takes typed options and returns a typed result in the report's
one schema; the faces only render what they are given. This layer also owns the vocabularies
the faces share (finding kinds and their aliases, sizes, moments), the one rule that turns an
exception into a one-line message, and the one sandboxed child-process runner.

Modules, by question:

- ``vocab``: finding kinds and aliases, device capacities.
- ``budget``: the theoretical budget, from options and the recorder's sidecar, and its
  reconciliation with a measured report.
- ``plan``: what fits, and the cheapest change that makes it fit: the script predicted once per
  configuration of levers (``memlens plan``).
"""
