"""Planning for accelerators from any machine: compiling a run's programs for TPU, GPU or CPU
topologies (``aot``, ``compile``), FLOPs and memory estimates."""
