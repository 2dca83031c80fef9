"""``explore``: generated workloads against a model (see :mod:`.story` for the model and
:mod:`.machine` for the Hypothesis state machine that drives it)."""
