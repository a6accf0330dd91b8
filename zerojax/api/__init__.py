"""The public API: ZeroConfig and ZeroOptimizer with its pieces (layout, init,
hand-back, the optax wrapper).

Modules: config, optimizer_layout, optimizer_init, optimizer_handback, optimizer_tx,
optimizer. Their old names (``zerojax.config``) are aliases of
the same modules (:mod:`zerojax._aliases`)."""
