"""The hardware model: WSE-2 and WSE-3 figures, each with its source, and the cost model.

Every number the compiler's estimates rest on lives here, so a reader can see
at once which are published figures and which are our modelling choices.

    from cs_runtime.compiler.hardware import WSE2
    WSE2.cores                      # 850,000
    WSE2.compute_time(flops, pes)   # seconds for `flops` spread over `pes` cores
    WSE3                            # the CS-3's wafer: the estimates' second target

The published figures (SEED) come from the PyTorch blog post on Cerebras and
Cerebras' WSE-2 announcement. The rest are ASSUMPTIONs or derived from the
published ones; change them here and every report follows.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

SEED = "PyTorch blog post on Cerebras / Cerebras WSE-2 announcement"

# --- published WSE-2 figures (source: SEED) ---------------------------------
CORES = 850_000                      # SEED: 850,000 AI-optimised cores
ON_CHIP_MEMORY_BYTES = 40 * 10**9    # SEED: 40 GB on-chip SRAM
MEMORY_BANDWIDTH_BYTES_S = 20e15     # SEED: 20 PB/s memory bandwidth
FABRIC_BANDWIDTH_BITS_S = 220e15     # SEED: 220 Pb/s fabric (interconnect) bandwidth
DIE_AREA_MM2 = 46_225                # SEED: 46,225 mm² of silicon

# --- modelling assumptions (not from the seeds) -----------------------------
# ASSUMPTION: the cores form an 850 x 1000 grid (850,000 exactly). The real
# fabric is near-square too; only the shape of the pictures depends on it.
GRID_ROWS, GRID_COLS = 850, 1000
# ASSUMPTION: a dense kernel is bound by its core's memory: each
# multiply-accumulate (2 FLOPs) reads one weight from local SRAM.
BYTES_PER_WEIGHT_READ = 4            # float32 weights
FLOPS_PER_WEIGHT_READ = 2
# ASSUMPTION: CS-2 system I/O of 12 x 100 GbE (Cerebras CS-2 datasheet), the
# link that input batches and, in weight streaming, weights and gradients use.
SYSTEM_IO_BITS_S = 12 * 100e9

# ASSUMPTION: what the emulator's numpy reaches on one laptop or login-node CPU
# (float32 matmuls on a few cores); only the report's line on the gap between
# the estimate and the emulator's own measured rate uses it.
HOST_FLOPS_S = 50e9

# --- published WSE-3 figures (source: SEED3) --------------------------------
SEED3 = "Cerebras WSE-3 announcement (March 2024); ALCF AI accelerators tutorial, SC24"
WSE3_CORES = 900_000                      # SEED3: 900,000 AI cores
WSE3_MEMORY_BYTES = 44 * 10**9            # SEED3: 44 GB on-chip SRAM
WSE3_MEMORY_BANDWIDTH_BYTES_S = 21e15     # SEED3: 21 PB/s memory bandwidth
WSE3_FABRIC_BANDWIDTH_BITS_S = 214e15     # SEED3: 214 Pb/s fabric bandwidth
# SEED3: "each WSE is housed within a CS system, which provides 1.2 Tbps I/O": the same as the CS-2's.
# ASSUMPTION: a 900 x 1000 grid, as the WSE-2's.
WSE3_GRID_ROWS, WSE3_GRID_COLS = 900, 1000


@dataclass(frozen=True)
class Wafer:
    """One wafer-scale engine as the compiler sees it."""

    name: str = "wse2"
    system: str = "CS-2 (WSE-2)"   # what the estimates say they are for
    cores: int = CORES
    rows: int = GRID_ROWS
    cols: int = GRID_COLS
    memory_bytes: int = ON_CHIP_MEMORY_BYTES
    memory_bw_bytes_s: float = MEMORY_BANDWIDTH_BYTES_S
    fabric_bw_bytes_s: float = FABRIC_BANDWIDTH_BITS_S / 8
    io_bw_bytes_s: float = SYSTEM_IO_BITS_S / 8

    def with_memory(self, memory_bytes: int | None) -> "Wafer":
        """This wafer with `memory_bytes` available to the model (None: all)."""
        return self if memory_bytes is None else replace(self, memory_bytes=memory_bytes)

    def part(self, n: int) -> "Wafer":
        """One of `n` equal side-by-side parts of this wafer (a replica's share): 1/n of
        its columns, cores, memory and bandwidths, so every per-core figure stays."""
        if n == 1:
            return self
        return replace(self, cores=self.rows * (self.cols // n), cols=self.cols // n,
                       memory_bytes=self.memory_bytes // n, memory_bw_bytes_s=self.memory_bw_bytes_s / n,
                       fabric_bw_bytes_s=self.fabric_bw_bytes_s / n, io_bw_bytes_s=self.io_bw_bytes_s / n)

    # --- per core, derived from the published totals
    @property
    def core_flops_s(self) -> float:
        """Peak FLOP/s of one core: its share of memory bandwidth, memory-bound."""
        per_core_bw = self.memory_bw_bytes_s / self.cores
        return per_core_bw / BYTES_PER_WEIGHT_READ * FLOPS_PER_WEIGHT_READ

    @property
    def core_memory_bytes(self) -> float:
        return self.memory_bytes / self.cores

    @property
    def core_fabric_bytes_s(self) -> float:
        return self.fabric_bw_bytes_s / self.cores

    @property
    def peak_flops_s(self) -> float:
        return self.core_flops_s * self.cores

    # --- the cost model
    def compute_time(self, flops: float, pes: int) -> float:
        """Seconds to do `flops` on `pes` cores at peak (perfect split)."""
        return flops / (max(pes, 1) * self.core_flops_s)

    def fabric_time(self, nbytes: float, edge_pes: int) -> float:
        """Seconds to move `nbytes` into a region through an edge of `edge_pes` cores."""
        return nbytes / (max(edge_pes, 1) * self.core_fabric_bytes_s)

    def io_time(self, nbytes: float) -> float:
        """Seconds to move `nbytes` between the wafer and the outside world."""
        return nbytes / self.io_bw_bytes_s

    def pes_for_memory(self, nbytes: float) -> int:
        """The fewest cores whose memory holds `nbytes`."""
        return max(1, math.ceil(nbytes / self.core_memory_bytes))


WSE2 = Wafer()
WSE3 = Wafer("wse3", "CS-3 (WSE-3)", WSE3_CORES, WSE3_GRID_ROWS, WSE3_GRID_COLS, WSE3_MEMORY_BYTES,
             WSE3_MEMORY_BANDWIDTH_BYTES_S, WSE3_FABRIC_BANDWIDTH_BITS_S / 8)
WAFERS = {w.name: w for w in (WSE2, WSE3)}
