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
- ``group``: the lens questions: what was live at a moment or window, grouped (``group``);
  what each ``record_function`` scope added (``stages``); bytes by line of one file (``lines``).
- ``moments``: ``--at``/``--window``/``--step`` text (the CLI's and the MCP tools') to the typed
  moments of ``memlens.analysis.lenses.moments``, errors naming the option as the caller does.
- ``errors``: the one rule that turns an exception into a one-line message (a mistake, an input
  that ran memlens out of memory or stack depth, a bug), for every face.
- ``runner``: the one sandboxed child-process runner (time and memory limits) that the
  dashboard's analyses, the MCP server's tool calls and the fleet's ranks run in.
- ``fleet``: many ranks of one job in parallel, typed rows, the outlier rank and why.
- ``triage``: one file loaded and analysed (``analyse``: the one load-and-analyse of every face,
  in a runner's child too) and its budget set beside each device (the report).
- ``follow``: a run folder as it is written: its newest complete snapshot triaged, and what is
  new since the last look (steps, findings, ranks; a leak's rate and when the device is full).
- ``diff``: two files compared: peaks, categories, stacks and one source file's lines.
- ``whatif``: a recorded run replayed with other allocator settings or another capacity.
- ``predict``: a script run against a simulated GPU, written and triaged as a recorded run.
- ``plan``: what fits, and the cheapest change that makes it fit: the script predicted once per
  configuration of levers (``memlens plan``).
"""
