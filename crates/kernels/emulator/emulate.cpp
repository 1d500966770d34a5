// The emulator's scheduler (see emulate.h): a launch runs its blocks one after the other; the
// threads of a block are fibers (ucontext) that run, one at a time, until they reach a barrier or
// end; a barrier opens once every thread it is for has reached it.
#include "emulate.h"

#include <ucontext.h>

#include <cstdio>
#include <map>
#include <memory>
#include <string>

namespace emu {
thread_local dim3 thread_idx, block_idx, block_dim, grid_dim;

namespace {
enum class State { Runnable, AtBlockBarrier, AtWarpBarrier, Done };

struct Fiber {
    ucontext_t ctx;
    std::unique_ptr<char[]> stack;
    dim3 tid;
    unsigned linear = 0;
    State state = State::Runnable;
};

constexpr size_t STACK_BYTES = 256 * 1024;

struct Launch {
    std::vector<Fiber> fibers;
    ucontext_t scheduler;
    Fiber* current = nullptr;
    const Entry* entry = nullptr;
    void** args = nullptr;
    std::vector<unsigned char> shared;
    std::vector<uint64_t> slots;  // warp exchange: one slot per thread
    std::string error;
    bool failed = false;
};

thread_local Launch* active = nullptr;

std::map<std::string, Entry>& registry() {
    static std::map<std::string, Entry> r;
    return r;
}

void yield_as(State s) {
    Launch& l = *active;
    Fiber* f = l.current;
    f->state = s;
    swapcontext(&f->ctx, &l.scheduler);
    // Resumed: the scheduler set the thread's coordinates back.
}

void trampoline() {
    Launch& l = *active;
    if (!l.failed) l.entry->invoke(l.entry->fn, l.args);
    l.current->state = State::Done;
    // uc_link returns to the scheduler.
}

void set_coordinates(const Fiber& f) { thread_idx = f.tid; }

// Run one block; false (with l.error set) on a barrier that cannot open.
bool run_block(Launch& l, bool reverse) {
    const unsigned n = static_cast<unsigned>(l.fibers.size());
    for (Fiber& f : l.fibers) {
        f.state = State::Runnable;
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = f.stack.get();
        f.ctx.uc_stack.ss_size = STACK_BYTES;
        f.ctx.uc_link = &l.scheduler;
        makecontext(&f.ctx, trampoline, 0);
    }
    std::fill(l.shared.begin(), l.shared.end(), 0xFF);
    const unsigned warps = (n + 31) / 32;
    for (;;) {
        for (unsigned k = 0; k < n; ++k) {
            Fiber& f = l.fibers[reverse ? n - 1 - k : k];
            if (f.state != State::Runnable) continue;
            l.current = &f;
            set_coordinates(f);
            swapcontext(&l.scheduler, &f.ctx);
            if (l.failed) return false;
        }
        // Every thread is done or waiting at a barrier.
        unsigned done = 0, at_block = 0;
        for (const Fiber& f : l.fibers) {
            done += f.state == State::Done;
            at_block += f.state == State::AtBlockBarrier;
        }
        if (done == n) return true;
        // Warps first: a warp whose live lanes all wait at a warp barrier (or exchange) goes on.
        bool released = false;
        for (unsigned w = 0; w < warps; ++w) {
            unsigned lo = w * 32, hi = std::min(n, lo + 32), waiting = 0, live = 0;
            for (unsigned i = lo; i < hi; ++i) {
                live += l.fibers[i].state != State::Done;
                waiting += l.fibers[i].state == State::AtWarpBarrier;
            }
            if (waiting > 0 && waiting == live) {
                for (unsigned i = lo; i < hi; ++i)
                    if (l.fibers[i].state == State::AtWarpBarrier) l.fibers[i].state = State::Runnable;
                released = true;
            }
        }
        // Then the block barrier, once every live thread waits at it.
        if (!released && at_block > 0 && at_block + done == n) {
            if (done > 0) {
                l.error = "__syncthreads reached by " + std::to_string(at_block) + " of " + std::to_string(n) +
                          " threads (" + std::to_string(done) + " had returned)";
                return false;
            }
            for (Fiber& f : l.fibers) f.state = State::Runnable;
            released = true;
        }
        if (!released) {
            l.error = "threads wait at barriers that cannot open: " + std::to_string(at_block) + " at __syncthreads, the rest at a warp barrier or exchange not every live lane of its warp reaches";
            return false;
        }
    }
}
}  // namespace

void add(Entry e) { registry()[e.name] = std::move(e); }

void sync_block() { yield_as(State::AtBlockBarrier); }
void sync_warp() { yield_as(State::AtWarpBarrier); }

unsigned lane() { return active->current->linear % 32; }

uint64_t exchange(uint64_t bits, unsigned src) {
    Launch& l = *active;
    const unsigned me = l.current->linear;
    const unsigned base = me - me % 32;
    l.slots[me] = bits;
    sync_warp();
    const unsigned from = base + src;
    uint64_t got = (src < 32 && from < l.fibers.size()) ? l.slots[from] : bits;
    sync_warp();
    return got;
}

void gather(uint64_t bits, uint64_t* out) {
    Launch& l = *active;
    const unsigned me = l.current->linear;
    const unsigned base = me - me % 32;
    l.slots[me] = bits;
    sync_warp();
    for (unsigned i = 0; i < 32; ++i) out[i] = base + i < l.fibers.size() ? l.slots[base + i] : bits;
    sync_warp();
}

unsigned char* dynamic_shared() { return active->shared.data(); }

void fail(const char* what) {
    Launch& l = *active;
    l.failed = true;
    l.error = what;
    l.current->state = State::Done;
    swapcontext(&l.current->ctx, &l.scheduler);
    __builtin_unreachable();
}
}  // namespace emu

extern "C" {
// Launch kernel `name` on the emulator: grid and block sizes (x, y, z), dynamic shared bytes, the
// argument values (`args[i]` points at `sizes[i]` bytes), threads within a block run first to
// last (`reverse` 0) or last to first. Returns 0, or -1 with a message in `err` (`errlen` bytes).
int lazarus_emu_launch(const char* name, const unsigned* grid, const unsigned* block, unsigned shared_bytes, void** args,
                       const unsigned* sizes, unsigned nargs, int reverse, char* err, unsigned errlen) {
    auto say = [&](const std::string& m) {
        if (errlen > 0) {
            std::snprintf(err, errlen, "%s", m.c_str());
        }
        return -1;
    };
    auto& reg = emu::registry();
    auto it = reg.find(name);
    if (it == reg.end()) return say(std::string("no kernel named ") + name);
    const emu::Entry& e = it->second;
    if (e.sizes.size() != nargs) {
        return say(std::string(name) + ": " + std::to_string(nargs) + " arguments for " + std::to_string(e.sizes.size()) +
                   " parameters");
    }
    for (unsigned i = 0; i < nargs; ++i) {
        if (e.sizes[i] != sizes[i]) {
            return say(std::string(name) + ": argument " + std::to_string(i) + " has " + std::to_string(sizes[i]) +
                       " bytes, the parameter " + std::to_string(e.sizes[i]));
        }
    }
    const unsigned threads = block[0] * block[1] * block[2];
    if (threads == 0 || threads > 1024) return say(std::string(name) + ": " + std::to_string(threads) + " threads per block");
    if (grid[0] == 0 || grid[1] == 0 || grid[2] == 0 || grid[1] > 65535 || grid[2] > 65535) {
        return say(std::string(name) + ": grid " + std::to_string(grid[0]) + "x" + std::to_string(grid[1]) + "x" +
                   std::to_string(grid[2]));
    }
    if (shared_bytes > 227 * 1024) return say(std::string(name) + ": " + std::to_string(shared_bytes) + " bytes of shared memory");
    emu::Launch l;
    l.entry = &e;
    l.args = args;
    l.shared.assign(shared_bytes, 0xFF);
    l.slots.assign(threads, 0);
    l.fibers.resize(threads);
    for (unsigned z = 0, i = 0; z < block[2]; ++z)
        for (unsigned y = 0; y < block[1]; ++y)
            for (unsigned x = 0; x < block[0]; ++x, ++i) {
                l.fibers[i].tid = dim3(x, y, z);
                l.fibers[i].linear = i;
                l.fibers[i].stack.reset(new char[emu::STACK_BYTES]);
            }
    emu::Launch* outer = emu::active;
    emu::active = &l;
    emu::block_dim = dim3(block[0], block[1], block[2]);
    emu::grid_dim = dim3(grid[0], grid[1], grid[2]);
    int rc = 0;
    for (unsigned bz = 0; bz < grid[2] && rc == 0; ++bz)
        for (unsigned by = 0; by < grid[1] && rc == 0; ++by)
            for (unsigned bx = 0; bx < grid[0] && rc == 0; ++bx) {
                emu::block_idx = dim3(bx, by, bz);
                if (!emu::run_block(l, reverse != 0)) {
                    rc = say(std::string(name) + " block (" + std::to_string(bx) + ", " + std::to_string(by) + ", " +
                             std::to_string(bz) + "): " + l.error);
                }
            }
    emu::active = outer;
    return rc;
}
}
