"""The modelled machines as data: Trainium generations and the instances built from them.

Every constant names its source (AWS Neuron documentation pages, see docs/hardware.md for the list):
S1/S2/S3 = trainium{,2,3}.rst chip pages, S4-S6 = neuron-core-v{2,3,4}.rst, S7-S9 = trn{1,2,3}-arch.rst,
S10 = data-types.rst, S11 = logical-neuroncore-config.rst, S12-S14 = NKI architecture guides,
S16/S17 = NKI DMA guides, [3p] = third-party (prices). Where AWS pages disagree the value used is noted.
Nothing here imports torch: the device, the compiler and the cost model all read this one table.
"""
from __future__ import annotations

from dataclasses import dataclass, field

GiB = 1 << 30
TB = 1e12


@dataclass(frozen=True)
class Engine:
    """One NeuronCore compute engine: clock and per-cycle throughput (elements or MACs per cycle)."""

    clock_hz: float
    lanes: int  # elements per cycle through the datapath (vector/scalar/gpsimd); PE columns for tensor


@dataclass(frozen=True)
class Chip:
    name: str
    core_version: str
    physical_cores: int  # NeuronCores per chip
    lnc_options: tuple[int, ...]  # valid NEURON_LOGICAL_NC_CONFIG values
    default_lnc: int
    hbm_bytes: int  # per chip
    hbm_bw: float  # bytes/s per chip
    dma_bw_per_core: float  # bytes/s, peak per physical core (16 DMA engines)
    # Dense tensor-engine peaks per physical core, FLOP/s (2 FLOP per MAC).
    peak_flops: dict[str, float]
    tensor: Engine
    vector: Engine
    scalar: Engine
    gpsimd: Engine
    sbuf_bytes: int  # per physical core (128 partitions)
    psum_bytes: int  # per physical core
    pe_rows: int = 128  # systolic array: contraction (partition) dimension per pass
    pe_cols: int = 128  # output columns per pass (stationary operand)
    psum_free_max: int = 512  # fp32 accumulators per partition per PSUM bank: moving free size per matmul
    link_bw: float = 0.0  # NeuronLink bytes/s per chip (intra-instance)
    dtypes: tuple[str, ...] = ()  # torch dtype names the hardware computes natively
    native_int64: bool = False  # int64 is reinterpreted as 32-bit unless the compiler's --native-int64
    notes: tuple[str, ...] = field(default_factory=tuple)

    def logical_cores(self, lnc: int) -> int:
        return self.physical_cores // lnc

    def core_hbm(self, lnc: int) -> int:
        """HBM per logical core: the chip's HBM split evenly among its logical cores."""
        return self.hbm_bytes // self.logical_cores(lnc)


_COMMON_DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2",
                  "int8", "uint8", "int16", "int32", "bool")

CHIPS: dict[str, Chip] = {
    "trn1": Chip(
        name="Trainium1", core_version="NeuronCore-v2", physical_cores=2, lnc_options=(1,), default_lnc=1,
        hbm_bytes=32 * GiB,  # S1, S12
        hbm_bw=820e9,  # S12 (S1 says 820 GiB/s)
        dma_bw_per_core=272e9,  # S16: 16 engines x 17 B/ns
        peak_flops={"bfloat16": 95e12, "float16": 95e12, "float8": 95e12, "float32": 23.75e12},  # S1: 190/47.5 per chip
        tensor=Engine(2.8e9, 128), vector=Engine(1.12e9, 128), scalar=Engine(1.4e9, 128),
        gpsimd=Engine(1.4e9, 128),  # S12 clocks
        sbuf_bytes=24 * 1024 * 1024, psum_bytes=2 * 1024 * 1024,  # S12
        link_bw=384e9,  # S2: NeuronLink-v2 per chip
        dtypes=_COMMON_DTYPES,
    ),
    "trn2": Chip(
        name="Trainium2", core_version="NeuronCore-v3", physical_cores=8, lnc_options=(1, 2), default_lnc=2,
        hbm_bytes=96 * GiB,  # S2 (4 x 24 GB stacks, each shared by 2 cores: S11)
        hbm_bw=2.9e12,  # S2 (S13 says 3 TB/s)
        dma_bw_per_core=368e9,  # S16
        peak_flops={"bfloat16": 83.4e12, "float16": 83.4e12, "float8": 162.4e12, "float32": 22.6e12},  # S2 / 8
        tensor=Engine(2.4e9, 128), vector=Engine(0.96e9, 256), scalar=Engine(1.2e9, 128),
        gpsimd=Engine(1.2e9, 128),  # S13
        sbuf_bytes=28 * 1024 * 1024, psum_bytes=2 * 1024 * 1024,  # S13
        link_bw=1024e9,  # S8
        dtypes=_COMMON_DTYPES,
    ),
    "trn3": Chip(
        name="Trainium3", core_version="NeuronCore-v4", physical_cores=8, lnc_options=(1, 2), default_lnc=2,
        hbm_bytes=144 * GiB,  # S3
        hbm_bw=4.9e12,  # S3 (S14 says 4.7 TB/s)
        dma_bw_per_core=528e9,  # S16
        peak_flops={"bfloat16": 83.9e12, "float16": 83.9e12, "float8": 314.6e12, "float32": 22.9e12},  # S3 / 8
        tensor=Engine(2.4e9, 128), vector=Engine(1.2e9, 256), scalar=Engine(1.2e9, 128),
        gpsimd=Engine(1.2e9, 128),  # S14
        sbuf_bytes=32 * 1024 * 1024, psum_bytes=2 * 1024 * 1024,  # S14
        link_bw=2048e9,  # S9 (S3 says 2.56 TB/s)
        dtypes=_COMMON_DTYPES,
    ),
}


@dataclass(frozen=True)
class Instance:
    name: str
    chip: str  # key of CHIPS
    chips: int
    price_per_hour: float | None  # USD on-demand, us-east-1; None where no source was found
    price_source: str = ""
    efa_bps: float = 0.0  # bits/s between instances


INSTANCES: dict[str, Instance] = {
    i.name: i
    for i in (
        Instance("trn1.2xlarge", "trn1", 1, 1.34375, "[3p] public price tables, 2026", 25e9),
        Instance("trn1.32xlarge", "trn1", 16, 21.50, "[3p] usage.ai 2026 and price tables", 800e9),
        Instance("trn1n.32xlarge", "trn1", 16, 24.78, "[3p] public price tables", 1600e9),
        Instance("trn2.3xlarge", "trn2", 1, 35.7608 / 16, "[derived] 1/16 of trn2.48xlarge; UNVERIFIED", 0.0),
        Instance("trn2.48xlarge", "trn2", 16, 35.7608, "[3p] us-east-1 Feb 2026, UNVERIFIED", 3200e9),
        Instance("trn3.48xlarge", "trn3", 16, None, "no public price found", 12800e9),
    )
}

DEFAULT_INSTANCE = "trn2.3xlarge"
