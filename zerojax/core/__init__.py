"""Layout rules and collectives (layers 1-2): the mesh, the partition rule, the train
state, quantization, activations, tiling, the model description, the collectives and the
layer schedule. Imports nothing else of zerojax.

Modules: compat, mesh, partition, state, quant, activations, tiling, modelspec,
collectives, schedule. Their old names (``zerojax.compat``) are aliases of
the same modules (:mod:`zerojax._aliases`)."""
