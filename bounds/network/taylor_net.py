"""``taylor_net``: a whole-network certificate of a ViT (lofast, vanilla or standard) that is exact to
first order (docs/bounds.md §5.1; this suite's, after SPEC §5.1). This module holds the loop over the
stages and the margins; each stage is a module of its own: :mod:`.project`, :mod:`.layernorm`,
:mod:`.attention`, :mod:`.ffn` (its activations in :mod:`.activations`), the residual sums in
:meth:`DeviationSet.plus`, and the pass back through them in :mod:`.backward`.

For an image x and a perturbation δ (‖δ‖₂ ≤ ε) every intermediate deviation Δ = T(x + δ) − T(x) is
held in one set (:class:`bounds.network.zonotope.DeviationSet`), pushed forward stage by stage from
the pixels to the margins:

    Δ = G δ + A ζ + Σ_j Q_j η_j + c + E,    ‖δ‖₂ ≤ ε,   ζ ∈ [−1, 1]^m,   ‖η_j‖₂ ≤ 1,   ‖E‖_F ≤ Σ_s ρ_s,

with G the exact first-order part (the product of every smooth stage's Jacobian at the clean image,
and of each kink's slope), A one column per unit that can cross a kink (a ReLU neuron, a token whose
ball straddles LayerProject's sphere: a zonotope's symbols, shared by every later stage so that their
signs cancel), Q_j a straddling token's own error ball, c the constant shifts of the relaxations, and
E the remainders of the smooth stages, one Frobenius ball per source s. Each stage:

* LayerProject, per token (:func:`project`): the identity where the token's ball stays inside the
  sphere; else the radial or tangential form of docs/bounds.md §5.1, a linear part, a ReLU of the
  radial change a = uᵀΔ (relaxed as any ReLU) and a second-order error;
* LayerNorm, per token (:func:`layer_norm`): its exact Jacobian and a second-order remainder;
* attention (:func:`attention`): its exact Jacobian at the clean input, applied densely on small
  layers and as an operator on large ones, and the Taylor remainder of docs/bounds.md §2.3
  (``bounds.remainder.remainder``) at the radius of its input set — or LoFAST's Δ₁ and δ₂ (``split``);
* the FFN x + W₂ σ(W₁x + b₁) + b₂ (:func:`ffn`): linear, but for the neurons whose range the
  activation bends, relaxed with a symbol of their own (ReLU: the parallelogram of least area, DeepZ,
  Singh et al. 2018; GELU: its exact slope and Taylor error);
* a standard block's residuals: the sum of the set and its branch's;
* mean pooling (or the class token after a final LayerNorm) and the head: linear.

Each margin m_j = (e_y − e_j)ᵀ logits is then bounded from below twice, by the set's support and by
one pass back through the stages (:func:`backward`, CROWN's slopes on the set's ranges), and takes
the better; images left uncertified get a second pass with every unit's range refined by the backward
pass. An image is certified when every m_j(x) beats its bound's loss with room for float64 rounding.
Every norm in it is an exact float64 Gram eigenvalue rounded up or a deterministic upper bound from
exact factors: the certificate is ``deterministic``. Built on torch alone (no auto_LiRPA).
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from models import InputError
from models.vit import TokenBatchNorm, ViT

from ..certificates import Certificate, Ledger
from ..norms import gram_norm
from .backward import Losses, backward
from .branches import BUDGET, branch_and_bound
from .constants import NetConstants, net_constants
from .propagated import check_stages
from .record import Fork, Join
from .slopes import optimized_backward
from .stages.attention import (
    BEST,
    BEST_OF,
    DENSE_J,
    NEGLIGIBLE,
    NORM_J,
    SPLITS,
    AttentionCache,
    AttentionParts,
    attention,
    attention_parts,
    curved_log,
    delta1_transpose,
    jacobian_apply,
    jacobian_bound,
    sparse_apply,
    transpose_apply,
)
from .stages.batchnorm import batch_norm
from .stages.ffn import REFINE_LIMIT, Mapped, Refine, ffn, relu_bounds
from .stages.layernorm import NormRecord, layer_norm, margin_sign
from .stages.project import FRAME_KAPPA, SAFE, error_frame, project
from .stages.second_order import FORM_ENTRIES
from .zonotope import DeviationSet

__all__ = ["BEST", "BEST_OF", "DENSE_J", "FRAME_KAPPA", "HOPELESS", "NEGLIGIBLE", "NORM_J", "REFINE_LIMIT",
           "SAFE", "SPLITS", "AttentionCache", "AttentionParts", "Diagnostics", "Mapped", "NetCertificate",
           "TaylorNet",
           "attention", "attention_parts", "backward", "delta1_transpose", "error_frame", "ffn", "hopeless",
           "jacobian_apply", "jacobian_bound", "project", "relu_bounds", "sparse_apply", "transpose_apply"]

# Room for float64 rounding, relative to the magnitudes of the margin and of every term of its loss:
# the set is pushed through ≤ a few dozen products of inner size ≤ 10⁴ (each off by ≤ 10⁴·u relative to
# the product of magnitudes, u = 1.1e-16), so 1e-9 leaves three orders of magnitude to spare.
ROUND = 1e-9


@dataclass
class Diagnostics:
    """Per image, at the class j whose test is closest to failing: the clean margin, the split of the
    bound that margin took (first order, kinks, and each source's remainder: the backward pass's where
    ``backward`` says its bound was the better one, else the forward set's; they add up to what
    ``lower`` lost), per block the number of unstable neurons and of straddling tokens, and whether a
    stage was undefined or refused in the image's ball (``refused``: a block LayerNorm's set exceeded
    its range at every token, or reached σ = 0 with e = 0; that pass certifies nothing there, and
    after a first pass the second is still tried)."""

    margin: Tensor
    first_order: Tensor
    kinks: Tensor
    remainders: dict[str, Tensor]
    unstable: list[Tensor]
    straddling: list[Tensor]
    backward: Tensor | None = None
    refused: Tensor | None = None

    @staticmethod
    def cat(parts: list[Diagnostics]) -> Diagnostics:
        """The diagnostics of consecutive batches as one (a source missing in a batch counts 0)."""
        names = list(dict.fromkeys(k for p in parts for k in p.remainders))
        zero = lambda p: torch.zeros_like(p.margin)
        join = lambda f: torch.cat([f(p) for p in parts])
        return Diagnostics(join(lambda p: p.margin), join(lambda p: p.first_order), join(lambda p: p.kinks),
                           {k: join(lambda p, k=k: p.remainders.get(k, zero(p))) for k in names},
                           [torch.cat(u) for u in zip(*(p.unstable for p in parts), strict=True)],
                           [torch.cat(s) for s in zip(*(p.straddling for p in parts), strict=True)],
                           join(lambda p: p.backward),
                           join(lambda p: p.refused) if all(p.refused is not None for p in parts) else None)

    @staticmethod
    def from_columns(cols: dict[str, Tensor]) -> Diagnostics:
        """The diagnostics whose :meth:`columns` are ``cols``."""

        def blocks(kind: str) -> list[Tensor]:
            count = sum(re.fullmatch(rf"{kind}_\d+", c) is not None for c in cols)
            return [cols[f"{kind}_{k}"] for k in range(count)]

        remainders = {c.removeprefix("remainder_"): v for c, v in cols.items() if c.startswith("remainder_")}
        return Diagnostics(cols["margin"], cols["first_order"], cols["kinks"], remainders, blocks("unstable"),
                           blocks("straddling"), cols.get("backward"), cols.get("refused"))

    def columns(self) -> dict[str, Tensor]:
        """Flat per-sample columns: ``margin``, ``first_order``, ``kinks``, ``backward``, ``refused``,
        ``remainder_<source>`` and per block ``unstable_<k>`` and ``straddling_<k>``."""
        out = {"margin": self.margin, "first_order": self.first_order, "kinks": self.kinks,
               "backward": self.backward}
        if self.refused is not None:
            out["refused"] = self.refused
        out |= {f"remainder_{s}": v for s, v in self.remainders.items()}
        out |= {f"unstable_{k}": u for k, u in enumerate(self.unstable)}
        return out | {f"straddling_{k}": s for k, s in enumerate(self.straddling)}

    def scattered(self, rows: Tensor, base: Diagnostics) -> Diagnostics:
        """``base`` with its rows ``rows`` [k] replaced by these diagnostics (of k images); a source
        missing from one counts 0."""
        return base._merged(self, lambda b, v: b.index_put((rows,), v))

    def where(self, mask: Tensor, other: Diagnostics) -> Diagnostics:
        """Per image, these diagnostics where ``mask`` [B] holds, ``other``'s elsewhere (a source
        missing from one counts 0)."""
        return self._merged(other, lambda a, b: torch.where(mask, a, b))

    def _merged(self, other: Diagnostics, f: Callable[[Tensor, Tensor], Tensor]) -> Diagnostics:
        """``f`` of these diagnostics' and ``other``'s, field by field (a source missing from one counts
        0 there; ``backward`` None where either has none)."""
        rem = lambda d, k: d.remainders.get(k, torch.zeros_like(d.margin))
        names = list(dict.fromkeys([*self.remainders, *other.remainders]))
        both = self.backward is not None and other.backward is not None
        refused = self.refused is not None and other.refused is not None
        return Diagnostics(f(self.margin, other.margin), f(self.first_order, other.first_order),
                           f(self.kinks, other.kinks), {k: f(rem(self, k), rem(other, k)) for k in names},
                           [f(a, b) for a, b in zip(self.unstable, other.unstable, strict=True)],
                           [f(a, b) for a, b in zip(self.straddling, other.straddling, strict=True)],
                           f(self.backward, other.backward) if both else None,
                           f(self.refused, other.refused) if refused else None)


DETERMINISTIC = Certificate("deterministic")  # taylor_net's norms: exact factors, rounded up


@dataclass
class NetCertificate:
    lower: Tensor  # [B, C]: lower bounds of every margin change over the ball (+inf at j = y)
    certified: Tensor  # [B] bool
    diagnostics: Diagnostics
    seconds: float
    verified: Tensor  # [B, C] bool: margin j proved positive with its rounding slack (True at j = y)
    image_seconds: Tensor  # [B]: each image's share of ``seconds`` (its own on a CPU)
    # deterministic, or weaker where a remainder's norm was (every norm this TaylorNet computed)
    certificate: Certificate = DETERMINISTIC



# A first pass on a CPU takes CPU_CHUNK images at once where a block's tokens are small (n·d ≤
# CPU_CHUNK_ND), one at a time elsewhere: a chunk pads every image's symbols to the largest count in
# it, which costs little on the digits models (a few symbols an image; a pass there is hundreds of
# small torch calls, whose overhead a chunk shares) and much on the Fashion-MNIST ones (hundreds of
# unstable neurons an image, their counts far apart): docs/bounds.md §5.1, "Chunks"
CPU_CHUNK = 8
CPU_CHUNK_ND = 512
# ... and while the sets stay small: once a chunk's first pass made more symbols than this in one
# image, the padding costs more than the chunk saves and the rest go one at a time (docs/scale.md)
CHUNK_SYMBOLS = 1024
# The second pass (refined ranges, the quadratic remainder) certifies images whose first pass falls far
# short: on the models trained without a margin it wins images short by hundreds of margins, and none
# short by 10³–10⁶ (docs/scale.md). An image short by more than HOPELESS margins at some class is left
# to its first pass (docs/bounds.md §5.1, "Refined ranges"): it can cost a verdict, never soundness
HOPELESS = 10000.0
# the largest n·d for which the second pass carries E as columns as well (DeviationSet.W): each
# remainder merged into them costs an n·d-wide Cholesky factorisation, and each radius an eigenvalue
# of an n·d-wide Gram. The first pass, which decides most images, keeps E as radii alone
BALL_ND = 4096
# a split's suffix that tunes the second pass's ReLU slopes (registry: taylor_net_alpha)
OPTIMIZED = "+alpha"
# ... and one that branches on the second pass's costliest ReLUs where a margin is left short
# (registry: taylor_net_bab; :mod:`bounds.network.branches`)
BRANCHED = "+bab"


def normalize(S: DeviationSet, raw: Tensor, norm, eps: float, k: int | str, log: list | None = None,
              radii: tuple[Tensor, Tensor] | None = None,
              refuse: bool = True, refine: Refine | None = None) -> tuple[DeviationSet, Tensor]:
    """The norm stage of a vanilla or standard block: :func:`layer_norm`, or :func:`batch_norm` (affine
    in eval) for the standard variant's BatchNorm."""
    if isinstance(norm, TokenBatchNorm):
        return batch_norm(S, norm, log, eps)
    return layer_norm(S, raw, norm, eps, k, log, radii=radii, refuse=refuse, refine=refine)


# the last stage's name in :meth:`TaylorNet.stages` where it stopped: every image's set was refused
# (a token's bound exceeded LayerNorm's range, :func:`bounds.network.stages.layernorm.layer_norm`)
REFUSED = "refused"


def refused(S: DeviationSet) -> bool:
    """Whether every image of the set was refused by a stage (:attr:`DeviationSet.void`)."""
    return S.void is not None and bool(S.void.all())


def hopeless(low: Tensor, logits: Tensor, y: Tensor) -> Tensor:
    """[B] bool: images whose first-pass bound ``low`` [B, C] (+∞ at y) of the margins' change falls
    short of some clean margin m_j by more than :data:`HOPELESS` × m_j; a bound that is not finite
    (no range came out of the first pass) is never called hopeless."""
    margins = logits.gather(-1, y[:, None]) - logits
    other = ~F.one_hot(y, logits.shape[-1]).bool()  # j = y has nothing to bound
    short = torch.where(other, -(margins + low) / margins.clamp_min(torch.finfo(low.dtype).tiny), -math.inf)
    finite = torch.where(other, torch.isfinite(low), True).all(-1)
    return finite & (short.amax(-1) > HOPELESS)


def _key(images: slice | Tensor) -> tuple:
    """A hashable name of a selection of the batch's images (a slice, or their indices)."""
    return (images.start, images.stop) if isinstance(images, slice) else tuple(images.tolist())


class TaylorNet:
    """The network's clean trace at a batch of images, and its certificate at any ε.

    Args:
        net: a float64 ViT of this suite (``models.load_vit``).
        images, labels: the batch, images in [0, 1].
        constants: the weights' constants, where the caller kept them for these weights.
        form_entries: the second pass forms attention's second order on the set's first generator
            where its forms have at most this many entries (:func:`.stages.second_order.fits`; the
            default keeps it to the digits ViTs on a CPU, ``math.inf`` forms it everywhere).
        branch_budget: the most parts a margin is bounded on by the split ``taylor+bab``
            (:func:`.branches.branch_and_bound`).
    """

    def __init__(self, net: ViT, images: Tensor, labels: Tensor, constants: NetConstants | None = None,
                 form_entries: float = FORM_ENTRIES, branch_budget: int = BUDGET):
        check_stages(net)
        if branch_budget < 0:
            raise InputError(f"branch_budget must be at least 0, got {branch_budget}")
        self.form_entries, self.branch_budget = form_entries, branch_budget
        if net.head.weight.dtype != torch.float64:
            raise InputError("certify a float64 network (models.load_vit loads one)")
        if net.head.weight.shape[0] < 2:
            raise InputError("a network with one class has no margin to certify")
        self.net, self.labels = net, labels
        x = images.to(torch.float64)
        # inference mode, here and in the passes: no autograd bookkeeping on each of a pass's
        # thousands of small torch calls (7 % of a pass on the 1-block digits model, 8 images)
        with torch.inference_mode():
            X = net.tokens(x)
            self.raw, self.inputs, self.mids, self.mid_norms = [], [], [], []
            for block in net.blocks:
                self.raw.append(X)
                Xp = block.prepare(X)
                self.inputs.append(Xp)
                if block.standard:  # X + A(LN₁X), then + M(LN₂·): the FFN branch's input is LN₂'s output
                    Y = X + block.attn(Xp)
                    self.mid_norms.append(block.norm2(Y))
                    X = Y + block.ffn.branch(self.mid_norms[-1])
                else:
                    Y = block.attn(Xp)
                    X = block.ffn(Y)
                self.mids.append(Y)
            self.last = X
            self.features = net.pool(X)
            self.logits = net.head(self.features)
        self.correct = self.logits.argmax(-1) == labels  # a misclassified image gets no pass
        # the weights' own constants (norms, G₀ and its patch columns): ``constants`` where the caller
        # kept them for this network's present weights (.constants)
        self.constants = const = net_constants(net, constants)
        self.layers, self.lip, self.embed = const.layers, const.lip, const.embed
        self.embed_norm, self.patch, self.span = const.embed_norm, const.patch, const.span
        # per block and batch slice, the remainder's parts that depend on the clean tokens alone
        # (two eigenproblems of four): computed at the first ε that needs them, reused at the others
        self.clean_parts: dict[tuple, AttentionCache] = {}
        # the certificates of the remainders' norms (a probabilistic value pair on a wide layer)
        self.ledger = Ledger()
        self.done: dict[tuple[float, str], NetCertificate] = {}  # the certificates made, per (ε, split)
        self.entry: dict[float, tuple[Tensor, Tensor]] = {}  # per ε, :meth:`entry_radii`
        n, d = X.shape[-2:]
        self.chunk = max(1, len(labels)) if self.logits.is_cuda else CPU_CHUNK if n * d <= CPU_CHUNK_ND else 1

    def certify(self, eps: float, split: str = "taylor") -> NetCertificate:
        """The certificate at image radius ``eps`` for every image of the batch, attention split as
        ``split`` says (:data:`SPLITS`, or :data:`BEST`): one image at a time on a CPU where a batch
        would pad every image's symbols to the largest count in it (:data:`CPU_CHUNK`), the whole
        batch at once on a GPU. Kept per (ε, split), so a
        ``best`` after its splits (or the reverse) reuses them; its seconds are still its own."""
        known = (*SPLITS, BEST, f"taylor{OPTIMIZED}", f"taylor{BRANCHED}")
        if split not in known:
            raise InputError(f"unknown attention split {split!r}; expected one of {', '.join(known)}")
        key = (float(eps), split)
        if key not in self.done:
            self.done[key] = self._best(eps) if split == BEST else self._split(eps, split)
        return self.done[key]

    def _split(self, eps: float, split: str, which: Tensor | None = None) -> NetCertificate:
        """One split's certificate on the images ``which`` [B] bool (all by default) that the network
        classifies right; an image left out gets no bound (−∞, not certified), no diagnostics but its
        clean margin (:meth:`_nothing`) and no seconds. A misclassified image is certified by nothing
        (its margin is negative at the image itself), so no pass is spent on it: on the Fashion-MNIST
        one-epoch models, 39–43 % of the test images, each a first pass of up to 10 s at ε = 0.1.

        The first pass runs on :attr:`chunk` images at a time; the images it leaves uncertified get the
        second pass, one at a time on a CPU, together on a GPU. Each image's seconds are its share of
        its chunk's first pass plus its own second pass."""
        B = len(self.labels)
        which = self.correct if which is None else which & self.correct
        todo = which.nonzero()[:, 0]
        lower = torch.full_like(self.logits, -math.inf)
        verified = torch.zeros_like(lower, dtype=torch.bool)
        diags, done = [], []
        per = torch.zeros(B, dtype=torch.float64)
        with torch.inference_mode():
            size, at = self.chunk, 0
            while at < len(todo):
                images = todo[at:at + size]
                at += len(images)
                start = time.perf_counter()
                # first without the remainder's quadratic form (its eigenproblems are 3–5× the rest
                # of a pass on the Fashion-MNIST models, and it changed no verdict of this pass on
                # the 3-block one; docs/bounds.md §5.1, "Refined ranges")
                low, ok, certified, diag = self.one_pass(eps, images, split, refine=False)
                per[images.cpu()] = (time.perf_counter() - start) / len(images)
                if size > 1 and int((sum(diag.unstable) + sum(diag.straddling)).max()) > CHUNK_SYMBOLS:
                    size = 1  # a large set: the rest one image at a time (CPU_CHUNK)
                # images left uncertified again, with the quadratic form and every unit's range refined
                # by the backward pass: it costs two functionals per unstable unit through every stage
                # before it, so only where the cheap pass did not suffice, and not where it fell short
                # by more than HOPELESS margins. Each margin takes the better of the passes' sound bounds
                left = ~certified & ~hopeless(low, self.logits[images], self.labels[images])
                left = left.nonzero()[:, 0]
                for part in left.split(len(left) if self.logits.is_cuda else 1):
                    if not len(part):
                        continue
                    start = time.perf_counter()
                    again = self.one_pass(eps, images[part], split, refine=True)
                    low[part] = torch.maximum(low[part], again[0])
                    ok[part] = ok[part] | again[1]
                    diag = again[3].scattered(part, diag)
                    per[images[part].cpu()] += (time.perf_counter() - start) / len(part)
                lower[images], verified[images] = low, ok
                diags.append(diag)
                done.append(images)
        lower = lower.scatter(-1, self.labels[:, None], math.inf)
        verified = verified | F.one_hot(self.labels, lower.shape[-1]).bool()
        certified = verified.all(-1) & which
        diag = self._nothing(slice(None))[3]
        if done:
            diag = Diagnostics.cat(diags).scattered(torch.cat(done), diag)
        return NetCertificate(lower, certified, diag, float(per.sum()), verified, per,
                              DETERMINISTIC & self.ledger.certificate)

    def _nothing(self, images: slice | Tensor, stopped: bool = False):
        """What :meth:`one_pass` returns for images that were not certified: no bound, no verdict, and
        of the diagnostics the clean margin to the closest class alone (the losses NaN: not computed;
        no unit counted); ``stopped``: a pass that stopped where every image was refused."""
        logits, y = self.logits[images], self.labels[images]
        lower = torch.full_like(logits, -math.inf).scatter(-1, y[:, None], math.inf)
        verified = F.one_hot(y, logits.shape[-1]).bool()
        closest = (logits.gather(-1, y[:, None]) - logits).scatter(-1, y[:, None], math.inf).amin(-1)
        unknown = torch.full((len(y),), math.nan, dtype=logits.dtype, device=logits.device)
        none = torch.zeros(len(y), dtype=torch.long, device=logits.device)
        no = torch.zeros(len(y), dtype=torch.bool, device=logits.device)
        counts = [none] * len(self.layers)
        diag = Diagnostics(closest, unknown, unknown, {}, counts, counts, no, no | stopped)
        return lower, verified, torch.zeros_like(y, dtype=torch.bool), diag

    def _best(self, eps: float) -> NetCertificate:
        """:data:`BEST`: every margin the better of the :data:`BEST_OF` splits' bounds, each sound
        (docs/bounds.md §5.1, "The best split"); the second split only on the images the first leaves
        uncertified and classified right. Its diagnostics are those of the split that certified the
        image, the first's where neither did; its seconds the first's plus the second's on the images
        it ran on."""
        first = self.certify(eps, BEST_OF[0])
        rest = ~first.certified & self.correct
        key = (float(eps), BEST_OF[1])
        second = self.done[key] if key in self.done else self._split(eps, BEST_OF[1], rest)
        lower = torch.where(rest[:, None], torch.maximum(first.lower, second.lower), first.lower)
        verified = first.verified | (second.verified & rest[:, None])
        certified = first.certified | (verified.all(-1) & rest)
        per = first.image_seconds + torch.where(rest.cpu(), second.image_seconds, 0.0)  # seconds: on the CPU
        diag = second.diagnostics.where(certified & ~first.certified, first.diagnostics)
        return NetCertificate(lower, certified, diag, float(per.sum()), verified, per,
                              DETERMINISTIC & self.ledger.certificate)

    def one_pass(self, eps: float, images: slice | Tensor, split: str, refine: bool):
        """One pass on ``images``; a split ending in :data:`OPTIMIZED` tunes the ReLUs' slopes of the
        second pass's last backward pass (:mod:`bounds.network.slopes`), one ending in :data:`BRANCHED`
        branches on its costliest ReLUs where a margin is left short (:mod:`bounds.network.branches`)."""
        log: list = []
        split, _, tuned = split.partition("+")
        stages = self.stages(eps, images, log, refine, split, form=False)
        if stages[-1][0] == REFUSED:  # every image refused at some LayerNorm
            return self._nothing(images, stopped=True)
        unstable = [count for name, _, count in stages if name.startswith("ffn")]
        straddling = [count for name, _, count in stages if re.fullmatch(r"(project|norm)\d+", name)]
        return self._margins(stages[-1][1], eps, unstable, straddling, images, log,
                             optimize=refine and f"+{tuned}" == OPTIMIZED, curved=refine,
                             branch=refine and f"+{tuned}" == BRANCHED)

    def stages(self, eps: float, images: slice | Tensor = slice(None), log: list | None = None,
               refine: bool = False, split: str = "taylor", form: bool = True,
               refuse: bool = True) -> list[tuple[str, DeviationSet | Mapped, Tensor | None]]:
        """The deviation set after every stage (``project<k>``, ``attention<k>``, ``ffn<k>``) with the
        stage's count of relaxed units (straddling tokens, unstable neurons; None for attention), for
        the ``images`` of the batch; ``log`` (a list) receives what :func:`backward` needs, and with
        ``refine`` the ranges of the units that can cross a kink are intersected with the backward
        pass's over the stages before them (docs/bounds.md §5.1); attention's remainder takes its
        quadratic form (``bounds.remainder.remainder``) with ``refine`` only. Without ``form`` the
        last FFN's set is left :class:`Mapped` (what :meth:`_margins` reads). With ``refuse`` a block's
        LayerNorm refuses an image whose set exceeds its range at every token (its set emptied), and
        where every image's set was refused the list stops, its last entry :data:`REFUSED`: the stages
        after it would cost a pass for nothing. Without it every set is a bound (as tests read them)."""
        B = len(self.labels[images])
        n, d, P = self.embed.shape
        like = self.logits[images]
        S = DeviationSet.ball_of(self.embed.expand(B, n, d, P), like.new_full((B,), self.embed_norm * eps))
        out = []
        refine = self._refiner(log, eps) if log is not None and refine else None
        if refine is not None and n * d <= BALL_ND:  # the second pass: E as columns too
            S = S.carry_balls()
        for k, block in enumerate(self.net.blocks):
            entry = tuple(t.expand(B, *t.shape[1:]) for t in self.entry_radii(eps)) if k == 0 else None
            if block.standard:
                S = self._standard_block(S, k, block, eps, images, log, refine, split, entry, out,
                                         refuse)
                if refused(S):
                    out.append((REFUSED, S, None))
                    return out
                continue
            if block.norm is not None:  # the vanilla variant: LayerNorm where LayerProject is
                S, s = normalize(S, self.raw[k][images], block.norm, eps, k, log, radii=entry, refuse=refuse,
                                 refine=refine if k else None)
                out.append((f"norm{k}", S, s))
                if refused(S):
                    out.append((REFUSED, S, None))
                    return out
            else:
                S, s = project(S, self.raw[k][images], self.net.cfg.R, eps, k, log, refine if k else None,
                               every=refine is not None, radii=entry, span=self.span if k == 0 else None)
                out.append((f"project{k}", S, s))
            S = self._attention(S, k, images, log, refine, split, eps)
            out.append((f"attention{k}", S, None))
            last = k == len(self.net.blocks) - 1
            S, u = ffn(S, block, self.mids[k][images], self.lip[k], eps, log, refine, form or not last)
            out.append((f"ffn{k}", S, u))
        if self.net.standard:  # the final norm (every token; the margins read one, or the mean)
            S, s = normalize(S, self.last[images], self.net.norm, eps, "_out", log, refuse=False,
                             refine=refine)
            out.append(("norm_out", S, s))
        return out

    def _attention(self, S: DeviationSet, k: int, images: slice | Tensor, log: list | None,
                   refine: Refine | None, split: str, eps: float) -> DeviationSet:
        """Block k's attention on S, with the clean parts kept per block and images; the quadratic
        form of its remainder costs h·n²-wide eigenproblems, so the second pass (``refine``) alone."""
        return attention(S, self.layers[k], self.inputs[k][images], k, log, split,
                         quadratic=refine is not None,
                         cache=self.clean_parts.setdefault((k, *_key(images)), AttentionCache()), eps=eps,
                         ledger=self.ledger, form_entries=self.form_entries)

    def _standard_block(self, S: DeviationSet, k: int, block, eps: float, images: slice | Tensor,
                        log: list | None, refine: Refine | None, split: str,
                        entry: tuple[Tensor, Tensor] | None, out: list, refuse: bool) -> DeviationSet:
        """A standard pre-LayerNorm block: X + A(LN₁X), then + M(LN₂·), each residual the sum of the
        set and its branch's (:meth:`DeviationSet.plus`), marked by a fork and a join in ``log`` for
        the backward pass (docs/bounds.md §5.1, "Residual branches")."""
        mark = (lambda rec: log.append(rec)) if log is not None else (lambda rec: None)
        mark(Fork())
        S1, s = normalize(S, self.raw[k][images], block.norm, eps, k, log, radii=entry, refuse=refuse,
                          refine=refine if k else None)
        out.append((f"norm{k}", S1, s))
        branch = self._attention(S1, k, images, log, refine, split, eps)
        mark(Join())
        S = S.plus(branch)
        out.append((f"attention{k}", S, None))
        if refused(S):  # the FFN's branch would cost its share of a pass for nothing
            return S
        mark(Fork())
        # the FFN's branch is per token: E's map across it is tracked from the fork (DeviationSet.fork)
        S2, s = normalize(S.fork(), self.mids[k][images], block.norm2, eps, f"{k}b", log, refuse=refuse,
                          refine=refine)
        out.append((f"norm{k}b", S2, s))
        branch, u = ffn(S2, block, self.mid_norms[k][images], self.lip[k] - 1.0, eps, log, refine,
                        residual=False)
        mark(Join())
        S = S.plus(branch)
        out.append((f"ffn{k}", S, u))
        return S

    def entry_radii(self, eps: float) -> tuple[Tensor, Tensor]:
        """The first block's input set's token radii [1, n] and radius [1] at ``eps``: that set, the
        pixels' ball through the embedding, is the same for every image, so its Grams and their
        eigenvalues are computed once per ε, not per image. Where every pixel moves one token
        (``constants.patch_columns``) G₀ᵀG₀ is block diagonal by token, so ‖G₀‖ = max_t ‖G_t‖ and each ‖G_t‖
        is the norm of its m nonzero columns: m×m Grams in place of d×d and P×P ones."""
        key = float(eps)
        if key not in self.entry:
            route = self.logits.new_full((1,), self.embed_norm * eps)
            cols = self.patch
            if cols is None:
                S = DeviationSet.ball_of(self.embed[None], route)
                r = S.token_radii(eps)
                self.entry[key] = (r, S.radius(eps, r))
            else:
                r = eps * gram_norm(cols.mT @ cols)[None]  # [1, n]
                self.entry[key] = (r, torch.minimum(route, torch.minimum(r.norm(dim=-1), r.amax(-1))))
        return self.entry[key]

    def _refiner(self, log: list, eps: float) -> Refine:
        """:data:`Refine` over the stages logged so far: each functional's range of ⟨c, Δ⟩ from the
        backward pass in both directions (with its rounding slack), intersected with the forward one."""
        def refine(units: Tensor, lo: Tensor, hi: Tensor) -> tuple[Tensor, Tensor]:
            both, mag = backward(log, torch.cat([units, -units], 1), self.embed, eps)
            both = both - ROUND * mag
            k = units.shape[1]
            return torch.maximum(lo, both[:, :k]), torch.minimum(hi, -both[:, k:])
        return refine

    def _curved(self, log: list, Lam: Tensor, eps: float, margins: Tensor, scale: Tensor, back: Tensor,
                mag: Tensor, losses: Losses, done: Tensor,
                beyond: dict[str, Tensor] | None = None) -> tuple[Tensor, Tensor]:
        """The margins [B, C] that neither the backward bound ``back`` nor the forward one (``done``)
        verifies, bounded again by a backward pass whose attention steps take the second order exactly
        along them (``curved_log``; docs/bounds.md §5.1, "Attention's remainder along a functional, its
        second order exact"): each margin the better of the two sound bounds, ``losses`` the better's.
        Only the classes left short pay the Hessians. ``beyond``: charges [B, C] of stages outside
        ``log`` by their names (:meth:`_sign`'s final norm), taken off both passes' bounds alike."""
        again = curved_log(log)
        need = (margins + back <= ROUND * (scale + mag)) & ~done
        # the pass lowers only attention's charges, each at least 0: a margin short by more than they
        # sum to stays short, and so does its image, whose other margins are then not asked either
        att = sum((v for k, v in losses.remainders.items() if k.startswith("attention")),
                  torch.zeros_like(back))
        hopeful = (~need | (margins + back + att > ROUND * (scale + mag - att))).all(-1)
        asked = need & hopeful[:, None]
        short = asked.any(0).nonzero()[:, 0]  # any image's
        if again is None or not len(short):
            return back, mag
        more = Losses()
        back2, mag2 = backward(again, Lam[:, short], self.embed, eps, more)
        for name, charge in (beyond or {}).items():
            back2, mag2 = back2 - charge[:, short], mag2 + charge[:, short]
            more.remainders[name] = charge[:, short]
        # an image takes the pass on its own short margins alone, so that its bounds do not depend on
        # which images share its batch (the columns are any image's)
        take = asked[:, short] & (back2 - ROUND * mag2 > back[:, short] - ROUND * mag[:, short])
        pick = lambda new, old: old.index_copy(1, short, torch.where(take, new, old[:, short]))
        losses.first_order = pick(more.first_order, losses.first_order)
        losses.kinks = pick(more.kinks, losses.kinks)
        zero = torch.zeros_like(back)
        for name in dict.fromkeys([*losses.remainders, *more.remainders]):
            new = more.remainders.get(name, zero[:, short])
            losses.remainders[name] = pick(new, losses.remainders.get(name, zero))
        return pick(back2, back), pick(mag2, mag)

    def _sign(self, log: list, Lam: Tensor, rows: Tensor, y: Tensor, others: Tensor,
              images: slice | Tensor) -> tuple[list, Tensor, dict[str, Tensor], Tensor] | None:
        """Where a final LayerNorm's class token is all the head reads: the margins' functionals
        ``Lam`` [B, C, N, d] moved before that norm twice, [B, 2C, N, d] — its first C by the norm's
        Jacobian (its remainder the charge), its last C through the margins' sign
        (:func:`margin_sign`; docs/bounds.md §5.1, "The final LayerNorm through the margins' sign") —
        with the log before the norm, the charges [B, 2C] under the norm's name and the sign's ratio
        ρ₀/ρ_max [B].
        None elsewhere."""
        norm = self.net.norm
        if (self.net.cls is None or not isinstance(norm, torch.nn.LayerNorm) or not log
                or not isinstance(log[-1], NormRecord)):
            return None
        rec = log[-1]
        step = rec.step(Lam)
        W, b = self.net.head_matrix(), self.net.head_bias()
        beta = norm.bias.detach().to(W) if norm.bias is not None else W.new_zeros(W.shape[1])
        k = (rows @ beta) + b[y][:, None] - b[others]
        g, charge, ratio = margin_sign(norm, self.last[images][:, 0], rows, k, rec.radii[:, 0])
        sign = torch.zeros_like(step.Lam)
        sign[:, :, 0] = g
        charges = {rec.name: torch.cat([step.charge, charge], 1)}
        return log[:-1], torch.cat([step.Lam, sign], 1), charges, ratio

    def _margins(self, S: DeviationSet | Mapped, eps: float, unstable, straddling, images: slice | Tensor,
                 log: list, optimize: bool = False, curved: bool = False, branch: bool = False):
        W = self.net.head_matrix()
        y = self.labels[images]
        logits = self.logits[images]
        mapped = S if isinstance(S, Mapped) else None
        S = S.S if mapped else S
        N = S.c.shape[1]  # every token; a head on the class token reads it alone
        S = S.token(0) if self.net.cls is not None else S
        n = S.c.shape[1]
        # the classes j ≠ y alone (m_y ≡ 0 needs no bound): [B, C − 1], each image's in order
        at = torch.arange(W.shape[0] - 1, device=y.device)[None]
        others = at + (at >= y[:, None])
        rows = (W[y][:, None, :] - W[others]) / n  # [B, C − 1, d]: the functional per token of m_j
        fro = rows.norm(dim=-1) * math.sqrt(n)  # ‖c_j‖_F over the n tokens
        balls = fro[..., None] * S.rho[:, None, :]  # [B, C, S]
        if mapped is None:
            first = eps * torch.einsum("bcd,bndp->bcp", rows, S.G).norm(dim=-1)
            kinks = torch.einsum("bcd,bndm->bcm", rows, S.A).abs().sum(-1)
            shift = torch.einsum("bcd,bnd->bc", rows, S.c)
            groups = torch.einsum("bcd,bndkg->bckg", rows, S.Q).norm(dim=-1)  # [B, C, k]
        else:  # ⟨c, L_tΔ_t + shift_t⟩ = ⟨L_tᵀc, Δ_t⟩ + ⟨c, shift_t⟩: per token, through the map
            F = mapped.pull(rows)  # [B, C, n, d]
            B, C = F.shape[:2]  # one product of [C, n·d] and [n·d, P] (an einsum copied G first)
            first = eps * (F.reshape(B, C, -1) @ S.G.reshape(B, -1, S.G.shape[-1])).norm(dim=-1)
            kinks = (torch.einsum("bcnd,bndm->bcm", F, S.A).abs().sum(-1)
                     + torch.einsum("bcd,bndm->bcm", rows, mapped.new).abs().sum(-1))
            shift = torch.einsum("bcnd,bnd->bc", F, S.c) + torch.einsum("bcd,bnd->bc", rows, mapped.shift)
            groups = torch.einsum("bcnd,bndkg->bckg", F, S.Q).norm(dim=-1)
        if S.W is not None and S.W.shape[-1]:  # E as columns: each source's share of ‖Wᵀc‖ where smaller
            # (through the map, ⟨c, L_tE_t⟩ = ⟨L_tᵀc, E_t⟩ with W before it: the columns' part alone, as
            # the radii ρ are those after the map, which ‖L_tᵀc‖ must not multiply)
            carried = S.column_support(F if mapped is not None else rows[:, :, None, :].expand(-1, -1, n, -1))
            total = balls.sum(-1)
            share = carried / total.clamp_min(torch.finfo(total.dtype).tiny)
            balls = balls * torch.where(total > carried, share, 1.0)[..., None]
        names = list(dict.fromkeys(S.sources + S.groups))
        of = lambda name: [j for j, s in enumerate(S.groups) if s == name]
        balls = torch.stack([balls[..., [i for i, s in enumerate(S.sources) if s == name]].sum(-1)
                             + S.only(name).grouped(groups[..., of(name)]) for name in names], -1) \
            if names else balls
        lower = shift - first - kinks - balls.sum(-1)
        own = logits.gather(-1, y[:, None])
        logits_j = logits.gather(-1, others)
        margins = own - logits_j
        slack = ROUND * (own.abs() + logits_j.abs() + first + kinks + shift.abs() + balls.sum(-1))
        # the backward pass over the same ranges: CROWN's slopes per sign, remainders at their own
        # coefficients; each margin takes the better of the two sound bounds
        losses = Losses()
        Lam = rows[:, :, None, :].expand(-1, -1, n, -1)
        if N != n:  # the class token's functional, zero at every other token
            Lam = torch.cat([Lam, Lam.new_zeros(*Lam.shape[:2], N - n, Lam.shape[-1])], 2)
        C = Lam.shape[1]
        sign = self._sign(log, Lam, rows, y, others, images)
        # with a final LayerNorm read by the head on one token, the functionals start before it, twice:
        # through its Jacobian with its remainder, and through the margins' sign with its charge
        log_b, Lam, beyond, ratio = sign if sign is not None else (log, Lam, {}, None)
        charge = sum(beyond.values(), 0.0)
        two = (lambda T: torch.cat([T, T], 1)) if sign is not None else (lambda T: T)
        scale = two(own.abs() + logits_j.abs())  # the clean logits' part of the rounding slack
        back, mag = backward(log_b, Lam, self.embed, eps, losses)
        back, mag = back - charge, mag + charge
        losses.remainders.update(beyond)
        if curved:  # the margins left short, again with attention's second order exact along them
            done = margins + lower > slack  # the forward set's bound already verifies these
            back, mag = self._curved(log_b, Lam, eps, two(margins), scale, back, mag, losses, two(done),
                                     beyond)
        if optimize:  # the slopes tuned: each margin the better of the two (the diagnostics CROWN's)
            tuned, tuned_mag = optimized_backward(log_b, Lam, self.embed, eps, ROUND)
            tuned, tuned_mag = tuned - charge, tuned_mag + charge
            take = tuned - ROUND * tuned_mag > back - ROUND * mag
            back, mag = torch.where(take, tuned, back), torch.where(take, tuned_mag, mag)
        if branch:  # the margins still short, on the parts of the ball where their costliest ReLUs keep signs
            net = back - ROUND * mag
            # a margin the forward set's bound verifies needs no parts (and, branched first and failed,
            # would stop its image's other margins)
            need = (two(margins) + back <= ROUND * (scale + mag)) & ~two(margins + lower > slack)
            parts = branch_and_bound(log_b, Lam, self.embed, eps, need, ROUND * scale - two(margins), net,
                                     ROUND, charge if torch.is_tensor(charge) else None, self.branch_budget)
            # a part's bound is already net of its rounding slack: it stands with no magnitude left
            won = parts > net
            back, mag = torch.where(won, parts, back), torch.where(won, 0.0, mag)
        signed = None
        if sign is not None:  # the sign's reading (m̃'s units) where it verifies a margin the other does not
            verifies = two(margins) + back > ROUND * (scale + mag)
            signed = verifies[:, C:] & ~verifies[:, :C]
            fold = lambda T: torch.where(signed, T[:, C:], T[:, :C])
            back, mag = fold(back), fold(mag)
            losses.first_order, losses.kinks = fold(losses.first_order), fold(losses.kinks)
            losses.remainders = {s: fold(v) for s, v in losses.remainders.items()}
        back_slack = ROUND * (own.abs() + logits_j.abs() + mag)
        better = back - back_slack > lower - slack
        lower, slack = torch.where(better, back, lower), torch.where(better, back_slack, slack)
        if S.void is not None:  # a stage undefined in the image's ball: nothing is certified there
            lower = lower.masked_fill(S.void[:, None], -math.inf)
        total = margins + lower
        verified = total > slack
        if signed is not None:  # m̃'s bound verifies m's sign; as a bound of m, m = m̃·ρ₀/ρ(z) ≥ m̃·ρ₀/ρ_max
            lower = torch.where(better & signed, total * ratio[:, None] - margins, lower)
        ok = torch.ones_like(logits, dtype=torch.bool).scatter(-1, others, verified)  # True at j = y
        certified = verified.all(-1) & (logits.argmax(-1) == y)
        worst = (total - slack).argmin(-1, keepdim=True)
        pick = lambda T: T.gather(-1, worst)[:, 0]
        # the split of the bound each margin took: the forward set's or the backward pass's
        take = lambda b, f: pick(torch.where(better, b, f))
        zero = torch.zeros_like(lower)
        forward = {s: balls[..., i] for i, s in enumerate(names)}
        sources = dict.fromkeys([*names, *losses.remainders])
        diag = Diagnostics(pick(margins), take(losses.first_order, first),
                           take(losses.kinks, kinks - shift),
                           {s: take(losses.remainders.get(s, zero), forward.get(s, zero)) for s in sources},
                           unstable, straddling, pick(better),
                           torch.zeros_like(certified) if S.void is None else S.void.clone())
        return torch.full_like(logits, math.inf).scatter(-1, others, lower), ok, certified, diag
