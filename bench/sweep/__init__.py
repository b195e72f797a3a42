"""A run of a profile: its cells (cases), the profiles that list them (profiles), what a cell
computes by task (tasks, evaluate, cost), the runner (in process, or on Dask: distributed) and the
rows it stores (rows). May import bench.nets, bench.core and the library; never bench.cli or
bench.report.
"""
