"""The compiler: a scheme file (spec) is planned into a cache layout (layout) and rendered into one module of
Triton kernels (codegen, templates/)."""
