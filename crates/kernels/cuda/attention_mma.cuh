// Causal attention on tensor cores: bf16 heads of 64 columns, the same flash-style schedule as
// attention.cuh (FlashAttention-2, Dao 2023) with every product a warp's mma.m16n8k16 (bf16 in,
// f32 accumulate) instead of a pair of lanes' dot products.
//
// A block is 4 warps over 64 query (or key) rows, 16 per warp; each warp holds its rows' Q (or
// K and V) as A fragments in registers for the whole pass. Tiles of 64 keys (or queries) are
// staged in shared memory as bf16, row-major and, where a product reads them the other way,
// transposed; each staged row is padded to 72 elements so that the 32 lanes' 32-bit fragment
// loads fall in 32 different banks. A product's f32 accumulators become the next product's A
// fragment in registers (the layout of C for two n-tiles is the layout of A for one k-step), so
// the probabilities never leave the warp. Softmax statistics (row max m, sum l, lse) are f32.
//
// Fragments (PTX ISA, mma.m16n8k16 .bf16): lane = 4·g + q. A (16 × 16, row-major): register r
// holds row g + 8·(r & 1), columns 2q, 2q + 1 (+ 8 for r ≥ 2). B (16 × 8, k × n): register r
// holds column n = g, rows k = 2q, 2q + 1 (+ 8 for r = 1). C (16 × 8, f32): c[i] is row
// g + 8·(i / 2), column 2q + (i % 2).
#pragma once
#include "attention.cuh"

#define MMA_DH 64
// Rows of a staged tile, and the padded row length in elements.
#define MMA_TILE 64
#define MMA_LD (MMA_DH + 8)

// Two bf16 in one register, the first in the low half.
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    return (u32)__bfloat16_as_ushort(__float2bfloat16(lo)) | ((u32)__bfloat16_as_ushort(__float2bfloat16(hi)) << 16);
}

__device__ __forceinline__ u32 load_u32(const bf16* p) { return *reinterpret_cast<const u32*>(p); }

// c (16 × 8, f32) += a (16 × 16, bf16) · b (16 × 8, bf16): one warp, every lane.
__device__ __forceinline__ void mma_bf16(float* c, const u32* a, const u32* b) {
#ifdef LAZARUS_EMULATE
    // The warp's fragments gathered into whole matrices, each lane summing its four outputs in
    // f32 (the tensor core's own order of summation is unspecified; the tests allow for it).
    uint64_t ra[4][32], rb[2][32];
    for (int r = 0; r < 4; ++r) emu::gather(a[r], ra[r]);
    for (int r = 0; r < 2; ++r) emu::gather(b[r], rb[r]);
    auto half = [](uint64_t w, int k) { return __bfloat162float(__nv_bfloat16{static_cast<uint16_t>(k % 2 ? w >> 16 : w)}); };
    auto A = [&](int row, int k) { return half(ra[row / 8 + 2 * (k / 8)][(row % 8) * 4 + (k % 8) / 2], k); };
    auto B = [&](int k, int n) { return half(rb[k / 8][n * 4 + (k % 8) / 2], k); };
    const int lane = (int)emu::lane(), g = lane / 4, q = lane % 4;
    for (int i = 0; i < 4; ++i) {
        const int row = g + 8 * (i / 2), col = 2 * q + i % 2;
        float s = 0;
        for (int k = 0; k < 16; ++k) s += A(row, k) * B(k, col);
        c[i] += s;
    }
#else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

// A fragments of rows [r0, r0 + 16) × 64 columns (4 k-steps) of a row-major bf16 matrix whose
// rows are `stride` apart; rows at or past t are zeros.
__device__ __forceinline__ void mma_rows_a(u32 (*a)[4], const bf16* base, u64 stride, int r0, int t) {
    const int lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
#pragma unroll
    for (int ks = 0; ks < MMA_DH / 16; ++ks)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int row = r0 + g + 8 * (r & 1), col = ks * 16 + 2 * q + 8 * (r >> 1);
            a[ks][r] = row < t ? load_u32(base + (u64)row * stride + col) : 0u;
        }
}

// The B fragment (k0..k0+16 × n0..n0+8) of a staged tile s that holds B transposed: B[k][n] =
// s[n][k].
__device__ __forceinline__ void mma_tile_b(u32* b, const bf16* s, int n0, int k0) {
    const int lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
    const bf16* p = s + (n0 + g) * MMA_LD + k0 + 2 * q;
    b[0] = load_u32(p);
    b[1] = load_u32(p + 8);
}

// acc (16 rows × 64 columns: 8 n-tiles) += a (16 × 64, 4 k-steps) · Bᵀ of a staged tile.
__device__ __forceinline__ void mma_rows_by_tile(float (*acc)[4], const u32 (*a)[4], const bf16* s) {
#pragma unroll
    for (int nt = 0; nt < MMA_TILE / 8; ++nt)
#pragma unroll
        for (int ks = 0; ks < MMA_DH / 16; ++ks) {
            u32 b[2];
            mma_tile_b(b, s, nt * 8, ks * 16);
            mma_bf16(acc[nt], a[ks], b);
        }
}

// acc (16 × 64) += p (16 × 64 f32 accumulators, rounded to bf16 as A fragments) · B, B[k][n] =
// st[n][k] (a tile staged transposed).
__device__ __forceinline__ void mma_probs_by_tile(float (*acc)[4], const float (*p)[4], const bf16* st) {
#pragma unroll
    for (int ks = 0; ks < MMA_TILE / 16; ++ks) {
        const u32 a[4] = {pack_bf16x2(p[2 * ks][0], p[2 * ks][1]), pack_bf16x2(p[2 * ks][2], p[2 * ks][3]),
                          pack_bf16x2(p[2 * ks + 1][0], p[2 * ks + 1][1]), pack_bf16x2(p[2 * ks + 1][2], p[2 * ks + 1][3])};
#pragma unroll
        for (int nt = 0; nt < MMA_DH / 8; ++nt) {
            u32 b[2];
            mma_tile_b(b, st, nt * 8, ks * 16);
            mma_bf16(acc[nt], a, b);
        }
    }
}

// Stage rows [r0, r0 + 64) × 64 columns of a row-major bf16 matrix (rows `stride` apart) into
// s[row][col] and/or st[col][row] (either may be null); rows at or past t are zeros.
__device__ __forceinline__ void mma_stage(bf16* s, bf16* st, const bf16* base, u64 stride, int r0, int t) {
    for (int k = threadIdx.x; k < MMA_TILE * MMA_DH / 8; k += blockDim.x) {
        const int rr = k / (MMA_DH / 8), c8 = (k % (MMA_DH / 8)) * 8, r = r0 + rr;
        uint4 v = {0u, 0u, 0u, 0u};
        if (r < t) v = *reinterpret_cast<const uint4*>(base + (u64)r * stride + c8);
        if (s) *reinterpret_cast<uint4*>(s + rr * MMA_LD + c8) = v;
        if (st) {
            const bf16* e = reinterpret_cast<const bf16*>(&v);
#pragma unroll
            for (int c = 0; c < 8; ++c) st[(c8 + c) * MMA_LD + rr] = e[c];
        }
    }
}

// Write a warp's 16 × 64 f32 result, times `scale`, as bf16 rows [r0, r0 + 16) (rows at or past
// t skipped) of a row-major matrix whose rows are `stride` apart.
__device__ __forceinline__ void mma_store_rows(bf16* base, u64 stride, const float (*acc)[4], int r0, int t, const float* scale) {
    const int lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = r0 + g + 8 * h;
        if (row >= t) continue;
#pragma unroll
        for (int nt = 0; nt < MMA_DH / 8; ++nt)
            *reinterpret_cast<u32*>(base + (u64)row * stride + nt * 8 + 2 * q) =
                pack_bf16x2(acc[nt][2 * h] * scale[h], acc[nt][2 * h + 1] * scale[h]);
    }
}

__device__ __forceinline__ float quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

__device__ __forceinline__ float quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

__device__ void attn_mma_fwd(const bf16* qkv, bf16* y, float* lse, int t, int heads, double scale_d) {
    __shared__ __align__(16) bf16 ks[MMA_TILE * MMA_LD];
    __shared__ __align__(16) bf16 vts[MMA_DH * MMA_LD];
    const Head<bf16> hd(qkv, t, heads, MMA_DH);
    const int lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
    const int r0 = hd.row0 + (threadIdx.x / 32) * 16;
    const float scale = (float)scale_d;
    u32 qa[MMA_DH / 16][4];
    mma_rows_a(qa, hd.q, hd.stride, r0, t);
    float o[MMA_DH / 8][4] = {};
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
    const int last = hd.last(t);
    for (int j0 = 0; j0 <= last; j0 += MMA_TILE) {
        __syncthreads();
        mma_stage(ks, nullptr, hd.k, hd.stride, j0, t);
        mma_stage(nullptr, vts, hd.v, hd.stride, j0, t);
        __syncthreads();
        if (j0 > r0 + 15) continue;  // every key of the tile after every row of this warp
        float s[MMA_TILE / 8][4] = {};
        mma_rows_by_tile(s, qa, ks);
        float mx[2] = {m[0], m[1]};
#pragma unroll
        for (int nt = 0; nt < MMA_TILE / 8; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int row = r0 + g + 8 * (i / 2), col = j0 + nt * 8 + 2 * q + i % 2;
                const float v = (col <= row && col < t) ? s[nt][i] * scale : -INFINITY;
                s[nt][i] = v;
                mx[i / 2] = fmaxf(mx[i / 2], v);
            }
        float mu[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            mx[h] = quad_max(mx[h]);
            mu[h] = mx[h] == -INFINITY ? 0.f : mx[h];  // a row with nothing unmasked yet
            const float alpha = expf(m[h] - mu[h]);
            l[h] *= alpha;
            for (int nt = 0; nt < MMA_DH / 8; ++nt) {
                o[nt][2 * h] *= alpha;
                o[nt][2 * h + 1] *= alpha;
            }
            m[h] = mx[h];
        }
#pragma unroll
        for (int nt = 0; nt < MMA_TILE / 8; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const float p = expf(s[nt][i] - mu[i / 2]);
                s[nt][i] = p;
                l[i / 2] += p;
            }
        mma_probs_by_tile(o, s, vts);
    }
    float inv[2];
    for (int h = 0; h < 2; ++h) {
        l[h] = quad_sum(l[h]);
        inv[h] = l[h] > 0.f ? 1.f / l[h] : 0.f;
        const int row = r0 + g + 8 * h;
        if (q == 0 && row < t) lse[(u64)hd.bh * t + row] = m[h] + logf(l[h]);
    }
    mma_store_rows(y + hd.out_row(t, 0, MMA_DH), (u64)hd.d, o, r0, t, inv);
}

// P (masked, from lse) and dS = P ∘ (dP − D) of a warp's 16 × 64 block, in place in s and dp.
// `rows`/`cols` give the absolute query and key of (row-half h, column c): the masking is
// key ≤ query, both before t.
template <bool KEYS_ARE_ROWS>
__device__ __forceinline__ void mma_probs_and_dscores(float (*s)[4], float (*dp)[4], int r0, int c0, int t, float scale,
                                                      const float* lse_of, const float* d_of) {
    const int lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
#pragma unroll
    for (int nt = 0; nt < MMA_TILE / 8; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int row = r0 + g + 8 * (i / 2), col = c0 + nt * 8 + 2 * q + i % 2;
            const int query = KEYS_ARE_ROWS ? col : row, key = KEYS_ARE_ROWS ? row : col;
            // lse and D indexed by the query: by row (its half) or by column (its tile index).
            const int at = KEYS_ARE_ROWS ? nt * 8 + 2 * q + i % 2 : i / 2;
            const bool on = key <= query && query < t;
            const float p = on ? expf(s[nt][i] * scale - lse_of[at]) : 0.f;
            s[nt][i] = p;
            dp[nt][i] = p * (dp[nt][i] - d_of[at]);
        }
}

__device__ void attn_mma_bwd_dq(const bf16* qkv, const bf16* dy, const float* lse, const float* dvec, bf16* dqkv, int t, int heads,
                                double scale_d) {
    __shared__ __align__(16) bf16 ks[MMA_TILE * MMA_LD];
    __shared__ __align__(16) bf16 kts[MMA_DH * MMA_LD];
    __shared__ __align__(16) bf16 vs[MMA_TILE * MMA_LD];
    const Head<bf16> hd(qkv, t, heads, MMA_DH);
    const int lane = threadIdx.x % 32, g = lane / 4;
    const int r0 = hd.row0 + (threadIdx.x / 32) * 16;
    const float scale = (float)scale_d;
    u32 qa[MMA_DH / 16][4], ga[MMA_DH / 16][4];
    mma_rows_a(qa, hd.q, hd.stride, r0, t);
    mma_rows_a(ga, dy + hd.out_row(t, 0, MMA_DH), (u64)hd.d, r0, t);
    float lse_r[2], d_r[2];
    for (int h = 0; h < 2; ++h) {
        const int row = r0 + g + 8 * h;
        lse_r[h] = row < t ? lse[(u64)hd.bh * t + row] : 0.f;
        d_r[h] = row < t ? dvec[(u64)hd.bh * t + row] : 0.f;
    }
    float dq[MMA_DH / 8][4] = {};
    const int last = hd.last(t);
    for (int j0 = 0; j0 <= last; j0 += MMA_TILE) {
        __syncthreads();
        mma_stage(ks, kts, hd.k, hd.stride, j0, t);
        mma_stage(vs, nullptr, hd.v, hd.stride, j0, t);
        __syncthreads();
        if (j0 > r0 + 15) continue;
        float s[MMA_TILE / 8][4] = {}, dp[MMA_TILE / 8][4] = {};
        mma_rows_by_tile(s, qa, ks);   // Q·Kᵀ
        mma_rows_by_tile(dp, ga, vs);  // dO·Vᵀ
        mma_probs_and_dscores<false>(s, dp, r0, j0, t, scale, lse_r, d_r);
        mma_probs_by_tile(dq, dp, kts);  // dS·K
    }
    const float sc[2] = {scale, scale};
    mma_store_rows(dqkv + hd.packed_row(t, 0, MMA_DH), hd.stride, dq, r0, t, sc);
}

__device__ void attn_mma_bwd_dkv(const bf16* qkv, const bf16* dy, const float* lse, const float* dvec, bf16* dqkv, int t, int heads,
                                 double scale_d) {
    __shared__ __align__(16) bf16 qs[MMA_TILE * MMA_LD];
    __shared__ __align__(16) bf16 qts[MMA_DH * MMA_LD];
    __shared__ __align__(16) bf16 gs[MMA_TILE * MMA_LD];
    __shared__ __align__(16) bf16 gts[MMA_DH * MMA_LD];
    __shared__ float ls[MMA_TILE], ds_[MMA_TILE];
    const Head<bf16> hd(qkv, t, heads, MMA_DH);
    const bf16* gb = dy + hd.out_row(t, 0, MMA_DH);
    const int r0 = hd.row0 + (threadIdx.x / 32) * 16;  // this warp's first key
    const float scale = (float)scale_d;
    u32 ka[MMA_DH / 16][4], va[MMA_DH / 16][4];
    mma_rows_a(ka, hd.k, hd.stride, r0, t);
    mma_rows_a(va, hd.v, hd.stride, r0, t);
    float dk[MMA_DH / 8][4] = {}, dv[MMA_DH / 8][4] = {};
    for (int i0 = hd.row0; i0 < t; i0 += MMA_TILE) {
        __syncthreads();
        mma_stage(qs, qts, hd.q, hd.stride, i0, t);
        mma_stage(gs, gts, gb, (u64)hd.d, i0, t);
        for (int r = threadIdx.x; r < MMA_TILE; r += blockDim.x) {
            const int i = i0 + r;
            ls[r] = i < t ? lse[(u64)hd.bh * t + i] : 0.f;
            ds_[r] = i < t ? dvec[(u64)hd.bh * t + i] : 0.f;
        }
        __syncthreads();
        float s[MMA_TILE / 8][4] = {}, dp[MMA_TILE / 8][4] = {};
        mma_rows_by_tile(s, ka, qs);   // K·Qᵀ = Sᵀ
        mma_rows_by_tile(dp, va, gs);  // V·dOᵀ = dPᵀ
        mma_probs_and_dscores<true>(s, dp, r0, i0, t, scale, ls, ds_);
        mma_probs_by_tile(dv, s, gts);   // Pᵀ·dO
        mma_probs_by_tile(dk, dp, qts);  // dSᵀ·Q
    }
    const float one[2] = {1.f, 1.f}, sc[2] = {scale, scale};
    bf16* packed = dqkv + hd.packed_row(t, 0, MMA_DH);
    mma_store_rows(packed + hd.d, hd.stride, dk, r0, t, sc);
    mma_store_rows(packed + 2 * hd.d, hd.stride, dv, r0, t, one);
}

extern "C" __global__ void __launch_bounds__(ATTN_THREADS)
    lazarus_attn_mma_fwd_bf16_64(const bf16* qkv, bf16* y, float* lse, int t, int heads, int dh, double scale) {
    attn_mma_fwd(qkv, y, lse, t, heads, scale);
}
EMU_REGISTER(lazarus_attn_mma_fwd_bf16_64)
extern "C" __global__ void __launch_bounds__(ATTN_THREADS)
    lazarus_attn_mma_bwd_dq_bf16_64(const bf16* qkv, const bf16* dy, const float* lse, const float* dvec, bf16* dqkv, int t, int heads,
                                    int dh, double scale) {
    attn_mma_bwd_dq(qkv, dy, lse, dvec, dqkv, t, heads, scale);
}
EMU_REGISTER(lazarus_attn_mma_bwd_dq_bf16_64)
extern "C" __global__ void __launch_bounds__(ATTN_THREADS)
    lazarus_attn_mma_bwd_dkv_bf16_64(const bf16* qkv, const bf16* dy, const float* lse, const float* dvec, bf16* dqkv, int t, int heads,
                                     int dh, double scale) {
    attn_mma_bwd_dkv(qkv, dy, lse, dvec, dqkv, t, heads, scale);
}
EMU_REGISTER(lazarus_attn_mma_bwd_dkv_bf16_64)
