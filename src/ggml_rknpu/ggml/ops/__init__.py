"""Host ops in numpy, one module per op family."""
