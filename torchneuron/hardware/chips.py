"""The modelled machines as data: Trainium generations, the instances built from them, and the GPU they are
compared with.

Every constant names its source (the full list with paths is docs/hardware.md):
S1/S2/S3 = trainium{,2,3}.rst chip pages, S4-S6 = neuron-core-v{2,3,4}.rst, S7-S9 = trn{1,2,3}-arch.rst,
S10 = data-types.rst, S11 = logical-neuroncore-config.rst, S12-S14 = NKI architecture guides,
S15 = NKI performance guide, S16/S17 = NKI DMA guides, S40 = nccom-test user guide (measured collectives),
S41/S42 = intra-/inter-node collective deep dives, S34/S35/S37/S38 = H100, p5, H200, B200 specifications [3p]
(S35, the EC2 Capacity Blocks pricing page, also gives the Capacity Block rates), S45/S46 = p5en / p6-b200 on-demand
prices [3p],
G1-G3 = published GPU measurements [3p] (matmul, HBM and launch, NCCL),
[3p] = third party, [derived] = arithmetic on cited values, [assumption] = no published figure.
Where AWS pages disagree the value used is noted. Nothing here imports torch: the device, the compiler and the
cost model all read these tables.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

GiB = 1 << 30
TB = 1e12


@dataclass(frozen=True)
class Engine:
    """One NeuronCore compute engine: clock and per-cycle throughput (elements or MACs per cycle)."""

    clock_hz: float
    lanes: int  # elements per cycle through the datapath (vector/scalar/gpsimd); PE columns for tensor
    narrow_lanes: int = 0  # elements per cycle for 16/8-bit data, where the datapath is wider (0: lanes)

    def rate(self, itemsize: int) -> float:
        """Elements per second for data of `itemsize` bytes."""
        return self.clock_hz * (self.narrow_lanes if self.narrow_lanes and itemsize <= 2 else self.lanes)


@dataclass(frozen=True)
class Fabric:
    """Collective-communication constants of one platform (the model using them: docs/costmodel.md)."""

    fixed_s: float  # latency floor of one collective (launch, synchronisation), measured at small sizes
    hop_s: float  # per algorithm step between ranks inside an instance
    efficiency: float  # achieved bus bandwidth / nominal link bandwidth per rank, large messages
    efa_hop_s: float = 15e-6  # per algorithm step between instances: "~15us" point-to-point, S42
    source: str = ""


# S40: nccom-test on trn1: a 2-rank all-reduce takes 58 us at 1 KiB-64 KiB; busbw is 52.83 GiB/s at 1 GiB
# (2 ranks) and 47.1 GiB/s (64 ranks on 2 instances). 52.83 GiB/s over 192 GB/s of NeuronLink-v2 per core
# is 0.295.
# S41: per-hop latency of Ring/KangaRing "about 1-2 us". Applied to every Trainium generation: no published
# measurements exist for trn2/trn3.
NEURON_FABRIC = Fabric(fixed_s=58e-6, hop_s=1.5e-6, efficiency=52.83 * GiB / 192e9,
                       source="S40 nccom-test (trn1), S41/S42 per-hop latencies")


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
    # Marketed dense tensor-engine peaks per physical core, FLOP/s (chip page / cores): the MFU denominator.
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
    # Cost-model constants.
    k_per_pass: dict[str, int] = field(default_factory=dict)  # contraction rows per pass, by dtype class
    mm_min_cycles: int = 64  # a matmul instruction issues every max(moving free size, 64) cycles: S12
    fp32_slowdown: int = 4  # fp32 matmul costs about 4x bf16: S12
    instr_cycles: int = 60  # fixed cycles to start each vector/scalar SBUF/PSUM access: S12, S15
    dma_fixed_s: float = 1.3e-6  # fixed cost per DMA transfer (cross-engine semaphore): S15
    launch_s: float = 30e-6  # [assumption] eager op: host dispatch + runtime submission of one kernel
    # NKI kernel timeline (torchneuron/nki/cost.py, docs/nki.md).
    dma_engines: int = 16  # DMA engines (queues) per core: S12, S13, S14
    # [assumption] a DMA's efficiency is row / (row + this) for `row` contiguous bytes per partition, fitted to
    # S15/S16 (under 256 B per partition overhead-bound, 2 KiB the recommended minimum, 4 KiB+ near peak)
    dma_row_overhead_bytes: int = 1024
    gpsimd_fixed_cycles: int = 150  # affine_select / iota: 150 + N GpSimd cycles, S22 (nki.isa.affine_select)
    fabric: Fabric = NEURON_FABRIC

    def logical_cores(self, lnc: int) -> int:
        return self.physical_cores // lnc

    def core_hbm(self, lnc: int) -> int:
        """HBM per logical core: the chip's HBM split evenly among its logical cores."""
        return self.hbm_bytes // self.logical_cores(lnc)

    def tensor_flops(self, dtype_class: str = "bfloat16") -> float:
        """Dense TensorE FLOP/s of one physical core from the clock and the array: 2 FLOP per PE per cycle,
        `k_per_pass` rows per pass (fp8 double-row, MX), a quarter for fp32."""
        rows = self.k_per_pass.get(dtype_class, self.pe_rows)
        slow = self.fp32_slowdown if dtype_class == "float32" else 1
        return 2 * rows * self.pe_cols * self.tensor.clock_hz / slow


_COMMON_DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2",
                  "int8", "uint8", "int16", "int32", "bool")

CHIPS: dict[str, Chip] = {
    "trn1": Chip(
        name="Trainium1", core_version="NeuronCore-v2", physical_cores=2, lnc_options=(1,), default_lnc=1,
        hbm_bytes=32 * GiB,  # S1, S12
        hbm_bw=820e9,  # S12 (S1 says 820 GiB/s)
        dma_bw_per_core=272e9,  # S16: 16 engines x 17 B/ns
        # S1: 190 / 47.5 TFLOPS per chip
        peak_flops={"bfloat16": 95e12, "float16": 95e12, "float8": 95e12, "float32": 23.75e12},
        tensor=Engine(2.8e9, 128), vector=Engine(1.12e9, 128), scalar=Engine(1.4e9, 128),
        gpsimd=Engine(1.4e9, 128),  # S12 clocks and datapath widths
        sbuf_bytes=24 * 1024 * 1024, psum_bytes=2 * 1024 * 1024,  # S12
        link_bw=384e9,  # S2: NeuronLink-v2 per chip
        dtypes=_COMMON_DTYPES,
        k_per_pass={},  # cFP8 runs at the bf16 rate on v2: S1
    ),
    "trn2": Chip(
        name="Trainium2", core_version="NeuronCore-v3", physical_cores=8, lnc_options=(1, 2), default_lnc=2,
        hbm_bytes=96 * GiB,  # S2 (4 x 24 GB stacks, each shared by 2 cores: S11)
        hbm_bw=2.9e12,  # S2 (S13 says 3 TB/s)
        dma_bw_per_core=368e9,  # S16
        peak_flops={"bfloat16": 83.4e12, "float16": 83.4e12, "float8": 162.4e12, "float32": 22.6e12},  # S2/8
        tensor=Engine(2.4e9, 128), vector=Engine(0.96e9, 256, 512), scalar=Engine(1.2e9, 128),
        gpsimd=Engine(1.2e9, 128),  # S13: Vector 512 elements/cycle for bf16/fp16, otherwise 256
        sbuf_bytes=28 * 1024 * 1024, psum_bytes=2 * 1024 * 1024,  # S13
        link_bw=1024e9,  # S8
        dtypes=_COMMON_DTYPES,
        k_per_pass={"float8": 256},  # fp8 double_row: K=256 per instruction, S13
    ),
    "trn3": Chip(
        name="Trainium3", core_version="NeuronCore-v4", physical_cores=8, lnc_options=(1, 2), default_lnc=2,
        hbm_bytes=144 * GiB,  # S3
        hbm_bw=4.9e12,  # S3 (S14 says 4.7 TB/s)
        dma_bw_per_core=528e9,  # S16
        peak_flops={"bfloat16": 83.9e12, "float16": 83.9e12, "float8": 314.6e12, "float32": 22.9e12},  # S3/8
        tensor=Engine(2.4e9, 128), vector=Engine(1.2e9, 256, 512), scalar=Engine(1.2e9, 128, 256),
        gpsimd=Engine(1.2e9, 128),  # S14: Scalar 256 elements/cycle for 16/8-bit
        sbuf_bytes=32 * 1024 * 1024, psum_bytes=2 * 1024 * 1024,  # S14
        link_bw=2048e9,  # S9 (S3 says 2.56 TB/s)
        dtypes=_COMMON_DTYPES,
        k_per_pass={"float8": 256, "mx": 512},  # double_row (S22) and MX matmul K=512 (S14)
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
    reserved_per_hour: float | None = None  # USD, AWS's published "RI-effective" rate (S26); None: not published
    capacity_block_per_hour: float | None = None  # USD, EC2 Capacity Blocks effective instance rate (S35)


INSTANCES: dict[str, Instance] = {
    i.name: i
    for i in (
        Instance("trn1.2xlarge", "trn1", 1, 1.34375, "[3p] public price tables, 2026", 25e9, 0.512),
        Instance("trn1.32xlarge", "trn1", 16, 21.50, "[3p] usage.ai 2026 and price tables", 800e9, 8.197, 15.49),
        Instance("trn1n.32xlarge", "trn1", 16, 24.78, "[3p] public price tables", 1600e9),
        Instance("trn2.3xlarge", "trn2", 1, 35.7608 / 16, "[derived] 1/16 of trn2.48xlarge; UNVERIFIED", 0.0),
        Instance("trn2.48xlarge", "trn2", 16, 35.7608, "[3p] us-east-1 Feb 2026, UNVERIFIED", 3200e9),
        Instance("trn3.48xlarge", "trn3", 16, None, "no public price found", 12800e9),
    )
}

# S49: how NxD (ExpertMLPsV2, the MoE layer of NxD Inference and optimum-neuron) runs an MoE layer in inference:
# a context-encoding pass of at least this many routed rows runs blockwise, each expert's rows padded to blocks of
# this many (DEFAULT_BLOCK_SIZE); selective loading only while tokens x top-k < experts
# (DEFAULT_SELECTIVE_LOADING_THRESHOLD 1.0)
NXD_MOE_BLOCK = 512

DEFAULT_INSTANCE = "trn2.3xlarge"

# The instance the cost model assumes for a target when none is named: the largest one, which has NeuronLink.
LARGEST_INSTANCE = {"trn1": "trn1.32xlarge", "trn2": "trn2.48xlarge", "trn3": "trn3.48xlarge"}


@dataclass(frozen=True)
class Gpu:
    """A GPU for comparison, calibrated like the Trainium side: its vendor peaks, then what published measurements
    reach of them (matmul, HBM, kernel and collective latencies), with the same collective model."""

    name: str
    peak_flops: dict[str, float]  # dense tensor-core FLOP/s by dtype class (the MFU denominator)
    vector_flops: float  # non-tensor FP32 FLOP/s
    hbm_bytes: int
    hbm_bw: float
    link_bw: float  # NVLink bytes/s per GPU
    sbuf_bytes: int  # on-chip memory an intermediate of a fused kernel can stay in (L2)
    launch_s: float  # eager op launch
    kernel_s: float  # fixed cost of a kernel inside a captured / compiled graph
    fabric: Fabric
    sms: int = 132  # streaming multiprocessors: a matmul's output tiles run in waves of this many
    # Achieved fraction of the dense peak on large, well-shaped GEMMs (the Maximum Achievable Matmul FLOPS), by
    # dtype class; shape effects (tile waves) come on top.
    mm_efficiency: dict[str, float] = field(default_factory=dict)
    hbm_efficiency: float = 1.0  # achieved / nominal HBM bandwidth of a streaming kernel
    # Fused (flash) attention's achieved fraction of the bf16 dense peak by key length: (keys, fraction) points,
    # interpolated in log(keys).
    attention_efficiency: tuple[tuple[int, float], ...] = ((1, 1.0),)

    def attention_fraction(self, keys: int) -> float:
        pts = self.attention_efficiency
        if keys <= pts[0][0]:
            return pts[0][1]
        for (k0, f0), (k1, f1) in zip(pts, pts[1:], strict=False):
            if keys <= k1:
                return f0 + (f1 - f0) * (math.log(keys) - math.log(k0)) / (math.log(k1) - math.log(k0))
        return pts[-1][1]


# Measurements applied to every NVIDIA GPU here ([3p] each, docs/hardware.md):
# G1 MAMF table (stas00/ml-engineering, compute/accelerator): bf16 matmul H100/H200 SXM 794.5 of 989 TF (80.3%),
#    B200 1745 of 2250 (77.6%); fp8 H200 1453.4 of 1979 (73.4%, used for H100 too: same chip), B200 3432.5 of
#    4500 (76.3%).
# G2 a public H100 (NVL) measurement: memory copy 90.6% of the datasheet HBM bandwidth; one kernel inside a
#    replayed CUDA graph 1.28 us; one eager op issued from Python 4.2 us.
# G3 nccl-tests on 8x H100 SXM: all-reduce busbw 460-480 GB/s (alayanew 2026): efficiency 470/900 of NVLink-4.
#    The NCCL small-message latency floor (15 us) stays an [assumption].
# G4 FlashAttention-3 paper (Shah et al. 2024, fig. 5): FlashAttention-2, the kernel PyTorch's SDPA flash backend
#    runs, forward, causal, head dim 128 on H100 SXM5: 191, 260, 298, 319, 333, 335 TF/s at 0.5k-16k keys.
_NV_FABRIC = Fabric(fixed_s=15e-6, hop_s=1e-6, efficiency=470 / 900,
                    source="G3 nccl-tests busbw 460-480 GB/s; latency floor [assumption]")
_HOPPER = dict(vector_flops=67e12, sbuf_bytes=50 * 10**6, launch_s=4.2e-6, kernel_s=1.28e-6, fabric=_NV_FABRIC,
               sms=132, mm_efficiency={"bfloat16": 0.803, "float8": 0.734, "float32": 0.803}, hbm_efficiency=0.906,
               attention_efficiency=tuple((k, tf / 989) for k, tf in ((512, 191), (1024, 260), (2048, 298),
                                                                     (4096, 319), (8192, 333), (16384, 335))))
GPUS: dict[str, Gpu] = {
    # S34 [3p]: H100 SXM5 dense 989 TF bf16/fp16, 1979 TF fp8, 494 TF tf32, 67 TF fp32 non-tensor; 80 GB HBM3 at
    # 3.35 TB/s; NVLink-4 900 GB/s; 50 MB L2.
    "h100": Gpu(name="H100 SXM5 80GB",
                peak_flops={"bfloat16": 989e12, "float16": 989e12, "float8": 1979e12, "float32": 494e12},
                hbm_bytes=80 * 10**9, hbm_bw=3.35e12, link_bw=900e9, **_HOPPER),
    # S37 [3p]: H200 SXM is the H100 chip with 141 GB HBM3e at 4.8 TB/s.
    "h200": Gpu(name="H200 SXM 141GB",
                peak_flops={"bfloat16": 989e12, "float16": 989e12, "float8": 1979e12, "float32": 494e12},
                hbm_bytes=141 * 10**9, hbm_bw=4.8e12, link_bw=900e9, **_HOPPER),
    # S38 [3p]: B200 (DGX B200) dense 2,250 TF bf16, 4,500 TF fp8, 180 GB HBM3e at 8 TB/s, NVLink-5 1.8 TB/s,
    # 148 SMs. Launch, kernel and NCCL latencies as on Hopper [assumption]; the NVLink efficiency of G3.
    "b200": Gpu(name="B200 SXM 180GB",
                peak_flops={"bfloat16": 2250e12, "float16": 2250e12, "float8": 4500e12, "float32": 1125e12},
                hbm_bytes=180 * 10**9, hbm_bw=8.0e12, link_bw=1800e9,
                **{**_HOPPER, "sms": 148, "vector_flops": 80e12, "sbuf_bytes": 126 * 10**6,
                   "mm_efficiency": {"bfloat16": 0.776, "float8": 0.763, "float32": 0.776}}),
}


@dataclass(frozen=True)
class GpuInstance:
    name: str
    gpu: str  # key of GPUS
    gpus: int
    price_per_hour: float | None  # USD on-demand; None where no source was found
    price_source: str
    efa_bps: float
    reserved_per_hour: float | None = None  # no reserved GPU rate is published in the sources used (hardware.md)
    capacity_block_per_hour: float | None = None  # USD, EC2 Capacity Blocks effective instance rate (S35)


GPU_INSTANCES: dict[str, GpuInstance] = {
    g.name: g
    for g in (
        GpuInstance("p5.48xlarge", "h100", 8, 55.04,
                    "[3p] us-east-1 on-demand after the June 2025 P5 price cut (2026 price tables); $98.32 at launch",
                    3200e9, capacity_block_per_hour=39.33),  # S35
        GpuInstance("p5en.48xlarge", "h200", 8, 63.296,
                    "[3p] us-east-1 on-demand, AWS price list as listed by dstack (PR #4110, Aug 2026) and 2026 "
                    "price tables", 3200e9),  # S45
        # the H200 instance AWS's Capacity Blocks page prices (S35: 8 x H200, 3,200 Gbps); after p5en, so that an
        # H200 comparison on demand uses p5en
        GpuInstance("p5e.48xlarge", "h200", 8, None, "no on-demand price in the sources used (hardware.md)",
                    3200e9, capacity_block_per_hour=43.26),
        GpuInstance("p6-b200.48xlarge", "b200", 8, 113.9328,
                    "[3p] us-east-1 on-demand, 2026 public price tables (Vantage, DoiT)", 3200e9),  # S46
    )
}

# The GPU instance the cost model uses for a GPU when none is named.
GPU_INSTANCE = {g.gpu: name for name, g in reversed(GPU_INSTANCES.items())}

# How an instance-hour is bought: on demand, AWS's RI-effective rate (S26), or an EC2 Capacity Block (S35).
PRICING = ("on-demand", "reserved", "capacity-block")


def hourly_rate(instance: str, pricing: str = "on-demand") -> float | None:
    """USD per hour of a Trainium or GPU instance bought as `pricing`; None where no rate is published in the
    sources used (docs/hardware.md, "Prices")."""
    i = INSTANCES[instance] if instance in INSTANCES else GPU_INSTANCES[instance]
    return {"on-demand": i.price_per_hour, "reserved": i.reserved_per_hour,
            "capacity-block": i.capacity_block_per_hour}[pricing]


def rated_instances(pricing: str) -> list[str]:
    """The instances with a published `pricing` rate (named in usage errors)."""
    return [n for n in (*INSTANCES, *GPU_INSTANCES) if hourly_rate(n, pricing) is not None]


def gpu_instance(gpu: str, pricing: str = "on-demand") -> str:
    """The instance a GPU is bought on: its default one, or under another pricing the first instance of that GPU
    with a published rate of that kind (an H200 Capacity Block is a p5e.48xlarge); the default when none has."""
    return next((n for n, g in GPU_INSTANCES.items() if g.gpu == gpu and hourly_rate(n, pricing) is not None),
                GPU_INSTANCE[gpu])
