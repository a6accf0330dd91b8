"""State I/O: formats, the sharded loader, checkpoints (reader, publishing, the state
and NVMe handlers, the manager) and export.

Modules: formats, load, checkpoint_reader, checkpoint_publish, checkpoint_state,
checkpoint_nvme, export, checkpoint. Their old names (``zerojax.formats``) are aliases
of
the same modules (:mod:`zerojax._aliases`)."""
