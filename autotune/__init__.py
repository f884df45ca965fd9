"""autotune: make deep-learning training fit in GPU memory without giving up throughput."""

__version__ = "0.1.0"
