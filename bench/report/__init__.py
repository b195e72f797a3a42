"""Figures, tables and comparisons rebuilt from a stored results table alone: render (the
``report`` command), figures (what each figure selects), tables, draw/axes/groups (matplotlib),
outdir (where a report is written), compare (against a baseline); studies/ holds one module per
study. May import bench.core (the store and its checks) and the library's names (bounds); never
bench.cli, bench.sweep or bench.nets: what a report shows comes from stored rows only.
"""
