"""``python -m bench certify``: certified accuracy of a trained ViT through the whole network
(docs/bounds.md §5, LoFAST Proposition 1 and this suite's pairwise-head test), against PGD on the
margin in the same ℓ2 ball of the image. A sample certified by a bound without a finding and broken
by PGD is a soundness violation (must be 0); those of a bound with a finding are counted apart."""

from __future__ import annotations

import argparse

import torch

import bounds
from bounds.certificates import KINDS
from bounds.network import check_network, network_bound
from bounds.network.netcrown import METHODS
from bounds.registry import CASCADE, CASCADE_FIRST, CASCADE_TN, PLUGIN_SHA256, TAYLOR_NET
from models import InputError
from models.imported.importer import check_source

from ..core.arglists import split_list
from ..core.env import device_name, resolve_device, set_threads, versions
from ..core.gate import DIRECT
from ..core.jsonout import dumps
from ..nets.accuracy import (
    CertifyRun,
    load_model,
    parse_eps,
    pick,
    run_certify,
    select_images,
)
from ..nets.from_file import check_data_path, check_normalization, is_network_file, load_network, read_data
from ..sweep.cases import num


def add_parser(subparsers) -> argparse.ArgumentParser:
    c = subparsers.add_parser("certify", help="certified accuracy of a ViT through the whole network, "
                              "against PGD on the margin")
    c.add_argument("--model", required=True, help="a ViT of this suite (.safetensors with its .json card), "
                   "or a network file another framework wrote (.onnx, or .pt2 from torch.export) with --data")
    c.add_argument("--dataset", default=None, help="digits (default) or fashion-mnist")
    c.add_argument("--data", default=None, metavar="FILE.pt",
                   help="the images and labels for a network file: (images, labels) or {'images': …, "
                        "'labels': …}, images [N, H, H] or [N, 1, H, H] in [0, 1]")
    c.add_argument("--mean", type=float, default=None, help="the mean a network file's input is normalized "
                   "by, (x − mean)/std, before the model (one channel; default 0): ε stays the radius over "
                   "the image in [0, 1]")
    c.add_argument("--std", type=float, default=None, help="the std of that normalization (default 1)")
    c.add_argument("--eps", default="0.02,0.05,0.1",
                   help="ℓ2 radii over the image in pixel space, comma-separated (default 0.02,0.05,0.1)")
    c.add_argument("--bounds", default=None, help="comma-separated bound names (default: every bound "
                   f"that certifies a network); {CASCADE} among them is --cascade")
    c.add_argument("--cascade", action="store_true", help=f"add the bound {CASCADE} (and {CASCADE_TN} "
                   f"where {TAYLOR_NET} runs; on a vanilla or standard ViT that one alone): {CASCADE_FIRST} "
                   "on every image, whole-network CROWN on the correctly classified ones it leaves "
                   "uncertified (needs auto_LiRPA)")
    c.add_argument("--limit", type=int, default=None, help="the first N test images (default all; from "
                   "--offset on where given)")
    c.add_argument("--offset", type=int, default=0, metavar="N",
                   help="skip the first N test images (default 0)")
    c.add_argument("--sample", type=int, default=None, metavar="N",
                   help="N test images drawn at random without replacement, from --seed (instead of "
                        "--limit/--offset); their indices are in the JSON")
    c.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    c.add_argument("--pgd-steps", type=int, default=100, help="PGD steps (PGD-20: 20; default 100)")
    c.add_argument("--pgd-restarts", type=int, default=8, help="random starts (default 8; plus one "
                   "along -∇margin)")
    c.add_argument("--seed", type=int, default=0, help="PGD's random starts and --sample's draw (default 0)")
    c.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    c.add_argument("--threads", dest="certify_threads", type=int, default=None, metavar="N",
                   help="torch CPU threads (default: the global --threads, else 1)")
    return c


def _key(eps: float) -> str:
    return num(eps)


def summary(res: CertifyRun) -> dict:
    """The aggregates: accuracies, violations, seconds per sample and certificates."""
    n, findings = res.n, {b: bounds.get(b).finding for b in res.bounds
                          if b in bounds.REGISTRY and bounds.get(b).finding}
    frac = lambda t: float(t.double().mean())
    out: dict = {"clean_accuracy": frac(res.correct), "certified_accuracy": {},
                 "certified_accuracy_prop1": {},
                 "pgd_accuracy": {_key(e): frac(~res.pgd_broken[e]) for e in res.eps},
                 "violations": 0, "finding_violations": {}, "seconds_per_sample": {}, "certificates": {},
                 "findings": findings}
    for b in res.bounds:
        out["certified_accuracy"][b] = {_key(e): frac(res.pairwise[(b, e)]) for e in res.eps}
        out["certified_accuracy_prop1"][b] = {_key(e): frac(res.prop1[(b, e)]) for e in res.eps}
        # one ε's certificate on its own (norms reused from another ε or bound are counted)
        out["seconds_per_sample"][b] = sum(res.seconds[(b, e)] for e in res.eps) / (n * len(res.eps))
        certs = [res.certificates[(b, e)] for e in res.eps]
        worst = max(certs, key=lambda c: (KINDS.index(c.kind), c.p))
        out["certificates"][b] = {"kind": worst.kind, "p": worst.p}
        broken = sum(int((res.pairwise[(b, e)] & res.pgd_broken[e]).sum()) for e in res.eps)
        # a value below the feature change PGD attained is refuted as well, certified or not
        below = sum(int((res.delta[(b, e)] < res.pgd_features[e] * (1 - 1e-6)).sum()) for e in res.eps)
        if b in findings:
            out["finding_violations"][b] = broken + below
        else:
            out["violations"] += broken + below
    out["pgd_seconds_per_sample"] = sum(res.pgd_seconds.values()) / (n * len(res.eps))
    return out


def null_reasons(res: CertifyRun) -> dict[str, str]:
    """Why a bound's per-sample ``delta`` holds nulls in the JSON (strict JSON has no NaN): a direct
    verification of the margins has no δ_features; any other bound's null is a value it could not
    compute at that sample."""
    out = {}
    for b in res.bounds:
        if not any(bool(torch.isnan(res.delta[(b, e)]).any()) for e in res.eps):
            continue
        out[b] = ("no δ_features: it verifies the margins directly (its verdict is in certified)"
                  if b in DIRECT else "δ_features could not be computed at those samples (NaN)")
    return out


def per_sample(res: CertifyRun, index: torch.Tensor) -> dict:
    """Columns over the samples: the test-set index, label, margin, and per bound and ε δ and both
    tests; per ε PGD."""
    col = lambda t: t.tolist()
    return {"index": col(index), "label": col(res.labels), "margin": col(res.margin),
            "correct": col(res.correct),
            "delta": {b: {_key(e): col(res.delta[(b, e)]) for e in res.eps} for b in res.bounds},
            "certified": {b: {_key(e): col(res.pairwise[(b, e)]) for e in res.eps} for b in res.bounds},
            "certified_prop1": {b: {_key(e): col(res.prop1[(b, e)]) for e in res.eps} for b in res.bounds},
            "sent_to_crown": {b: {_key(e): col(v) for (b2, e), v in res.sent.items() if b2 == b}
                              for b in {b for b, _ in res.sent}},
            "diagnostics": {b: {_key(e): {f: col(v) for f, v in d.items()}
                                for (b2, e), d in res.diagnostics.items() if b2 == b}
                            for b in {b for b, _ in res.diagnostics}},
            "pgd_broken": {_key(e): col(res.pgd_broken[e]) for e in res.eps},
            "pgd_margin": {_key(e): col(res.pgd_margin[e]) for e in res.eps}}


def table(res: CertifyRun, s: dict) -> str:
    w = max(16, *(len(b) + 5 for b in res.bounds))  # the bound column: the longest name and " (!)"
    head = (f"{'bound':<{w}}" + "".join(f"{'ε=' + _key(e):>17}" for e in res.eps)
            + f"{'s/sample':>10}  certificate")
    direct = [b for b in res.bounds if b in DIRECT]  # named only where they ran
    said = (f" ({', '.join(direct)}: a direct verification of the margins, the same verdict in both)"
            if direct else "")
    lines = [f"certified accuracy: pairwise test (ours) / LoFAST Proposition 1{said}", head,
             "-" * len(head)]
    for b in res.bounds:
        pair, prop = s["certified_accuracy"][b], s["certified_accuracy_prop1"][b]
        cells = "".join(f"{pair[_key(e)]:>8.4f} / {prop[_key(e)]:.4f}" for e in res.eps)
        cert = s["certificates"][b]
        mark = " (!)" if b in s["findings"] else ""
        lines.append(f"{b + mark:<{w}}{cells}{s['seconds_per_sample'][b]:>10.4f}  {cert['kind']}"
                     + (f" (p={cert['p']:.1e})" if cert["kind"] == "probabilistic" else ""))
    lines.append(f"{'PGD robust':<{w}}" + "".join(f"{s['pgd_accuracy'][_key(e)]:>17.4f}" for e in res.eps)
                 + f"{s['pgd_seconds_per_sample']:>10.4f}")
    lines += ["", f"soundness violations (certified by a bound without a finding yet broken by PGD, or "
              f"below the feature change PGD attained): {s['violations']}"]
    for b, why in s["findings"].items():
        lines.append(f"(!) {b}: published as a bound, but {why}; its certified-yet-broken samples: "
                     f"{s['finding_violations'][b]}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.certify_threads is not None:
        if args.certify_threads < 1:
            raise InputError(f"--threads must be at least 1, got {args.certify_threads}")
        set_threads(args.certify_threads)
    eps = parse_eps(args.eps)
    names = split_list("--bounds", args.bounds) if args.bounds is not None else None
    cascade = args.cascade or bool({CASCADE, CASCADE_TN} & set(names or []))
    if names is not None:  # a cascade named as a bound is --cascade (alone: beside its first bound)
        firsts = [TAYLOR_NET] if CASCADE_TN in names and TAYLOR_NET not in names else []
        names = [n for n in names if n not in (CASCADE, CASCADE_TN)] + firsts or [CASCADE_FIRST]
    for name in names or []:
        network_bound(name)  # refuse before loading anything
    for name in (names or []) + (["crown"] if cascade else []):
        if name in METHODS:
            network_bound(name).check()  # auto_LiRPA missing: one error line before any work
    # named as the flags, not as the library's words, and before the model or the data is read
    for flag, value, least in (("--limit", args.limit, 1), ("--offset", args.offset, 0),
                               ("--sample", args.sample, 1)):
        if value is not None and value < least:
            raise InputError(f"{flag} must be at least {least}, got {value}")
    if args.sample is not None and (args.limit is not None or args.offset):
        raise InputError("--sample draws from the whole test set: give it without --limit and --offset")
    if args.seed < 0:
        raise InputError(f"--seed must be >= 0, got {args.seed}")
    if args.pgd_steps < 0 or args.pgd_restarts < 1:
        raise InputError(f"--pgd-steps must be >= 0 and --pgd-restarts >= 1, got {args.pgd_steps} "
                         f"and {args.pgd_restarts}")
    from_file = is_network_file(args.model)
    if from_file:
        if args.data is None:
            raise InputError(f"{args.model}: a network file is certified on --data FILE.pt (its images and "
                             f"labels)")
        if args.dataset is not None:
            raise InputError("--dataset and --data: give one (--data for a network file)")
        check_source(args.model)
        check_data_path(args.data)
        mean, std = 0.0 if args.mean is None else args.mean, 1.0 if args.std is None else args.std
        check_normalization(mean, std)
    elif args.data is not None or args.mean is not None or args.std is not None:
        raise InputError("--data, --mean and --std are for a network file (.onnx, .pt2); a ViT card is "
                         "certified on --dataset")
    dataset = args.data if from_file else args.dataset or "digits"
    device = resolve_device(args.device)
    if from_file:
        X, y = read_data(args.data)
        images, labels, index = pick(X, y, f"--data {args.data}", args.limit, offset=args.offset,
                                     sample=args.sample, seed=args.seed)
        net, card = load_network(args.model, images, labels, mean, std)
        check_network(net, names, cascade)
    else:
        net, card = load_model(args.model)
        check_network(net, names, cascade)
        images, labels, index = select_images(dataset, net, args.limit, offset=args.offset,
                                              sample=args.sample, seed=args.seed)
    res = run_certify(net, images, labels, eps, names, steps=args.pgd_steps, restarts=args.pgd_restarts,
                      seed=args.seed, device=device, progress=True, cascade=cascade)
    s = summary(res)
    cfg = net.cfg
    keys = (("source", "format", "sha256", "mean", "std", "dtype", "max_rel_err") if from_file else
            ("dataset", "variant", "constraint", "ffn_constraint", "test_accuracy", "sha256"))
    s["meta"] = {"model": str(args.model), "card": {k: card.get(k) for k in keys},
                 "architecture": cfg.to_dict(), "dataset": str(dataset), "n": res.n, "eps": eps,
                 "offset": args.offset, "sample": args.sample,
                 "pgd_steps": args.pgd_steps, "pgd_restarts": args.pgd_restarts, "seed": args.seed,
                 "device": device.type, "device_name": device_name(device), "versions": versions(),
                 "threads": torch.get_num_threads(), "bounds": res.bounds,
                 "plugins": {b: PLUGIN_SHA256[b] for b in res.bounds if b in PLUGIN_SHA256}}
    if args.json:
        # NaN (CROWN's δ, a failed bound's) is null; the reason beside it, per bound
        print(dumps(s | {"nulls": null_reasons(res), "samples": per_sample(res, index)}))
        return 0
    if from_file:
        print(f"{args.model}: recovered as a standard ViT ({cfg.norm} norm, {cfg.activation}, {cfg.pool} "
              f"pooling); its logits reproduce the runtime's to {card['max_rel_err']:.2g} relative")
    which = (f"{res.n} test images drawn with seed {args.seed}" if args.sample is not None else
             f"the first {res.n} test images" if not args.offset else
             f"test images {args.offset}–{args.offset + res.n - 1}")
    print(f"{args.model}: {cfg.variant} ViT, depth {cfg.depth}, {cfg.heads} heads, d {cfg.d}, "
          f"c {cfg.constraint}; {dataset}, {which}; "
          f"clean accuracy {s['clean_accuracy']:.4f}")
    print(f"PGD on the margin: {args.pgd_steps} steps, {args.pgd_restarts} random starts + 1 along -∇margin, "
          f"seed {args.seed}; ε is the ℓ2 radius over the image (pixels in [0, 1])\n")
    print(table(res, s))
    return 0
