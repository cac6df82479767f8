"""The only code that opens, ioctls and mmaps: one syscall interface object,
one driver class per kernel ABI (vendor ``rknpu`` DRM, mainline ``rocket``
accel), and ``NpuDevice`` on top of whichever is present."""
