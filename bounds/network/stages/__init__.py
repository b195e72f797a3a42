"""The stages of ``taylor_net`` (docs/bounds.md §5.1), one module each: LayerProject (project),
LayerNorm (layernorm), BatchNorm in eval (batchnorm), attention, the FFN (ffn, its activations in
activations). Each maps the deviation set of its input to that of its output and leaves a record with
``step(Λ)`` for the backward pass (bounds/network/record.py); docs/guide/add-a-stage.md says how to add
one."""
