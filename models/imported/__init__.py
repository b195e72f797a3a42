"""Attention layers imported from a user's model (ONNX or torch.export) as the suite's DotMHA, exactly
(docs/bounds.md §1.1, §1.5): ``python -m bench import``."""

from .importer import Result, import_module, load, manifest, run, write

__all__ = ["Result", "import_module", "load", "manifest", "run", "write"]
