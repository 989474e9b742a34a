"""The dashboard's panels as pure functions: plain values and an ``Analysis``/``Report`` in;
figures, Dash components or plain dicts out.

Nothing here registers a callback or reads Dash's callback context, so each panel can be called
(and tested) without a server; ``memlens_app.callbacks`` only wires Inputs and Outputs to them.
No panel computes an analysis either: the numbers come from ``memlens.analysis`` (the report,
``live_at``, the lenses), ``memlens.budget``, ``memlens.allocator`` and ``memlens.ops.fleet``; the
figures from ``memlens.figures``. One module a panel: ``overview`` (the headline cards),
``timeline`` (the curve, the zoomed window and the findings), ``live`` (what was live at a moment,
grouped), ``budget``, ``whatif``, ``compare`` and ``ranks``; ``common`` holds what they share.
"""
