"""``ServerConfig``: every setting of ``rknpu serve`` that the server reads (the CLI's flags,
parsed in ``cli/serve.py``), with the defaults the tests and the library use."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ggml_rknpu.server.rpc.deadlines import MIN_RATE_KIB_S

HOST_ONLY_BUDGET = 4 << 30   # --device host: the RK3588 NPU's 32-bit IOVA window [docs/decisions.md "Interfaces between the layers": 32-bit NPU addresses]
MAX_CLIENTS = 256            # connections served at once; one more is refused at accept (--max-clients)


@dataclass
class ServerConfig:
    n_devices: int = 1
    weight_format: str = "fp16"
    cache_dir: Path | None = None
    progress: bool = True
    stats_each_client: bool = False
    stats_json: Path | None = None    # rewritten after every client and at exit
    stall_timeout_s: float = 120.0    # a message (or a reply) that makes no progress this long closes the client
    min_rate_kib_s: float = MIN_RATE_KIB_S   # ... as does one not complete in stall_timeout_s + bytes / this rate
    weight_reuse: bool = True         # keep staged weights of freed buffers for later clients (RetiredWeights)
    threads: int | None = None        # ggml-cpu host threads (None: libggml.compute.default_threads())
    group_matmuls: bool = True        # NPU matmuls reading one activation run as one submit (plan_steps.NpuGroup)
    activations: str = "fp16"         # NPU matmul activations as sent ("fp16") or rounded as ggml-cpu does ("ggml")
    placement: str = "npu"            # weight matmuls: "auto" by cost (rknpu serve's default), "npu", "host"
    host_threads: int | None = None   # A76 threads host matmuls are priced at (None: threads, else the 4 A76s)
    host_repack: bool = False         # host matmuls read a repacked copy where ggml-cpu repacks (rknpu serve: on)
    placement_split: bool = False     # auto may split a matmul's rows between the NPU and the host (opt-in)
    npu_attention: str = "auto"       # attention's matmuls on the NPU: "auto" by cost, "on", "off" (server/attention_plan.py)
    idle_timeout_s: float | None = None   # close a client idle this long between messages (None: never)
    max_clients: int = MAX_CLIENTS    # connections served at once; more are refused at accept
    session_memory: int | None = None  # buffer bytes one connection may hold (None: the device budget)
    retired_budget: int | None = None  # bytes of retired weights kept (server.host_budget; None: NPU memory only)
