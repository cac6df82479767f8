"""The vendor ``rknpu`` kernel driver (0.9.x) in software: ACTION, MEM_CREATE / MAP / DESTROY /
SYNC and SUBMIT's PC-mode commit, answering as ``rknpu_drv.c``, ``rknpu_gem.c`` and
``rknpu_job.c`` do [docs/npu-programming.md §4]; IOMMU domains 0..15 shared by every open file,
one live at a time: a call naming another domain switches to it (``iommu_domain_id``).
Sources: docs/decisions.md "sim/kernel"."""

from __future__ import annotations

import ctypes
import errno
from typing import Any

from ggml_rknpu.hw.alignment import ceil_div
from ggml_rknpu.hw.limits import HW_VERSION, INT_CLEAR_ALL
from ggml_rknpu.kernel.rknpu import uapi as rk
from ggml_rknpu.sim.kernel.common import (
    CNA_S_POINTER,
    CORE_S_POINTER,
    PC_BASE_ADDRESS,
    PC_INTERRUPT_CLEAR,
    PC_INTERRUPT_MASK,
    PC_INTERRUPT_RAW_STATUS,
    PC_INTERRUPT_STATUS,
    PC_OPERATION_ENABLE,
    PC_REGISTER_AMOUNTS,
    PC_TASK_CON,
    PC_TASK_DMA_BASE_ADDR,
    PC_TASK_STATUS,
    RW,
    S_POINTER_CORE_BIT,
    S_POINTER_PP,
    DrmFile,
    Ioctl,
    IoctlTable,
    NpuModel,
    SimKernel,
    fail,
)
from ggml_rknpu.sim.memory import IOVA_BASE, IOVA_END, GemObject, IommuDomain

# Device nodes the simulator pretends to have. The vendor render node number depends on
# the board's other DRM devices (the display is usually card0/renderD128); renderD129 is
# the usual place of rknpu on RK3588 images - a typical value, not a fixed one.
VENDOR_NODES = {"/dev/dri": ["card1", "renderD129"]}
# the flags the per-job ioctls test, as plain ints (an IntFlag operation costs a call)
_CACHEABLE = int(rk.MemFlag.CACHEABLE)
_KERNEL_MAPPING = int(rk.MemFlag.KERNEL_MAPPING)
_TO_DEVICE, _FROM_DEVICE = int(rk.SyncFlag.TO_DEVICE), int(rk.SyncFlag.FROM_DEVICE)
_JOB_PC, _JOB_PINGPONG = int(rk.JobFlag.PC), int(rk.JobFlag.PINGPONG)
_JOB_UNMODELED = int(rk.JobFlag.NONBLOCK | rk.JobFlag.FENCE_IN | rk.JobFlag.FENCE_OUT)

# Values the ACTION ioctl reports. Sources per value; guesses say so.
NPU_FREQ_HZ = 1_000_000_000  # guess: the RKNN runtime's default "take 1000MHz" [capture pw_c256_h14]
NPU_VOLT_UV = 850_000  # placeholder, NOT a measured RK3588 value: the simulator has no regulator
# DRIVER_DATE of rknpu_drv.h per version [VEND rknpu_drv.h as in WolfVision/linux (0.8.3),
# orangepi-xunlong/linux-orangepi (0.9.6), khadas/linux (0.9.7), Rockchip's 0.9.8 tarball]; others: unknown
DRIVER_DATES = {(0, 8, 3): "20221110", (0, 9, 6): "20240322", (0, 9, 7): "20240424", (0, 9, 8): "20240828"}
# the bandwidth-priority actions: RK3588 has no such block (rk3588_rknpu_config bw_priority_addr 0),
# so rknpu_get/set_bw_priority return EINVAL [VEND rknpu_job.c; docs/npu-programming.md §4]
_BW_ACTIONS = frozenset({rk.Action.GET_BW_PRIORITY, rk.Action.SET_BW_PRIORITY, rk.Action.GET_BW_EXPECT,
                         rk.Action.SET_BW_EXPECT, rk.Action.GET_BW_TW, rk.Action.SET_BW_TW})
# actions rknpu_action has no case for: EINVAL, nothing done [VEND 0.9.8 rknpu_drv.c rknpu_action]
_NO_CASE = frozenset({rk.Action.POWER_ON, rk.Action.POWER_OFF, rk.Action.SET_FREQ, rk.Action.SET_VOLT})


def fuzz_status(status: int) -> int:
    """Widen every set interrupt bit to its whole group0/group1 pair [VEND rknpu_fuzz_status]."""
    out = 0
    for pair in (0x3, 0xC, 0x30, 0xC0, 0x300, 0xC00):
        if status & pair:
            out |= pair
    return out


class SimRknpuKernel(SimKernel):
    """The vendor driver: a fake kernel pointer (``obj_addr``) per buffer, one shared domain."""

    abi = "rknpu"
    nodes = VENDOR_NODES
    default_version = (0, 9, 8)  # [capture: "RKNN Driver Information, version: 0.9.8"]
    default_iova_window = (IOVA_BASE, IOVA_END)  # the IOMMU DMA window without page 0, top-down
    shared_domain = True
    page_aligned_nodes = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        assert self._shared_domain is not None
        self._iommu_domains: dict[int, IommuDomain] = {0: self._shared_domain}
        self.iommu_domain_id = 0   # the live domain (rknpu_dev->iommu_domain_id)
        self.domain_switches = 0

    def _domain(self, f: DrmFile) -> IommuDomain:
        return self._iommu_domains[self.iommu_domain_id]

    def _domains(self) -> list[IommuDomain]:
        return list(self._iommu_domains.values())

    def _switch(self, domain_id: int, what: str) -> None:
        """rknpu_iommu_domain_get_and_switch: make ``domain_id`` live (a new id gets a fresh
        domain with the same window); the wait for the live domain's jobs is nothing here,
        where every job has finished before its SUBMIT returns [VEND rknpu_iommu.c]."""
        if not 0 <= domain_id < rk.MAX_IOMMU_DOMAINS:
            self._log(f"invalid iommu domain id: {domain_id}, reuse domain id: {self.iommu_domain_id}")
            raise fail(errno.EINVAL, f"{what}: iommu domain id {domain_id} is not one of 0..{rk.MAX_IOMMU_DOMAINS - 1}")
        if domain_id == self.iommu_domain_id:
            return
        domain = self._iommu_domains.get(domain_id)
        if domain is None:
            domain = self._iommu_domains[domain_id] = IommuDomain(*self.iova_window, ident=domain_id)
        self._log(f"switch iommu domain from {self.iommu_domain_id} to {domain_id}")
        self.iommu_domain_id = domain_id
        self.mmu.attach(domain)
        self.domain_switches += 1

    def driver_ioctls(self) -> IoctlTable:
        return {
            rk.Nr.ACTION: Ioctl(self._rk_action, rk.rknpu_action, RW),
            rk.Nr.SUBMIT: Ioctl(self._rk_submit, rk.submit_struct_for(self.driver_version), RW),
            rk.Nr.MEM_CREATE: Ioctl(self._rk_mem_create, rk.mem_create_struct_for(self.driver_version), RW),
            rk.Nr.MEM_MAP: Ioctl(self._rk_mem_map, rk.rknpu_mem_map, RW),
            rk.Nr.MEM_DESTROY: Ioctl(self._rk_mem_destroy, rk.rknpu_mem_destroy, RW),
            rk.Nr.MEM_SYNC: Ioctl(self._rk_mem_sync, rk.rknpu_mem_sync, RW),
        }

    def version_strings(self) -> tuple[str, str, str]:
        return "rknpu", DRIVER_DATES.get(self.driver_version, "unknown"), "RKNPU driver"  # [VEND rknpu_drv.h]

    def _rk_action(self, f: DrmFile, a: rk.rknpu_action) -> None:
        try:
            action = rk.Action(a.flags)
        except ValueError:
            raise fail(errno.EINVAL, f"ACTION {a.flags} is not a known RKNPU action (see kernel.rknpu.uapi.Action)") from None
        self.powered = True  # [VEND rknpu_drv.c RKNPU_IOCTL] every ioctl powers the NPU for the call
        if action in _NO_CASE:
            # SET_FREQ/SET_VOLT break out with ret still -EINVAL; POWER_ON/OFF fall to default
            raise fail(errno.EINVAL, f"ACTION {action.name}: rknpu 0.9.8's rknpu_action has no case for it "
                                     "(EINVAL, nothing done)")
        if action in _BW_ACTIONS:
            raise fail(errno.EINVAL, f"ACTION {action.name}: RK3588 has no bandwidth-priority block "
                                     "(rknpu_get/set_bw_priority: EINVAL)")
        getters = {
            rk.Action.GET_HW_VERSION: HW_VERSION,
            rk.Action.GET_DRV_VERSION: rk.encode_drv_version(*self.driver_version),
            rk.Action.GET_FREQ: NPU_FREQ_HZ,
            rk.Action.GET_VOLT: NPU_VOLT_UV,
            rk.Action.GET_IOMMU_EN: 1,  # inference: captured dma addresses are IOVAs (0xfff9f000...)
            rk.Action.GET_TOTAL_SRAM_SIZE: 0,  # guess: no SRAM reserved for the NPU on common RK3588 DTs
            rk.Action.GET_FREE_SRAM_SIZE: 0,
        }
        if action in getters:
            a.value = getters[action]
        elif action == rk.Action.GET_IOMMU_DOMAIN_ID:
            a.value = self.iommu_domain_id
        elif action == rk.Action.ACT_RESET:
            if self._npu is not None:
                self._npu.soft_reset(None)
            self._log("soft reset")
        elif action == rk.Action.SET_IOMMU_DOMAIN_ID:   # get_and_switch, then put
            self._switch(ctypes.c_int32(a.value).value, "ACTION SET_IOMMU_DOMAIN_ID")
        elif action in (rk.Action.GET_DT_WR_AMOUNT, rk.Action.GET_DT_RD_AMOUNT, rk.Action.GET_WT_RD_AMOUNT,
                        rk.Action.GET_TOTAL_RW_AMOUNT):
            a.value = 0  # the traffic counters are not modelled
        # SET_PROC_NICE, ACT_CLR_TOTAL_RW_AMOUNT: accepted, nothing to model

    def _rk_mem_create(self, f: DrmFile, m: ctypes.Structure) -> None:
        self._switch(getattr(m, "iommu_domain_id", 0), "MEM_CREATE")   # the 40-byte struct: domain 0
        handle, obj = self._new_object(f, m.size, m.flags, cached=bool(m.flags & rk.MemFlag.CACHEABLE))
        m.handle, m.size, m.obj_addr, m.dma_addr, m.sram_size = handle, obj.size, obj.obj_addr, obj.dma_addr, 0

    def _rk_mem_map(self, f: DrmFile, m: rk.rknpu_mem_map) -> None:
        m.offset = self._mmap_offset(self._lookup_handle(f, m.handle, errno.ENOENT, "MEM_MAP"))

    def _rk_mem_destroy(self, f: DrmFile, m: rk.rknpu_mem_destroy) -> None:
        # rknpu_gem_destroy_ioctl looks the handle up and ignores obj_addr [VEND rknpu_gem.c]
        obj = self._lookup_handle(f, m.handle, errno.EINVAL, "MEM_DESTROY")
        self._switch_to(obj, "MEM_DESTROY")
        self._drop_handle(f, m.handle)

    def _switch_to(self, obj: GemObject, what: str) -> None:
        """MEM_SYNC and MEM_DESTROY switch to the object's domain first [VEND rknpu_gem.c]."""
        if obj.domain is not None:
            self._switch(obj.domain.ident, what)

    def _rk_object(self, obj_addr: int, what: str) -> GemObject:
        if obj_addr == 0:
            raise fail(errno.EINVAL, f"{what}: obj_addr is 0")   # the driver's NULL check
        obj = self._objects.get(obj_addr)
        if obj is None:
            # the driver casts obj_addr to a kernel pointer: a stale one is a use-after-free, a
            # kernel oops rather than an errno; the simulator refuses it and records the misuse
            self._misuse(what, f"obj_addr {obj_addr:#x} is not a live buffer (destroyed, or not the obj_addr "
                               "MEM_CREATE returned)", "the kernel dereferences it: use-after-free or oops")
            raise fail(errno.EFAULT, f"{what}: obj_addr {obj_addr:#x} is not a live buffer (destroyed, or not "
                                      "the obj_addr MEM_CREATE returned)")
        return obj

    def _rk_mem_sync(self, f: DrmFile, s: rk.rknpu_mem_sync) -> None:
        obj = self._rk_object(s.obj_addr, "MEM_SYNC")
        if not obj.flags & _CACHEABLE:
            raise fail(errno.EINVAL, "MEM_SYNC on a buffer created without RKNPU_MEM_CACHEABLE: uncached buffers "
                                      "need no sync (the driver refuses it)")
        self._switch_to(obj, "MEM_SYNC")
        # the range is never checked (the scatterlist walk stops at the buffer's end) and unknown
        # flag bits are ignored [VEND rknpu_gem.c rknpu_gem_sync_ioctl]
        offset, size = min(s.offset, obj.size), max(0, min(s.size, obj.size - s.offset))
        if (offset, size) != (s.offset, s.size):
            self._misuse("MEM_SYNC", f"range [{s.offset}, {s.offset + s.size}) runs past the {obj.size}-byte buffer",
                         "accepted and clamped: the bytes meant past the end are never synced")
        if s.flags & _TO_DEVICE:
            obj.sync_for_device(offset, size)
        if s.flags & _FROM_DEVICE:
            obj.sync_for_cpu(offset, size)

    def _rk_core_ranges(self, s: ctypes.Structure) -> dict[int, tuple[int, int]]:
        """core -> (task_start, task_number) by the §4 core_mask/subcore_task rules."""
        mask = s.core_mask & rk.CORE_MASK_ALL
        if mask == 0:  # AUTO: the least-loaded core, use_core_num = 1; all idle here, so core 0
            cores = [0]
        else:
            cores = [i for i in range(self.n_cores) if mask >> i & 1]
        if s.core_mask & ~((1 << self.n_cores) - 1):
            raise fail(errno.EINVAL, f"core_mask {s.core_mask:#x} selects cores this NPU does not have "
                                      f"({self.n_cores} cores: mask bits 0..{self.n_cores - 1})")
        if mask and mask not in rk.COMMITTED_CORE_MASKS:
            # rknpu_job_commit: "Unknown core mask", nothing committed; rknpu_job_wait times out,
            # finds no last task and returns EINVAL [VEND rknpu_job.c]
            self._log(f"Unknown core mask: {mask}")
            raise fail(errno.EINVAL, f"SUBMIT: core_mask {mask:#x} is not one rknpu_job_commit commits "
                                     f"({', '.join(hex(m) for m in rk.COMMITTED_CORE_MASKS)}): nothing ran, "
                                     f"EINVAL after the {s.timeout} ms job timeout (simulated: no wait)")
        slot = 2 if len(cores) == 3 else 0  # 3 cores: subcore_task[i+2]; 1-2 cores: subcore_task[i]
        return {c: (s.subcore_task[c + slot].task_start, s.subcore_task[c + slot].task_number) for c in cores}

    def _rk_commit(self, npu: NpuModel, core: int, tasks, start: int, number: int, pp_en: int,
                   task_base_addr: int) -> tuple[int, str | None]:
        """rknpu_job_commit_pc for one core and its IRQ handler: (INT_STATUS, failure or None)."""
        first, last = tasks[start], tasks[start + number - 1]
        amount = ceil_div(first.regcfg_amount + rk.PC_DATA_EXTRA_AMOUNT, rk.PC_DATA_AMOUNT_SCALE) - 1
        pointer = S_POINTER_PP + S_POINTER_CORE_BIT * core
        fault = self._run(npu, core, [
            (PC_BASE_ADDRESS, 1),
            (CNA_S_POINTER, pointer),
            (CORE_S_POINTER, pointer),
            (PC_BASE_ADDRESS, first.regcmd_addr),
            (PC_REGISTER_AMOUNTS, amount),
            (PC_INTERRUPT_MASK, last.int_mask),
            (PC_INTERRUPT_CLEAR, first.int_mask),
            (PC_TASK_CON, ((0x6 | pp_en) << 12) | number),
            (PC_TASK_DMA_BASE_ADDR, task_base_addr),
            (PC_OPERATION_ENABLE, 1),
            (PC_OPERATION_ENABLE, 0),
        ])
        if fault:
            return 0, fault
        status = npu.mmio_read(core, PC_INTERRUPT_STATUS)  # rknpu_irq_handler
        failure = None
        if status == 0:
            failure = "no interrupt (the task list did not finish)"
        elif fuzz_status(status) != last.int_mask:
            raw = npu.mmio_read(core, PC_INTERRUPT_RAW_STATUS)
            counter = npu.mmio_read(core, PC_TASK_STATUS) & rk.PC_TASK_NUMBER_MASK
            self._log(f"invalid irq status: {status:#x}, raw status: {raw:#x}, require mask: {last.int_mask:#x}, "
                      f"task counter: {counter:#x}")
            failure = (f"invalid irq status {status:#x} (fuzzed {fuzz_status(status):#x}) != last task's int_mask "
                       f"{last.int_mask:#x}; int_mask must be the whole bit pair of the block that finishes the "
                       "task, e.g. 0x300 for DPU, 0xc00 for PPU")
        npu.mmio_write(core, PC_INTERRUPT_CLEAR, INT_CLEAR_ALL)
        return status, failure

    def _rk_submit(self, f: DrmFile, s: ctypes.Structure) -> None:
        if s.task_number == 0:
            raise fail(errno.EINVAL, "SUBMIT: invalid rknpu task number 0")
        if not s.flags & _JOB_PC:
            raise fail(errno.EINVAL, "SUBMIT: flags must include RKNPU_JOB_PC (1); only PC mode exists on RK3588")
        unsupported = s.flags & _JOB_UNMODELED
        if unsupported:
            raise fail(errno.EINVAL, f"SUBMIT: flags {unsupported:#x} (NONBLOCK/FENCE_*) are not modelled by the "
                                      "simulator; submit blocking")
        if s.task_obj_addr == 0:
            raise fail(errno.EINVAL, "SUBMIT: task_obj_addr is 0; pass the task BO's obj_addr")
        task_obj = self._rk_object(s.task_obj_addr, "SUBMIT task_obj_addr")
        if not task_obj.flags & _KERNEL_MAPPING:
            raise fail(errno.EINVAL, "SUBMIT: the task BO was created without RKNPU_MEM_KERNEL_MAPPING, so the "
                                      "kernel cannot read the rknpu_task array (create it with flags 0x40b)")
        ranges = self._rk_core_ranges(s)
        n_slots = task_obj.size // ctypes.sizeof(rk.rknpu_task)
        for core, (start, number) in ranges.items():
            if number == 0:
                raise fail(errno.EINVAL, f"SUBMIT: core {core} is selected but its subcore_task entry has "
                                          "task_number 0 (1-2 cores: subcore_task[i]; 3 cores: subcore_task[i+2])")
            if number > rk.MAX_SUBMIT_TASKS and self.driver_version < rk.CHUNKED_SUBMIT_VERSION:
                # the old commit ORs the count into TASK_CON, overflowing into the ping-pong bits
                raise fail(errno.EINVAL, f"SUBMIT: {number} tasks on core {core}; driver "
                                          f"{'.'.join(map(str, self.driver_version))} puts at most "
                                          f"{rk.MAX_SUBMIT_TASKS} in TASK_CON per hardware run - split the job")
            if start + number > n_slots:
                raise fail(errno.EINVAL, f"SUBMIT: tasks [{start}, {start + number}) of core {core} run past the "
                                          f"{n_slots} rknpu_task slots of the task BO")
        domain_id = getattr(s, "iommu_domain_id", 0)   # before 0.9.5: no field, domain 0
        if not 0 <= domain_id < rk.MAX_IOMMU_DOMAINS:
            # rknpu_job_schedule: the switch fails, nothing is queued, rknpu_job_wait waits three
            # timeouts and returns EINVAL, and rknpu_job_abort puts a reference never taken
            self._misuse("SUBMIT", f"iommu_domain_id {domain_id} is not one of 0..{rk.MAX_IOMMU_DOMAINS - 1}",
                         "EINVAL after three job timeouts, and the domain refcount left unbalanced "
                         "(later switches can time out)")
            raise fail(errno.EINVAL, f"SUBMIT: iommu_domain_id {domain_id} is not one of "
                                     f"0..{rk.MAX_IOMMU_DOMAINS - 1}: nothing ran (simulated: no wait)")
        self._switch(domain_id, "SUBMIT")
        npu = self._npu_model()
        # the kernel mapping (numpy's stubs give ndarray its buffer protocol only on Python >= 3.12)
        tasks = (rk.rknpu_task * n_slots).from_buffer(task_obj.cpu)  # type: ignore[arg-type]
        pp_en = 1 if s.flags & _JOB_PINGPONG else 0
        self.powered = True
        first_core = min(ranges)
        int_status: dict[int, int] = {}
        failures: dict[int, str] = {}
        inject, self.inject = self.inject, None
        if inject == "timeout":
            failures[first_core] = "injected hang (simulator fault hook)"
        for core, (start, number) in ranges.items():
            if failures:
                break
            # 0.9.5+ re-issues lists longer than max_submit_number in chunks from its IRQ path
            for chunk in range(start, start + number, rk.MAX_SUBMIT_TASKS):
                count = min(rk.MAX_SUBMIT_TASKS, start + number - chunk)
                if inject == "stale" and core == first_core and chunk + count == start + number:
                    count -= 1  # the chain's last task silently dropped (fault hook)
                    if count == 0:
                        continue
                status, failure = self._rk_commit(npu, core, tasks, chunk, count, pp_en, s.task_base_addr)
                int_status[core] = status
                if failure:
                    failures[core] = failure
                    break
        # rknpu_job_wait writes the wait core's status (the first core of the mask) into
        # job->last_task: the last task of the core committed last [VEND rknpu_job.c]
        start, number = ranges[max(ranges)]
        last_index = start + number - 1
        tasks[last_index].int_status = int_status.get(first_core, 0)  # through the kernel mapping
        task_obj.sync_for_device(last_index * ctypes.sizeof(rk.rknpu_task), ctypes.sizeof(rk.rknpu_task))
        if hasattr(s, "hw_elapse_time"):
            s.hw_elapse_time = 0  # no hardware clock in the simulator
        if not failures:
            s.task_counter = s.task_number
            return
        s.task_counter = npu.mmio_read(first_core, PC_TASK_STATUS) & rk.PC_TASK_NUMBER_MASK
        lines = []
        for core, why in failures.items():
            lines.append(f"core {core}: {why}")
            lines.extend(f"core {core}: {d}" for d in self._diagnostics(npu, core))
        for line in lines:
            self._log(line)
        npu.soft_reset(None)  # rknpu_job_abort -> rknpu_soft_reset (whole NPU)
        self._log("soft reset after failed job")
        # the driver knows only timeouts: a DMA fault is an IOMMU page fault in dmesg and ETIMEDOUT
        dma = any(why.startswith("NPU DMA fault") for why in failures.values())
        head = (f"SUBMIT: job timeout after {s.timeout} ms" + (" (the NPU DMA faulted: an IOMMU page fault on a board)"
                                                               if dma else "") + " (simulated time: no wall-clock wait)")
        raise fail(errno.ETIMEDOUT, f"{head}; task_counter={s.task_counter}; " + "; ".join(lines)
                   + "; the NPU was soft-reset")

