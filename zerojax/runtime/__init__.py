"""The runtime (process-level services): launchers, jax.distributed, the progress
watchdog and row checks, preemption, host memory, the NVMe directory lock. Imports
zerojax.core only.

Modules: launchers, preemption, distributed, hostmem, nvme_lock. Their old names
(``zerojax.launchers``) are aliases of
the same modules (:mod:`zerojax._aliases`)."""
