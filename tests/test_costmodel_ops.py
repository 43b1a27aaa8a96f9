"""The op cost functions against rooflines computed by hand from the constants in hardware/chips.py."""
from __future__ import annotations

import math

import pytest

from torchneuron.costmodel.ops import collective_cost, kernel_time, op_cost, pe_cycles, target
from torchneuron.hardware.chips import CHIPS, NEURON_FABRIC

BF, F32 = "bfloat16", "float32"
KERNEL = 2 * 1.3e-6  # two DMA fixed costs (S15)


def mm(m, k, n, dtype=BF, tgt="trn2", mode="kernel", **kw):
    return op_cost("aten::mm", [((m, k), dtype), ((k, n), dtype)], [((m, n), dtype)], tgt, mode=mode, **kw)


def test_tuned_matmul_on_trn1_is_compute_bound_at_full_tile_use():
    # [4096,8192] x [8192,8192] bf16 on one NeuronCore-v2: K 8192/128 = 64 passes of contraction, stationary
    # 4096/128 = 32 column tiles, moving 8192/512 = 16 PSUM-bank tiles of 512 cycles each.
    cycles = 64 * 32 * 16 * 512  # 16,777,216
    compute = cycles / 2.8e9  # 5.9919 ms
    c = mm(4096, 8192, 8192, tgt="trn1")
    assert c.engine == "tensor" and c.bound == "compute"
    assert c.flops == 2 * 4096 * 8192 * 8192
    assert c.compute_s == pytest.approx(compute)
    assert c.time_s == pytest.approx(compute + KERNEL)
    # peak = 2 FLOP x 128 x 128 PEs x 2.8 GHz = 91.75 TFLOP/s; achieved is the whole time's share of it
    assert c.peak_flops == pytest.approx(2 * 128 * 128 * 2.8e9)
    assert c.achieved == pytest.approx(c.flops / (compute + KERNEL) / 91.75e12, rel=1e-3)
    # HBM: 64 + 128 + 64 MiB compulsory, below the tiled re-read bound 2MNK*2 B / sqrt(24 MiB / 2 B)
    reread = 2 * 4096 * 8192 * 8192 * 2 / (24 * 2**20 / 2) ** 0.5
    assert c.io_bytes == (4096 * 8192 + 8192 * 8192 + 4096 * 8192) * 2
    assert c.bytes == pytest.approx(reread)
    assert c.memory_s == pytest.approx(reread / 272e9)  # per-core stream: min(820/2 GB/s HBM, 272 GB/s DMA)


def test_partial_tiles_cost_full_tiles():
    # [100,128] x [128,100] on one NeuronCore-v3 (LNC=1): one pass, 100 stationary columns (of 128), 100
    # moving (>= 64): 100 cycles for 100*128*100 MACs, i.e. 100/128 of the array.
    assert pe_cycles(100, 128, 100, CHIPS["trn2"], BF) == 100
    c = mm(100, 128, 100, tgt=target("trn2", lnc=1))
    assert c.compute_s == pytest.approx(100 / 2.4e9)
    # K = 129 needs a second contraction pass: twice the cycles for one more row
    assert pe_cycles(100, 129, 100, CHIPS["trn2"], BF) == 200


def test_gemv_picks_the_short_moving_orientation_and_is_memory_bound():
    # [1,8192] x [8192,8192]: weights stationary (64 column tiles), the token moving: 1 column, so the
    # 64-cycle floor. 64 contraction passes x 64 tiles x 64 cycles = 262,144;
    # the other way round: 64 x 1 x 16 x 512 = 524,288.
    assert pe_cycles(1, 8192, 8192, CHIPS["trn2"], BF) == 64 * 64 * 64
    t = target("trn2", lnc=1)
    c = mm(1, 8192, 8192, tgt=t)
    assert c.compute_s == pytest.approx(262144 / 2.4e9)  # 109 us
    nbytes = (8192 + 8192 * 8192 + 8192) * 2
    assert t.hbm_bw == pytest.approx(2.9e12 / 8)  # a physical core's HBM share (DMA 368 GB/s is higher)
    assert c.bound == "memory" and c.memory_s == pytest.approx(nbytes / (2.9e12 / 8))  # 370 us


def test_lnc2_doubles_the_array_and_the_bandwidth():
    one, two = mm(2048, 2048, 2048, tgt=target("trn2", 1)), mm(2048, 2048, 2048, tgt=target("trn2", 2))
    assert two.compute_s == pytest.approx(one.compute_s / 2)
    assert target("trn2", 2).hbm_bw == pytest.approx(2 * 2.9e12 / 8)


def test_dtype_rates():
    bf16, fp32 = mm(512, 1024, 512), mm(512, 1024, 512, dtype=F32)
    assert fp32.compute_s == pytest.approx(4 * bf16.compute_s)  # fp32 at a quarter rate
    # fp8 double-row on trn2: K = 256 per pass, so 4 instead of 8 contraction passes
    fp8 = mm(512, 1024, 512, dtype="float8_e4m3fn")
    assert pe_cycles(512, 1024, 512, CHIPS["trn2"], "float8") == 4 * 4 * 512
    assert fp8.compute_s == pytest.approx(bf16.compute_s / 2)
    # trn1 has no fast fp8 mode (cFP8 at the bf16 rate)
    t1 = lambda d: mm(512, 1024, 512, dtype=d, tgt="trn1").compute_s
    assert t1("float8_e4m3fn") == pytest.approx(t1(BF))


def test_tensor_parallel_shard_divides_a_dimension():
    full, shard = mm(8192, 4096, 14336, tgt="trn1"), mm(8192, 4096, 14336, tgt="trn1", shard=("n", 32))
    # N 14336/32 = 448: 448 moving columns per pass (no waste), so exactly 1/32 of the work
    assert shard.flops == full.flops / 32
    assert shard.compute_s == pytest.approx(full.compute_s / 32)


def test_elementwise_on_the_vector_engine():
    # fp32 add of two [4096,4096] on trn2 (LNC=2): 2 inputs -> 2 passes over 16.8M elements at 256 fp32
    # lanes x 0.96 GHz x 2 cores; plus 60 cycles per 128x2048-element instruction per pass.
    n = 4096 * 4096
    compute = 2 * n / (256 * 0.96e9 * 2) + (n // (128 * 2048)) * 2 * 60 / 0.96e9
    c = op_cost("add", [((4096, 4096), F32)] * 2, [((4096, 4096), F32)], "trn2")
    assert c.engine == "vector" and c.compute_s == pytest.approx(compute)
    assert c.bytes == 3 * n * 4 and c.memory_s == pytest.approx(3 * n * 4 / 725e9)
    assert c.bound == "memory"
    assert c.overhead_s == pytest.approx(30e-6 + KERNEL)  # eager: launch + kernel
    # bf16 doubles the vector datapath on NeuronCore-v3 (512 elements per cycle)
    b = op_cost("add", [((4096, 4096), BF)] * 2, [((4096, 4096), BF)], "trn2")
    assert b.compute_s < c.compute_s * 0.6


def test_activation_goes_to_the_scalar_engine_and_views_are_free():
    c = op_cost("aten::gelu", [((1024, 1024), F32)], [((1024, 1024), F32)], "trn1")
    assert c.engine == "scalar"
    assert c.compute_s == pytest.approx(1024 * 1024 / (128 * 1.4e9) + 4 * 60 / 1.4e9)
    v = op_cost("aten::view", [((8, 8), F32)], [((64,), F32)], "trn1")
    assert v.time_s == 0 and v.engine == "free"


def test_embedding_reads_only_the_rows_it_returns():
    c = op_cost("embedding", [((128256, 4096), BF), ((1, 8192), "int64")], [((1, 8192, 4096), BF)], "trn2",
                mode="fused")
    assert c.engine == "gpsimd"
    assert c.bytes == 2 * 8192 * 4096 * 2 + 8192 * 8  # rows read + written, and the indices


def test_flash_attention_counts_only_the_causal_half():
    q = ((1, 32, 4096, 128), BF)
    full = op_cost("_scaled_dot_product_flash_attention_for_cpu", [q, q, q], [q], "trn2", mode="fused")
    causal = op_cost("_scaled_dot_product_flash_attention_for_cpu", [q, q, q], [q], "trn2", mode="fused",
                     attrs={"is_causal": True})
    assert full.flops == 2 * 32 * 4096 * 4096 * (128 + 128)
    assert causal.flops == full.flops / 2
    assert full.memory_s == pytest.approx(4 * 32 * 4096 * 128 * 2 / 725e9)  # q, k, v, o once each


def test_lstm_layer_runs_its_steps_one_after_another():
    # nn.LSTM's sequence kernel, 35 steps of batch 128, input and hidden 512 (4 gates: 2048 wide) on trn1: each
    # step one [128, 1024] x [1024, 2048] GEMM, then the gates (ScalarE once, VectorE three times), in turn.
    steps, b, h, g = 35, 128, 512, 2048
    x, w_ih, w_hh, hc = ((steps, b, h), BF), ((g, h), BF), ((g, h), BF), ((b, h), BF)
    t = target("trn1")
    gemm = mm(b, 2 * h, g, tgt="trn1", mode="fused").compute_s
    gates = b * g * (1 / t.engine_rate("scalar", 2) + 3 / t.engine_rate("vector", 2))
    fwd = op_cost("mkldnn_rnn_layer", [x, w_ih, w_hh, hc, hc], [((steps, b, h), BF), hc, hc], "trn1", mode="fused")
    assert fwd.engine == "tensor" and fwd.flops == 2 * steps * b * 2 * h * g
    assert fwd.compute_s == pytest.approx(steps * (gemm + gates))
    assert fwd.compute_s > 2 * mm(steps * b, 2 * h, g, tgt="trn1", mode="fused").compute_s  # not one big GEMM
    bwd = op_cost("mkldnn_rnn_layer_backward", [x, w_ih, w_hh, hc, hc], [x, w_ih, w_hh], "trn1", mode="fused")
    assert bwd.flops == 2 * fwd.flops and bwd.compute_s == pytest.approx(steps * (2 * gemm + gates))


def test_fused_kernel_overlaps_engines_and_pays_one_fixed_cost():
    a = op_cost("mm", [((1024, 1024), BF)] * 2, [((1024, 1024), BF)], "trn2", mode="fused")
    g = op_cost("gelu", [((1024, 1024), BF)], [((1024, 1024), BF)], "trn2", mode="fused")
    hbm = 3 * 1024 * 1024 * 2  # both inputs of the matmul and the gelu output: the intermediate stays on chip
    t = kernel_time([a, g], hbm, "trn2")
    assert t == pytest.approx(max(a.compute_s, g.compute_s, hbm / 725e9) + KERNEL)
    assert kernel_time([a, g], hbm, "trn2", eager=True) == pytest.approx(t + 30e-6)


def test_small_all_reduce_is_latency_bound():
    # 16 KiB over 64 logical cores of one trn2.48xlarge: Mesh (< 1 MiB) = 2 steps of 1.5 us, plus the 58 us
    # floor, plus 2*63/64 of the buffer at the bus bandwidth (1024 GB/s per chip / 4 cores x 0.295).
    eff = 52.83 * 2**30 / 192e9
    assert NEURON_FABRIC.efficiency == pytest.approx(eff)
    busbw = 1024e9 / 4 * eff
    c = collective_cost("all_reduce", 16384, 64, "trn2")
    assert c.time_s == pytest.approx(58e-6 + 2 * 1.5e-6 + 2 * 63 / 64 * 16384 / busbw)
    assert c.bound == "communication"


def test_large_all_gather_rides_the_ring():
    # 64 MiB all-gather over 32 trn1 cores: ring (> 56 MiB), 31 steps; 31/32 of the buffer at 192 GB/s x 0.295
    busbw = 384e9 / 2 * NEURON_FABRIC.efficiency
    c = collective_cost("all_gather", 64 * 2**20, 32, "trn1")
    assert c.time_s == pytest.approx(58e-6 + 31 * 1.5e-6 + 31 / 32 * 64 * 2**20 / busbw)


def test_collective_across_instances_adds_an_efa_stage():
    # 1 GiB all-reduce over 64 ranks, 32 per trn1.32xlarge: intra ring (62 steps) on 1 GiB, then between the 2
    # instances on 1/32 of it (32 MiB: recursive halving-doubling, 2 steps of 15 us) at 800 Gb/s / 32 ranks.
    busbw = 384e9 / 2 * NEURON_FABRIC.efficiency
    efa = 800e9 / 8 / 32
    intra = 62 * 1.5e-6 + 2 * 31 / 32 * 2**30 / busbw
    inter = 2 * 15e-6 + 2 * 1 / 2 * 2**30 / 32 / efa
    c = collective_cost("all_reduce", 2**30, 64, "trn1", ranks_per_node=32, efa_bw=efa)
    assert c.time_s == pytest.approx(58e-6 + intra + inter)


def test_all_to_all_sends_each_block_straight_to_its_rank():
    """MoE dispatch: 8 MiB per rank over 64 ranks, 32 per trn1.32xlarge. Each rank keeps 1/64 of its buffer,
    sends 31/64 to ranks of its instance (one Mesh step of 1.5 us, at 192 GB/s x 0.295) and 32/64 to the other
    instance (one 15 us EFA step, at 800 Gb/s shared by the instance's 32 ranks). Inside one instance only the
    first part is paid."""
    busbw = 384e9 / 2 * NEURON_FABRIC.efficiency
    efa = 800e9 / 8 / 32
    n = 8 * 2**20
    c = collective_cost("all_to_all", n, 64, "trn1", ranks_per_node=32, efa_bw=efa)
    assert c.time_s == pytest.approx(58e-6 + 1.5e-6 + 31 / 64 * n / busbw + 15e-6 + 32 / 64 * n / efa)
    assert c.bytes == pytest.approx(63 / 64 * n)
    one = collective_cost("all_to_all", n, 8, "trn1")
    assert one.time_s == pytest.approx(58e-6 + 1.5e-6 + 7 / 8 * n / busbw)
    assert collective_cost("all_to_all", n, 1, "trn1").time_s == 0


def test_gpu_matmul_is_its_calibrated_roofline():
    """H100: 989 TF/s bf16 x the measured 80.3% (G1); 32 x 32 = 1,024 output tiles of 128 x 128 run in
    ceil(1024 / 132) = 8 waves over the SMs, the last one partial; 1.28 us per graph kernel (G2)."""
    c = mm(4096, 4096, 4096, tgt="h100")
    waves = 1024 / (8 * 132)
    assert c.compute_s == pytest.approx(2 * 4096**3 / (989e12 * 0.803) / waves)
    assert c.overhead_s == pytest.approx(1.28e-6)
    # fewer tiles than SMs (2 x 2): each of 4 SMs runs one 128 x 128 x 4096 tile at 1/132 of the rate, the other
    # 128 SMs idle (no split-K)
    per_sm = 989e12 * 0.803 / 132
    assert mm(256, 4096, 256, tgt="h100").compute_s == pytest.approx(2 * 128 * 128 * 4096 / per_sm)
    # a decode GEMV (one row, 64 tiles) still streams its 8192 x 8192 weights at the measured HBM rate (G2)
    gemv = mm(1, 8192, 8192, tgt="h100")
    assert gemv.compute_s < gemv.memory_s == pytest.approx(gemv.bytes / (3.35e12 * 0.906))


def test_gpu_fp8_and_weight_only_matmul_rates():
    """fp8 x fp8 runs at the fp8 peak x its measured 73.4%; 8-bit weights with bf16 activations run at the bf16
    rate but read one byte per weight."""
    n = 8192
    fp8 = op_cost("mm", [((n, n), "float8_e4m3fn"), ((n, n), "float8_e4m3fn")], [((n, n), "bfloat16")], "h100")
    waves = 4096 / (math.ceil(4096 / 132) * 132)
    assert fp8.compute_s == pytest.approx(2 * n**3 / (1979e12 * 0.734) / waves)
    w8 = op_cost("mm", [((1, n), "bfloat16"), ((n, n), "int8")], [((1, n), "bfloat16")], "h100")
    assert w8.io_bytes == pytest.approx(n * 2 + n * n + n * 2)
    assert w8.peak_flops == pytest.approx(989e12 * 0.803)
    assert w8.memory_s == pytest.approx(w8.io_bytes / (3.35e12 * 0.906))  # HBM at its measured 90.6% (G2)


def test_gpu_attention_runs_at_the_measured_flash_fraction():
    """Causal flash attention, 8 heads x 8192 x 128: half the 2 x 2 x s^2 x d FLOPs per head, at
    FlashAttention-2's measured 333 TF/s at 8k keys (G4)."""
    q = ((1, 8, 8192, 128), "bfloat16")
    c = op_cost("_scaled_dot_product_flash_attention", [q, q, q], [q], "h100", attrs={"is_causal": True})
    flops = 2 * 8 * 8192 * 8192 * 256 / 2
    assert c.flops == pytest.approx(flops)
    assert c.compute_s == pytest.approx(flops / 333e12)


def test_unknown_target_and_mode_are_errors():
    with pytest.raises(ValueError, match="unknown target"):
        target("tpu")
    with pytest.raises(ValueError, match="LNC"):
        target("trn2", lnc=4)
    with pytest.raises(ValueError, match="mode"):
        mm(8, 8, 8, mode="lazy")
