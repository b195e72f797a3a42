"""The certificate of a certified value, and the two blocks that carry certificates and norms
between the functions that compute them (docs/bounds.md §2.4).

A :class:`Certificate` says how a value was certified: its kind (:data:`KINDS`, strongest first), its
failure probability and the seeds to replay it. The certified norms themselves are computed in
:mod:`bounds.norms`; each records its certificate in the ledger opened by :func:`ledger`, so that a
bound built from several norms (ζ and every ‖M_l‖, over every block of a stack) carries the weakest
kind and the summed failure probability of its parts (a union bound). Inside a :func:`norm_cache`
block a norm of the same operator at the same tensors is computed once, and each value that uses it
is still charged its seconds (:attr:`Ledger.reused_seconds`).
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor

# strongest first. ``relaxation``: an outer relaxation of the whole layer (CROWN, α-CROWN through
# auto_LiRPA, docs/bounds.md §2.5), sound in exact arithmetic and evaluated without directed rounding
KINDS = ("exact", "deterministic", "relaxation", "probabilistic", "estimate")
CERTIFIED_KINDS = KINDS[:-1]  # the kinds of a certified value: every kind but ``estimate``



@dataclass(frozen=True)
class Certificate:
    """How a value was certified: its kind, failure probability, and the seeds to replay it."""

    kind: str = "exact"
    p: float = 0.0  # probability that the value is not an upper bound (0 unless probabilistic)
    seeds: tuple[int, ...] = field(default=(), compare=False)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown certificate kind {self.kind!r}")

    def __and__(self, other: Certificate) -> Certificate:
        """The certificate of a value built from both: the weaker kind, the summed probability."""
        kind = max(self.kind, other.kind, key=KINDS.index)
        return Certificate(kind, self.p + other.p, self.seeds + other.seeds)

    def __str__(self) -> str:
        return f"probabilistic (p={self.p:.1e})" if self.kind == "probabilistic" else self.kind


@dataclass(frozen=True)
class Entry:
    """One certified norm used by a value: its certificate, what it cost to compute, and whether
    this use found it already computed (then its cost was paid by an earlier value)."""

    certificate: Certificate
    seconds: float
    reused: bool = False
    key: tuple | None = field(default=None, compare=False)  # the norm's cache key (None: not cached)


@dataclass
class Ledger:
    entries: list[Entry] = field(default_factory=list)

    @property
    def certificate(self) -> Certificate:
        out = Certificate("exact")
        for e in self.entries:
            out = out & e.certificate
        return out

    @property
    def reused_seconds(self) -> float:
        """Time of the norms this value reused from an earlier value: add it to the value's wall
        time to get what the value costs on its own. Each norm counts once, however many times the
        value used it (``best`` asks for ζ once per ingredient), and not at all where this value
        computed it itself (its time is in the wall time already)."""
        computed = {e.key for e in self.entries if not e.reused}
        taken = {e.key: e.seconds for e in self.entries if e.reused and e.key not in computed}
        return sum(taken.values())


_LEDGER: contextvars.ContextVar[Ledger | None] = contextvars.ContextVar("ledger", default=None)
_NORM_CACHE: contextvars.ContextVar[dict | None] = contextvars.ContextVar("norm_cache", default=None)


@contextlib.contextmanager
def ledger() -> Iterator[Ledger]:
    """Collects the certificates of every certified norm computed inside the block."""
    book = Ledger()
    token = _LEDGER.set(book)
    try:
        yield book
    finally:
        _LEDGER.reset(token)


@contextlib.contextmanager
def norm_cache(cache: dict | None = None) -> Iterator[None]:
    """Inside the block, a certified norm of the same operator at the same tensors is computed once
    (several bounds of one evaluation share ζ, ‖M_l‖ and σ̄_J). The cache holds its key tensors, so
    no id is recycled while it lives. Pass the ``cache`` of an earlier block (an empty dict to start
    one) to go on sharing with it."""
    token = _NORM_CACHE.set({} if cache is None else cache)
    try:
        yield
    finally:
        _NORM_CACHE.reset(token)


def norm_cache_open() -> bool:
    """Whether a :func:`norm_cache` block is open."""
    return _NORM_CACHE.get() is not None


def cached_certified(key: tuple, tensors: tuple[Tensor, ...],
                     compute: Callable[[], tuple[object, Certificate]], like: Tensor | None = None) -> object:
    """The value of ``compute()`` (a value and its certificate), computed once per ``key`` and
    tensors inside a :func:`norm_cache` block (every call outside one), its certificate and seconds
    in the ledger either way: a value that takes it from the cache still counts its cost
    (:attr:`Ledger.reused_seconds`). ``like`` names the device to synchronise for the timing."""
    cache = _NORM_CACHE.get()
    full_key = (key, *(id(t) for t in tensors))
    if cache is not None and full_key in cache:
        value, cert, seconds, _ = cache[full_key]
        _record(Entry(cert, seconds, reused=True, key=full_key))
        return value
    if like is not None:
        _sync(like)
    start = time.perf_counter()
    value, cert = compute()
    if like is not None:
        _sync(like)
    seconds = time.perf_counter() - start
    if cache is not None:
        cache[full_key] = (value, cert, seconds, tensors)  # holds the tensors: no id is recycled
    _record(Entry(cert, seconds, key=full_key))
    return value


def cached_value(key: tuple, tensors: tuple[Tensor, ...], compute: Callable[[], object]) -> object:
    """``compute()`` once per ``key`` and tensors inside a :func:`norm_cache` block, as
    :func:`certified_norm` for norms: for the parts of a bound that do not depend on ε. It adds no
    certificate of its own (an ``exact`` entry in the ledger, for its seconds)."""
    return cached_certified(key, tensors, lambda: (compute(), Certificate()))


def _record(entry: Entry) -> None:
    book = _LEDGER.get()
    if book is not None:
        book.entries.append(entry)


def record(certificate: Certificate, seconds: float, reused: bool = False, key: tuple | None = None) -> None:
    """Records a value certified by other means than a norm here (bounds/crown.py, the remainder's
    probabilistic value pairs) in the ledger; ``reused`` and ``key`` as in :class:`Entry`."""
    _record(Entry(certificate, seconds, reused, key))


def _sync(t: Tensor) -> None:
    if t.is_cuda:
        torch.cuda.synchronize(t.device)
