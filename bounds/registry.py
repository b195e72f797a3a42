"""The explicit registry of every bound, and the one entry point that evaluates a bound on a layer
or a stack (docs/bounds.md §1.4: block k is bounded at its projected input X_k with radius ε_k = δ_{k−1})."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from models import InputError, Stack, as_batch, check_eps

from . import crown as crown_
from . import jacobian as jac
from . import lofast as lf
from . import taylor as tay
from .base import Bound, propagate
from .certificates import Certificate, Ledger, NormCache, book
from .lipschitz import castin as castin_
from .lipschitz import kim as kim_
from .lipschitz import olsa as olsa_
from .lipschitz import specformer as sf
from .lipschitz import yudin as yudin_

DOT, L2, OLSA_KIND = frozenset({"dot"}), frozenset({"l2"}), frozenset({"olsa"})
ALL = frozenset({"dot", "l2", "olsa"})
LOFAST = "Havens et al., LoFAST (seed 000)"
CROWN = "Zhang et al. 2018 (CROWN), through auto_LiRPA (Xu et al. 2020)"
# LoFAST Table 2's procedure (docs/bounds.md §5): the cheapest sound network bound on every image,
# whole-network CROWN on the correctly classified ones it leaves uncertified. naive is the cheapest by
# measurement (docs/results.md, "Certified accuracy of the trained ViTs")
CASCADE = "cascade_crown"
CASCADE_FIRST = "naive"
TAYLOR_NET = "taylor_net"
# taylor_net with each attention bound that can serve as its remainder (docs/bounds.md §5.1, "what
# the attention bound buys"): the name → bounds.network.taylor_net's split
TAYLOR_NETS = {TAYLOR_NET: "taylor", "taylor_net_lofast": "lofast", "taylor_net_lofast_half": "lofast_half",
               "taylor_net_best": "best", "taylor_net_alpha": "taylor+alpha",
               "taylor_net_bab": "taylor+bab"}
# the same cascade with taylor_net first: CROWN gets only what taylor_net leaves (docs/bounds.md §5.1)
CASCADE_TN = "cascade_taylor_net_crown"
CASCADES = {CASCADE: CASCADE_FIRST, CASCADE_TN: TAYLOR_NET}

def _network_only(layer, X, eps, *, ledger: Ledger | None = None):
    raise InputError(f"{CASCADE} certifies a whole network only: python -m bench certify --cascade")


def _taylor_net_only(layer, X, eps, *, ledger: Ledger | None = None):
    raise InputError(f"{TAYLOR_NET} certifies a whole network only: python -m bench certify --bounds "
                     f"{TAYLOR_NET}")


# ``biases=True``: docs/bounds.md §1.5 extends the bound to dot layers with biases (b_v and b_o cancel,
# P_l and the U, V of ‖M_l‖ and ξ_l are computed with b_q, b_k; Jacobians follow by autograd). The
# three bounds of §3 are formulas in ‖X‖_F and weight norms that §1.5 does not extend: they refuse.
BOUNDS: tuple[Bound, ...] = (
    Bound(name="naive_delta1", fn=lf.naive_delta1, paper=LOFAST, equation="eq. 12", certified=True,
          kinds=DOT, objective="delta1", biases=True, display="naive δ₁ (eq. 12)"),
    Bound(name="zeta", fn=lambda layer, X, eps, ledger=None: lf.zeta(layer, X, ledger=ledger), paper=LOFAST,
          equation="eq. 15",
          certified=True, kinds=DOT, objective=None,
          description="ζ(X) itself, a norm: compare delta1 = ζε with PGD", biases=True,
          display="ζ(X) (eq. 15)"),
    Bound(name="delta1", fn=lf.delta1, paper=LOFAST, equation="Lemma 1", certified=True, kinds=DOT,
          objective="delta1", biases=True, display="LoFAST δ₁ = ζε (Lemma 1)"),
    Bound(name="naive", fn=lf.naive, paper=LOFAST, equation="eq. 12 + eq. 28 (Fig. 1)", certified=True,
          kinds=DOT, stack="propagate", biases=True, display="naive (eq. 12 + 28)"),
    Bound(name="delta2_M", fn=lf.delta2_M, paper=LOFAST, equation="eq. 27", certified=True, kinds=DOT,
          objective="delta2", biases=True, display="LoFAST δ₂⁽¹⁾ (‖M‖)"),
    Bound(name="delta2_xi", fn=lf.delta2_xi, paper=LOFAST, equation="eq. 28", certified=True, kinds=DOT,
          objective="delta2", biases=True, display="LoFAST δ₂⁽²⁾ (ξ)"),
    Bound(name="lofast_M", fn=lf.lofast_M, paper=LOFAST, equation="Theorem 1, eq. 27", certified=True,
          kinds=DOT, stack="propagate", biases=True, display="LoFAST (‖M‖)"),
    Bound(name="lofast_xi", fn=lf.lofast_xi, paper=LOFAST, equation="Theorem 1, eq. 28", certified=True,
          kinds=DOT, stack="propagate", biases=True, display="LoFAST (ξ)"),
    Bound(name="delta21_M", fn=lf.delta21_M, paper=LOFAST, equation="§5.1, eq. 25", certified=True,
          kinds=DOT, objective="delta21", per_head=True, biases=True, display="LoFAST δ₂,₁⁽¹⁾ (‖M‖)"),
    Bound(name="delta21_xi", fn=lf.delta21_xi, paper=LOFAST, equation="§5.1, eq. 26", certified=True,
          kinds=DOT, objective="delta21", per_head=True, biases=True, display="LoFAST δ₂,₁⁽²⁾ (ξ)"),
    Bound(name="delta22_tight", fn=lf.delta22_tight, paper=LOFAST, equation="eq. 18", certified=True,
          kinds=DOT, objective="delta22", per_head=True, biases=True, display="LoFAST δ₂,₂⁽¹⁾ (eq. 18)"),
    Bound(name="delta22_naive", fn=lf.delta22_naive, paper=LOFAST, equation="§5.1", certified=True,
          kinds=DOT, objective="delta22", per_head=True, biases=True, display="LoFAST δ₂,₂⁽²⁾"),
    Bound(name="lofast_M_half", fn=lf.lofast_M_half,
          paper="this suite, docs/bounds.md §2.2 (on LoFAST Theorem 1)", equation="§2.2", certified=True,
          kinds=DOT, stack="propagate", ours=True, biases=True, display="LoFAST ½ (‖M‖)"),
    Bound(name="lofast_xi_half", fn=lf.lofast_xi_half,
          paper="this suite, docs/bounds.md §2.2 (on LoFAST Theorem 1)", equation="§2.2", certified=True,
          kinds=DOT, stack="propagate", ours=True, biases=True, display="LoFAST ½ (ξ)"),
    Bound(name="specformer", fn=sf.specformer, paper="Hu et al., SpecFormer (seed 001)",
          equation="Theorem 4.3, adapted (docs/bounds.md §3.1)", certified=True, kinds=DOT,
          stack="propagate", finding=sf.FINDING, display="SpecFormer (Thm 4.3)"),
    Bound(name="kim", fn=kim_.kim, paper="Kim, Papamakarios & Mnih, ICML 2021", equation="Theorem 3.2",
          certified=True, kinds=L2, stack="propagate", finding=kim_.FINDING, display="Kim et al. (Thm 3.2)"),
    Bound(name="olsa", fn=olsa_.olsa, paper="Xu et al., OLSA (seed 002)", equation="Theorem 4.1",
          certified=True, kinds=OLSA_KIND, stack="propagate", finding=olsa_.FINDING,
          display="OLSA (Thm 4.1)"),
    # the field's newer local Lipschitz constants (docs/bounds.md §3.5, §3.6): ε times a constant over
    # a set that holds the ball; biases enter through the logit factors (§1.5) or a constant coordinate
    Bound(name="castin", fn=castin_.castin, paper="Castin, Ablin & Peyré, ICML 2024",
          equation="Theorem 3.3, adapted (docs/bounds.md §3.5)", certified=True, kinds=DOT,
          stack="propagate", biases=True, display="Castin et al. (Thm 3.3)"),
    Bound(name="yudin", fn=yudin_.yudin,
          paper="Yudin, Gaponov, Kudriashov & Rakhuba, arXiv 2507.07814 (2025)",
          equation="the abstract's construction, over the ball (docs/bounds.md §3.6)", certified=True,
          kinds=DOT, stack="propagate", biases=True, display="Yudin et al. (softmax-Jacobian norm)",
          description="the layer's Jacobian through ‖diag(p) − ppᵀ‖ of each attention row, over the "
                      "ball; built from the abstract, the paper's equation not read"),
    Bound(name="yudin_local", fn=yudin_.yudin_local,
          paper="Yudin, Gaponov, Kudriashov & Rakhuba, arXiv 2507.07814 (2025)",
          equation="the abstract's construction, at X alone (docs/bounds.md §3.6)", certified=False,
          kinds=DOT, stack="propagate", biases=True, display="Yudin et al., at X",
          description="the same Jacobian bound at the clean input only: the local constant at X times ε"),
    Bound(name="taylor", fn=tay.taylor, paper="this suite, docs/bounds.md §2.3", equation="§2.3",
          certified=True, kinds=DOT, stack="propagate", ours=True, biases=True, display="Taylor",
          taylor_options=True),
    Bound(name="best", fn=lambda layer, X, eps, **options: best(layer, X, eps, **options),
          paper="this suite, docs/bounds.md §2.3", equation="min over the certified bounds", certified=True,
          kinds=DOT, stack="propagate", ours=True, biases=True, display="best certified",
          taylor_options=True,
          description="the smallest certified end-to-end bound without a finding, per input (and "
                      "per block of a stack)"),
    # attention's Taylor remainder itself, against an attack on the remainder (objective
    # ``remainder``, attacks.pgd.attack_remainder): opt-in, as that attack costs several of the others
    Bound(name="taylor_remainder", fn=tay.taylor_remainder, paper="this suite, docs/bounds.md §2.3.1–2.3.2",
          equation="taylor − σ̄_J·ε: the smallest of the global, local and quadratic remainders",
          certified=True, kinds=DOT, objective="remainder", ours=True, biases=True, opt_in=True,
          display="Taylor remainder",
          description="the certified bound of ‖F(X+Γ) − F(X) − J_F(X)[Γ]‖_F that taylor pays"),
    Bound(name="taylor_remainder_global", fn=tay.taylor_remainder_global,
          paper="this suite, docs/bounds.md §2.3",
          equation="§2.3's remainder: softmax's global constants (½, 1)", certified=True, kinds=DOT,
          objective="remainder", ours=True, biases=True, opt_in=True,
          display="Taylor remainder, global (§2.3)",
          description="the remainder taylor paid before §2.3.1–2.3.2, beside the one it pays"),
    # the field's yardstick (docs/bounds.md §2.5): opt-in, as it costs seconds where the others cost
    # milliseconds, and needs the optional auto_LiRPA (the crown extra)
    Bound(name="crown", fn=crown_.crown, paper=CROWN,
          equation="per-output CROWN bounds over the joint L2 ball", certified=True, kinds=DOT,
          stack="propagate", biases=True, opt_in=True, check=crown_.check, display="CROWN"),
    Bound(name="alpha_crown", fn=crown_.alpha_crown, paper="Xu et al. 2021 (α-CROWN), through auto_LiRPA",
          equation="per-output α-CROWN bounds over the joint L2 ball", certified=True, kinds=DOT,
          stack="propagate", biases=True, opt_in=True, check=crown_.check, display="α-CROWN"),
    # a whole-network procedure only (``bench certify --cascade``, the certify_crown task): no layer
    # kind, so no layer sweep, ``point`` nor ``best`` computes it; registered so that its certify rows
    # are judged by the gate as any certified bound's
    Bound(name="cascade_crown", fn=_network_only,
          paper="Havens et al., LoFAST Table 2 (its cascade), with CROWN",
          equation=f"{CASCADE_FIRST}, then whole-network CROWN on the rest (docs/bounds.md §5)",
          certified=True, kinds=frozenset(), opt_in=True, check=crown_.check,
          display=f"{CASCADE_FIRST} → CROWN (cascade)"),
    # this suite's whole-network certificate, exact to first order (docs/bounds.md §5.1): like the
    # cascade, no layer kind (no layer sweep, ``point`` nor ``best`` computes it), a direct verdict
    Bound(name=TAYLOR_NET, fn=_taylor_net_only, paper="this suite, docs/bounds.md §5.1",
          equation="§5.1: first order exact, remainders and kinks bounded", certified=True,
          kinds=frozenset(), ours=True, display="taylor_net",
          description="a zonotope of the whole network's deviations from the pixels to the margins: "
                      "each smooth stage's Jacobian at the clean image plus its remainder, a "
                      "relaxation only for the units that can cross a kink"),
    Bound(name="taylor_net_lofast", fn=_taylor_net_only,
          paper="this suite, docs/bounds.md §5.1, with LoFAST's split",
          equation="§5.1 with attention as LoFAST's Δ₁ and δ₂ of eq. 28 (ξ)", certified=True,
          kinds=frozenset(), ours=True, display="taylor_net, LoFAST δ₂ (ξ)",
          description="taylor_net with attention's remainder LoFAST's δ₂ (first order) in place of Taylor's"),
    Bound(name="taylor_net_lofast_half", fn=_taylor_net_only,
          paper="this suite, docs/bounds.md §5.1 and §2.2",
          equation="§5.1 with attention as LoFAST's Δ₁ and ½δ₂ (softmax ½-Lipschitz)", certified=True,
          kinds=frozenset(), ours=True, display="taylor_net, LoFAST ½δ₂ (ξ)",
          description="taylor_net with attention's remainder the halved δ₂ of docs/bounds.md §2.2"),
    Bound(name="taylor_net_best", fn=_taylor_net_only,
          paper="this suite, docs/bounds.md §5.1, the best split",
          equation="§5.1, every margin the better of the Taylor and ½δ₂ splits' bounds", certified=True,
          kinds=frozenset(), ours=True, display="taylor_net, best split",
          description="per margin the larger of taylor_net's and taylor_net_lofast_half's lower bounds "
                      "(the second only on images the first leaves)"),
    Bound(name="taylor_net_alpha", fn=_taylor_net_only,
          paper="this suite, docs/bounds.md §5.1, with α-CROWN's slopes (Xu et al. 2021)",
          equation="§5.1, the second pass's ReLU slopes tuned per image and class (\"Optimized slopes\")",
          certified=True, kinds=frozenset(), ours=True, opt_in=True, display="taylor_net, α slopes",
          description="taylor_net with the lower slopes of every relaxed ReLU in its second pass's last "
                      "backward pass tuned by projected Adam steps on the margins' bound"),
    Bound(name="taylor_net_bab", fn=_taylor_net_only,
          paper="this suite, docs/bounds.md §5.1, with β-CROWN's branches (Wang et al. 2021)",
          equation="§5.1, the second pass's short margins on the parts of the ball where their costliest "
                   "ReLUs keep one sign (\"Branches on the kinks\")",
          certified=True, kinds=frozenset(), ours=True, opt_in=True, display="taylor_net, branches",
          description="taylor_net with every margin its second pass leaves short bounded again on the parts "
                      "of the ball where its costliest relaxed ReLUs keep one sign, up to 20,000 parts"),
    Bound(name=CASCADE_TN, fn=_network_only,
          paper="this suite, docs/bounds.md §5.1, with LoFAST Table 2's cascade",
          equation=f"{TAYLOR_NET}, then whole-network CROWN on the rest (docs/bounds.md §5.1)",
          certified=True, kinds=frozenset(), ours=True, opt_in=True, check=crown_.check,
          display=f"{TAYLOR_NET} → CROWN (cascade)"),
    Bound(name="jacobian", fn=jac.jacobian, paper="Wang & Ruan, the Cauchy view (seed 003)",
          equation="σ_max(J_F), §3.4; product over blocks for stacks", certified=False, kinds=ALL,
          stack="propagate", biases=True, display="σ_max(J)·ε"),
    Bound(name="jacobian_l1linf", fn=jac.jacobian_l1linf, paper="Wang & Ruan, the Cauchy view (seed 003)",
          equation="√(‖J‖₁‖J‖∞), §3.4", certified=False, kinds=ALL, biases=True, display="√(‖J‖₁‖J‖∞)·ε"),
    Bound(name="jacobian_exp", fn=jac.jacobian_exp, paper="Wang & Ruan, the Cauchy view (seed 003)",
          equation="eq. 15", certified=False, kinds=ALL, stack="only", biases=True, display="ε·exp(Σ‖J_G‖)"),
)
REGISTRY: dict[str, Bound] = {b.name: b for b in BOUNDS}


def best_ingredients(layer) -> list[Bound]:
    """The bounds ``best`` takes the minimum of: certified, end to end, no finding of unsoundness."""
    return [b for b in BOUNDS if b.name != "best" and b.certified and not b.finding and not b.opt_in
            and b.objective == "output" and not b.per_head and b.stack != "only"
            and layer.kind in b.kinds and (b.biases or not has_biases(layer))]


def best(layer, X: Tensor, eps, *, options: tay.TaylorOptions = tay.NO_OPTIONS,
         ledger: Ledger | None = None) -> Tensor:
    """The smallest of :func:`best_ingredients` at each input: a minimum of upper bounds is one.
    On a stack it is taken at every block, so each block starts from the smallest radius.
    ``options`` go on to the ingredients that take them (``taylor``); every ingredient's
    certificates go to ``ledger``."""
    ledger = book(ledger)
    # the ingredients share ζ, ‖M_l‖ and σ̄_J: each is computed once, on the ledger's cache or one
    # of their own
    shared = ledger if ledger.cache is not None else Ledger(cache={})
    values = [b.fn(layer, X, eps, options=options, ledger=shared) if b.taylor_options
              else b.fn(layer, X, eps, ledger=shared) for b in best_ingredients(layer)]
    if shared is not ledger:
        ledger.entries.extend(shared.entries)
    return torch.stack(values).amin(0)


def get(name: str) -> Bound:
    try:
        return REGISTRY[name]
    except KeyError:
        raise InputError(f"unknown bound {name!r}; known: {', '.join(REGISTRY)}") from None


# a researcher's own bounds, joined for one run (``--plugin FILE.py``, docs/guide/plugins.md): kept
# apart from BOUNDS, so that ``best``, the built-in lists and their tests never see them; REGISTRY and
# PLUGINS are changed in place, so every module that imported them sees the same objects
PLUGINS: list[Bound] = []
PLUGIN_SHA256: dict[str, str] = {}  # plugin bound name -> sha256 of the file that defined it
_PLUGIN_SOURCE: dict[str, str] = {}  # plugin bound name -> that file, for the messages


class PluginError(InputError):
    """A plugin bound that raised, or returned a value that is not a finite [B] tensor: never
    skipped as a bound that refuses an instance is, since its kinds already say where it applies."""


def every() -> list[Bound]:
    """The built-in bounds, then the plugins registered for this run."""
    return [*BOUNDS, *PLUGINS]


def register(plugin_bounds: Sequence[Bound], source: str, sha256: str) -> list[str]:
    """Adds a plugin file's bounds to the registry; returns the names it added. Refuses (InputError)
    a name of a built-in bound or of another plugin file's; the same file (by sha256) registered
    again is a no-op, so a run and its worker may both register it."""
    fresh = [b for b in plugin_bounds if PLUGIN_SHA256.get(b.name) != sha256]
    for b in fresh:  # every name checked before any is added
        if b.name in REGISTRY:
            other = ("a built-in bound (bounds/registry.py)" if b.name not in PLUGIN_SHA256 else
                     f"defined by the plugin {_PLUGIN_SOURCE[b.name]}")
            raise InputError(f"plugin {source}: bound {b.name!r} is already {other}; rename it")
    added = []
    for b in fresh:
        guarded = replace(b, fn=_guarded(b, source))
        PLUGINS.append(guarded)
        REGISTRY[b.name] = guarded
        PLUGIN_SHA256[b.name], _PLUGIN_SOURCE[b.name] = sha256, source
        added.append(b.name)
    return added


def unregister(names: Sequence[str]) -> None:
    """Removes plugin bounds (by name) from the registry; built-in names are left alone."""
    for name in names:
        if name in PLUGIN_SHA256:
            PLUGINS[:] = [b for b in PLUGINS if b.name != name]
            REGISTRY.pop(name, None)
            PLUGIN_SHA256.pop(name)
            _PLUGIN_SOURCE.pop(name)


def _guarded(bound: Bound, source: str):
    """A plugin's fn that says, as one PluginError, what went wrong: an exception of its own, or a
    value that is not a finite tensor of shape [B] (X's batch)."""

    takes_ledger = "ledger" in inspect.signature(bound.fn).parameters

    def fn(layer, X, eps, *, ledger: Ledger | None = None, **options):
        where = f"plugin bound {bound.name!r} ({source})"
        if takes_ledger:  # a plugin that computes certified norms (bounds.norms) records them there
            options["ledger"] = ledger
        try:
            out = bound.fn(layer, X, eps, **options)
        except InputError:
            raise
        except Exception as e:
            raise PluginError(f"{where} raised {type(e).__name__}: {e}") from None
        if not isinstance(out, Tensor):
            raise PluginError(f"{where} returned {type(out).__name__}, not a torch.Tensor of shape "
                              f"[{X.shape[0]}]")
        if tuple(out.shape) != (X.shape[0],):
            raise PluginError(f"{where} returned shape {list(out.shape)}; a bound returns one value per "
                              f"input of X, shape [{X.shape[0]}]")
        if not bool(torch.isfinite(out).all()):
            raise PluginError(f"{where} returned a value that is not finite: {out.tolist()}")
        return out

    return fn


def has_biases(layer) -> bool:
    """Whether the layer, or some block of the stack, has a nonzero bias (docs/bounds.md §1.5)."""
    if isinstance(layer, Stack):
        return any(has_biases(b) for b in layer.blocks)
    return getattr(layer, "has_biases", False)  # only dot layers carry biases


def _applies_to_kind(bound: Bound, layer) -> bool:
    if isinstance(layer, Stack):
        return bound.stack in ("propagate", "only") and layer.block_kind in bound.kinds
    return bound.stack != "only" and layer.kind in bound.kinds


def applies(bound: Bound, layer) -> bool:
    """Whether the bound applies: to the layer's kind (or a stack's), and to its biases if it has
    any (docs/bounds.md §1.5); the one place where both are decided."""
    return _applies_to_kind(bound, layer) and (bound.biases or not has_biases(layer))


def applicable(layer) -> list[Bound]:
    """Every registered bound that applies to this layer or stack, in registry order, but those
    computed only when asked for by name (``opt_in``)."""
    return [b for b in every() if applies(b, layer) and not b.opt_in]


def unavailable() -> set[str]:
    """The registered bounds whose optional package this environment lacks (their ``check`` refuses:
    CROWN and what runs it without auto_LiRPA). The one question the runner, the tasks and
    ``compare`` ask; never answered from a table."""
    out = set()
    for b in every():
        if b.check is not None:
            try:
                b.check()
            except InputError:
                out.add(b.name)
    return out


def require(bound: Bound, layer) -> None:
    """Raises InputError when the bound does not apply to this layer or stack, or cannot run here."""
    if not _applies_to_kind(bound, layer):
        what = f"a stack of {layer.block_kind} blocks" if isinstance(layer, Stack) else layer.kind
        raise InputError(f"bound {bound.name!r} does not apply to {what} layers")
    if not applies(bound, layer):
        what = "a stack whose blocks have biases" if isinstance(layer, Stack) else "a layer with biases"
        raise InputError(f"bound {bound.name!r} does not apply to {what} (docs/bounds.md §1.5)")
    if bound.check is not None:
        bound.check()


@dataclass(frozen=True)
class Value:
    """A bound's values with the certificate of the norms they rest on (docs/bounds.md §2.4)."""

    value: Tensor  # [B] or [B, h]
    certificate: Certificate
    reused_seconds: float  # time of certified norms reused from an earlier bound (on the same cache)


def evaluate_certified(bound: Bound | str, layer, X: Tensor, eps: float, *,
                       cache: NormCache | None = None) -> Value:
    """The bound's values for each input of X ([n, d] or [B, n, d]) at radius eps, and how they
    are certified: ``estimate`` for estimates; for certified bounds the weakest certificate of the
    norms used (``exact`` when every norm was an exact SVD) with the summed failure probability.
    ``cache`` (a dict, empty at first): certified norms shared with the other evaluations given the
    same one (:class:`bounds.certificates.Ledger`).

    Certified bounds compute in float64 whatever X's dtype: a float32 norm can fall below the
    truth by its rounding (docs/bounds.md §2.4). Estimates compute in X's dtype. Both on X's
    device. Raises InputError for bad input or a bound that does not apply to the layer's kind.
    """
    bound = get(bound) if isinstance(bound, str) else bound
    require(bound, layer)
    X = as_batch(X, layer.d)
    eps = check_eps(eps)
    if bound.certified:
        X = X.to(torch.float64)
    layer = layer.to(X)
    ledger = Ledger(cache=cache)
    if not isinstance(layer, Stack) or bound.stack == "only":
        value = bound.fn(layer, X, eps, ledger=ledger)
    else:
        value = propagate(bound, layer.blocks, layer.trajectory(X)[:-1], eps, ledger=ledger)
    cert = ledger.certificate if bound.certified else Certificate("estimate")
    return Value(value, cert, ledger.reused_seconds)


def evaluate(bound: Bound | str, layer, X: Tensor, eps: float, *, cache: NormCache | None = None) -> Tensor:
    """:func:`evaluate_certified`'s values alone."""
    return evaluate_certified(bound, layer, X, eps, cache=cache).value
