"""The backends behind the device seam (:mod:`chainexec.runtime.device`): NumPy on the host
(:mod:`~chainexec.runtime.backends.numpy`) and CuPy on a GPU (:mod:`~chainexec.runtime.backends.cupy`,
with its contraction methods in :mod:`~chainexec.runtime.backends.methods` and its autotuner in
:mod:`~chainexec.runtime.backends.tuning`); :mod:`~chainexec.runtime.backends.common` holds what
both use."""
