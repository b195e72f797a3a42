"""Trained networks: training a small ViT (train), the committed zoo (zoo) and certified accuracy
through a whole network (accuracy). May import bench.core and the library; never bench.cli,
bench.sweep or bench.report.
"""
