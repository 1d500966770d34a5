// Row movement of the MoE layer and the embedding: gathers, and sums of listed rows.
//
// A sum of rows into one destination row is a *list* (CSR: offsets into a row list, built on the
// host from the routing it already holds), summed in list order by the thread that owns the
// destination element. No atomics: the result is the same bits on every run, and every
// destination element is written exactly once (an empty list writes zero). candle's index_add,
// which these replace, runs one thread per column over every listed row in turn: at 32,768 rows
// of 1,024 columns that is 1,024 threads doing 32,768 dependent steps each.
#pragma once
#include "common.cuh"

// Row kernels run a block per row (striding over rows past the grid) and the block's threads over
// the row's columns: no 64-bit division per element, coalesced accesses, the row's indices read
// once.

// out[r, :] = src[idx[r], :] for r < rows (src, out: row-major, d columns).
template <class T>
__device__ void gather_rows(const T* src, const u32* idx, T* out, u64 rows, u32 d) {
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* s = src + (u64)idx[r] * d;
        for (u32 c = threadIdx.x; c < d; c += blockDim.x) out[r * d + c] = s[c];
    }
}

// out[t, :] = Σ_{k = off[t]}^{off[t+1]-1} w[slot(list[k])] · src[list[k], :] for t < n (w null:
// 1; slot(r) = wslot[r], or r when wslot is null), summed in k order in the accumulator type.
template <class Tin, class Tw, class Tout>
__device__ void sum_listed_rows(const Tin* src, const Tw* w, const u32* wslot, const u32* off, const u32* list, Tout* out, u64 n,
                                u32 d) {
    typedef typename AccOf<Tw>::type A;
    for (u64 t = blockIdx.x; t < n; t += gridDim.x) {
        const u32 k0 = off[t], k1 = off[t + 1];
        for (u32 c = threadIdx.x; c < d; c += blockDim.x) {
            A acc = 0;
            for (u32 k = k0; k < k1; ++k) {
                const u32 r = list[k];
                const A v = (A)to_acc(src[(u64)r * d + c]);
                acc += w ? (A)to_acc(w[wslot ? wslot[r] : r]) * v : v;
            }
            out[t * d + c] = from_acc<Tout>(acc);
        }
    }
}

// The combine's backward, one warp per row r (token t = tokens[r], weight slot s = wslot[r], or
// r when wslot is null): dy[r, :] = w[s] · g[t, :] and dw[s] = Σ_c y[r, c] · g[t, c].
template <class Ty, class Tw, class Tg>
__device__ void combine_rows_bwd(const Ty* y, const Tw* w, const u32* wslot, const Tg* g, const u32* tokens, Ty* dy, Tw* dw, u64 rows,
                                 u32 d) {
    typedef typename AccOf<Tw>::type A;
    const u64 warps = (u64)gridDim.x * (blockDim.x / 32);
    const u32 lane = threadIdx.x % 32;
    for (u64 r = blockIdx.x * (u64)(blockDim.x / 32) + threadIdx.x / 32; r < rows; r += warps) {
        const u64 t = tokens[r], s = wslot ? wslot[r] : r;
        const A wr = (A)to_acc(w[s]);
        A dot = 0;
        for (u32 c = lane; c < d; c += 32) {
            const A gv = (A)to_acc(g[t * d + c]);
            dot += (A)to_acc(y[r * d + c]) * gv;
            dy[r * d + c] = from_acc<Ty>(wr * gv);
        }
        dot = warp_sum(dot);
        if (lane == 0) dw[s] = from_acc<Tw>(dot);
    }
}

// The embedding: out[r, :] = tok[ids[r], :] + pos[r mod t, :] for r < rows.
template <class T>
__device__ void embed_fwd(const T* tok, const T* pos, const u32* ids, T* out, u64 rows, u32 t, u32 d) {
    typedef typename AccOf<T>::type A;
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* a = tok + (u64)ids[r] * d;
        const T* b = pos + (r % t) * d;
        for (u32 c = threadIdx.x; c < d; c += blockDim.x) out[r * d + c] = from_acc<T>((A)to_acc(a[c]) + (A)to_acc(b[c]));
    }
}

#define ROWS_KERNELS(SUF, T)                                                                                         \
    extern "C" __global__ void lazarus_gather_rows_##SUF(const T* src, const u32* idx, T* out, u64 rows, u32 d) {    \
        gather_rows<T>(src, idx, out, rows, d);                                                                      \
    }                                                                                                                \
    EMU_REGISTER(lazarus_gather_rows_##SUF)                                                                          \
    extern "C" __global__ void lazarus_embed_fwd_##SUF(const T* tok, const T* pos, const u32* ids, T* out, u64 rows, \
                                                       u32 t, u32 d) {                                               \
        embed_fwd<T>(tok, pos, ids, out, rows, t, d);                                                                \
    }                                                                                                                \
    EMU_REGISTER(lazarus_embed_fwd_##SUF)
ROWS_KERNELS(f32, float)
ROWS_KERNELS(f64, double)
ROWS_KERNELS(bf16, bf16)

#define SUM_ROWS_KERNEL(SUF, TIN, TW, TOUT)                                                                           \
    extern "C" __global__ void lazarus_sum_listed_rows_##SUF(const TIN* src, const TW* w, const u32* wslot,         \
                                                             const u32* off, const u32* list, TOUT* out, u64 n,      \
                                                             u32 d) {                                                \
        sum_listed_rows<TIN, TW, TOUT>(src, w, wslot, off, list, out, n, d);                                          \
    }                                                                                                                 \
    EMU_REGISTER(lazarus_sum_listed_rows_##SUF)
SUM_ROWS_KERNEL(f32, float, float, float)
SUM_ROWS_KERNEL(f64, double, double, double)
SUM_ROWS_KERNEL(bf16, bf16, float, bf16)
SUM_ROWS_KERNEL(bf16_f32, bf16, float, float)

#define COMBINE_BWD_KERNEL(SUF, TY, TW, TG)                                                                            \
    extern "C" __global__ void lazarus_combine_rows_bwd_##SUF(const TY* y, const TW* w, const u32* wslot, const TG* g,  \
                                                              const u32* tokens, TY* dy, TW* dw, u64 rows, u32 d) {    \
        combine_rows_bwd<TY, TW, TG>(y, w, wslot, g, tokens, dy, dw, rows, d);                                         \
    }                                                                                                                  \
    EMU_REGISTER(lazarus_combine_rows_bwd_##SUF)
COMBINE_BWD_KERNEL(f32, float, float, float)
COMBINE_BWD_KERNEL(f64, double, double, double)
COMBINE_BWD_KERNEL(bf16_f32, bf16, float, float)
