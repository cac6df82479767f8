"""The RK3588 NPU as data: register database, regcmd word codec, task tail, limits.
Every fact cites its source next to where it is encoded."""
