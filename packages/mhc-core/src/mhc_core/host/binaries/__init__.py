"""Compiled code, the ground floor of the host: kernels and the host library, compiled, keyed,
shipped, cached, verified, loaded and launched.

``compiler`` (compiling a kernel for an arch without a GPU, ptxas's report), ``artifacts`` (a
kernel's full key, the shipped manifests, the on-disk cache), ``cache_files`` and ``verified`` (a
cache eight ranks and a shared machine can trust; loading the very bytes that were checked),
``source_form`` (what a key hashes of a module's source), ``launch`` (calling a compiled kernel
through its TVM-FFI entry), ``support`` (whether this process's device can run the kernels),
``cuda_runtime`` (the runtime calls torch has no API for, through torch's own libcudart) and
``native/`` (the C++ executor of every call: its library built, cached and loaded). Imports
nothing of the host above it.
"""
