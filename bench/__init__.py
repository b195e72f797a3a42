"""The tightness benchmark, in rooms by job (tests/project/test_layout.py checks who imports whom):
cli (the commands) → sweep (cells, profiles, tasks, the runner, rows) → nets (trained ViTs);
report reads stored rows only; core (env, store, gate, arglists) is shared by all.
"""

__version__ = "0.1.0"
