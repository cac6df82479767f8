"""Host ops in numpy, one module per op family (docs/decisions.md contract G).

``registry`` holds the seam (``OpNode``, ``TensorRef``, ``plan_op``, ``UnsupportedOp``);
``convert`` the shared type conversions and ggml's repeat-broadcast; then ``binary``
(ADD/SUB/MUL/DIV), ``scale``, ``norm`` (RMS_NORM, NORM), ``rope`` (ROPE, ROPE_BACK),
``softmax``, ``attention`` (FLASH_ATTN_EXT), ``glu``, ``unary`` (UNARY and plain
elementwise ops), ``rows`` (GET_ROWS, SET_ROWS), ``copy`` (CPY, DUP, CONT), ``matmul``
(host MUL_MAT) and ``shape`` (REPEAT, CONCAT, reductions).
"""
