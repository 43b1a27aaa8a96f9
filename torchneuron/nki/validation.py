"""The NKI matmul tutorial's four optimisation stages (AWS's published latencies: S25, trn1, one NeuronCore, bf16
[4096, 8192] x [8192, 8192], `nki.benchmark` P99), written here from the tutorial's description, and the modelled
latency of each (`python -m torchneuron.nki.validation`; docs/nki.md has the table)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import isa as nisa
from . import language as nl
from .kernel import jit

TM, TK, TN = 128, 128, 512  # stationary free, contraction (partitions), moving free: one PSUM bank of fp32

# S25: measured P99 latency per stage (ms)
PUBLISHED_MS = {"tiled": 51.80, "hoisted": 42.96, "blocked": 22.07, "optimized": 6.97}
SHAPE = (8192, 4096, 8192)  # K, M, N: lhsT [K, M], rhs [K, N]
@jit
def matmul_tiled(lhsT, rhs):
    """Stage 1: one PSUM tile per output tile, both operand tiles loaded for every k."""
    K, M = lhsT.shape
    N = rhs.shape[1]
    out = nl.ndarray((M, N), dtype=lhsT.dtype, buffer=nl.shared_hbm)
    for m in nl.affine_range(M // TM):
        for n in nl.affine_range(N // TN):
            acc = nl.ndarray((TM, TN), dtype=nl.float32, buffer=nl.psum)
            for k in nl.affine_range(K // TK):
                a = nl.ndarray((TK, TM), dtype=lhsT.dtype, buffer=nl.sbuf)
                b = nl.ndarray((TK, TN), dtype=rhs.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=a, src=lhsT[nl.ds(k * TK, TK), nl.ds(m * TM, TM)])
                nisa.dma_copy(dst=b, src=rhs[nl.ds(k * TK, TK), nl.ds(n * TN, TN)])
                nisa.nc_matmul(dst=acc, stationary=a, moving=b)
            res = nl.ndarray((TM, TN), dtype=out.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(dst=res, src=acc)
            nisa.dma_copy(dst=out[nl.ds(m * TM, TM), nl.ds(n * TN, TN)], src=res)
    return out


@jit
def matmul_hoisted(lhsT, rhs):
    """Stage 2: the lhsT column of an output row is loaded once per m, the rhs column once per (m, n)."""
    K, M = lhsT.shape
    N = rhs.shape[1]
    out = nl.ndarray((M, N), dtype=lhsT.dtype, buffer=nl.shared_hbm)
    for m in nl.affine_range(M // TM):
        a_col = []
        for k in nl.affine_range(K // TK):
            a = nl.ndarray((TK, TM), dtype=lhsT.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=a, src=lhsT[nl.ds(k * TK, TK), nl.ds(m * TM, TM)])
            a_col.append(a)
        for n in nl.affine_range(N // TN):
            b_col = []
            for k in nl.affine_range(K // TK):
                b = nl.ndarray((TK, TN), dtype=rhs.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=b, src=rhs[nl.ds(k * TK, TK), nl.ds(n * TN, TN)])
                b_col.append(b)
            acc = nl.ndarray((TM, TN), dtype=nl.float32, buffer=nl.psum)
            for k in nl.affine_range(K // TK):
                nisa.nc_matmul(dst=acc, stationary=a_col[k], moving=b_col[k])
            res = nl.ndarray((TM, TN), dtype=out.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(dst=res, src=acc)
            nisa.dma_copy(dst=out[nl.ds(m * TM, TM), nl.ds(n * TN, TN)], src=res)
    return out


@jit
def matmul_blocked(lhsT, rhs, BM=2, BN=2):
    """Stage 3: BM x BN output tiles share their operand loads."""
    K, M = lhsT.shape
    N = rhs.shape[1]
    out = nl.ndarray((M, N), dtype=lhsT.dtype, buffer=nl.shared_hbm)
    for mb in nl.affine_range(M // (TM * BM)):
        a_blk = [[None] * (K // TK) for _ in range(BM)]
        for i in nl.affine_range(BM):
            for k in nl.affine_range(K // TK):
                a = nl.ndarray((TK, TM), dtype=lhsT.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=a, src=lhsT[nl.ds(k * TK, TK), nl.ds((mb * BM + i) * TM, TM)])
                a_blk[i][k] = a
        for nb in nl.affine_range(N // (TN * BN)):
            b_blk = [[None] * (K // TK) for _ in range(BN)]
            for j in nl.affine_range(BN):
                for k in nl.affine_range(K // TK):
                    b = nl.ndarray((TK, TN), dtype=rhs.dtype, buffer=nl.sbuf)
                    nisa.dma_copy(dst=b, src=rhs[nl.ds(k * TK, TK), nl.ds((nb * BN + j) * TN, TN)])
                    b_blk[j][k] = b
            for i in nl.affine_range(BM):
                for j in nl.affine_range(BN):
                    acc = nl.ndarray((TM, TN), dtype=nl.float32, buffer=nl.psum)
                    for k in nl.affine_range(K // TK):
                        nisa.nc_matmul(dst=acc, stationary=a_blk[i][k], moving=b_blk[j][k])
                    res = nl.ndarray((TM, TN), dtype=out.dtype, buffer=nl.sbuf)
                    nisa.tensor_copy(dst=res, src=acc)
                    nisa.dma_copy(dst=out[nl.ds((mb * BM + i) * TM, TM), nl.ds((nb * BN + j) * TN, TN)], src=res)
    return out


@jit
def matmul_optimized(lhsT, rhs, BM=16, BN=2, BK=8):
    """Stage 4: blocks on M, N and K; each K block's partial products are summed into SBUF result tiles, and the
    operand loads are whole blocks (rows of BM*128 and BN*512 elements)."""
    K, M = lhsT.shape
    N = rhs.shape[1]
    out = nl.ndarray((M, N), dtype=lhsT.dtype, buffer=nl.shared_hbm)
    for nb in nl.affine_range(N // (TN * BN)):
        sums = [[[None] * BN for _ in range(BM)] for _ in range(M // (TM * BM))]
        for mb in range(M // (TM * BM)):
            for i in range(BM):
                for j in range(BN):
                    t = nl.ndarray((TM, TN), dtype=lhsT.dtype, buffer=nl.sbuf)
                    nisa.memset(dst=t, value=0.0)
                    sums[mb][i][j] = t
        for kb in nl.sequential_range(K // (TK * BK)):
            b_blk = []
            for kk in nl.affine_range(BK):
                b = nl.ndarray((TK, BN * TN), dtype=rhs.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=b, src=rhs[nl.ds((kb * BK + kk) * TK, TK), nl.ds(nb * BN * TN, BN * TN)])
                b_blk.append(b)
            for mb in nl.affine_range(M // (TM * BM)):
                a_blk = []
                for kk in nl.affine_range(BK):
                    a = nl.ndarray((TK, BM * TM), dtype=lhsT.dtype, buffer=nl.sbuf)
                    nisa.dma_copy(dst=a, src=lhsT[nl.ds((kb * BK + kk) * TK, TK), nl.ds(mb * BM * TM, BM * TM)])
                    a_blk.append(a)
                for i in nl.affine_range(BM):
                    for j in nl.affine_range(BN):
                        acc = nl.ndarray((TM, TN), dtype=nl.float32, buffer=nl.psum)
                        for kk in nl.affine_range(BK):
                            nisa.nc_matmul(dst=acc, stationary=a_blk[kk][:, nl.ds(i * TM, TM)],
                                           moving=b_blk[kk][:, nl.ds(j * TN, TN)])
                        s = sums[mb][i][j]
                        nisa.tensor_tensor(dst=s, data1=s, data2=acc, op=nl.add)
        for mb in nl.affine_range(M // (TM * BM)):
            for i in nl.affine_range(BM):
                for j in nl.affine_range(BN):
                    nisa.dma_copy(dst=out[nl.ds((mb * BM + i) * TM, TM), nl.ds((nb * BN + j) * TN, TN)],
                                  src=sums[mb][i][j])
    return out


STAGES = {"tiled": matmul_tiled, "hoisted": matmul_hoisted, "blocked": matmul_blocked,
          "optimized": matmul_optimized}


@dataclass(frozen=True)
class Row:
    stage: str
    published_ms: float
    modelled_ms: float
    bottleneck: str

    @property
    def error(self) -> float:
        return self.modelled_ms / self.published_ms - 1


def run(stages: tuple[str, ...] = tuple(STAGES), shape: tuple[int, int, int] = SHAPE,
        blocks: dict[str, int] | None = None) -> list[Row]:
    """Each stage's modelled latency on trn1 (cost only, no values: about a minute per stage at the tutorial's
    shape). `blocks`: the optimised stage's BM/BN/BK for other shapes."""
    k, m, n = shape
    rows = []
    for s in stages:
        kw = blocks or {} if s == "optimized" else {}
        p = STAGES[s].estimate(((k, m), torch.bfloat16), ((k, n), torch.bfloat16), target="trn1", **kw)
        rows.append(Row(s, PUBLISHED_MS[s], p.latency_s * 1e3, p.bottleneck))
    return rows


def table(rows: list[Row]) -> str:
    out = ["| stage | published (ms) | modelled (ms) | error | bottleneck |", "|---|---|---|---|---|"]
    out += [f"| {r.stage} | {r.published_ms:.2f} | {r.modelled_ms:.2f} | {r.error:+.1%} | {r.bottleneck} |"
            for r in rows]
    return "\n".join(out)


if __name__ == "__main__":
    print(table(run()))
