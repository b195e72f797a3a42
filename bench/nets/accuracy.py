"""Certified and empirical robustness of a ViT over test images (docs/bounds.md §5): every network
bound at every ε (LoFAST Proposition 1 and the pairwise-head test), PGD on the margin at every ε,
and the soundness check that joins them. ``python -m bench certify`` and the ``certify`` task both
compute through :func:`run_certify`; the Cauchy task's per-block Jacobian norms are here too.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor
from tqdm import tqdm

from attacks.margin import attack_margin, margin
from bounds.certificates import Certificate
from bounds.network import Certifier, check_network, default_bounds, network_bound
from bounds.network.netcrown import METHODS, RELAXATION, BatchStore, TracedViT, batch_key, net_digest, verify
from bounds.network.taylor_net import Diagnostics, TaylorNet
from bounds.norms import exact_norm
from bounds.registry import CASCADE, CASCADE_TN, CASCADES, TAYLOR_NET, TAYLOR_NETS
from models import InputError, check_eps
from models.data import SHAPES, load_dataset
from models.operators import DENSE_LIMIT, jacobian_lanczos, jacobian_matrix
from models.vit import ViT
from models.vit_io import load_vit

from ..core.arglists import split_list

# Samples per batch: the dense certified norms hold [chunk, nd, nd] float64 matrices (8 MB each at
# n·d = 1024), so a chunk of 32 keeps a few hundred MB at most. On a GPU a chunk is one batch of every
# kernel of the ≈ 126 Lanczos steps per norm: 256 samples amortise the launches (≈ 2 GB at nd = 1024)
CHUNK = 32
GPU_CHUNK = 256


def chunk_size(device: torch.device | str) -> int:
    """Samples certified as one batch on ``device``."""
    return GPU_CHUNK if torch.device(device).type == "cuda" else CHUNK


@dataclass
class CertifyRun:
    """Per sample (the first N test images): label, clean margin, and per (bound, ε) δ_features
    and both tests; per ε the attack's worst margin, its verdict and the feature change it caused
    (‖φ(x + γ) − φ(x)‖, attained, so a lower bound of the true δ_features)."""

    labels: Tensor
    margin: Tensor
    correct: Tensor
    eps: list[float]
    bounds: list[str]
    delta: dict[tuple[str, float], Tensor] = field(default_factory=dict)
    prop1: dict[tuple[str, float], Tensor] = field(default_factory=dict)
    pairwise: dict[tuple[str, float], Tensor] = field(default_factory=dict)
    certificates: dict[tuple[str, float], Certificate] = field(default_factory=dict)
    seconds: dict[tuple[str, float], float] = field(default_factory=dict)  # whole batch, on its own
    pgd_margin: dict[float, Tensor] = field(default_factory=dict)
    pgd_broken: dict[float, Tensor] = field(default_factory=dict)
    pgd_features: dict[float, Tensor] = field(default_factory=dict)
    pgd_seconds: dict[float, float] = field(default_factory=dict)
    # per (cascade, ε): whether the cascade sent the image on to CROWN
    sent: dict[tuple[str, float], Tensor] = field(default_factory=dict)
    # per (taylor_net, ε): where its certificate spends the margin, per sample (bounds.network.taylor_net)
    diagnostics: dict[tuple[str, float], dict[str, Tensor]] = field(default_factory=dict)

    @property
    def n(self) -> int:
        return len(self.labels)


@dataclass
class _Collected:
    """One (bound, ε)'s results chunk by chunk, joined when the run ends: per chunk δ_features, both
    tests' verdicts, the certificate, the cascade's images sent on and taylor_net's diagnostics; the
    seconds of every chunk and of the last (a cascade takes its first bound's)."""

    delta: list[Tensor] = field(default_factory=list)
    prop1: list[Tensor] = field(default_factory=list)
    pairwise: list[Tensor] = field(default_factory=list)
    cert: list[Certificate] = field(default_factory=list)
    sent: list[Tensor] = field(default_factory=list)
    diag: list = field(default_factory=list)
    seconds: float = 0.0
    last_seconds: float = 0.0

    def direct(self, verdict: Tensor, certificate: Certificate, seconds: float) -> None:
        """A chunk certified by verifying the margins directly: no δ_features (NaN), one verdict."""
        self.delta.append(torch.full((len(verdict),), torch.nan, dtype=torch.float64))
        self.prop1.append(verdict)
        self.pairwise.append(verdict)
        self.cert.append(certificate)
        self.last_seconds = seconds
        self.seconds += seconds


@dataclass
class _Attacked:
    """The margin attack at one ε, chunk by chunk: worst margins, verdicts, feature changes, seconds."""

    margin: list[Tensor] = field(default_factory=list)
    broken: list[Tensor] = field(default_factory=list)
    features: list[Tensor] = field(default_factory=list)
    seconds: float = 0.0


def parse_eps(text: str) -> list[float]:
    """``0.02,0.05,0.1`` → [0.02, 0.05, 0.1]: each finite and > 0, no repeats."""
    values = [check_eps(s) for s in split_list("--eps", text)]
    if len(set(values)) != len(values):
        raise InputError(f"--eps lists a value twice: {text!r}")
    return values


def first_test_images(dataset: str, net: ViT, limit: int | None) -> tuple[Tensor, Tensor]:
    """The first ``limit`` test images and labels of a bundled dataset, checked against the network."""
    X, y, _ = select_images(dataset, net, limit)
    return X, y


def _count(value: int | None, name: str, least: int) -> None:
    if value is not None and (isinstance(value, bool) or value < least):
        raise InputError(f"{name} must be at least {least}, got {value}")


def select_images(dataset: str, net: ViT, limit: int | None = None, *, offset: int = 0,
                sample: int | None = None, seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """Test images [B, H, W], labels [B] and their indices in the test set [B] of a bundled dataset,
    checked against the network: the ``limit`` images from index ``offset`` on (all of them without
    ``limit``), or with ``sample`` a uniform draw of that many without replacement (``torch.randperm``
    from ``seed``, indices in ascending order), so a reader can cite which images were certified."""
    _count(limit, "the number of test samples", 1)
    _count(offset, "the offset", 0)
    _count(sample, "the sample size", 1)
    if sample is not None and (limit is not None or offset):
        raise InputError("a random sample is drawn from the whole test set: give the sample size "
                         "alone, without a limit or an offset")
    # a dataset's shape is known before it is loaded: a model of the other one is refused even where
    # that dataset is not installed
    if dataset in SHAPES and SHAPES[dataset] != (net.cfg.image, net.cfg.classes):
        side, classes = SHAPES[dataset]
        raise InputError(_mismatch(dataset, f"{side}×{side}", classes, net))
    _, _, X, y = load_dataset(dataset)
    classes = int(y.max()) + 1
    if tuple(X.shape[1:]) != (net.cfg.image, net.cfg.image) or classes > net.cfg.classes:
        raise InputError(_mismatch(dataset, "×".join(map(str, X.shape[1:])), classes, net))
    return pick(X, y, dataset, limit, offset=offset, sample=sample, seed=seed)


def pick(X: Tensor, y: Tensor, where: str, limit: int | None = None, *, offset: int = 0,
         sample: int | None = None, seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """(images, labels, indices) of :func:`select_images`'s choice among the images X of ``where`` (a
    dataset or a data file)."""
    want = sample if sample is not None else (limit or 0) + offset
    if want > len(X) or offset >= len(X):
        what = (f"a sample of {sample}" if sample is not None else
                f"images from index {offset}" if limit is None else
                f"the {limit} asked for from index {offset}" if offset else f"the {limit} asked for")
        raise InputError(f"{where} has {len(X)} test images, fewer than {what}")
    if sample is not None:
        idx = torch.randperm(len(X), generator=torch.Generator().manual_seed(seed))[:sample].sort().values
    else:
        idx = torch.arange(offset, len(X) if limit is None else offset + limit)
    return X[idx], y[idx], idx


def _mismatch(dataset: str, side: str, classes: int, net: ViT) -> str:
    """Why ``net`` cannot be certified on ``dataset``, naming the bundled datasets it fits (in words,
    not as a flag: certify's --dataset and a profile's ``dataset`` both come here)."""
    cfg = net.cfg
    fits = [name for name, shape in SHAPES.items() if shape == (cfg.image, cfg.classes)]
    hint = f"use it with {' or '.join(fits)}, whose images it takes" if fits else "no bundled dataset fits it"
    return (f"the model takes {cfg.image}×{cfg.image} images in {cfg.classes} classes, but {dataset} has "
            f"{side} images in {classes} classes; {hint}")


def load_model(path: str | Path) -> tuple[ViT, dict]:
    """``load_vit``, refusing a path that is not a file with one InputError line."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: no such model file")
    return load_vit(path)


def _cat(parts: list[Tensor]) -> Tensor:
    return torch.cat(parts) if parts else torch.empty(0)


def run_certify(net: ViT, images: Tensor, labels: Tensor, eps: list[float], names: list[str] | None = None,
                *, steps: int = 100, restarts: int = 8, seed: int = 0,
                device: torch.device | str = "cpu", memo: dict | None = None,
                progress: bool = False, cascade: bool = False,
                dtype: torch.dtype = torch.float64, store: BatchStore | None = None) -> CertifyRun:
    """Every bound (``names``, default those of :func:`bounds.network.network_bounds` that are not
    opt-in and take the network: on a vanilla ViT, taylor_net's) and PGD on the margin at every ε,
    in chunks of :func:`chunk_size` samples. ``memo`` (a dict, filled by the first call) keeps each
    chunk's trace and certified norms for a later call on the same network and images at other ε:
    the norms do not depend on ε. ``progress``: a bar over
    the images on stderr (450 images are minutes of work).

    ``crown`` and ``alpha_crown`` verify the margins of the whole network directly
    (:mod:`bounds.network.netcrown`): their δ_features is NaN, their verdict that of both tests. ``cascade``
    adds :data:`CASCADE`: naive on every image, CROWN on those it leaves uncertified (on a lofast ViT:
    naive needs its norm route), and :data:`CASCADE_TN`, the same with taylor_net first, where
    taylor_net runs
    (CROWN's verdicts and share of seconds reused where ``crown`` runs too).

    The margin attack searches in ``dtype`` and judges an image broken by its float64 margin
    (attacks.margin.attack_margin); the certified side is float64 whatever ``dtype``. ``store`` keeps
    CROWN's bounds batch by batch (:func:`bounds.network.netcrown.verify`) and each chunk's taylor_net
    certificates and PGD attacks, each with its seconds: a run cut short resumes there."""
    check_network(net, names, cascade)
    bounds_ = [network_bound(n) for n in names] if names else default_bounds(net)
    eps = [check_eps(e) for e in eps]
    # naive's cascade needs the norm route, which only a lofast ViT has (check_network)
    lofast = net.cfg.variant == "lofast"
    # the norm route's trace and norms, where a bound or the cascade takes them (never on a vanilla ViT)
    routed = (cascade and lofast) or any(b.name not in METHODS and b.name not in TAYLOR_NETS for b in bounds_)
    net = net.to(device)
    images, labels = images.to(device=device, dtype=torch.float64), labels.to(device)
    direct = [b for b in bounds_ if b.name in METHODS]
    for b in direct:
        b.check()
    traced = TracedViT(net) if direct or cascade else None
    digest = net_digest(net) if store is not None else ""  # the weights, in every kept result's key
    # the cascades: naive's on a lofast ViT, taylor_net's where taylor_net runs too (its verdicts reused)
    ran = [b.name for b in bounds_]
    wanted = {CASCADE: lofast, CASCADE_TN: TAYLOR_NET in ran}
    cascades = [name for name, runs in wanted.items() if runs] if cascade else []
    listed = ran + cascades
    keys = [(b, e) for e in eps for b in listed]
    parts = {k: _Collected() for k in keys}
    attack = {e: _Attacked() for e in eps}
    clean, chunk = [], chunk_size(device)
    traces = memo if memo is not None else {}  # taylor_net's clean trace per chunk, for every split and ε
    bar = tqdm(total=len(images), desc="certify", unit="image", file=sys.stderr, disable=not progress,
               mininterval=2)
    try:
        for i in range(0, len(images), chunk):
            x, y = images[i:i + chunk], labels[i:i + chunk]
            # without a memo each chunk's norms are dropped after it, not held to the end of the run
            held = memo.get(i) if memo is not None else None
            if held is None or (routed and held[0] is None):
                held = (Certifier(net, x, y) if routed else None, {})
                if memo is not None:
                    memo[i] = held
            cert, norms = held
            if cert is not None:
                clean.append(cert.logits)
            else:
                with torch.no_grad():
                    clean.append(net(x))
            # one chunk's norms (``norms``), shared by every bound and ε (ε-free)
            for e in eps:
                for b in bounds_:
                    p = parts[(b.name, e)]
                    if b in direct:
                        v = verify(net, x, y, e, b.name, traced, store, digest)
                        p.direct(v.certified, RELAXATION, v.seconds)
                        continue
                    if b.name in TAYLOR_NETS:
                        _taylor_net(p, net, x, y, e, traces, i, b.name, store, digest)
                        continue
                    c = cert.certify(b, e, norms)
                    p.delta.append(c.delta)
                    p.prop1.append(c.prop1)
                    p.pairwise.append(c.pairwise)
                    p.cert.append(c.certificate)
                    p.seconds += c.seconds
                for name in cascades:
                    _cascade(parts, net, x, y, e, cert, traced, name, norms, clean[-1], store, digest)
            with torch.no_grad():
                features = net.trace(x).features  # the clean features, the same for every ε
            for e in eps:
                kept = _attack(net, x, y, e, features, steps, restarts, seed + i, dtype, store, digest)
                attack[e].margin.append(kept["margin"].to(x.device))
                attack[e].broken.append(kept["broken"].to(x.device))
                attack[e].features.append(kept["features"].to(x.device))
                attack[e].seconds += float(kept["seconds"])
            bar.update(len(x))
    finally:  # an error (out of memory, Ctrl-C) ends the bar before its line is printed
        bar.close()
    logits = torch.cat(clean)
    out = CertifyRun(labels.cpu(), margin(logits, labels).cpu(), (logits.argmax(-1) == labels).cpu(),
                     eps, listed)
    for k, p in parts.items():
        out.delta[k], out.prop1[k], out.pairwise[k] = (_cat(t).cpu() for t in (p.delta, p.prop1, p.pairwise))
        out.certificates[k] = per_sample(p.cert)
        out.seconds[k] = p.seconds
        if p.sent:
            out.sent[k] = _cat(p.sent).cpu()
        if p.diag:
            # joined as Diagnostics: a source (a wild token's group) may be missing from a chunk
            out.diagnostics[k] = {f: v.cpu() for f, v in Diagnostics.cat(p.diag).columns().items()}
    for e, a in attack.items():
        out.pgd_margin[e], out.pgd_broken[e], out.pgd_features[e] = (
            _cat(t).cpu() for t in (a.margin, a.broken, a.features))
        out.pgd_seconds[e] = a.seconds
    return out


def _attack(net: ViT, x: Tensor, y: Tensor, eps: float, features: Tensor, steps: int, restarts: int,
            seed: int, dtype: torch.dtype, store: BatchStore | None, digest: str) -> dict:
    """PGD on the margin of one chunk at ``eps``: its worst margins, verdicts, the feature change it
    caused and its seconds, read from ``store`` where kept there, else computed and kept."""
    key = batch_key(digest, f"pgd|{steps}|{restarts}|{seed}|{dtype}", eps, x, y) if store is not None else ""
    kept = store.get(key) if store is not None else None
    if kept is not None:
        return kept
    start = time.perf_counter()
    a = attack_margin(net, x, y, eps, steps=steps, restarts=restarts, seed=seed, dtype=dtype)
    with torch.no_grad():
        moved = (net.trace(x + a.delta).features - features).norm(dim=-1)
    kept = {"margin": a.margin, "broken": a.broken, "features": moved, "seconds": time.perf_counter() - start}
    if store is not None:
        store.put(key, {k: v.cpu() if torch.is_tensor(v) else v for k, v in kept.items()})
    return kept


def _taylor_net(p: _Collected, net: ViT, x: Tensor, y: Tensor, eps: float, memo: dict, i: int,
                name: str = TAYLOR_NET, store: BatchStore | None = None, digest: str = "") -> None:
    """One chunk of a taylor_net bound (:data:`TAYLOR_NETS`: its split of attention) at ``eps``
    (bounds.network.taylor_net): the chunk's clean trace kept in ``memo`` for the other splits and ε,
    its verdict that of both tests (no δ_features), and its per-sample diagnostics. ``store``: where
    the chunk's result is kept once made, and read back (with its seconds) where it was (``digest``:
    the network's, :func:`bounds.network.netcrown.net_digest`)."""
    where = batch_key(digest, name, eps, x, y) if store is not None else ""
    kept = store.get(where) if store is not None else None
    paid = (TAYLOR_NET, i, "built")  # the chunk's trace, whose seconds the first split to run counts
    if kept is not None:
        certificate = Certificate(kept["kind"], float(kept["p"]), tuple(int(v) for v in kept["seeds"]))
        p.direct(kept["certified"].to(x.device), certificate, float(kept["built"] + kept["seconds"]))
        p.diag.append(Diagnostics.from_columns({k: None if v is None else v.to(x.device)
                                                for k, v in kept["diag"].items()}))
        memo[paid] = memo.get(paid, False) or kept["built"] > 0
        return
    key = (TAYLOR_NET, i)
    start = time.perf_counter()
    held = memo.get(key)
    if held is None:  # the weights' constants of an earlier chunk's TaylorNet serve this one
        kept = memo.get(TAYLOR_NET)
        held = memo[key] = TaylorNet(net, x, y, kept)
        memo[TAYLOR_NET] = held.constants
    # counted once a chunk, as in a run never cut: not again where a kept split counted it
    built = 0.0 if memo.get(paid) else time.perf_counter() - start
    memo[paid] = True
    # its own seconds: a split or ``best`` made before for another bound at this ε is reused, and its
    # seconds are counted again here, once, as they would be if this bound ran alone
    c = held.certify(eps, TAYLOR_NETS[name])
    p.direct(c.certified, c.certificate, built + c.seconds)  # the last seconds: for its cascade
    p.diag.append(c.diagnostics)
    if store is not None:
        diag = {k: None if v is None else v.cpu() for k, v in c.diagnostics.columns().items()}
        store.put(where, {"certified": c.certified.cpu(), "kind": c.certificate.kind, "p": c.certificate.p,
                          "seeds": list(c.certificate.seeds), "built": built, "seconds": c.seconds,
                          "diag": diag})


def _cascade(parts: dict[tuple[str, float], _Collected], net: ViT, x: Tensor, y: Tensor, eps: float,
             cert: Certifier | None, traced: TracedViT, name: str, norms: dict, logits: Tensor,
             store: BatchStore | None = None, digest: str | None = None) -> None:
    """One chunk of the cascade ``name`` (:data:`bounds.registry.CASCADES`) at ``eps``: its first
    bound's pairwise test on every image (naive's norms reused from the chunk's other bounds where
    they ran, through their cache ``norms``; taylor_net's verdicts and seconds taken from its own
    run on the chunk), CROWN on the correctly classified rest. Where ``crown`` ran on the chunk as
    well its verdicts are the same computation, so they are taken with its seconds per image times
    the number sent, not computed twice. ``cert`` (the chunk's norm route) is None where no bound
    takes it (taylor_net's cascade on a vanilla or standard ViT); ``logits`` are the chunk's clean ones."""
    first_name = CASCADES[name]
    if first_name == TAYLOR_NET:
        own = parts[(TAYLOR_NET, eps)]
        pairwise, seconds, certificate = own.pairwise[-1], own.last_seconds, own.cert[-1]
    else:
        first = cert.certify(first_name, eps, norms)
        pairwise, seconds, certificate = first.pairwise, first.seconds, first.certificate
    correct = logits.argmax(-1) == y
    sent = ~pairwise.to(correct.device) & correct  # a misclassified image is certified by nothing
    verdict = pairwise.cpu().clone()
    crown = parts.get(("crown", eps))
    if sent.any():
        if crown is not None:
            verdict[sent.cpu()] = crown.pairwise[-1][sent.cpu()]
            seconds += crown.last_seconds * int(sent.sum()) / len(x)
        else:
            v = verify(net, x[sent], y[sent], eps, "crown", traced, store, digest)
            verdict[sent.cpu()] = v.certified
            seconds += v.seconds
    p = parts[(name, eps)]
    p.direct(verdict, certificate & RELAXATION, seconds)
    p.sent.append(sent.cpu())


def per_sample(certs: list[Certificate]) -> Certificate:
    """The certificate of one sample's value when chunks were certified apart: the weakest kind and
    the largest per-value failure probability (a value rests on its own chunk's norms only)."""
    out = Certificate("exact")
    for c in certs:
        joined = out & c
        out = Certificate(joined.kind, max(out.p, c.p), joined.seeds)
    return out


def block_inputs(net: ViT, images: Tensor) -> list[Tensor]:
    """Each block's input before its LayerProject or LayerNorm: the point where the Cauchy view takes
    the block's Jacobian (``net.blocks[k]`` as the function)."""
    X, out = net.tokens(images), []
    with torch.no_grad():
        for block in net.blocks:
            out.append(X)
            X = block(X)
    return out


def block_sigmas(net: ViT, images: Tensor) -> tuple[list[Tensor], list[float], str]:
    """σ_max of every block's Jacobian at every image ([B] per block), the seconds per block, and how
    it is known: exact (the dense Jacobian's top Gram eigenvalue in float64, rounded up; twice as fast
    as its SVD) when n·d ≤ DENSE_LIMIT, else a Lanczos estimate."""
    sigmas, seconds = [], []
    dense = net.cfg.n_tokens * net.cfg.d <= DENSE_LIMIT
    with torch.no_grad():
        inputs = block_inputs(net, images.to(torch.float64))
    for block, X in zip(net.blocks, inputs, strict=True):
        start = time.perf_counter()
        parts = [exact_norm(jacobian_matrix(block, X[i:i + CHUNK])) if dense
                 else jacobian_lanczos(block, X[i:i + CHUNK]).sigma for i in range(0, len(X), CHUNK)]
        sigmas.append(torch.cat(parts).detach())
        seconds.append(time.perf_counter() - start)
    return sigmas, seconds, "exact" if dense else "estimate"
