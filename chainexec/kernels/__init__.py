"""GPU kernels as data: CUDA C source generators and the models that choose their configurations.

Pure functions, like the planner: no CuPy, no CUDA, no files. The runtime compiles the sources
(:mod:`chainexec.runtime.kernelcache`) and launches them (:mod:`chainexec.runtime.launch`,
:mod:`chainexec.runtime.pointwise`); the tests compile them with nvcc and run them on the CPU.

Contraction kernels: :mod:`~chainexec.kernels.kernelconf` and :mod:`~chainexec.kernels.codegen`
(COGENT), :mod:`~chainexec.kernels.gett` (GETT on FP64 tensor cores),
:mod:`~chainexec.kernels.sumkernel` and :mod:`~chainexec.kernels.summma` (one kernel for a run of
contractions into one buffer), :mod:`~chainexec.kernels.batchedgemm` and
:mod:`~chainexec.kernels.stacking` (contractions as cuBLAS batched GEMMs; terms stacked into one).
Point-wise kernels: :mod:`~chainexec.kernels.elementwise` (element-wise statements and
reductions), :mod:`~chainexec.kernels.direct` (a thread per output element of any contraction),
:mod:`~chainexec.kernels.symmetrize` (in-place symmetrization), :mod:`~chainexec.kernels.orbits`
(reductions over values computed once per orbit of points).
"""
