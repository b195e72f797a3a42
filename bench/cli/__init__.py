"""The commands of ``python -m bench`` (main.py parses and dispatches): their options, the
checks that need no work (run before any), and what they print. The top room: it may import every
other room (sweep, nets, report, core) and the library (models, bounds, attacks); nothing in bench
imports it but ``bench.__main__``.
"""
