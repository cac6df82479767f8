"""The validator in front of the host backend: what the server admits, as rules.

``rules`` has one rule per admitted op (arity, types, the dst ggml's builder would make,
strides the kernels assume, index sources), with the families in ``rules_conv``,
``rules_training`` and ``rules_dsv4`` merged into its ``RULES`` and their shared vocabulary
in ``rulekit``; ``geometry`` the ggml shape/stride predicates
the rules use (twins of ggml.c's, tested against the library); ``registry`` the shared
names, errors and tensor views. The ops themselves run in ggml-cpu (``libggml``).
"""
