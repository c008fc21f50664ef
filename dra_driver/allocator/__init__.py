"""The structured-parameters allocator behind ``tessera explain``."""
