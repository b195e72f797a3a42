"""Certified robustness of a whole ViT (docs/bounds.md §5; LoFAST §5.2 and Proposition 1).

For images in an ℓ2 ball of radius ε (pixel space, over the whole image), a ``lofast``-variant
:class:`models.vit.ViT` changes its pooled features by at most

    δ_features = pool · r_N,   r_0 = ‖E‖·ε,   r_{k+1} = Lip(FFN_k) · bound(attn_k, X̂_k, r_k),

where X̂_k is block k's actual projected input on the clean image (LayerProject is 1-Lipschitz, so
the perturbed projected input lies in the ball of radius r_k around it, docs/bounds.md §1.4), the
FFN constant is exact (``ViT.ffn_lipschitz``) and mean pooling is 1/√n-Lipschitz. The positional
embedding and every bias cancel in differences. A sample (correctly classified) is then certified

* by LoFAST Proposition 1 when ``margin > √2·‖W‖·δ_features``;
* by this suite's pairwise-head test when ``F_y − F_j > ‖w_y − w_j‖·δ_features`` for every j ≠ y,
  which certifies every sample Proposition 1 certifies (``‖w_y − w_j‖ ≤ √2‖W‖``).

Everything is float64; the certified norms inside the bounds carry their certificate, collected
over the blocks by a :class:`bounds.certificates.Ledger` (docs/bounds.md §2.4).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
from torch import Tensor

from models import InputError
from models.vit import ViT

from ..base import Bound, propagate
from ..certificates import Certificate, Ledger, NormCache, book
from ..norms import exact_norm
from ..registry import TAYLOR_NET, TAYLOR_NETS, best_ingredients, every, get
from ..taylor import TaylorOptions, sigma_J
from .stages.activations import ACTIVATION_STAGES

# Float64 rounding in the logits, in the products of the test and in the SVDs of ‖E‖ and Lip(FFN)
# (a few ulps each; the norms inside the bounds are rounded up already): a gap must beat its
# threshold by more than this many ulps of the numbers involved, so no sample is certified by a last bit.
ROUNDING = 64 * torch.finfo(torch.float64).eps


# a block's Taylor bound skips the remainder's forms where the cheaper remainders are at most this
# share of its first-order term (bounds.taylor.TaylorOptions): each block's radius is then at
# most 0.1% above the full bound's. On the Fashion-MNIST blocks the cheaper remainders are ≤ 2e-4 of
# the first order at radii up to 0.5 and the forms took about half of `taylor`'s time an image
NEGLIGIBLE = 1e-3

# whole-network procedures with a verdict of their own and no δ_features (docs/bounds.md §5.1)
PROCEDURES = tuple(TAYLOR_NETS)


def network_bounds(opt_in: bool = False) -> list[Bound]:
    """The bounds that can certify a network: certified, end to end (``output``), not per head, and
    propagated block by block through dot-product layers (docs/bounds.md §1.4), and the network
    procedures of :data:`PROCEDURES` (``taylor_net``, docs/bounds.md §5.1); the opt-in ones
    (CROWN, α-CROWN: a whole-network verification in ``bench certify``) only with ``opt_in``."""
    return [b for b in every() if b.certified and (b.name in PROCEDURES or (
            b.objective == "output" and not b.per_head and "dot" in b.kinds and b.stack == "propagate"))
            and (opt_in or not b.opt_in)]


def network_bound(name: str) -> Bound:
    """The bound of that name, refused (InputError) unless it can certify a network."""
    bound = get(name)
    if bound not in network_bounds(opt_in=True):
        raise InputError(f"bound {name!r} cannot certify a network (needs a certified end-to-end bound "
                         f"of dot-product layers); use one of "
                         f"{', '.join(b.name for b in network_bounds(opt_in=True))}")
    return bound


def check_certifiable(net: ViT) -> None:
    """Refuses a network whose blocks the propagation of docs/bounds.md §1.4 does not cover."""
    if net.cfg.variant != "lofast":
        raise InputError(f"a {net.cfg.variant!r} ViT cannot be certified this way: its blocks start with "
                         f"LayerNorm, which is not 1-Lipschitz (its constant grows without bound as a "
                         f"token's variance goes to 0), where the certificate needs LayerProject "
                         f"(docs/bounds.md §1.4, §5)")


# the network bounds that take a LayerNorm (vanilla) ViT: taylor_net's, with LayerNorm as a stage of
# its own (docs/bounds.md §5.1), and CROWN's through auto_LiRPA's relaxations of LayerNorm's ops
LAYERNORM_BOUNDS = (*PROCEDURES, "crown", "alpha_crown")


def check_network(net: ViT, names: list[str] | None, cascade: bool = False) -> None:
    """Refuses, before any work, the bounds (``names``; None: the default list) and the cascade that
    cannot certify ``net``: a vanilla or standard ViT is certified by :data:`LAYERNORM_BOUNDS` alone,
    and its cascade is taylor_net's (``bounds.registry.CASCADE_TN``), which needs taylor_net run."""
    check_stages(net)
    if net.cfg.variant == "lofast":
        return
    wrong = [n for n in names or [] if n not in LAYERNORM_BOUNDS]
    if wrong:
        raise InputError(f"{', '.join(wrong)} cannot certify a {net.cfg.variant!r} ViT: a norm route "
                         f"through each block needs LayerProject, and LayerNorm is not Lipschitz as a "
                         f"token's variance goes to 0 (docs/bounds.md §5); these can: "
                         f"{', '.join(LAYERNORM_BOUNDS)}")
    # the cascade there is taylor_net's alone (naive's starts from the norm route)
    if cascade and names is not None and TAYLOR_NET not in names:
        raise InputError(f"--cascade on a {net.cfg.variant!r} ViT starts from taylor_net (naive's "
                         f"cascade needs the norm route); add taylor_net to the bounds")


def default_bounds(net: ViT) -> list[Bound]:
    """The bounds a certify run takes when none are named: :func:`network_bounds`, those that take
    ``net``."""
    every = network_bounds()
    return every if net.cfg.variant == "lofast" else [b for b in every if b.name in LAYERNORM_BOUNDS]


def check_stages(net: ViT) -> None:
    """Refuses a network with a block ``taylor_net`` has no stage for: it takes LayerProject
    (``lofast``) and LayerNorm (``vanilla``) blocks alike (docs/bounds.md §5.1)."""
    if net.cfg.variant not in ("lofast", "vanilla", "standard"):
        raise InputError(f"a {net.cfg.variant!r} ViT has no stages taylor_net knows")
    if net.cfg.activation not in ACTIVATION_STAGES:
        raise InputError(f"an FFN with {net.cfg.activation} has no stage yet "
                         f"({', '.join(ACTIVATION_STAGES)} do)")


@dataclass(frozen=True)
class NetworkCertificate:
    """One bound at one ε over a batch of samples."""

    bound: str
    eps: float
    delta: Tensor  # [B], δ_features
    prop1: Tensor  # [B] bool, certified by LoFAST Proposition 1
    pairwise: Tensor  # [B] bool, certified by the pairwise-head test (ours)
    certificate: Certificate  # per sample: the weakest kind, the failure probability of one value
    seconds: float  # what this value costs on its own (each reused norm counted once), for the whole batch


class Certifier:
    """A network at a batch of images: the clean trace is taken once, so that every bound and ε
    given the same norm cache share the certified norms of each block
    (:class:`bounds.certificates.Ledger`)."""

    def __init__(self, net: ViT, images: Tensor, labels: Tensor):
        check_certifiable(net)
        if labels.shape != images.shape[:1]:
            raise InputError(f"labels must be [B] for images [B, H, W], got {list(labels.shape)}")
        if net.head.weight.dtype != torch.float64:
            raise InputError("certify a float64 network (models.load_vit loads one): a float32 trace "
                             "would move the margins by more than the certificate accounts for")
        with torch.no_grad():
            trace = net.trace(images.to(torch.float64))
        self.inputs = [X.detach() for X in trace.inputs]
        self.logits = trace.logits.detach()
        self.labels = labels.to(self.logits.device)
        self.layers = [layer.to(self.logits) for layer in net.attention_layers()]
        self.ffn = net.ffn_lipschitz()
        self.embedding = net.embedding_norm()
        self.pool = net.pool_lipschitz
        self.W = net.head_matrix()
        self.W_norm = float(exact_norm(self.W))
        self.correct = self.logits.argmax(-1) == self.labels

    def delta(self, bound: Bound, eps: float,
              cache: NormCache | None = None) -> tuple[Tensor, Certificate, float]:
        """(δ_features [B], its certificate, seconds on its own) at image radius ``eps``. A bound
        that takes :class:`bounds.taylor.TaylorOptions` (``taylor``, ``best``) skips the remainder's
        forms where they are negligible (:data:`NEGLIGIBLE`) and at the images that a first-order
        chain below both fails to certify (:meth:`first_order_fails`): their verdict cannot change."""
        start = time.perf_counter()
        ledger = Ledger(cache=cache)
        r0 = torch.full_like(self.logits[:, 0], self.embedding * eps)
        if bound.taylor_options:
            skip = self.first_order_fails(r0, ledger)
            options = TaylorOptions(negligible=NEGLIGIBLE, not_needed=skip)
            radius = propagate(bound, self.layers, self.inputs, r0, self.ffn, options=options, ledger=ledger)
        else:
            radius = propagate(bound, self.layers, self.inputs, r0, self.ffn, ledger=ledger)
        seconds = time.perf_counter() - start + ledger.reused_seconds
        return radius * self.pool, ledger.certificate, seconds

    def first_order_fails(self, r0: Tensor, ledger: Ledger | None = None) -> Tensor:
        """[B] bool: the images that the pairwise test (which certifies all that Proposition 1 does)
        refuses even at δ_features = pool·L_N, with L_0 = ``r0`` and L_{k+1} = Lip(FFN_k)·min(σ̄_J,k·L_k,
        f(L_k) for every other ingredient f of ``best``). Taylor's radius at block k is σ̄_J,k·r_k plus a
        remainder ≥ 0, and each f is non-decreasing in the radius
        (tests/bounds/network/test_negligible.py), so by induction both ``taylor``'s and ``best``'s
        radii stay ≥ L_k whatever the remainders, and so does their δ_features. One chain for both,
        so that the two skip the same images and share the forms computed for the others (the
        ledger's cache keys them by those images). σ̄_J and the ingredients' norms are those the
        bounds certify anyway, recorded in ``ledger``."""
        ledger = book(ledger)
        low = r0
        for layer, X, lip in zip(self.layers, self.inputs, self.ffn, strict=True):
            step = sigma_J(layer, X, ledger=ledger) * low
            for other in best_ingredients(layer):
                if other.name != "taylor":
                    step = torch.minimum(step, other.fn(layer, X, low, ledger=ledger))
            low = lip * step
        return ~pairwise(self.logits, self.labels, self.W, low * self.pool)

    def certify(self, bound: Bound | str, eps: float, cache: NormCache | None = None) -> NetworkCertificate:
        """``bound``'s certificate at image radius ``eps``; ``cache`` (a dict, empty at first) shares
        the certified norms with the other bounds and ε certified with the same one."""
        bound = network_bound(bound) if isinstance(bound, str) else bound
        delta, cert, seconds = self.delta(bound, eps, cache)
        return NetworkCertificate(bound.name, eps, delta, prop1(self.logits, self.labels, self.W_norm, delta),
                                  pairwise(self.logits, self.labels, self.W, delta), cert, seconds)


def _beats(logits: Tensor, labels: Tensor, threshold: Tensor) -> Tensor:
    """Whether ``F_y − F_j > threshold[:, j]`` for every j ≠ y, with room for rounding; NaN or inf
    thresholds certify nothing."""
    own = logits.gather(-1, labels[:, None])
    gaps = (own - logits).scatter(-1, labels[:, None], math.inf)
    threshold = threshold.scatter(-1, labels[:, None], 0.0)  # j = y: no condition (and no inf·0)
    slack = ROUNDING * (own.abs() + logits.abs() + threshold)
    return (gaps > threshold + slack).all(-1)


def prop1(logits: Tensor, labels: Tensor, W_norm: float, delta: Tensor) -> Tensor:
    """LoFAST Proposition 1 with a linear head W: ``margin > √2·‖W‖·δ_features`` (docs/bounds.md §5)."""
    threshold = (math.sqrt(2) * W_norm * delta)[:, None].expand_as(logits)
    return _beats(logits, labels, threshold)


def pairwise(logits: Tensor, labels: Tensor, W: Tensor, delta: Tensor) -> Tensor:
    """This suite's pairwise-head test: ``F_y − F_j > ‖w_y − w_j‖·δ_features`` for every j ≠ y
    (docs/bounds.md §5); each logit difference moves by at most ‖w_y − w_j‖·δ_features."""
    rows = torch.linalg.vector_norm(W[labels][:, None, :] - W[None], dim=-1)  # [B, C]
    return _beats(logits, labels, rows * delta[:, None])
