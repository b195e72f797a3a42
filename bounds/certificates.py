"""The certificate of a certified value, and the ledger that carries certificates and shared norms
between the functions that compute them (docs/bounds.md §2.4).

A :class:`Certificate` says how a value was certified: its kind (:data:`KINDS`, strongest first), its
failure probability and the seeds to replay it. The certified norms themselves are computed in
:mod:`bounds.norms`; each records its certificate in the :class:`Ledger` passed to it, so that a
bound built from several norms (ζ and every ‖M_l‖, over every block of a stack) carries the weakest
kind and the summed failure probability of its parts (a union bound). Ledgers on one cache share
their norms: a norm of the same operator at the same tensors is computed once, and each value that
uses it is still charged its seconds (:attr:`Ledger.reused_seconds`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
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


NormCache = dict  # (key, *ids of its tensors) -> (value, certificate, seconds, the tensors)


@dataclass
class Ledger:
    """The certificates of every certified norm one value used, and the cache of norms that value
    shares with the values computed beside it. Every function that computes a certified norm takes
    it as the keyword ``ledger``; without one, a fresh ledger is used and its certificates are
    dropped (the value is as certified, but no caller learns how).

    ``cache`` (a :data:`NormCache`, None: no sharing): a certified norm of the same operator at the
    same tensors is computed once for every ledger on the same cache (several bounds of one
    evaluation share ζ, ‖M_l‖ and σ̄_J), and each value that uses it is still charged its seconds
    (:attr:`reused_seconds`). The cache holds its key tensors, so no id is recycled while it lives.
    """

    entries: list[Entry] = field(default_factory=list)
    cache: NormCache | None = field(default=None, repr=False)

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

    def sharing(self) -> Ledger:
        """A fresh ledger on the same cache: another value's, computed beside this one."""
        return Ledger(cache=self.cache)

    def record(self, certificate: Certificate, seconds: float, reused: bool = False,
               key: tuple | None = None) -> None:
        """Records a value certified by other means than a norm here (bounds/crown.py, the
        remainder's probabilistic value pairs); ``reused`` and ``key`` as in :class:`Entry`."""
        self.entries.append(Entry(certificate, seconds, reused, key))

    def certified(self, key: tuple, tensors: tuple[Tensor, ...],
                  compute: Callable[[], tuple[object, Certificate]], like: Tensor | None = None) -> object:
        """The value of ``compute()`` (a value and its certificate), computed once per ``key`` and
        tensors on this ledger's cache (every call without one), its certificate and seconds
        recorded either way: a value that takes it from the cache still counts its cost
        (:attr:`reused_seconds`). ``like`` names the device to synchronise for the timing."""
        full_key = (key, *(id(t) for t in tensors))
        if self.cache is not None and full_key in self.cache:
            value, cert, seconds, _ = self.cache[full_key]
            self.record(cert, seconds, reused=True, key=full_key)
            return value
        if like is not None:
            _sync(like)
        start = time.perf_counter()
        value, cert = compute()
        if like is not None:
            _sync(like)
        seconds = time.perf_counter() - start
        if self.cache is not None:
            self.cache[full_key] = (value, cert, seconds, tensors)  # holds the tensors: no id is recycled
        self.record(cert, seconds, key=full_key)
        return value

    def value(self, key: tuple, tensors: tuple[Tensor, ...], compute: Callable[[], object]) -> object:
        """``compute()`` once per ``key`` and tensors on this ledger's cache, as :meth:`certified`
        for norms: for the parts of a bound that do not depend on ε. It adds no certificate of its
        own (an ``exact`` entry, for its seconds)."""
        return self.certified(key, tensors, lambda: (compute(), Certificate()))


def book(ledger: Ledger | None) -> Ledger:
    """``ledger``, or a fresh one where the caller passed none (its certificates dropped)."""
    return Ledger() if ledger is None else ledger


def _sync(t: Tensor) -> None:
    if t.is_cuda:
        torch.cuda.synchronize(t.device)
