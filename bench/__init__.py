"""The tightness benchmark: cases, sweeps, the runner, the result store, reports, and the CLI."""

__version__ = "0.1.0"
