"""The vendor ``rknpu`` DRM driver: its UAPI structs (``uapi``), one typed callable per ioctl
(``ioctls``) and the ``NpuDriver`` implementation ``NpuDevice`` holds (``driver``)."""
