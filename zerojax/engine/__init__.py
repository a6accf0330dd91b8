"""The training step: the ZeRO step program (step) and the NVMe tier's step (nvme_step).

Modules: step, nvme_step (over nvme_plan, nvme_update, nvme_pipeline). Their old
names (``zerojax.step``) are aliases of the same modules (:mod:`zerojax._aliases`)."""
