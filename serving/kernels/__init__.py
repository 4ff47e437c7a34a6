"""CPU kernels in C (compiled at first use), the whole-step call and huge-page buffers."""
