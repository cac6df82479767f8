"""Modeled silicon time of a program, separate from its function. Every constant
cites its source; every figure it produces is printed as *modeled*."""
