"""The memory tiers below the device: host offload and the NVMe tier's files.

Modules: offload, nvme (over nvme_files, nvme_programs). Their old names
(``zerojax.offload``) are aliases of the same modules (:mod:`zerojax._aliases`)."""
