"""The one ``error:`` line of a command that failed for want of memory, of floating-point range or of a
file, with advice in that command's own terms: ``run`` has cells and a profile, ``certify`` images and
alpha_crown, ``point`` a layer and an input (one message for all once spoke of images to ``run``)."""

from __future__ import annotations

import torch

# what to make smaller when a command runs out of memory; whole-network α-CROWN is the usual cause
# (≈ 8 GB an image at one block, > 11 GB at two, > 20 GB at three), in certify and in a profile's certify
# sweeps alike
SMALLER = {
    "point": "the layer and its input do not fit this machine's memory: give a layer with a smaller d or "
             "fewer heads, an input with fewer tokens or a smaller batch, or fewer --bounds",
    "run": "a cell of the profile does not fit this machine's memory: make the cells smaller (--n, --d, "
           "--depth, --samples), run fewer --workers, or leave out the profile's largest sweeps "
           "(whole-network alpha_crown needs 8 GB or more an image)",
    "certify": "the images do not fit this machine's memory: certify fewer of them (--limit), a smaller "
               "model, or leave out alpha_crown (8 GB or more an image)",
    "train": "the model does not fit this machine's memory: train a smaller one (--d, --depth, --heads, "
             "--ffn) or with a smaller --batch-size",
    "baseline": "the quick profile does not fit this machine's memory: run it on a larger machine and "
                "pass the finished run with --from",
}
# what may be out of floating point's range when a command's computation fails numerically
TOO_LARGE = {
    "point": "the input, the layer's weights or --eps may be too large for floating point",
    "run": "a cell's sizes, x_norm, w_vo, w_qk or eps may be too large for floating point",
    "certify": "the model's weights or --eps may be too large for floating point",
    "train": "the training may have diverged: try a smaller --lr or --margin-eps",
    "baseline": "a cell of the quick profile may be too large for floating point",
}


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def is_out_of_memory(e: BaseException) -> bool:
    """torch's CPU allocator raises a RuntimeError, CUDA's OutOfMemoryError is one: told apart by text."""
    text = str(e)
    return isinstance(e, (MemoryError, getattr(torch, "OutOfMemoryError", MemoryError))) or \
        "can't allocate memory" in text or "out of memory" in text.lower()


def out_of_memory(command: str, e: BaseException) -> str:
    advice = SMALLER.get(command, "the problem is too large for this machine's memory")
    return f"error: out of memory during {command} ({first_line(e)}); {advice}"


def numerical(command: str, e: BaseException) -> str:
    advice = TOO_LARGE.get(command, "the numbers may be too large for floating point")
    return f"error: {command}'s computation failed numerically ({first_line(e)}); {advice}"


def os_error(command: str, e: OSError) -> str:
    """A path the library did not foresee (a full disk, a vanished directory), named with its command."""
    where = f" on {e.filename}" if e.filename else ""
    return f"error: {command} failed{where}: {e.strerror or e}"
