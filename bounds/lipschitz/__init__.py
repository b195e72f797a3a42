"""The field's Lipschitz-constant bounds: each is ε times a constant of the layer over a set that holds
the ball B(X, ε) (docs/bounds.md §3): SpecFormer, Kim et al., OLSA, Castin et al., Yudin et al."""
