"""What every room shares: where a computation runs and with what (env), the result store (store)
and what a stored table claims, recomputed from its numbers (gate), and the one rule for
comma-separated options (arglists). May import the library (models,
bounds.registry) and ``bench.__version__``; no other room of bench.
"""
