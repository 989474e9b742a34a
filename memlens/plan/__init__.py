"""``memlens plan``'s engine: the levers (``levers``: the ``--try`` spec; ``apply``: the hooks
that pull them inside a predicted run), the configurations and what passes to and from each
child process (``configurations``, ``child``), the ``--max`` bisection (``search``) and the code
change recommended (``recommend``). The service is ``memlens.ops.plan``.
"""
