// A GPU stand-in for machines without a GPU (tests/test_emulated_kernels.py and the `emulate`
// backend): compiled with -DFK_EMULATE by a plain C++ compiler, the kernels in kernels/*.cuh run
// their real code, index arithmetic, tails, shared memory, barriers and shuffles included. Each GPU
// thread of a block is a fiber (its own stack, ucontext) on the launching host thread; blocks run
// one after another.
//
// What it checks that a plain run of the code would not:
//   launch limits   a launch a GPU refuses fails with the GPU's error (launch_error): more than
//                   1024 threads, grid y or z above 65535, dynamic shared memory above 48 KB without
//                   the kernel's own opt-in (CUDA), or above the device's maximum (kDevices)
//   scheduling      one thread runs at a time; at every barrier, shuffle and matrix instruction the
//                   next thread to run is drawn at random (seeded: FK_EMU_SEED, or `seed`), so the
//                   lanes of a warp do not run in lockstep, as on Volta and later GPUs: code that
//                   relies on an order no barrier enforces reads stale or poisoned memory
//   barriers        a barrier that some thread never reaches aborts with a message (a GPU hangs or
//                   races), so does a block that ends with cp.async copies not waited for
//   races (TSan)    built with -fsanitize=thread, every GPU thread of every block is a ThreadSanitizer
//                   fiber, switched to without synchronization, so the only happens-before edges it
//                   sees are a GPU's: __syncthreads within a block, and a launch before and after
//                   all its blocks. The warp-wide exchanges (shuffles, ldmatrix, the matrix
//                   instructions) order nothing but their operands, as on a GPU: their slots here
//                   are registers there, untracked, so they neither report nor hide a race. Any
//                   pair of shared- or global-memory accesses, within a block or between
//                   consecutive blocks, that no __syncthreads orders and that includes a write is
//                   reported. What TSan can miss: a race between blocks two or more apart (a
//                   destroyed fiber's accesses look ordered before its successor's), and, as it
//                   tracks 255 threads at once, a race between two threads that held the same TSan
//                   slot in turn, possible only once a block and the one before it have more than
//                   254 threads together.
//   launch bounds   every kernel's largest block is recorded (largest_block) for a test to hold
//                   against its __launch_bounds__, which a host compiler cannot see
//   bounds (ASan)   built with -fsanitize=address, shared memory (dynamic and FK_STATIC_SHARED) is a
//                   fresh allocation of exactly its bytes for every block, so any access past it is
//                   reported, as is any past a global buffer the caller allocated exactly.
//   atomics         atomicAdd on 32- and 64-bit unsigned integers, atomics to ThreadSanitizer too
//   address spaces  store16 (a global store, st.global on CUDA) to shared memory aborts, as it faults there
//   ranks           the GPUs of a tensor-parallel group (kernels/allreduce.cuh) as concurrent launches,
//                   each on its own host thread (launch state is thread_local), their flags C++ atomics of
//                   the same orders, so TSan sees a GPU's release/acquire edges between ranks; a spin
//                   past the watchdog (FK_EMU_WATCHDOG_SECONDS) aborts: on a GPU, a hang
// Shared memory starts 0xff-filled (NaN as fp16, bf16 and fp32) in every block. The matrix
// instructions compute with the fragment layouts of the PTX and AMD documentation (platform.h), in
// fp32. Not emulated: timing, the hardware memory model beyond the orders above (a fence-based
// protocol between blocks would look racy here), stack overflows within a GPU thread, and the
// 16-bit conversion instructions (numeric.h's software conversions run instead).
#pragma once

#include <dlfcn.h>
#include <sys/mman.h>
#include <ucontext.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <tuple>
#include <type_traits>
#include <utility>
#include <thread>
#include <vector>

#if defined(__SANITIZE_THREAD__)
#define FK_EMU_TSAN 1
#endif
#if defined(__SANITIZE_ADDRESS__)
#define FK_EMU_ASAN 1
#endif
#if defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define FK_EMU_TSAN 1
#endif
#if __has_feature(address_sanitizer)
#define FK_EMU_ASAN 1
#endif
#endif
#if defined(FK_EMU_TSAN)
#include <sanitizer/tsan_interface.h>
extern "C" {
void AnnotateIgnoreReadsBegin(const char* file, int line);
void AnnotateIgnoreReadsEnd(const char* file, int line);
void AnnotateIgnoreWritesBegin(const char* file, int line);
void AnnotateIgnoreWritesEnd(const char* file, int line);
void AnnotateIgnoreSyncBegin(const char* file, int line);
void AnnotateIgnoreSyncEnd(const char* file, int line);
}
#endif
#if defined(FK_EMU_ASAN)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

#define __host__
#define __device__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ use_FK_STATIC_SHARED_for_static_shared_memory  // per block, see StaticShared

struct uint4 {
  uint32_t x, y, z, w;
};
inline uint4 make_uint4(uint32_t x, uint32_t y, uint32_t z, uint32_t w) { return {x, y, z, w}; }
struct int4 {
  int32_t x, y, z, w;
};
struct uint2 {
  uint32_t x, y;
};
struct float2 {
  float x, y;
};
struct float4 {
  float x, y, z, w;
};
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
struct dim3 {
  unsigned x, y, z;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

inline float rsqrtf(float x) { return 1.f / std::sqrt(x); }
inline float __int_as_float(int i) {
  float f;
  std::memcpy(&f, &i, sizeof f);
  return f;
}

namespace fk::emu {

[[noreturn]] inline void fail(const char* what) {
  std::fprintf(stderr, "flashkern emulation: %s\n", what);
  std::abort();
}

// ---- what ThreadSanitizer sees (nothing, in other builds) ----
inline void tsan_release(void* sync) {
#if defined(FK_EMU_TSAN)
  __tsan_release(sync);
#endif
  (void)sync;
}
inline void tsan_acquire(void* sync) {
#if defined(FK_EMU_TSAN)
  __tsan_acquire(sync);
#endif
  (void)sync;
}
// The emulator's own bookkeeping in a scope (schedule, slots, block state): not the kernel's accesses.
struct Untracked {
#if defined(FK_EMU_TSAN)
  Untracked() { AnnotateIgnoreReadsBegin(__FILE__, __LINE__), AnnotateIgnoreWritesBegin(__FILE__, __LINE__); }
  ~Untracked() { AnnotateIgnoreWritesEnd(__FILE__, __LINE__), AnnotateIgnoreReadsEnd(__FILE__, __LINE__); }
#else
  Untracked() {}
#endif
  Untracked(const Untracked&) = delete;
  Untracked& operator=(const Untracked&) = delete;
};

// ---- the emulated device ----
struct DeviceModel {
  const char* name;
  int warp_size;
  int max_shared;      // dynamic shared memory a block may have (CUDA: with the kernel's opt-in)
  bool shared_opt_in;  // CUDA: above 48 KB only for a kernel given cudaFuncAttributeMaxDynamicSharedMemorySize
};
inline constexpr DeviceModel kDevices[] = {
    {"sm_90", 32, 227 * 1024, true},    // H100, H200
    {"sm_80", 32, 163 * 1024, true},    // A100
    {"gfx90a", 64, 64 * 1024, false},   // MI200 (CDNA2, wave64)
    {"gfx1030", 32, 64 * 1024, false},  // RDNA2 (wave32)
};
inline constexpr int kDefaultSharedLimit = 48 * 1024;
#if defined(FK_EMULATE_HIP)
inline constexpr bool kEmulatingHip = true;
inline DeviceModel device = kDevices[2];
#else
inline constexpr bool kEmulatingHip = false;
inline DeviceModel device = kDevices[0];
#endif

// Launch errors, with the CUDA runtime's codes and strings.
enum Error : int { kSuccess = 0, kInvalidValue = 1, kInvalidConfiguration = 9 };
inline const char* error_string(int e) {
  switch (e) {
    case kSuccess:
      return "no error";
    case kInvalidValue:
      return "invalid argument";
    case kInvalidConfiguration:
      return "invalid configuration argument";
    default:
      return "unknown error";
  }
}
inline thread_local int last_error = kSuccess;    // cudaGetLastError's: read and reset, per host thread
inline std::map<const void*, int> shared_opt_in;  // kernel -> the dynamic shared memory it was allowed
// kernel -> the largest block it was launched with. A host compiler cannot see __launch_bounds__;
// tests/test_kernel_build.py holds these against the bounds nvcc wrote into the PTX (.maxntid).
inline std::map<const void*, unsigned> largest_block;
// shared_opt_in and largest_block from any host thread (the ranks of a group launch at once, each
// from its own): a lock that ThreadSanitizer does not take for an order between their kernels.
inline std::mutex launch_records;
struct RecordsLock {
  Untracked untracked;
#if defined(FK_EMU_TSAN)
  RecordsLock() { AnnotateIgnoreSyncBegin(__FILE__, __LINE__), launch_records.lock(); }
  ~RecordsLock() { launch_records.unlock(), AnnotateIgnoreSyncEnd(__FILE__, __LINE__); }
#else
  RecordsLock() { launch_records.lock(); }
  ~RecordsLock() { launch_records.unlock(); }
#endif
  RecordsLock(const RecordsLock&) = delete;
  RecordsLock& operator=(const RecordsLock&) = delete;
};

// false for a device this build does not emulate (a CUDA build emulates NVIDIA devices, HIP AMD).
inline bool set_device(const char* name) {
  for (const DeviceModel& d : kDevices) {
    if (std::strcmp(d.name, name) == 0 && d.shared_opt_in != kEmulatingHip) {
      device = d;
      return true;
    }
  }
  return false;
}

template <typename Kernel>
int set_max_dynamic_shared(Kernel kernel, int bytes) {
  if (bytes < 0 || bytes > device.max_shared) return last_error = kInvalidValue;  // also the last error, as CUDA's
  const RecordsLock lock;
  shared_opt_in[reinterpret_cast<const void*>(kernel)] = bytes;
  return kSuccess;
}

// What a GPU says of a launch configuration before it runs anything.
inline int launch_error(const void* kernel, dim3 grid, dim3 block, size_t shared_bytes) {
  const uint64_t threads = uint64_t(block.x) * block.y * block.z;
  if (threads == 0 || threads > 1024 || block.x > 1024 || block.y > 1024 || block.z > 64) return kInvalidConfiguration;
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > 0x7fffffffu || grid.y > 65535 || grid.z > 65535)
    return kInvalidConfiguration;
  size_t limit = device.shared_opt_in ? kDefaultSharedLimit : size_t(device.max_shared);
  const RecordsLock lock;
  if (device.shared_opt_in) {
    const auto raised = shared_opt_in.find(kernel);
    if (raised != shared_opt_in.end() && size_t(raised->second) > limit) limit = size_t(raised->second);
  }
  return shared_bytes > limit ? kInvalidValue : kSuccess;
}

inline uint64_t seed_from_env() {
  const char* s = std::getenv("FK_EMU_SEED");
  return s ? std::strtoull(s, nullptr, 10) : 1;
}
inline uint64_t seed = seed_from_env();  // of the thread schedule; every seed is another order

// ---- a block: its threads as fibers, one at a time ----

// A barrier for `expected` threads. Only the running thread touches it.
struct Barrier {
  unsigned expected = 0, arrived = 0;
  std::vector<unsigned> waiting;
  bool orders_memory = false;  // __syncthreads; not the warp-wide exchanges
  unsigned phase = 0;          // completed rounds
  char sync[2];                // TSan: a round's arrivals before its departures, one address per round
                               // (a thread resumed late must not acquire the next round's arrivals)
};

// A cp.async copy (platform.h: cp_async16, cp_async8) not landed yet, and its commit group (the thread's
// count of commits when it was issued).
struct AsyncCopy {
  void* dst;
  uint8_t bytes[16];
  uint8_t size;  // 16 or 8
  uint64_t group;
};

// An execution context: a GPU thread, or the host thread that launched the block.
struct Context {
  ucontext_t uc;
  void* stack = nullptr;  // its own mapping, fresh for every block (sanitizers see new memory)
  size_t stack_bytes = 0;
  void* tsan = nullptr;  // TSan's thread for it
};

struct Thread : Context {
  static constexpr size_t kStackBytes = 128 * 1024;
  dim3 thread_idx;
  unsigned index = 0;  // linear, in the block
  Barrier* warp = nullptr;
  std::vector<AsyncCopy> async_copies;  // in flight, oldest first
  uint64_t commits = 0;
  bool dependents_launched = false;  // pdl_launch_dependents() called
};

// Per block: fresh barriers (TSan keys synchronization by address), fresh shared memory.
struct Block {
  dim3 block_idx;
  Barrier barrier;  // __syncthreads
  std::vector<Barrier> warps;
  uint8_t* dynamic_shared = nullptr;
  size_t dynamic_shared_bytes = 0;
  std::vector<std::pair<uint8_t*, size_t>> static_shared;  // FK_STATIC_SHARED allocations and their bytes
  uint64_t serial = 0;                  // tells the blocks apart (StaticShared)
  std::vector<unsigned> ready;          // threads that may run, the running one excluded
  unsigned finished = 0;
  uint64_t rng = 0;
};

// A launch's state belongs to the host thread that runs it: ranks of a group (kernels/allreduce.cuh)
// launch at once, each from its own host thread.
inline thread_local dim3 grid_dim, block_dim;
inline thread_local std::vector<Thread> threads;
inline thread_local Context host;
inline thread_local Block* this_block = nullptr;
inline thread_local std::atomic<Thread*> running{nullptr};  // read by kernel code, hence atomic (TSan)
inline thread_local std::vector<float> shuffle_slots;
inline thread_local std::vector<std::array<uint32_t, 8>> word_slots;  // operands of the emulated matrix instructions
inline thread_local std::vector<const void*> pointer_slots;           // ldmatrix row addresses
inline thread_local int launch_end;  // TSan: every block of a launch before what the host does after it

inline Thread& me() { return *running.load(std::memory_order_relaxed); }
inline unsigned linear_thread() {
  Untracked untracked;
  return me().index;
}
inline unsigned block_threads() { return block_dim.x * block_dim.y * block_dim.z; }

inline uint8_t* shared_allocation(size_t bytes) {  // 16-byte aligned, 0xff-filled
  auto* p = static_cast<uint8_t*>(::operator new[](bytes ? bytes : 1, std::align_val_t(16)));
  std::memset(p, 0xff, bytes);
  return p;
}
inline void free_shared(uint8_t* p) { ::operator delete[](p, std::align_val_t(16)); }

// ---- switching between contexts ----
// glibc's own swapcontext: ASan's wrapper clears the shadow of the whole target stack on every
// switch, which the fiber annotations in jump() make unnecessary (and which costs more than the rest).
inline int libc_swapcontext(ucontext_t* from, const ucontext_t* to) {
  using Swap = int (*)(ucontext_t*, const ucontext_t*);
  static const Swap swap = [] {
    void* libc = dlopen("libc.so.6", RTLD_LAZY | RTLD_NOLOAD);
    void* f = libc ? dlsym(libc, "swapcontext") : nullptr;
    return f ? reinterpret_cast<Swap>(f) : &swapcontext;
  }();
  return swap(from, to);
}

inline thread_local Context* switching_from = nullptr;
inline void jump(Context& from, Context& to, bool from_finished) {
  void* to_stack;
  size_t to_stack_bytes;
  void* to_tsan;
  {
    Untracked untracked;
    switching_from = &from;
    to_stack = to.stack, to_stack_bytes = to.stack_bytes, to_tsan = to.tsan;
  }
#if defined(FK_EMU_ASAN)
  void* fake_stack = nullptr;
  __sanitizer_start_switch_fiber(from_finished ? nullptr : &fake_stack, to_stack, to_stack_bytes);
#endif
#if defined(FK_EMU_TSAN)
  __tsan_switch_to_fiber(to_tsan, __tsan_switch_to_fiber_no_sync);
#endif
  (void)from_finished, (void)to_stack, (void)to_stack_bytes, (void)to_tsan;
  libc_swapcontext(&from.uc, &to.uc);
#if defined(FK_EMU_ASAN)
  __sanitizer_finish_switch_fiber(fake_stack, nullptr, nullptr);
#endif
}

// A ready thread, drawn at random (splitmix64 of the block's seed), taken off the list.
inline unsigned take_ready() {
  Block& b = *this_block;
  if (b.ready.empty()) fail("a barrier that not every thread of the block (or of the warp) reaches: on a GPU, a hang");
  uint64_t z = (b.rng += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  const size_t i = (z ^ (z >> 31)) % b.ready.size();
  const unsigned t = b.ready[i];
  b.ready[i] = b.ready.back();
  b.ready.pop_back();
  return t;
}

// The running thread waits at `barrier` (counted in it already, or just finished) and another runs.
inline void run_next(bool finished) {
  Thread& from = me();
  Context* to;
  {
    Untracked untracked;
    if (finished && ++this_block->finished == block_threads()) {
      to = &host;
    } else {
      Thread& next = threads[take_ready()];
      if (&next == &from) return;
      running.store(&next, std::memory_order_relaxed);
      to = &next;
    }
  }
  jump(from, *to, finished);
}

inline void arrive_and_wait(Barrier& barrier) {
  void* sync;
  {
    Untracked untracked;
    sync = &barrier.sync[barrier.phase % 2];
  }
  if (barrier.orders_memory) tsan_release(sync);
  {
    Untracked untracked;
    if (++barrier.arrived == barrier.expected) {
      barrier.arrived = 0;
      ++barrier.phase;
      this_block->ready.insert(this_block->ready.end(), barrier.waiting.begin(), barrier.waiting.end());
      barrier.waiting.clear();
      this_block->ready.push_back(me().index);
    } else {
      barrier.waiting.push_back(me().index);
    }
  }
  run_next(false);
  if (barrier.orders_memory) tsan_acquire(sync);
}

inline void warp_sync() {
  Barrier* warp;
  {
    Untracked untracked;
    warp = me().warp;
  }
  arrive_and_wait(*warp);
}

// The body of every GPU thread: the kernel, then the end of its part of the block.
inline thread_local void (*block_body)() = nullptr;
inline void thread_main() {
#if defined(FK_EMU_ASAN)
  const void* from_stack = nullptr;
  size_t from_bytes = 0;
  __sanitizer_finish_switch_fiber(nullptr, &from_stack, &from_bytes);
  {
    Untracked untracked;
    if (switching_from == &host) host.stack = const_cast<void*>(from_stack), host.stack_bytes = from_bytes;
  }
#endif
  block_body();
  {
    Untracked untracked;
    Thread& t = me();
    if (!t.async_copies.empty()) fail("a block ended with cp.async copies not waited for");
  }
  tsan_release(&launch_end);
  run_next(true);
  fail("a finished thread was resumed");
}

// Thread t's stack: one mapping per thread index, kept from block to block, except under TSan,
// where each block's threads get new mappings (TSan would take a stack reused by another of its
// threads for shared memory).
inline thread_local std::vector<void*> stacks;
inline void* stack_of(unsigned t) {
  if (stacks.size() <= t) stacks.resize(t + 1, nullptr);
  if (stacks[t] == nullptr) {
    void* p = mmap(nullptr, Thread::kStackBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
    if (p == MAP_FAILED) fail("no memory for a thread's stack");
    stacks[t] = p;
  }
#if defined(FK_EMU_ASAN)
  __asan_unpoison_memory_region(stacks[t], Thread::kStackBytes);  // what the thread before left poisoned
#endif
  return stacks[t];
}
inline void release_stack(unsigned t) {
  munmap(stacks[t], Thread::kStackBytes);
  stacks[t] = nullptr;
}

// TSan: the fibers of the block that ran before the current one, destroyed only after it: a
// destroyed fiber's slot goes to the next fiber created, which TSan then takes as ordered after all
// that the old one did (and TSan allows 8128 threads, so not every block's can stay). Races are
// seen between consecutive blocks; TSan's 255 slots, shared in turn, bound it further (see the top).
inline thread_local std::vector<void*> previous_block_fibers;
inline void destroy_fibers(std::vector<void*>& fibers) {
#if defined(FK_EMU_TSAN)
  for (void* fiber : fibers) __tsan_destroy_fiber(fiber);
#endif
  fibers.clear();
}

// Runs one block: every thread from the start of `body` to its end.
inline void run_block(unsigned linear_block, uint64_t serial, size_t dynamic_shared_bytes, void (*body)()) {
  const unsigned n = block_threads(), warps = (n + device.warp_size - 1) / device.warp_size;
  {
    Untracked untracked;
    this_block = new Block;
    this_block->block_idx = dim3(linear_block % grid_dim.x, (linear_block / grid_dim.x) % grid_dim.y,
                            linear_block / (grid_dim.x * grid_dim.y));
    this_block->barrier = Barrier{n, 0, {}, true};
    this_block->warps.assign(warps, Barrier{});
    for (unsigned w = 0; w < warps; ++w)
      this_block->warps[w].expected = std::min<unsigned>(device.warp_size, n - w * device.warp_size);
    this_block->dynamic_shared = shared_allocation(dynamic_shared_bytes);
    this_block->dynamic_shared_bytes = dynamic_shared_bytes;
    this_block->serial = serial;
    this_block->rng = seed * 0x9e3779b97f4a7c15ull ^ (uint64_t(linear_block) << 32 | n);
    for (unsigned t = 0; t < n; ++t) this_block->ready.push_back(t);
    block_body = body;
    threads.resize(n);
    for (unsigned t = 0; t < n; ++t) {
      Thread& th = threads[t];
      th.index = t;
      th.thread_idx = dim3(t % block_dim.x, (t / block_dim.x) % block_dim.y, t / (block_dim.x * block_dim.y));
      th.warp = &this_block->warps[t / device.warp_size];
      th.async_copies.clear();
      th.commits = 0;
      th.dependents_launched = false;
      th.stack_bytes = Thread::kStackBytes;
      th.stack = stack_of(t);
      getcontext(&th.uc);
      th.uc.uc_stack.ss_sp = th.stack;
      th.uc.uc_stack.ss_size = th.stack_bytes;
      th.uc.uc_link = nullptr;
      makecontext(&th.uc, thread_main, 0);
#if defined(FK_EMU_TSAN)
      th.tsan = __tsan_create_fiber(0);
#endif
    }
    Thread& first = threads[take_ready()];
    running.store(&first, std::memory_order_relaxed);
#if defined(FK_EMU_TSAN)
    host.tsan = __tsan_get_current_fiber();
#endif
  }
  jump(host, *running.load(std::memory_order_relaxed), false);
  {
    Untracked untracked;
    running.store(nullptr, std::memory_order_relaxed);
    destroy_fibers(previous_block_fibers);
#if defined(FK_EMU_TSAN)
    for (unsigned t = 0; t < n; ++t) {
      previous_block_fibers.push_back(threads[t].tsan);
      release_stack(t);
    }
#endif
    free_shared(this_block->dynamic_shared);
    for (const auto& [p, bytes] : this_block->static_shared) free_shared(p);
    delete this_block;
    this_block = nullptr;
  }
}

// Runs kernel(args...) on every thread of every block of `grid`, or records the launch error.
template <typename... Params>
struct Launcher {
  void (*kernel)(Params...);
  dim3 grid, block;
  size_t shared_bytes;
  template <typename... Args>
  void operator()(Args&&... args) const {
    const void* address = reinterpret_cast<const void*>(kernel);
    if (const int e = launch_error(address, grid, block, shared_bytes)) {
      last_error = e;
      return;
    }
    {
      const RecordsLock lock;
      unsigned& largest = largest_block[address];
      largest = std::max(largest, block.x * block.y * block.z);
    }
    if (this_block != nullptr) fail("a kernel launched from inside a kernel");
    static thread_local uint64_t serial = 0;
    static thread_local void (*launched)(Params...);
    static thread_local std::tuple<std::decay_t<Args>...>* arguments;
    std::tuple<std::decay_t<Args>...> copy(args...);
    {
      Untracked untracked;
      grid_dim = grid;
      block_dim = block;
      const unsigned n = block.x * block.y * block.z;
      shuffle_slots.assign(n, 0.f);
      word_slots.assign(n, {});
      pointer_slots.assign(n, nullptr);
      launched = kernel;
      arguments = &copy;
    }
    // Each block's threads are new TSan threads created by the host: they see what it did before
    // the launch, and only their own __syncthreads among themselves.
    const unsigned blocks = grid.x * grid.y * grid.z;
    const auto body = [] { std::apply(launched, *arguments); };
    for (unsigned b = 0; b < blocks; ++b) run_block(b, ++serial, shared_bytes, body);
    tsan_acquire(&launch_end);
    Untracked untracked;
    destroy_fibers(previous_block_fibers);
  }
};

template <typename... Params>
Launcher<Params...> launcher(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared_bytes) {
  return {kernel, grid, block, shared_bytes};
}

// Static shared memory of one declaration (FK_STATIC_SHARED): a fresh allocation for each block,
// made by the first of its threads to get there.
struct StaticShared {
  uint64_t serial = 0;
  uint8_t* data = nullptr;
  uint8_t* get(size_t bytes) {
    Untracked untracked;
    if (serial != this_block->serial) {
      serial = this_block->serial;
      data = shared_allocation(bytes);
      this_block->static_shared.emplace_back(data, bytes);
    }
    return data;
  }
};

inline dim3 thread_index() {
  Untracked untracked;
  return me().thread_idx;
}
inline dim3 block_index() {
  Untracked untracked;
  return this_block->block_idx;
}
inline uint8_t* dynamic_shared() {
  Untracked untracked;
  return this_block->dynamic_shared;
}

// Whether p is in this block's shared memory: a global-only instruction (store16's st.global) given such
// an address faults on a GPU (an illegal address: it is not in the global window), while the host store
// would quietly work.
inline bool is_shared(const void* p) {
  Untracked untracked;
  const auto* b = static_cast<const uint8_t*>(p);
  auto within = [&](const uint8_t* base, size_t bytes) { return b >= base && b < base + bytes; };
  if (within(this_block->dynamic_shared, this_block->dynamic_shared_bytes)) return true;
  for (const auto& [base, bytes] : this_block->static_shared)
    if (within(base, bytes)) return true;
  return false;
}
}  // namespace fk::emu

#define threadIdx (::fk::emu::thread_index())
#define blockIdx (::fk::emu::block_index())
#define gridDim (::fk::emu::grid_dim)
#define blockDim (::fk::emu::block_dim)

inline void __syncthreads() {
  fk::emu::Barrier* barrier;
  {
    fk::emu::Untracked untracked;
    barrier = &fk::emu::this_block->barrier;
  }
  fk::emu::arrive_and_wait(*barrier);
}

// A block barrier that also tells whether any thread's predicate was true.
inline bool __syncthreads_or(bool predicate) {
  const unsigned t = fk::emu::linear_thread();
  {
    fk::emu::Untracked untracked;
    fk::emu::shuffle_slots[t] = predicate ? 1.f : 0.f;
  }
  __syncthreads();
  bool any = false;
  {
    fk::emu::Untracked untracked;
    for (unsigned i = 0; i < fk::emu::block_threads(); ++i) any = any || fk::emu::shuffle_slots[i] != 0.f;
  }
  __syncthreads();
  return any;
}

namespace fk::emu {
// Every lane of the warp calls it together (see the top of this file): v in, thread `src`'s v out.
inline float exchange(float v, unsigned src, const char* bad_lane) {
  const unsigned t = linear_thread(), warp = unsigned(device.warp_size);
  if (src >= block_threads() || src / warp != t / warp) fail(bad_lane);
  {
    Untracked untracked;
    shuffle_slots[t] = v;
  }
  warp_sync();
  float result;
  {
    Untracked untracked;
    result = shuffle_slots[src];
  }
  warp_sync();
  return result;
}
}  // namespace fk::emu

inline float __shfl_xor(float v, int lane_mask) {
  using namespace fk::emu;
  if (unsigned(lane_mask) >= unsigned(device.warp_size)) fail("__shfl_xor names a lane outside the warp");
  return exchange(v, linear_thread() ^ unsigned(lane_mask), "__shfl_xor names a lane outside the block");
}

inline float __shfl(float v, int src_lane) {
  const unsigned t = fk::emu::linear_thread(), base = t - t % unsigned(fk::emu::device.warp_size);
  if (unsigned(src_lane) >= unsigned(fk::emu::device.warp_size)) fk::emu::fail("__shfl names a lane outside the warp");
  return fk::emu::exchange(v, base + unsigned(src_lane), "__shfl names a lane outside the block");
}

// Shared- or global-memory atomics. Only one GPU thread runs at a time here, so any add is atomic;
// the __atomic builtins make them atomics to ThreadSanitizer too, which orders nothing else by them
// (relaxed): a plain access racing with them is still reported.
inline unsigned atomicAdd(unsigned* p, unsigned v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
  return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
}

// ---- platform.h's flags between the GPUs of a group ----
// The ranks of a group run at once, each launch on its own host thread (tests/emu/emu_ops.cpp:
// emu_allreduce), over one process's memory standing for the peer-mapped buffers. The flags are
// C++ atomics with the same orders, so ThreadSanitizer sees exactly the happens-before edges a GPU's
// release and acquire give: a peer's read of data that no flag ordered after its write is a race.
namespace fk::emu {
inline double watchdog_seconds() {
  const char* s = std::getenv("FK_EMU_WATCHDOG_SECONDS");
  return s ? std::strtod(s, nullptr) : 20.0;
}
inline thread_local std::chrono::steady_clock::time_point spin_started;
}  // namespace fk::emu

namespace fk {
inline void signal_release_system(uint32_t* p, uint32_t v) {
  {
    emu::Untracked untracked;
    if (emu::me().dependents_launched)
      emu::fail("a peer signalled after pdl_launch_dependents: the dependent launch must follow the last store");
  }
  __atomic_store_n(p, v, __ATOMIC_RELEASE);
}
inline uint32_t poll_acquire_system(const uint32_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
inline void fence_system() {}
inline uint64_t clock_ns() {
  return uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(
                      std::chrono::steady_clock::now().time_since_epoch()).count());
}
// n: the spin's iteration, 0 first. A spin longer than the watchdog (FK_EMU_WATCHDOG_SECONDS, 20 s)
// is a hang on a GPU: a peer that never signals, or waits for another count.
inline void spin_pause(uint32_t n) {
  emu::Untracked untracked;
  const auto now = std::chrono::steady_clock::now();
  if (n == 0) emu::spin_started = now;
  if (std::chrono::duration<double>(now - emu::spin_started).count() > emu::watchdog_seconds())
    emu::fail("a flag waited for longer than the watchdog allows: on a GPU, a hang");
  std::this_thread::yield();
}
}  // namespace fk

namespace fk {
using gpuStream_t = void*;
using gpuError_t = int;
inline constexpr gpuError_t gpuSuccess = 0;
inline gpuError_t gpuGetLastError() { return std::exchange(emu::last_error, 0); }
inline const char* gpuGetErrorString(gpuError_t e) { return emu::error_string(e); }
inline int gpuCurrentDevice() { return 0; }
inline int gpuMultiprocessorCount(int) { return 4; }
inline int gpuWarpSize(int) { return emu::device.warp_size; }
template <typename Kernel>
int gpuMaxActiveBlocksPerSM(Kernel, int) {
  return 2;
}
template <typename Kernel>
gpuError_t gpuSetMaxDynamicShared(Kernel kernel, int bytes) {
  return emu::set_max_dynamic_shared(kernel, bytes);
}
}  // namespace fk

// ---- platform.h's asynchronous copies and warp matrix instructions ----
// Emulating a CUDA build, a copy lands only when a cp_async_wait of its thread retires its group;
// until then its destination holds 0xff bytes (NaN as fp16 and bf16), so a read that a missing
// wait or barrier leaves too early shows up. Emulating HIP, it is done at once, as on AMD.
namespace fk {
template <int kBytes>
void cp_async(void* smem, const void* gmem, bool valid) {
  emu::AsyncCopy copy{smem, {}, kBytes, 0};
  if (valid) std::memcpy(copy.bytes, gmem, kBytes);
#if defined(FK_EMULATE_HIP)
  std::memcpy(smem, copy.bytes, kBytes);
#else
  std::memset(smem, 0xff, kBytes);
  emu::Untracked untracked;
  emu::Thread& t = emu::me();
  copy.group = t.commits;
  t.async_copies.push_back(copy);
#endif
}
inline void cp_async16(void* smem, const void* gmem, bool valid) { cp_async<16>(smem, gmem, valid); }
inline void cp_async8(void* smem, const void* gmem, bool valid) { cp_async<8>(smem, gmem, valid); }
inline void cp_async_commit() {
  emu::Untracked untracked;
  ++emu::me().commits;
}
template <int kPending>
void cp_async_wait() {  // lands the copies of every group but the newest kPending committed ones
  emu::AsyncCopy* copies;
  size_t landing = 0;
  {
    emu::Untracked untracked;
    emu::Thread& t = emu::me();
    copies = t.async_copies.data();
    while (landing < t.async_copies.size() && t.async_copies[landing].group + kPending < t.commits) ++landing;
  }
  for (size_t i = 0; i < landing; ++i) std::memcpy(copies[i].dst, copies[i].bytes, copies[i].size);  // the copies' writes: tracked
  emu::Untracked untracked;
  std::vector<emu::AsyncCopy>& in_flight = emu::me().async_copies;
  in_flight.erase(in_flight.begin(), in_flight.begin() + std::ptrdiff_t(landing));
}

namespace emu {
inline uint16_t half_word(uint32_t w, int i) { return uint16_t(w >> (16 * i)); }

// Every lane of this thread's warp puts its operand words; each gets all of them.
template <int kWords>
void exchange_words(const uint32_t (&mine)[kWords], std::array<uint32_t, 8> (&lanes)[64], int warp) {
  const unsigned t = linear_thread(), base = t - t % unsigned(warp);
  {
    Untracked untracked;
    for (int i = 0; i < kWords; ++i) word_slots[t][i] = mine[i];
  }
  warp_sync();
  {
    Untracked untracked;
    for (int l = 0; l < warp; ++l) lanes[l] = word_slots[base + unsigned(l)];
  }
  warp_sync();
}

inline void ldmatrix_x4(uint32_t (&r)[4], const void* row, bool trans) {
  if (device.warp_size != 32) fail("ldmatrix on a device whose warp is not 32 lanes");
  const unsigned t = linear_thread(), lane = t % 32, base = t - lane;
  const uint16_t* rows[32];
  {
    Untracked untracked;
    pointer_slots[t] = row;
  }
  warp_sync();
  {
    Untracked untracked;
    for (unsigned l = 0; l < 32; ++l) rows[l] = static_cast<const uint16_t*>(pointer_slots[base + l]);
  }
  warp_sync();
  for (int i = 0; i < 4; ++i) {  // the shared-memory reads are the instruction's own: tracked
    if (!trans) {  // row lane / 4 of matrix i, columns 2 (lane % 4) and the next one
      const uint16_t* src = rows[8 * i + lane / 4];
      r[i] = uint32_t(src[2 * (lane % 4)]) | uint32_t(src[2 * (lane % 4) + 1]) << 16;
    } else {  // the same of the transpose: rows 2 (lane % 4) and the next one, column lane / 4
      const uint16_t* lo = rows[8 * i + 2 * (lane % 4)];
      const uint16_t* hi = rows[8 * i + 2 * (lane % 4) + 1];
      r[i] = uint32_t(lo[lane / 4]) | uint32_t(hi[lane / 4]) << 16;
    }
  }
}
}  // namespace emu

inline void ldmatrix_x4(uint32_t (&r)[4], const void* row) { emu::ldmatrix_x4(r, row, false); }
inline void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row) { emu::ldmatrix_x4(r, row, true); }

template <typename T>
void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  if (emu::device.warp_size != 32) emu::fail("mma.sync on a device whose warp is not 32 lanes");
  const unsigned lane = emu::linear_thread() % 32;
  const uint32_t mine[6] = {a[0], a[1], a[2], a[3], b[0], b[1]};
  std::array<uint32_t, 8> lanes[64];
  emu::exchange_words(mine, lanes, 32);
  const int g = int(lane / 4), tid = int(lane % 4);
  for (int e = 0; e < 4; ++e) {
    const int row = g + 8 * (e / 2), col = 2 * tid + e % 2;
    float acc = 0.f;
    for (int k = 0; k < 16; ++k) {
      const unsigned a_lane = unsigned((row % 8) * 4 + (k % 8) / 2);
      const int a_word = row / 8 + 2 * (k / 8);
      const unsigned b_lane = unsigned(col * 4 + (k % 8) / 2);
      const int b_word = 4 + k / 8;
      acc += to_float(T{emu::half_word(lanes[a_lane][a_word], k % 2)}) *
             to_float(T{emu::half_word(lanes[b_lane][b_word], k % 2)});
    }
    d[e] += acc;
  }
}

template <typename T>
void mfma_16x16x16(float (&d)[4], const uint32_t (&a)[2], const uint32_t (&b)[2]) {
  if (emu::device.warp_size != 64) emu::fail("MFMA on a device whose wavefront is not 64 lanes");
  const unsigned lane = emu::linear_thread() % 64;
  const uint32_t mine[4] = {a[0], a[1], b[0], b[1]};
  std::array<uint32_t, 8> lanes[64];
  emu::exchange_words(mine, lanes, 64);
  auto element = [&](unsigned l, int first_word, int k) { return emu::half_word(lanes[l][first_word + k / 2], k % 2); };
  const int col = int(lane % 16), q = int(lane / 16);
  for (int e = 0; e < 4; ++e) {
    const int row = 4 * q + e;
    float acc = 0.f;
    for (int k = 0; k < 16; ++k) {  // A(row, k) in lane row + 16 (k / 4); B(k, col) in lane col + 16 (k / 4)
      acc += to_float(T{element(unsigned(row + 16 * (k / 4)), 0, k % 4)}) *
             to_float(T{element(unsigned(col + 16 * (k / 4)), 2, k % 4)});
    }
    d[e] += acc;
  }
}
}  // namespace fk
