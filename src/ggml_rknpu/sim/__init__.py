"""The NPU and both kernel drivers in software, at the ioctl boundary.
An independent witness: decodes register words with ``hw`` only, never imports
``compiler``."""
