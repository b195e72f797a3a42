"""Certificates of a whole ViT (docs/bounds.md §5): the norm route of LoFAST (``propagated``: a
radius pushed block by block through the layer bounds), whole-network CROWN through auto_LiRPA
(``netcrown``), and this suite's first-order-exact ``taylor_net`` (docs/bounds.md §5.1). They may
import bounds' layer bounds and models/, never bench/."""

from .propagated import (
    PROCEDURES,
    ROUNDING,
    Certifier,
    NetworkCertificate,
    check_certifiable,
    check_network,
    default_bounds,
    network_bound,
    network_bounds,
    pairwise,
    prop1,
)

__all__ = ["PROCEDURES", "ROUNDING", "Certifier", "NetworkCertificate", "check_certifiable", "check_network",
           "default_bounds", "network_bound", "network_bounds", "pairwise", "prop1"]
