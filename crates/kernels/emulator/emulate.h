// CUDA's execution model on the CPU, enough to run Lazarus's kernels (cuda/*.cuh) unchanged in
// tests on machines without a GPU: a grid of blocks run one after the other, every thread of a
// block a fiber (its own stack, switched cooperatively), `__syncthreads` and the warp exchanges
// as barriers among the fibers, shared memory as storage common to the block's fibers.
//
// What it checks: every kernel's arithmetic and indexing, its launch (grid, block, shared bytes,
// the argument list's sizes against the kernel's parameters), and barriers reached by only part
// of a block or warp (an error, not a hang). Between two barriers the threads run one at a time,
// in an order the caller picks (first to last, or last to first): a result that changes with the
// order is a missing barrier. What it cannot check: speed, and races the two orders both miss.
#pragma once

#include <algorithm>
#include <cfloat>
#include <climits>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

struct dim3 {
    unsigned x, y, z;
    constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

namespace emu {
// Per OS thread: tests launch kernels from several threads at once.
extern thread_local dim3 thread_idx, block_idx, block_dim, grid_dim;
// Wait until every thread of the block is here.
void sync_block();
// Wait until every thread of the calling thread's warp is here.
void sync_warp();
// This thread's lane in its warp.
unsigned lane();
// Every lane of the warp offers `bits`; returns what lane `src` offered (its own where `src` is
// out of the warp).
uint64_t exchange(uint64_t bits, unsigned src);
// Every lane of the warp offers `bits`; `out[i]` gets what lane i offered (its own value where
// the warp is short of lane i): one meeting point for a whole register of the warp (the emulated
// tensor-core product reads its fragments this way).
void gather(uint64_t bits, uint64_t* out);
// The block's dynamic shared memory (poisoned with 0xFF bytes at each block's start).
unsigned char* dynamic_shared();
// Stop the launch with an error (a kernel's own check failed).
[[noreturn]] void fail(const char* what);

template <class A>
A load_arg(void* p) {
    A a;
    std::memcpy(&a, p, sizeof(A));
    return a;
}

template <class... A, size_t... I>
void call(void (*f)(A...), void** args, std::index_sequence<I...>) {
    f(load_arg<A>(args[I])...);
}

using Invoker = void (*)(void* fn, void** args);

// One kernel the emulator can launch by name, with the sizes of its parameters.
struct Entry {
    const char* name;
    void* fn;
    Invoker invoke;
    std::vector<unsigned> sizes;
};
void add(Entry e);

template <class... A>
struct Registrar {
    explicit Registrar(const char* name, void (*f)(A...)) {
        add(Entry{name, reinterpret_cast<void*>(f),
                  [](void* fn, void** args) { call(reinterpret_cast<void (*)(A...)>(fn), args, std::index_sequence_for<A...>{}); },
                  {static_cast<unsigned>(sizeof(A))...}});
    }
};
template <class... A>
Registrar(const char*, void (*)(A...)) -> Registrar<A...>;
}  // namespace emu

#define threadIdx (emu::thread_idx)
#define blockIdx (emu::block_idx)
#define blockDim (emu::block_dim)
#define gridDim (emu::grid_dim)
#define warpSize 32
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
// Shared memory is static storage of the launching OS thread (blocks run one at a time on it).
#define __shared__ alignas(16) static thread_local
#define __align__(n)
#define __syncthreads() emu::sync_block()
#define __syncwarp(...) emu::sync_warp()
#define DYNAMIC_SHARED(name) unsigned char* name = emu::dynamic_shared()
#define EMU_REGISTER(name) static emu::Registrar emu_registrar_##name(#name, &name);

template <class T>
T shfl_from(T v, unsigned src) {
    static_assert(sizeof(T) <= 8, "a register of at most 8 bytes");
    uint64_t bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    uint64_t got = emu::exchange(bits, src);
    T out;
    std::memcpy(&out, &got, sizeof(T));
    return out;
}
template <class T>
T __shfl_xor_sync(unsigned, T v, int mask, int = 32) {
    return shfl_from(v, emu::lane() ^ static_cast<unsigned>(mask));
}
template <class T>
T __shfl_down_sync(unsigned, T v, unsigned delta, int = 32) {
    return shfl_from(v, emu::lane() + delta);
}
template <class T>
T __shfl_sync(unsigned, T v, int src, int = 32) {
    return shfl_from(v, static_cast<unsigned>(src) % 32);
}

template <class T>
T atomicAdd(T* p, T v) {
    T old = *p;
    *p = old + v;
    return old;
}

inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline double rsqrt(double x) { return 1.0 / std::sqrt(x); }
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __uint_as_float(unsigned u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

struct alignas(16) float4 {
    float x, y, z, w;
};
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};

// bfloat16: the top 16 bits of an f32, rounded to nearest even (NaN kept a NaN).
struct __nv_bfloat16 {
    uint16_t x;
};
inline float __bfloat162float(__nv_bfloat16 h) {
    uint32_t u = static_cast<uint32_t>(h.x) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.x; }
inline __nv_bfloat16 __float2bfloat16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return __nv_bfloat16{static_cast<uint16_t>((u >> 16) | 0x40u)};
    u += 0x7fffu + ((u >> 16) & 1u);
    return __nv_bfloat16{static_cast<uint16_t>(u >> 16)};
}
