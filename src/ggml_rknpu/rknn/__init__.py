"""Optional second engine over Rockchip's closed librknnrt ``rknn_matmul_api``."""
