"""The memory tiers below the device: host offload and the NVMe tier's files.

Modules: offload, nvme. Their old names (``zerojax.offload``) are aliases of
the same modules (:mod:`zerojax._aliases`)."""
