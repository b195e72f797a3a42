"""One module per study: its figures (as plain Plots, drawn elsewhere) and tables, selected from the
stored rows. May import bench.report.panels, one another and bounds (names, registry order);
nothing that draws, writes or computes a bound.
"""
