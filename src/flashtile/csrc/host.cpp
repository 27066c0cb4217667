// The eager path's per-call work in C++: a planned call's outputs allocated, its params struct written, its
// launches queued, and in training the autograd node whose backward does the same for the backward plan.
//
// Python decides everything (flashtile/plans.py builds the plans; flashtile/host.py hands them over): a plan
// arrives here as its kernels' handles and geometry plus the params struct packed with its address fields zero.
// A call then only writes the operands' addresses into a copy of that struct and launches. torch builds this
// file at run time where a host compiler exists; elsewhere the Python path runs the same plans.

#include <dlfcn.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <tuple>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ATen/Dispatch.h>
#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

namespace py = pybind11;
using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

namespace {

// ---- Errors ------------------------------------------------------------------------------------------------

// This file's errors reach Python as RuntimeError through a pybind11 exception type (as pybind11's own cast errors
// do), with the message built by std::string alone. On the H200 (torch 2.11, g++ 13) TORCH_CHECK's c10::Error and
// a plain std::runtime_error with a c10::str message, thrown by this extension's code, both killed the process as
// they crossed into Python, where a pybind11 cast error from the same code arrived as a Python error.
struct HostError : py::builtin_exception {
  using py::builtin_exception::builtin_exception;
  void set_error() const override { PyErr_SetString(PyExc_RuntimeError, what()); }
};

inline std::string text(const char* s) { return s; }
inline std::string text(const std::string& s) { return s; }
template <class Number, class = std::enable_if_t<std::is_arithmetic_v<Number>>>
std::string text(Number n) { return std::to_string(n); }

template <class... Parts>
void require(bool condition, const Parts&... parts) {
  if (!condition) throw HostError((std::string() + ... + text(parts)));
}

// ---- The driver: three entry points of the libcuda torch has loaded -------------------------------------

using CUresult = int;
constexpr CUresult kSuccess = 0;
constexpr CUresult kInvalidContext = 201;  // CUDA_ERROR_INVALID_CONTEXT: this thread has no current context

struct Driver {
  CUresult (*launch_kernel)(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                            unsigned smem, void* stream, void** params, void** extra);
  CUresult (*ctx_set_current)(void* context);
  CUresult (*get_error_name)(CUresult error, const char** name);
};

void* driver_symbol(void* library, const char* name) {
  void* symbol = dlsym(library, name);
  require(symbol != nullptr, "flashtile: libcuda.so.1 has no ", name);
  return symbol;
}

const Driver& driver() {
  static const Driver entry_points = [] {
    void* library = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    require(library != nullptr, "flashtile: cannot open libcuda.so.1: ", dlerror());
    Driver d;
    d.launch_kernel = reinterpret_cast<decltype(d.launch_kernel)>(driver_symbol(library, "cuLaunchKernel"));
    d.ctx_set_current = reinterpret_cast<decltype(d.ctx_set_current)>(driver_symbol(library, "cuCtxSetCurrent"));
    d.get_error_name = reinterpret_cast<decltype(d.get_error_name)>(driver_symbol(library, "cuGetErrorName"));
    return d;
  }();
  return entry_points;
}

void check(CUresult result, const char* what) {
  if (result == kSuccess) return;
  const char* name = nullptr;
  driver().get_error_name(result, &name);
  require(false, what, " failed: ", name ? name : "unknown error", " (", result, ")");
}

// ---- A plan's launches ----------------------------------------------------------------------------------

constexpr size_t kParamsCapacity = 1024;  // bytes; the largest struct (BwdParams) is well under it
constexpr size_t kMaxMapsBytes = 640;     // a second argument: K's, V's (and Q's, dO's, dQ's) 128-byte tensor maps
constexpr size_t kMapsAlign = 64;         // a tensor map's alignment

struct Step {
  void* function;
  std::array<unsigned, 3> grid;
  unsigned threads;
  unsigned smem;
};

struct Launches {
  std::vector<Step> steps;
  std::string params;  // the packed struct, its address fields zero
  void* context;       // the device's primary context: made current where a thread has none

  // Queue steps [first, last) on `stream`, all reading the struct at `struct_bytes` (and the maps, if any).
  void run(size_t first, size_t last, void* struct_bytes, void* maps, void* stream) const {
    void* argv[2] = {struct_bytes, maps};
    for (size_t i = first; i < last; ++i) {
      const Step& s = steps[i];
      auto launch = [&] {
        return driver().launch_kernel(s.function, s.grid[0], s.grid[1], s.grid[2], s.threads, 1, 1, s.smem, stream,
                                      argv, nullptr);
      };
      CUresult result = launch();
      if (result == kInvalidContext) {  // a thread where the CUDA runtime never ran (autograd's device thread)
        check(driver().ctx_set_current(context), "cuCtxSetCurrent");
        result = launch();
      }
      check(result, "cuLaunchKernel");
    }
  }
};

// A plan's launches from what Python hands over, checked here and not in a constructor: an exception thrown out of
// a bound constructor killed the process on the H200 (torch 2.11's pybind11 built by g++ 13), where the same
// exception out of a bound function raises a Python error.
Launches launches_of(const py::list& launch_steps, py::bytes packed, uintptr_t primary_context) {
  Launches launches{{}, std::string(packed), reinterpret_cast<void*>(primary_context)};
  require(launches.params.size() <= kParamsCapacity, "flashtile: params struct of ", launches.params.size(),
              " bytes");
  for (const auto& item : launch_steps) {
    auto t = item.cast<std::tuple<uintptr_t, unsigned, unsigned, unsigned, unsigned, unsigned>>();
    launches.steps.push_back(Step{reinterpret_cast<void*>(std::get<0>(t)),
                                  {std::get<1>(t), std::get<2>(t), std::get<3>(t)}, std::get<4>(t), std::get<5>(t)});
  }
  return launches;
}

constexpr size_t kAddressBytes = 8;

struct alignas(16) ParamsBuffer {
  char bytes[kParamsCapacity];
};

void put_address(ParamsBuffer& buffer, size_t offset, const at::Tensor& t) {
  uint64_t address = t.defined() ? reinterpret_cast<uint64_t>(t.data_ptr()) : 0;
  std::memcpy(buffer.bytes + offset, &address, sizeof(address));
}

// Tests fill every buffer a kernel writes with NaN first, so that an element a kernel forgets fails them.
bool poison_outputs = false;

void poison(std::initializer_list<at::Tensor*> buffers) {
  if (!poison_outputs) return;
  for (at::Tensor* t : buffers) {
    if (t->defined()) t->fill_(std::numeric_limits<float>::quiet_NaN());
  }
}

// AttnParams begins with the addresses of q, k, v, o and the LSE.
constexpr size_t kScratchSlot = 5;  // AttnParams.scores, after q, k, v, o and lse

void put_operands(ParamsBuffer& buffer, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& o, const at::Tensor& lse) {
  size_t slot = 0;
  for (const at::Tensor* t : {&q, &k, &v, &o, &lse}) put_address(buffer, (slot++) * kAddressBytes, *t);
}

void* current_stream(const at::Device& device) {
  return c10::impl::getDeviceGuardImpl(device.type())->getStream(device).native_handle();
}

// ---- The backward plan (plans.BwdPlan.run) ------------------------------------------------------------------

constexpr uintptr_t kAlignBytes = 16;        // plans.ALIGN_BYTES: the kernels' vector loads
constexpr int64_t kScratchAlignFloats = 64;  // plans.SCRATCH_ALIGN_FLOATS

// A tensor's address at one of its heads (dimension -2): a head group's operand.
uint64_t head_address(const at::Tensor& t, int64_t head) {
  return reinterpret_cast<uint64_t>(t.data_ptr()) + static_cast<uint64_t>(head * t.stride(-2) * t.element_size());
}

// ---- Tensor maps, kept by the addresses they describe (plans.FwdPlan.maps, plans.BwdPlan.maps) ----------------

constexpr size_t kMaxKeptMaps = 64;  // plans.MAX_KEPT_MAPS

// The addresses the maps describe: the forward's Q (0 where its maps omit Q), K, V and 0; the backward's Q, K, V, dO.
using MapsKey = std::array<uint64_t, 4>;
struct MapsKeyHash {
  size_t operator()(const MapsKey& a) const {
    size_t h = 0;
    for (uint64_t x : a) h = h * 1000003u ^ x;
    return h;
  }
};

// The maps `make` returns for `key`, encoded once and kept (all forgotten when kMaxKeptMaps are kept), copied to
// `out` (kMaxMapsBytes at a tensor map's alignment). `make` runs with the GIL held and `lock` released: the backward
// runs on autograd's threads, which hold neither.
template <typename Make>
void kept_maps(std::unordered_map<MapsKey, std::string, MapsKeyHash>& kept, std::mutex& lock, const MapsKey& key,
               const Make& make, void* out) {
  {
    std::lock_guard<std::mutex> hold(lock);
    auto found = kept.find(key);
    if (found != kept.end()) {
      std::memcpy(out, found->second.data(), found->second.size());
      return;
    }
  }
  std::string bytes;
  {
    py::gil_scoped_acquire gil;
    bytes = make().template cast<std::string>();
  }
  require(bytes.size() <= kMaxMapsBytes, "flashtile: tensor maps of ", bytes.size(), " bytes");
  std::memcpy(out, bytes.data(), bytes.size());
  std::lock_guard<std::mutex> hold(lock);
  if (kept.size() >= kMaxKeptMaps) kept.clear();
  kept.emplace(key, std::move(bytes));
}

struct alignas(kMapsAlign) MapsBuffer {
  char bytes[kMaxMapsBytes];
};

uint64_t address_of(const at::Tensor& t) { return reinterpret_cast<uint64_t>(t.data_ptr()); }

struct Backward {
  Launches launches;
  size_t bwd_addresses;  // byte offset of BwdParams' own address fields (dO first)
  std::vector<int64_t> dout_stride;
  int64_t lse_floats, accum_floats, semaphore_ints;          // a head group's
  int64_t groups, q_heads, kv_heads, lse_head_dim;           // plans.HeadGroups
  py::object make_maps;  // (q, k, v, dout) of a head group -> the main kernel's tensor maps; None: one argument
  mutable std::unordered_map<MapsKey, std::string, MapsKeyHash> maps;
  mutable std::mutex maps_lock;  // backward calls may run on several threads (one per device)

  Backward(Launches launches, size_t bwd_addresses, std::vector<int64_t> dout_stride, int64_t lse_floats,
           int64_t accum_floats, int64_t semaphore_ints, int64_t groups, int64_t q_heads, int64_t kv_heads,
           int64_t lse_head_dim, py::object make_maps)
      : launches(std::move(launches)), bwd_addresses(bwd_addresses), dout_stride(std::move(dout_stride)),
        lse_floats(lse_floats), accum_floats(accum_floats), semaphore_ints(semaphore_ints), groups(groups),
        q_heads(q_heads), kv_heads(kv_heads), lse_head_dim(lse_head_dim), make_maps(std::move(make_maps)) {}

  // The maps of one head group's operands: views of the group's heads (the head dimension is the one before the
  // head dim), as plans.BwdPlan.run hands them over.
  void* maps_for(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& dout,
                 int64_t q_head, int64_t kv_head, MapsBuffer& out) const {
    if (make_maps.is_none()) return nullptr;
    const MapsKey key{head_address(q, q_head), head_address(k, kv_head), head_address(v, kv_head),
                      head_address(dout, q_head)};
    kept_maps(maps, maps_lock, key, [&] {
      const int64_t heads_dim = q.dim() - 2;
      return make_maps(q.narrow(heads_dim, q_head, q_heads), k.narrow(heads_dim, kv_head, kv_heads),
                       v.narrow(heads_dim, kv_head, kv_heads), dout.narrow(heads_dim, q_head, q_heads));
    }, out.bytes);
    return out.bytes;
  }

  std::tuple<at::Tensor, at::Tensor, at::Tensor> run(at::Tensor dout, const at::Tensor& q, const at::Tensor& k,
                                                      const at::Tensor& v, const at::Tensor& o,
                                                      const at::Tensor& lse, const at::Tensor& dlse) const {
    c10::DeviceGuard guard(q.device());
    if (dout.strides() != c10::IntArrayRef(dout_stride) || reinterpret_cast<uintptr_t>(dout.data_ptr()) % kAlignBytes) {
      dout = at::empty_like(o).copy_(dout);
    }
    at::Tensor dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
    poison({&dq, &dk, &dv});
    const int64_t accum_at = (2 * lse_floats + kScratchAlignFloats - 1) / kScratchAlignFloats * kScratchAlignFloats;
    at::Tensor scratch = at::empty({accum_at + accum_floats}, q.options().dtype(at::kFloat));
    at::Tensor semaphore =
        semaphore_ints ? at::zeros({groups * semaphore_ints}, q.options().dtype(at::kInt)) : at::Tensor();
    const auto base = reinterpret_cast<uint64_t>(scratch.data_ptr());
    void* stream = current_stream(q.device());
    const size_t steps = launches.steps.size();
    // The groups run one after the other on the stream: they share the scratch buffer (plans.BwdPlan.run).
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t q_head = g * q_heads, kv_head = g * kv_heads;
      at::Tensor lse_part = lse, dlse_part = dlse;
      if (groups > 1) {
        lse_part = lse.narrow(lse_head_dim, q_head, q_heads).contiguous();
        if (dlse.defined()) dlse_part = dlse.narrow(lse_head_dim, q_head, q_heads);
      }
      ParamsBuffer buffer;
      std::memcpy(buffer.bytes, launches.params.data(), launches.params.size());
      const std::array<uint64_t, 5> operands = {head_address(q, q_head), head_address(k, kv_head),
                                                head_address(v, kv_head), head_address(o, q_head),
                                                reinterpret_cast<uint64_t>(lse_part.data_ptr())};
      std::memcpy(buffer.bytes, operands.data(), sizeof(operands));
      // The LSE's gradient, which the preprocess kernel subtracts from D, read laid out as the LSE.
      if (dlse_part.defined() && (dlse_part.scalar_type() != at::kFloat || dlse_part.strides() != lse_part.strides())) {
        dlse_part = at::empty_like(lse_part).copy_(dlse_part);
      }
      // (The last address, varlen's batch order, stays 0: planned calls are dense.)
      const std::array<uint64_t, 10> own = {
          head_address(dout, q_head), head_address(dq, q_head), head_address(dk, kv_head), head_address(dv, kv_head),
          base + accum_at * sizeof(float), base, base + lse_floats * sizeof(float),
          semaphore.defined() ? reinterpret_cast<uint64_t>(semaphore.data_ptr()) + g * semaphore_ints * sizeof(int)
                              : 0,
          dlse_part.defined() ? reinterpret_cast<uint64_t>(dlse_part.data_ptr()) : 0, 0};
      std::memcpy(buffer.bytes + bwd_addresses, own.data(), sizeof(own));
      MapsBuffer maps_buffer;
      launches.run(0, steps, buffer.bytes, maps_for(q, k, v, dout, q_head, kv_head, maps_buffer), stream);
    }
    return {dq, dk, dv};
  }
};

// ---- The autograd node (ops.Attention's backward) -----------------------------------------------------------

// torch's autograd holds nodes by shared_ptr in some releases and by intrusive_ptr in others.
using NodePtr = decltype(torch::autograd::Edge().function);

constexpr const char* kTwiceMessage =
    "trying to differentiate twice a function that was marked with @once_differentiable (flashtile's attention "
    "backward is not itself differentiable)";

// backward(create_graph=True): the gradients join the graph through a node that refuses a second backward.
variable_list refused_twice(variable_list grads) {
  for (auto& g : grads) g = g.detach().requires_grad_(true);
  torch::autograd::DelayedError refusal(kTwiceMessage, static_cast<int64_t>(grads.size()));
  return refusal.apply(std::move(grads));
}

// What both nodes keep: the edges to q, k and v and the five saved tensors (out and lse detached: a node's own
// outputs saved as inputs would form a cycle).
struct SavedOperands : torch::autograd::Node {
  SavedVariable q, k, v, out, lse;

  void save(const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_, const at::Tensor& out_,
            const at::Tensor& lse_) {
    set_next_edges(torch::autograd::collect_next_edges(q_, k_, v_));
    q = SavedVariable(q_, false);
    k = SavedVariable(k_, false);
    v = SavedVariable(v_, false);
    out = SavedVariable(out_.detach(), false);
    lse = SavedVariable(lse_.detach(), false);
  }

  void release_variables() override {
    for (SavedVariable* s : {&q, &k, &v, &out, &lse}) s->reset_data();
  }
};

struct AttentionBackward : SavedOperands {
  std::shared_ptr<const Backward> plan;

  std::string name() const override { return "flashtile::AttentionBackward"; }

  variable_list apply(variable_list&& grads) override {
    at::Tensor dout = grads[0], dlse = grads[1];
    if (!dout.defined() && !dlse.defined()) return {at::Tensor(), at::Tensor(), at::Tensor()};
    at::Tensor q_ = q.unpack(), k_ = k.unpack(), v_ = v.unpack(), out_ = out.unpack(), lse_ = lse.unpack();
    if (!dout.defined()) dout = at::zeros_like(out_);  // only the log-sum-exp reached the loss
    bool recorded = at::GradMode::is_enabled() &&
                    (dout.requires_grad() || (dlse.defined() && dlse.requires_grad()));
    auto [dq, dk, dv] = [&] {
      at::AutoGradMode off(false);
      return plan->run(dout, q_, k_, v_, out_, lse_, dlse);
    }();
    return recorded ? refused_twice({dq, dk, dv}) : variable_list{dq, dk, dv};
  }
};

template <class T>
NodePtr new_node() {
  if constexpr (std::is_same_v<NodePtr, std::shared_ptr<torch::autograd::Node>>) {
    return std::shared_ptr<T>(new T());
  } else {
    return c10::make_intrusive<T>();
  }
}

// ---- The forward plan (plans.FwdPlan.run) -------------------------------------------------------------------

struct Forward {
  Launches launches;
  std::vector<int64_t> out_shape;  // empty: the output is at::empty_like(q)
  std::vector<int64_t> lse_shape;  // empty: no LSE
  py::object make_maps;  // (q, k, v, o) -> the tensor maps as bytes (K's, V's, then Q's and O's if the flags say so);
                         // None: one argument
  bool maps_of_q;        // the maps describe Q as well
  bool maps_of_o;        // ... and O
  std::unordered_map<MapsKey, std::string, MapsKeyHash> maps;
  std::mutex maps_lock;
  std::shared_ptr<const Backward> backward;
  int64_t scratch_floats;  // fp32 scratch the kernels share (AttnParams.scores); 0: none
  int64_t zeroed_floats;   // its last floats, zeroed before each call (the tail split's counters)

  Forward(Launches launches, std::vector<int64_t> out_shape, std::vector<int64_t> lse_shape, py::object make_maps,
          bool maps_of_q, bool maps_of_o, std::shared_ptr<Backward> backward, int64_t scratch_floats,
          int64_t zeroed_floats)
      : launches(std::move(launches)), out_shape(std::move(out_shape)), lse_shape(std::move(lse_shape)),
        make_maps(std::move(make_maps)), maps_of_q(maps_of_q), maps_of_o(maps_of_o), backward(std::move(backward)),
        scratch_floats(scratch_floats), zeroed_floats(zeroed_floats) {}

  void* maps_for(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& o,
                 MapsBuffer& out) {
    if (make_maps.is_none()) return nullptr;
    const MapsKey key{maps_of_q ? address_of(q) : 0, address_of(k), address_of(v), maps_of_o ? address_of(o) : 0};
    kept_maps(maps, maps_lock, key, [&] { return make_maps(q, k, v, o); }, out.bytes);
    return out.bytes;
  }

  std::pair<at::Tensor, at::Tensor> run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
    c10::DeviceGuard guard(q.device());
    at::Tensor o = out_shape.empty() ? at::empty_like(q) : at::empty(out_shape, q.options());
    at::Tensor lse = lse_shape.empty() ? at::Tensor() : at::empty(lse_shape, q.options().dtype(at::kFloat));
    poison({&o, &lse});
    ParamsBuffer buffer;
    std::memcpy(buffer.bytes, launches.params.data(), launches.params.size());
    put_operands(buffer, q, k, v, o, lse);
    at::Tensor scratch;  // kept until the launches are queued; the allocator orders its reuse on the stream
    if (scratch_floats > 0) {
      scratch = at::empty({scratch_floats}, q.options().dtype(at::kFloat));
      if (zeroed_floats > 0) scratch.narrow(0, scratch_floats - zeroed_floats, zeroed_floats).zero_();
      put_address(buffer, kScratchSlot * kAddressBytes, scratch);
    }
    MapsBuffer maps_buffer;
    launches.run(0, launches.steps.size(), buffer.bytes, maps_for(q, k, v, o, maps_buffer),
                 current_stream(q.device()));
    return {o, lse};
  }

  // The forward as training calls it: (out, lse) with the node whose backward runs the backward plan.
  std::pair<at::Tensor, at::Tensor> train(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
    require(backward != nullptr && !lse_shape.empty(), "flashtile: this call was planned without gradients");
    auto [o, lse] = [&] {
      at::AutoGradMode off(false);
      return run(q, k, v);
    }();
    NodePtr node = new_node<AttentionBackward>();
    auto* attention = static_cast<AttentionBackward*>(node.get());
    attention->plan = backward;
    attention->save(q, k, v, o, lse);
    torch::autograd::set_history(o, node);
    torch::autograd::set_history(lse, node);
    return {o, lse};
  }
};

// ---- The CPU's kernel call (dispatch.GeneralCall, cpu_kernel.forward's square case) ------------------------------

// Whether a tensor holds no NaN or Inf. A contiguous tensor is scanned as bits: with the sign cleared, its
// largest element lies below the all-ones exponent. The scan is compiled with the loop vectoriser on (GCC's -O2
// leaves it off), and on x86-64 Linux beside AVX-512 and AVX2 copies of itself, one of which the loader picks for
// the machine. It reads memory once; a sum (reference._all_finite's test, fp32, fp64 for fp64) does too but
// vectorises better on large 32- and 64-bit tensors, so those take the sum above kScanElements. A sum that
// overflows is only a false alarm, which sends the call to the Python path: slower, never wrong.
#if defined(__GNUC__) && !defined(__clang__)
#define FT_VECTORISED __attribute__((optimize("O3")))
#else
#define FT_VECTORISED
#endif
// The AVX2 copy is x86-64-v3 where the compiler can name it (GCC 12 on): AVX2 with FMA, which a plain "avx2"
// copy lacks, so its multiply-adds would not fuse.
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
#define FT_CPU_CLONES __attribute__((target_clones("avx512f", "arch=x86-64-v3", "default")))
#elif defined(__x86_64__) && defined(__linux__) && defined(__GNUC__)
#define FT_CPU_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define FT_CPU_CLONES
#endif
constexpr int64_t kScanElements = int64_t{1} << 18;  // per chunk, and the 32/64-bit limit: measured in notes.md

FT_CPU_CLONES FT_VECTORISED static bool scan_finite16(const uint16_t* bits, int64_t n, uint16_t exponent) {
  uint16_t largest = 0;
  for (int64_t i = 0; i < n; ++i) largest = std::max<uint16_t>(largest, bits[i] & 0x7fffu);
  return largest < exponent;
}
FT_CPU_CLONES FT_VECTORISED static bool scan_finite32(const uint32_t* bits, int64_t n) {
  uint32_t largest = 0;
  for (int64_t i = 0; i < n; ++i) largest = std::max<uint32_t>(largest, bits[i] & 0x7fffffffu);
  return largest < 0x7f800000u;
}
FT_CPU_CLONES FT_VECTORISED static bool scan_finite64(const uint64_t* bits, int64_t n) {
  uint64_t largest = 0;
  for (int64_t i = 0; i < n; ++i) largest = std::max<uint64_t>(largest, bits[i] & 0x7fffffffffffffffull);
  return largest < 0x7ff0000000000000ull;
}

bool finite(const at::Tensor& t) {
  const int bytes = t.element_size();
  if (!t.is_contiguous() || (bytes > 2 && t.numel() > kScanElements)) {
    return std::isfinite(t.sum(t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat).item<double>());
  }
  const void* data = t.const_data_ptr();
  const uint16_t exponent = t.scalar_type() == at::kHalf ? 0x7c00 : 0x7f80;  // fp16's, bf16's
  auto scan = [&](int64_t begin, int64_t end) {
    if (bytes == 2) return scan_finite16(static_cast<const uint16_t*>(data) + begin, end - begin, exponent);
    if (bytes == 4) return scan_finite32(static_cast<const uint32_t*>(data) + begin, end - begin);
    return scan_finite64(static_cast<const uint64_t*>(data) + begin, end - begin);
  };
  if (t.numel() <= kScanElements) return scan(0, t.numel());
  std::atomic<bool> ok{true};
  at::parallel_for(0, t.numel(), kScanElements, [&](int64_t begin, int64_t end) {
    if (!scan(begin, end)) ok = false;
  });
  return ok;
}

// The fp32 bit patterns x[0, n) hold no NaN, no Inf and no zero (of either sign): with the sign cleared, the smallest
// lies above 0 and the largest below the all-ones exponent. Vectorised and cloned as the scans above.
FT_CPU_CLONES FT_VECTORISED static bool scan_nonzero_finite32(const uint32_t* bits, int64_t n) {
  uint32_t smallest = 0x7fffffffu, largest = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t magnitude = bits[i] & 0x7fffffffu;
    smallest = std::min(smallest, magnitude);
    largest = std::max(largest, magnitude);
  }
  return smallest > 0 && largest < 0x7f800000u;
}

// Whether torch's kernel computed every row from finite scores, judged by its LSE (fp32, any layout of dense
// memory) instead of a scan of q (or k), which is the LSE's head dim times larger. A NaN or Inf anywhere in a query
// row makes every score of that row NaN or infinite; a NaN in a key, or an Inf that gives a row's score +inf or
// NaN, does so to that score of every row that sees the key. The kernel then gives each such row a NaN or
// infinite LSE, or treats it as masked out: max 0, sum 1, LSE exactly 0 (tests/test_host.py probes both on the
// torch installed). A square problem has no masked-out row, so every LSE must be finite and not 0. A row whose true
// LSE is 0, or one whose scores overflow, is only a false alarm: the caller then takes the Python path.
bool rows_finite(const at::Tensor& lse) {
  if (lse.scalar_type() != at::kFloat || !lse.is_non_overlapping_and_dense()) {
    return at::logical_and(at::isfinite(lse), at::ne(lse, 0)).all().item().toBool();
  }
  return scan_nonzero_finite32(static_cast<const uint32_t*>(lse.const_data_ptr()), lse.numel());
}

// ---- The CPU's own kernel for small problems -----------------------------------------------------------------

// Up to about a million multiply-adds a head, torch's fused kernel spends much of a call on fixed costs
// (its buffers, its blocking, a GEMM call per block), and its inputs must be scanned for NaN and Inf first. This
// kernel serves those problems whole: flashtile's definition (reference.py), bottom-right causal masks of any
// shape, GQA, fp32/fp64/bf16/fp16 operands of any strides, computed in fp32 (fp64 for fp64). It reads every input
// once, and NaN and Inf take the paths reference.py's rules give them: scores are computed from q and k as they
// are (IEEE arithmetic spreads a NaN to the row that read it), while the products that spread values over other
// rows or keys (P V, dS K, dS^T Q) read a vector holding a NaN or Inf as zeros, as the chunked loop does, and a
// row that sees such a value vector is NaN. So it needs no separate scan.
//
// Each (batch, head) works on its own buffers (its keys and values converted once, then blocks of query rows):
// memory grows with seqlen_k * head_dim, never seqlen_q * seqlen_k. The scores of a block are exact two-pass
// softmax over all the keys its rows see. The products are loops over small fixed tiles that the compiler keeps
// in registers and vectorises (fp contraction on, so multiply-adds fuse), cloned for AVX-512 and AVX2 like the
// scan above.
#if defined(__GNUC__) && !defined(__clang__)
#define FT_KERNEL_OPTIONS __attribute__((optimize("O3", "fp-contract=fast")))
#else
#define FT_KERNEL_OPTIONS
#endif
#if defined(__GNUC__)
#define FT_KERNEL_INLINE inline __attribute__((always_inline)) FT_KERNEL_OPTIONS
#else
#define FT_KERNEL_INLINE inline
#endif

// The CPU kernels' register tiles, written with the compiler's vector types (GCC and Clang) so that every tile
// compiles to the same plain loads, broadcasts and multiply-adds, in vectors of kVectorBytes: the build's choice
// for the machine (host.py's cpu_vector_bytes, which also names the build's folder): 64 with AVX-512, else 32.
// Machines with narrower registers split a wider vector, and tiles sized for 64-byte registers then need more
// registers than AVX2's sixteen (or NEON's thirty-two) hold and spill. Products: with 64-byte vectors
// kWideRows x kWideCols where the columns allow it, else kNarrowRows x kNarrowCols; with 32-byte ones kHalfRows x
// kHalfCols; eight vectors of accumulators each. Key counts and head dims are padded to kNarrowCols.
#ifndef FT_VECTOR_BYTES
#define FT_VECTOR_BYTES 64
#endif
constexpr int64_t kVectorBytes = FT_VECTOR_BYTES;
static_assert(kVectorBytes == 32 || kVectorBytes == 64, "FT_VECTOR_BYTES: 32 or 64");
typedef float FloatVector __attribute__((vector_size(kVectorBytes)));
typedef double DoubleVector __attribute__((vector_size(kVectorBytes)));
template <class Acc>
using VectorOf = std::conditional_t<std::is_same_v<Acc, float>, FloatVector, DoubleVector>;
typedef int32_t FloatIndex __attribute__((vector_size(kVectorBytes)));  // a vector's lanes as integers
typedef int64_t DoubleIndex __attribute__((vector_size(kVectorBytes)));
template <class Acc>
using IndexOf = std::conditional_t<std::is_same_v<Acc, float>, FloatIndex, DoubleIndex>;
constexpr int64_t kWideRows = 4;
constexpr int64_t kWideCols = 32;
constexpr int64_t kNarrowRows = 8;
constexpr int64_t kNarrowCols = 16;
constexpr int64_t kHalfRows = 4;
constexpr int64_t kHalfCols = 16;
constexpr int64_t kPad = kNarrowCols;
constexpr int64_t kBlockRows = 16;   // query rows per block (a multiple of both tiles' rows)
constexpr int64_t kLanes = 16;       // partial sums and maxima per row reduction (a divisor of kPad)
constexpr double kLog2e = 1.4426950408889634;  // scores are kept in base 2: softmax weights are exp2 of them
constexpr double kLn2 = 0.6931471805599453;

inline int64_t padded(int64_t n, int64_t multiple) { return (n + multiple - 1) / multiple * multiple; }

template <class Acc>
FT_KERNEL_INLINE VectorOf<Acc> load_lanes(const Acc* from) {
  VectorOf<Acc> v;
  std::memcpy(&v, from, sizeof(v));
  return v;
}
template <class Acc>
FT_KERNEL_INLINE void store_lanes(Acc* to, const VectorOf<Acc>& v) {
  std::memcpy(to, &v, sizeof(v));
}

// C (rows x cols, ldc) = A (rows x depth, lda) B (depth x cols, ldb), rows a multiple of R, cols of C.
template <int64_t R, int64_t C, class Acc>
FT_KERNEL_INLINE void product_t(const Acc* a, int64_t lda, const Acc* b, int64_t ldb, Acc* c, int64_t ldc,
                                int64_t rows, int64_t depth, int64_t cols) {
  constexpr int64_t kLanesPer = kVectorBytes / sizeof(Acc), kVectors = C / kLanesPer;
  static_assert(C % kLanesPer == 0, "a tile is whole vectors");
  for (int64_t r0 = 0; r0 < rows; r0 += R) {
    for (int64_t c0 = 0; c0 < cols; c0 += C) {
      VectorOf<Acc> tile[R][kVectors] = {};
      for (int64_t e = 0; e < depth; ++e) {
        VectorOf<Acc> line[kVectors];
        for (int64_t n = 0; n < kVectors; ++n) line[n] = load_lanes(b + e * ldb + c0 + n * kLanesPer);
        for (int64_t r = 0; r < R; ++r) {
          const Acc x = a[(r0 + r) * lda + e];
          for (int64_t n = 0; n < kVectors; ++n) tile[r][n] += x * line[n];
        }
      }
      for (int64_t r = 0; r < R; ++r) {
        for (int64_t n = 0; n < kVectors; ++n) store_lanes(c + (r0 + r) * ldc + c0 + n * kLanesPer, tile[r][n]);
      }
    }
  }
}

// C (cols x width, ldc) += A^T B: A (rows x cols, lda), B (rows x width, ldb); cols a multiple of R, width of C.
template <int64_t R, int64_t C, class Acc>
FT_KERNEL_INLINE void product_tn_t(const Acc* a, int64_t lda, const Acc* b, int64_t ldb, Acc* c, int64_t ldc,
                                   int64_t rows, int64_t cols, int64_t width) {
  constexpr int64_t kLanesPer = kVectorBytes / sizeof(Acc), kVectors = C / kLanesPer;
  static_assert(C % kLanesPer == 0, "a tile is whole vectors");
  for (int64_t j0 = 0; j0 < cols; j0 += R) {
    for (int64_t c0 = 0; c0 < width; c0 += C) {
      VectorOf<Acc> tile[R][kVectors];
      for (int64_t j = 0; j < R; ++j) {
        for (int64_t n = 0; n < kVectors; ++n) tile[j][n] = load_lanes(c + (j0 + j) * ldc + c0 + n * kLanesPer);
      }
      for (int64_t r = 0; r < rows; ++r) {
        VectorOf<Acc> line[kVectors];
        for (int64_t n = 0; n < kVectors; ++n) line[n] = load_lanes(b + r * ldb + c0 + n * kLanesPer);
        for (int64_t j = 0; j < R; ++j) {
          const Acc x = a[r * lda + j0 + j];
          for (int64_t n = 0; n < kVectors; ++n) tile[j][n] += x * line[n];
        }
      }
      for (int64_t j = 0; j < R; ++j) {
        for (int64_t n = 0; n < kVectors; ++n) store_lanes(c + (j0 + j) * ldc + c0 + n * kLanesPer, tile[j][n]);
      }
    }
  }
}

// 2^x for x <= 0 (and NaN), in fp32: 2^round(x) by its exponent bits times 2^f, |f| <= 1/2, by its Taylor
// polynomial to degree 7 (truncation below 6e-9 relative). Branch-free, so that the loops calling it vectorise.
// Below 2^-126 (subnormal weights, < 1e-38 of the row's largest) it gives 0, as it does for -inf; NaN stays NaN.
constexpr float kExp2Min = -126.0f;
constexpr float kRoundingShift = 12582912.0f;  // 1.5 * 2^23: adding it rounds a float of |x| < 2^22 to an integer
constexpr int32_t kExponentBias = 127;
constexpr int kMantissaBits = 23;

// Float: float (Bits int32_t), or FloatVector (Bits its lanes' bit patterns), each lane computed as a float is.
template <class Float, class Bits>
FT_KERNEL_INLINE Float exp2_poly(Float x) {
  const Float clamped = x < kExp2Min ? Float{} + kExp2Min : x;
  const Float shifted = clamped + kRoundingShift;
  const Float whole = shifted - kRoundingShift;
  const Float f = clamped - whole;
  Bits shifted_bits;
  int32_t shift_bits;
  std::memcpy(&shifted_bits, &shifted, sizeof(Float));
  std::memcpy(&shift_bits, &kRoundingShift, sizeof(float));
  const Bits power_bits = (shifted_bits - shift_bits + kExponentBias) << kMantissaBits;
  Float power;
  std::memcpy(&power, &power_bits, sizeof(Float));
  const Float g = f * static_cast<float>(kLn2);  // 2^f = e^g
  Float poly = Float{} + 1.0f / 5040.0f;
  poly = poly * g + 1.0f / 720.0f;
  poly = poly * g + 1.0f / 120.0f;
  poly = poly * g + 1.0f / 24.0f;
  poly = poly * g + 1.0f / 6.0f;
  poly = poly * g + 0.5f;
  poly = poly * g + 1.0f;
  poly = poly * g + 1.0f;
  const Float value = poly * power;
  return x < kExp2Min ? Float{} : (x != x ? x : value);
}
FT_KERNEL_INLINE float exp2_of(float x) { return exp2_poly<float, int32_t>(x); }
FT_KERNEL_INLINE double exp2_of(double x) { return std::exp2(x); }
// exp2_of on every lane of a vector.
FT_KERNEL_INLINE FloatVector exp2_lanes(FloatVector x) { return exp2_poly<FloatVector, FloatIndex>(x); }
FT_KERNEL_INLINE DoubleVector exp2_lanes(DoubleVector x) {
  for (int64_t t = 0; t < kVectorBytes / static_cast<int64_t>(sizeof(double)); ++t) x[t] = std::exp2(x[t]);
  return x;
}

// The rows' loops below run kLanes keys a step as kLaneVectors<Acc> vectors, whose lanes keep kLanes partial maxima
// and sums (the same bits whatever the vector width). Key counts are padded to kPad, a multiple of kLanes.
template <class Acc>
constexpr int64_t kLanesPerVector = kVectorBytes / sizeof(Acc);
template <class Acc>
constexpr int64_t kLaneVectors = kLanes / kLanesPerVector<Acc>;
static_assert(kPad % kLanes == 0, "rows are whole steps of kLanes keys");

// Each lane's key within a vector, counted in Acc (exact: rows are far shorter than 2^24 keys).
template <class Acc>
FT_KERNEL_INLINE VectorOf<Acc> lane_keys() {
  VectorOf<Acc> key;
  for (int64_t t = 0; t < kLanesPerVector<Acc>; ++t) key[t] = static_cast<Acc>(t);
  return key;
}

// A row of base-2 scores s[0, width) whose first `visible` keys the row sees, made its softmax weights
// exp2(s - max), 0 past `visible`; returns (max, sum of the weights). A NaN score leaves the max alone but makes
// its weight, and so the sum, NaN.
template <class Acc>
FT_KERNEL_INLINE std::pair<Acc, Acc> softmax_row_t(Acc* s, int64_t visible, int64_t width) {
  using Vector = VectorOf<Acc>;
  constexpr int64_t kPer = kLanesPerVector<Acc>, kVectors = kLaneVectors<Acc>;
  constexpr Acc kMinusInf = -std::numeric_limits<Acc>::infinity();
  const Vector key = lane_keys<Acc>(), last = Vector{} + static_cast<Acc>(visible), minus_inf = Vector{} + kMinusInf;
  Vector lanes[kVectors];
  for (int64_t n = 0; n < kVectors; ++n) lanes[n] = minus_inf;
  for (int64_t j0 = 0; j0 < width; j0 += kLanes) {
    for (int64_t n = 0; n < kVectors; ++n) {
      const int64_t j = j0 + n * kPer;
      const Vector x = key + static_cast<Acc>(j) < last ? load_lanes(s + j) : minus_inf;
      lanes[n] = lanes[n] < x ? x : lanes[n];
    }
  }
  Acc largest = kMinusInf;
  for (int64_t t = 0; t < kLanes; ++t) largest = largest < lanes[t / kPer][t % kPer] ? lanes[t / kPer][t % kPer] : largest;
  Vector sums[kVectors] = {};
  for (int64_t j0 = 0; j0 < width; j0 += kLanes) {
    for (int64_t n = 0; n < kVectors; ++n) {
      const int64_t j = j0 + n * kPer;
      const Vector p = key + static_cast<Acc>(j) < last ? exp2_lanes(load_lanes(s + j) - largest) : Vector{};
      store_lanes(s + j, p);
      sums[n] += p;
    }
  }
  Acc total = 0;
  for (int64_t t = 0; t < kLanes; ++t) total += sums[t / kPer][t % kPer];
  return {largest, total};
}

// The backward's weights and score gradients of a row: p = exp2(s - lse2) and ds = p (dp - delta) over the
// first `visible` keys, both exactly 0 past them (whatever NaN the row holds).
template <class Acc>
FT_KERNEL_INLINE void gradient_row_t(Acc* s, Acc* dp, Acc lse2, Acc delta, int64_t visible, int64_t width) {
  using Vector = VectorOf<Acc>;
  constexpr int64_t kPer = kLanesPerVector<Acc>;
  const Vector key = lane_keys<Acc>(), last = Vector{} + static_cast<Acc>(visible);
  for (int64_t j = 0; j < width; j += kPer) {
    const auto seen = key + static_cast<Acc>(j) < last;
    const Vector p = seen ? exp2_lanes(load_lanes(s + j) - lse2) : Vector{};
    store_lanes(s + j, p);
    store_lanes(dp + j, seen ? p * (load_lanes(dp + j) - delta) : Vector{});
  }
}

// The products with the tile the vectors and the columns allow. The fp32 copies are cloned for the machine (see
// the scan above); fp64 runs the same templates as they are.
template <class Acc>
FT_KERNEL_INLINE void product_any(const Acc* a, int64_t lda, const Acc* b, int64_t ldb, Acc* c, int64_t ldc,
                                  int64_t rows, int64_t depth, int64_t cols) {
  if constexpr (kVectorBytes < 64) {
    product_t<kHalfRows, kHalfCols>(a, lda, b, ldb, c, ldc, rows, depth, cols);
  } else if (cols % kWideCols == 0) {
    product_t<kWideRows, kWideCols>(a, lda, b, ldb, c, ldc, rows, depth, cols);
  } else {
    product_t<kNarrowRows, kNarrowCols>(a, lda, b, ldb, c, ldc, rows, depth, cols);
  }
}
template <class Acc>
FT_KERNEL_INLINE void product_tn_any(const Acc* a, int64_t lda, const Acc* b, int64_t ldb, Acc* c, int64_t ldc,
                                     int64_t rows, int64_t cols, int64_t width) {
  if constexpr (kVectorBytes < 64) {
    product_tn_t<kHalfRows, kHalfCols>(a, lda, b, ldb, c, ldc, rows, cols, width);
  } else if (width % kWideCols == 0) {
    product_tn_t<kWideRows, kWideCols>(a, lda, b, ldb, c, ldc, rows, cols, width);
  } else {
    product_tn_t<kNarrowRows, kNarrowCols>(a, lda, b, ldb, c, ldc, rows, cols, width);
  }
}
FT_CPU_CLONES FT_KERNEL_OPTIONS static void product(const float* a, int64_t lda, const float* b, int64_t ldb,
                                                    float* c, int64_t ldc, int64_t rows, int64_t depth, int64_t cols) {
  product_any(a, lda, b, ldb, c, ldc, rows, depth, cols);
}
static void product(const double* a, int64_t lda, const double* b, int64_t ldb, double* c, int64_t ldc, int64_t rows,
                    int64_t depth, int64_t cols) {
  product_any(a, lda, b, ldb, c, ldc, rows, depth, cols);
}
FT_CPU_CLONES FT_KERNEL_OPTIONS static void product_tn(const float* a, int64_t lda, const float* b, int64_t ldb,
                                                       float* c, int64_t ldc, int64_t rows, int64_t cols,
                                                       int64_t width) {
  product_tn_any(a, lda, b, ldb, c, ldc, rows, cols, width);
}
static void product_tn(const double* a, int64_t lda, const double* b, int64_t ldb, double* c, int64_t ldc,
                       int64_t rows, int64_t cols, int64_t width) {
  product_tn_any(a, lda, b, ldb, c, ldc, rows, cols, width);
}

// The dot product of two vectors of n elements (n a multiple of kLanes), in kLanes partial sums: one chain of n
// dependent adds would take longer than the products around it.
template <class Acc>
FT_KERNEL_INLINE Acc row_dot_t(const Acc* a, const Acc* b, int64_t n) {
  Acc lanes[kLanes] = {};
  for (int64_t e0 = 0; e0 < n; e0 += kLanes) {
    for (int64_t t = 0; t < kLanes; ++t) lanes[t] += a[e0 + t] * b[e0 + t];
  }
  Acc total = 0;
  for (int64_t t = 0; t < kLanes; ++t) total += lanes[t];
  return total;
}
FT_CPU_CLONES FT_KERNEL_OPTIONS static float row_dot(const float* a, const float* b, int64_t n) {
  return row_dot_t(a, b, n);
}
static double row_dot(const double* a, const double* b, int64_t n) { return row_dot_t(a, b, n); }

// softmax_row_t and gradient_row_t over the first `rows` rows of a block (row r at s + r * ld), `visible[r]`
// keys each: one call a block.
template <class Acc>
FT_KERNEL_INLINE void softmax_block_t(Acc* s, int64_t ld, int64_t rows, const int64_t* visible, int64_t width,
                                      Acc* largest, Acc* total) {
  for (int64_t r = 0; r < rows; ++r) {
    std::tie(largest[r], total[r]) = softmax_row_t(s + r * ld, visible[r], width);
  }
}
template <class Acc>
FT_KERNEL_INLINE void gradient_block_t(Acc* s, Acc* dp, int64_t ld, int64_t rows, const Acc* lse2, const Acc* delta,
                                       const int64_t* visible, int64_t width) {
  for (int64_t r = 0; r < rows; ++r) {
    gradient_row_t(s + r * ld, dp + r * ld, lse2[r], delta[r], visible[r], width);
  }
}
FT_CPU_CLONES FT_KERNEL_OPTIONS static void softmax_block(float* s, int64_t ld, int64_t rows, const int64_t* visible,
                                                          int64_t width, float* largest, float* total) {
  softmax_block_t(s, ld, rows, visible, width, largest, total);
}
static void softmax_block(double* s, int64_t ld, int64_t rows, const int64_t* visible, int64_t width, double* largest,
                          double* total) {
  softmax_block_t(s, ld, rows, visible, width, largest, total);
}
FT_CPU_CLONES FT_KERNEL_OPTIONS static void gradient_block(float* s, float* dp, int64_t ld, int64_t rows,
                                                           const float* lse2, const float* delta,
                                                           const int64_t* visible, int64_t width) {
  gradient_block_t(s, dp, ld, rows, lse2, delta, visible, width);
}
static void gradient_block(double* s, double* dp, int64_t ld, int64_t rows, const double* lse2, const double* delta,
                           const int64_t* visible, int64_t width) {
  gradient_block_t(s, dp, ld, rows, lse2, delta, visible, width);
}

// A (batch, seqlen, heads, dim) operand read through its strides.
template <class In>
struct Operand {
  const In* data;
  int64_t sb, ss, sh, sd;
  explicit Operand(const at::Tensor& t)
      : data(t.const_data_ptr<In>()), sb(t.stride(0)), ss(t.stride(1)), sh(t.stride(2)), sd(t.stride(3)) {}
  const In* at(int64_t b, int64_t s, int64_t h) const { return data + b * sb + s * ss + h * sh; }
};

// (batch, heads, seqlen) per-row values (the LSE, its gradient) read through their strides, as Acc.
struct RowValues {
  const at::Tensor* t;
  int64_t sb = 0, sh = 0, ss = 0;
  explicit RowValues(const at::Tensor& x) : t(&x) {
    if (x.defined()) sb = x.stride(0), sh = x.stride(1), ss = x.stride(2);
  }
  template <class Acc>
  Acc at(int64_t b, int64_t h, int64_t s) const {
    const int64_t i = b * sb + h * sh + s * ss;
    return t->scalar_type() == at::kDouble ? static_cast<Acc>(t->const_data_ptr<double>()[i])
                                           : static_cast<Acc>(t->const_data_ptr<float>()[i]);
  }
};

// Whether x[0, n) holds no NaN or Inf: with the sign cleared, the largest bit pattern lies below the all-ones
// exponent (an integer max, which vectorises, as in the scan above).
template <class Acc>
FT_KERNEL_INLINE bool finite_values_t(const Acc* x, int64_t n) {
  using Bits = std::conditional_t<sizeof(Acc) == sizeof(uint32_t), uint32_t, uint64_t>;
  constexpr Bits kMagnitude = ~Bits(0) >> 1;
  constexpr Bits kExponent = sizeof(Acc) == sizeof(uint32_t) ? Bits(0x7f800000u) : Bits(0x7ff0000000000000ull);
  Bits largest = 0;
  for (int64_t e = 0; e < n; ++e) {
    Bits bits;
    std::memcpy(&bits, x + e, sizeof(Bits));
    largest = std::max<Bits>(largest, bits & kMagnitude);
  }
  return largest < kExponent;
}
FT_CPU_CLONES FT_KERNEL_OPTIONS static bool finite_values(const float* x, int64_t n) { return finite_values_t(x, n); }
static bool finite_values(const double* x, int64_t n) { return finite_values_t(x, n); }

// Copy vector x (n elements, stride sd) to `to` as Acc.
template <class In, class Acc>
FT_KERNEL_INLINE void load_vector(const In* x, int64_t sd, int64_t n, Acc* to) {
  if (sd == 1) {
    for (int64_t e = 0; e < n; ++e) to[e] = static_cast<Acc>(x[e]);
  } else {
    for (int64_t e = 0; e < n; ++e) to[e] = static_cast<Acc>(x[e * sd]);
  }
}

// Zero the vectors (rows of `dim` elements, ld apart) of `from` that hold a NaN or Inf, into `to` (which may be
// `from`); the first such row (`count` if none). One check of the whole block first: almost always it is clean.
template <class Acc>
int64_t zero_nonfinite_rows(const Acc* from, Acc* to, int64_t ld, int64_t count, int64_t dim) {
  if (finite_values(from, count * ld)) {
    if (to != from) std::copy(from, from + count * ld, to);
    return count;
  }
  int64_t first = count;
  for (int64_t j = 0; j < count; ++j) {
    const bool ok = finite_values(from + j * ld, dim);
    if (!ok) first = std::min(first, j);
    if (!ok) {
      std::fill(to + j * ld, to + j * ld + dim, Acc(0));
    } else if (to != from) {
      std::copy(from + j * ld, from + j * ld + dim, to + j * ld);
    }
  }
  return first;
}

// One problem's shape and the keys a query row sees (the first `visible(i)`: causal masks are bottom-right
// aligned, so row i sees keys j <= i + seqlen_k - seqlen_q).
struct Shape {
  int64_t batch, seqlen_q, seqlen_k, heads_q, heads_kv, dim, group, keys_padded, dim_padded;
  bool causal;
  Shape(const at::Tensor& q, const at::Tensor& k, bool causal)
      : batch(q.size(0)), seqlen_q(q.size(1)), seqlen_k(k.size(1)), heads_q(q.size(2)), heads_kv(k.size(2)),
        dim(q.size(3)), group(q.size(2) / k.size(2)), keys_padded(padded(k.size(1), kPad)),
        dim_padded(padded(q.size(3), kPad)), causal(causal) {}
  int64_t visible(int64_t row) const {
    if (!causal) return seqlen_k;
    return std::clamp<int64_t>(row + seqlen_k - seqlen_q + 1, 0, seqlen_k);
  }
};

// to[e * ld_to + j] = from[j * ld_from + e] for j < count, e < dim: a transpose by tiles of kPad rows, so
// that the stores run along `to`'s rows (one at a time down its columns, they cost more than the products).
template <class Acc>
FT_KERNEL_INLINE void transpose(const Acc* from, int64_t ld_from, int64_t count, int64_t dim, Acc* to, int64_t ld_to) {
  for (int64_t j0 = 0; j0 < count; j0 += kPad) {
    const int64_t n = std::min(kPad, count - j0);
    for (int64_t e = 0; e < dim; ++e) {
      for (int64_t j = 0; j < n; ++j) to[e * ld_to + j0 + j] = from[(j0 + j) * ld_from + e];
    }
  }
}

// One (batch, kv head)'s keys and values as the products read them: K^T (dim x keys_padded) as given, and the
// vectors with a NaN or Inf zeroed, K and V (keys_padded x dim_padded) and V^T; the first key whose value vector
// was zeroed (seqlen_k if none). The buffers are made (zero, so padding is zero) once per thread; each load
// writes every element that is not padding.
template <class Acc>
struct KeysValues {
  std::vector<Acc> k_rows, k_t, k_finite, v_finite, v_finite_t;
  const Acc* k_finite_rows = nullptr;  // k_rows where every key is finite (no copy), else k_finite
  int64_t first_bad_v = 0;

  KeysValues(const Shape& p, bool backward)
      : k_rows(p.keys_padded * p.dim_padded), k_t(p.dim * p.keys_padded), v_finite(p.keys_padded * p.dim_padded) {
    if (backward) {
      k_finite.resize(p.keys_padded * p.dim_padded);
      v_finite_t.resize(p.dim * p.keys_padded);
    }
  }

  template <class In>
  FT_KERNEL_INLINE void load(const Shape& p, const Operand<In>& k, const Operand<In>& v, int64_t b, int64_t hk) {
    for (int64_t j = 0; j < p.seqlen_k; ++j) {
      load_vector(k.at(b, j, hk), k.sd, p.dim, k_rows.data() + j * p.dim_padded);
      load_vector(v.at(b, j, hk), v.sd, p.dim, v_finite.data() + j * p.dim_padded);
    }
    first_bad_v = zero_nonfinite_rows(v_finite.data(), v_finite.data(), p.dim_padded, p.seqlen_k, p.dim);
    transpose(k_rows.data(), p.dim_padded, p.seqlen_k, p.dim, k_t.data(), p.keys_padded);
    if (!k_finite.empty()) {
      const bool k_clean = finite_values(k_rows.data(), p.seqlen_k * p.dim_padded);
      k_finite_rows = k_clean ? k_rows.data() : k_finite.data();
      if (!k_clean) zero_nonfinite_rows(k_rows.data(), k_finite.data(), p.dim_padded, p.seqlen_k, p.dim);
      transpose(v_finite.data(), p.dim_padded, p.seqlen_k, p.dim, v_finite_t.data(), p.keys_padded);
    }
  }
};

// Work items below this many multiply-adds run on one thread: parallel_for's wake-up costs more than they take.
constexpr int64_t kParallelWork = int64_t{1} << 17;

// The work items [first, last) of own_forward_typed (and below, own_backward_typed): inline bodies, so that the
// copies for each input type, cloned for the machine like the products (fp64's not: gradcheck's type), vectorise
// their copies and conversions too.
template <class In, class Acc>
struct ForwardWork {
  const Shape& p;
  const Operand<In>& q;
  const Operand<In>& k;
  const Operand<In>& v;
  In* out_data;
  float* lse_data;
  Acc q_factor;
};

template <class In, class Acc>
FT_KERNEL_INLINE void forward_items_t(const ForwardWork<In, Acc>& w, int64_t first, int64_t last) {
  const Shape& p = w.p;
  const Operand<In>& q = w.q;
  const Operand<In>& k = w.k;
  const Operand<In>& v = w.v;
  In* out_data = w.out_data;
  float* lse_data = w.lse_data;
  const Acc q_factor = w.q_factor;
  KeysValues<Acc> kv(p, false);
  std::vector<Acc> q_block(kBlockRows * p.dim_padded), scores(kBlockRows * p.keys_padded),
      o_block(kBlockRows * p.dim_padded);
  int64_t loaded = -1;  // the (batch, kv head) whose keys kv holds
  for (int64_t item = first; item < last; ++item) {
    const int64_t b = item / p.heads_q, h = item % p.heads_q, hk = h / p.group;
    if (b * p.heads_kv + hk != loaded) {
      kv.load(p, k, v, b, hk);
      loaded = b * p.heads_kv + hk;
    }
    for (int64_t r0 = 0; r0 < p.seqlen_q; r0 += kBlockRows) {
      const int64_t rows = std::min(kBlockRows, p.seqlen_q - r0);
      const int64_t tile_rows = padded(rows, kNarrowRows);  // what the products compute: few padding rows
      const int64_t keys = p.visible(r0 + rows - 1);
      const int64_t keys_padded = padded(keys, kPad);
      std::fill(q_block.begin() + rows * p.dim_padded, q_block.end(), Acc(0));  // past the last row
      for (int64_t r = 0; r < rows; ++r) {
        Acc* line = q_block.data() + r * p.dim_padded;
        load_vector(q.at(b, r0 + r, h), q.sd, p.dim, line);
        for (int64_t e = 0; e < p.dim; ++e) line[e] *= q_factor;
      }
      if (keys_padded) {
        product(q_block.data(), p.dim_padded, kv.k_t.data(), p.keys_padded, scores.data(), p.keys_padded,
                tile_rows, p.dim, keys_padded);
      }
      Acc largest[kBlockRows], total[kBlockRows];
      int64_t visible[kBlockRows];
      for (int64_t r = 0; r < tile_rows; ++r) visible[r] = r < rows ? p.visible(r0 + r) : 0;
      softmax_block(scores.data(), p.keys_padded, tile_rows, visible, keys_padded, largest, total);
      if (keys_padded) {
        product(scores.data(), p.keys_padded, kv.v_finite.data(), p.dim_padded, o_block.data(), p.dim_padded,
                tile_rows, keys_padded, p.dim_padded);
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t i = r0 + r, visible = p.visible(i);
        In* o = out_data + ((b * p.seqlen_q + i) * p.heads_q + h) * p.dim;
        float& row_lse = lse_data[(b * p.heads_q + h) * p.seqlen_q + i];
        if (visible == 0) {
          std::fill(o, o + p.dim, static_cast<In>(0));
          row_lse = -std::numeric_limits<float>::infinity();
          continue;
        }
        const Acc base2 = largest[r] + std::log2(total[r]);
        row_lse = std::isfinite(base2) ? static_cast<float>(base2 * kLn2) : std::numeric_limits<float>::quiet_NaN();
        const Acc inverse = Acc(1) / total[r];
        const Acc* line = o_block.data() + r * p.dim_padded;
        if (kv.first_bad_v < visible) {
          std::fill(o, o + p.dim, static_cast<In>(std::numeric_limits<float>::quiet_NaN()));
        } else {
          for (int64_t e = 0; e < p.dim; ++e) o[e] = static_cast<In>(line[e] * inverse);
        }
      }
    }
  }
}
FT_CPU_CLONES FT_KERNEL_OPTIONS static void forward_items(const ForwardWork<float, float>& w, int64_t first,
                                                          int64_t last) {
  forward_items_t(w, first, last);
}
FT_CPU_CLONES FT_KERNEL_OPTIONS static void forward_items(const ForwardWork<c10::BFloat16, float>& w, int64_t first,
                                                          int64_t last) {
  forward_items_t(w, first, last);
}
FT_CPU_CLONES FT_KERNEL_OPTIONS static void forward_items(const ForwardWork<c10::Half, float>& w, int64_t first,
                                                          int64_t last) {
  forward_items_t(w, first, last);
}
FT_KERNEL_OPTIONS static void forward_items(const ForwardWork<double, double>& w, int64_t first, int64_t last) {
  forward_items_t(w, first, last);
}

template <class In, class Acc>
FT_KERNEL_OPTIONS void own_forward_typed(const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_, double scale,
                                         bool causal, at::Tensor& out, at::Tensor& lse) {
  const Shape p(q_, k_, causal);
  const Operand<In> q(q_), k(k_), v(v_);
  In* out_data = out.data_ptr<In>();
  float* lse_data = lse.data_ptr<float>();
  const Acc q_factor = static_cast<Acc>(scale * kLog2e);
  const int64_t items = p.batch * p.heads_q;
  const int64_t item_work = std::max<int64_t>(1, p.seqlen_q * p.seqlen_k * p.dim * 2);
  at::parallel_for(0, items, std::max<int64_t>(1, kParallelWork / item_work), [&](int64_t first, int64_t last) {
    forward_items(ForwardWork<In, Acc>{p, q, k, v, out_data, lse_data, q_factor}, first, last);
  });
}

template <class In, class Acc>
struct BackwardWork {
  const Shape& p;
  const Operand<In>& q;
  const Operand<In>& k;
  const Operand<In>& v;
  const Operand<In>& dout;
  const Operand<In>& out;
  const RowValues& lse;
  const RowValues& dlse;
  bool with_dlse;
  In* dq_data;
  In* dk_data;
  In* dv_data;
  Acc q_factor, grad_scale;
};

template <class In, class Acc>
FT_KERNEL_INLINE void backward_items_t(const BackwardWork<In, Acc>& w, int64_t first, int64_t last) {
  const Shape& p = w.p;
  const Operand<In>& q = w.q;
  const Operand<In>& k = w.k;
  const Operand<In>& v = w.v;
  const Operand<In>& dout = w.dout;
  const Operand<In>& out = w.out;
  const RowValues& lse = w.lse;
  const RowValues& dlse = w.dlse;
  In* dq_data = w.dq_data;
  In* dk_data = w.dk_data;
  In* dv_data = w.dv_data;
  const Acc q_factor = w.q_factor, grad_scale = w.grad_scale;
  const Acc log2e = static_cast<Acc>(kLog2e), inf = std::numeric_limits<Acc>::infinity();
  KeysValues<Acc> kv(p, true);
  std::vector<Acc> q_block(kBlockRows * p.dim_padded), q_finite(kBlockRows * p.dim_padded),
      dout_block(kBlockRows * p.dim_padded), dq_block(kBlockRows * p.dim_padded), out_line(p.dim_padded),
      weights(kBlockRows * p.keys_padded), grads(kBlockRows * p.keys_padded),
      dk_acc(p.keys_padded * p.dim_padded), dv_acc(p.keys_padded * p.dim_padded);
  for (int64_t item = first; item < last; ++item) {
    const int64_t b = item / p.heads_kv, hk = item % p.heads_kv;
    kv.load(p, k, v, b, hk);
    std::fill(dk_acc.begin(), dk_acc.end(), Acc(0));
    std::fill(dv_acc.begin(), dv_acc.end(), Acc(0));
    for (int64_t h = hk * p.group; h < (hk + 1) * p.group; ++h) {
      for (int64_t r0 = 0; r0 < p.seqlen_q; r0 += kBlockRows) {
        const int64_t rows = std::min(kBlockRows, p.seqlen_q - r0);
        const int64_t tile_rows = padded(rows, kNarrowRows);
        const int64_t keys_padded = padded(p.visible(r0 + rows - 1), kPad);
        if (keys_padded == 0) {  // no row of the block sees a key: dq is 0
          for (int64_t r = 0; r < rows; ++r) {
            In* dq_line = dq_data + ((b * p.seqlen_q + r0 + r) * p.heads_q + h) * p.dim;
            std::fill(dq_line, dq_line + p.dim, static_cast<In>(0));
          }
          continue;
        }
        for (auto* block : {&q_block, &q_finite, &dout_block}) {  // past the last row
          std::fill(block->begin() + rows * p.dim_padded, block->end(), Acc(0));
        }
        Acc lse2[kBlockRows], delta[kBlockRows];
        for (int64_t r = 0; r < tile_rows; ++r) {
          if (r >= rows) {
            lse2[r] = inf;
            delta[r] = 0;
            continue;
          }
          const int64_t i = r0 + r;
          Acc* q_line = q_block.data() + r * p.dim_padded;
          Acc* q_finite_line = q_finite.data() + r * p.dim_padded;
          load_vector(q.at(b, i, h), q.sd, p.dim, q_finite_line);
          for (int64_t e = 0; e < p.dim; ++e) q_line[e] = q_finite_line[e] * q_factor;
          Acc* dout_line = dout_block.data() + r * p.dim_padded;
          load_vector(dout.at(b, i, h), dout.sd, p.dim, dout_line);
          load_vector(out.at(b, i, h), out.sd, p.dim, out_line.data());
          Acc d = row_dot(dout_line, out_line.data(), p.dim_padded);
          if (w.with_dlse) d -= dlse.at<Acc>(b, h, i);
          delta[r] = d;
          const Acc row_lse = lse.at<Acc>(b, h, i);
          lse2[r] = row_lse == -inf ? inf : row_lse * log2e;  // a row that sees no key: every weight 0
        }
        zero_nonfinite_rows(q_finite.data(), q_finite.data(), p.dim_padded, rows, p.dim);
        product(q_block.data(), p.dim_padded, kv.k_t.data(), p.keys_padded, weights.data(), p.keys_padded,
                tile_rows, p.dim, keys_padded);
        product(dout_block.data(), p.dim_padded, kv.v_finite_t.data(), p.keys_padded, grads.data(), p.keys_padded,
                tile_rows, p.dim, keys_padded);
        int64_t visible[kBlockRows];
        for (int64_t r = 0; r < tile_rows; ++r) visible[r] = r < rows ? p.visible(r0 + r) : 0;
        gradient_block(weights.data(), grads.data(), p.keys_padded, tile_rows, lse2, delta, visible, keys_padded);
        product_tn(weights.data(), p.keys_padded, dout_block.data(), p.dim_padded, dv_acc.data(), p.dim_padded,
                   rows, keys_padded, p.dim_padded);
        product_tn(grads.data(), p.keys_padded, q_finite.data(), p.dim_padded, dk_acc.data(), p.dim_padded,
                   rows, keys_padded, p.dim_padded);
        product(grads.data(), p.keys_padded, kv.k_finite_rows, p.dim_padded, dq_block.data(), p.dim_padded,
                tile_rows, keys_padded, p.dim_padded);
        for (int64_t r = 0; r < rows; ++r) {
          In* dq_line = dq_data + ((b * p.seqlen_q + r0 + r) * p.heads_q + h) * p.dim;
          const Acc* line = dq_block.data() + r * p.dim_padded;
          for (int64_t e = 0; e < p.dim; ++e) dq_line[e] = static_cast<In>(line[e] * grad_scale);
        }
      }
    }
    for (int64_t j = 0; j < p.seqlen_k; ++j) {
      In* dk_line = dk_data + ((b * p.seqlen_k + j) * p.heads_kv + hk) * p.dim;
      In* dv_line = dv_data + ((b * p.seqlen_k + j) * p.heads_kv + hk) * p.dim;
      const Acc* dk_from = dk_acc.data() + j * p.dim_padded;
      const Acc* dv_from = dv_acc.data() + j * p.dim_padded;
      for (int64_t e = 0; e < p.dim; ++e) {
        dk_line[e] = static_cast<In>(dk_from[e] * grad_scale);
        dv_line[e] = static_cast<In>(dv_from[e]);
      }
    }
  }
}
FT_CPU_CLONES FT_KERNEL_OPTIONS static void backward_items(const BackwardWork<float, float>& w, int64_t first,
                                                           int64_t last) {
  backward_items_t(w, first, last);
}
FT_CPU_CLONES FT_KERNEL_OPTIONS static void backward_items(const BackwardWork<c10::BFloat16, float>& w,
                                                           int64_t first, int64_t last) {
  backward_items_t(w, first, last);
}
FT_CPU_CLONES FT_KERNEL_OPTIONS static void backward_items(const BackwardWork<c10::Half, float>& w, int64_t first,
                                                           int64_t last) {
  backward_items_t(w, first, last);
}
FT_KERNEL_OPTIONS static void backward_items(const BackwardWork<double, double>& w, int64_t first, int64_t last) {
  backward_items_t(w, first, last);
}

template <class In, class Acc>
FT_KERNEL_OPTIONS void own_backward_typed(const at::Tensor& dout_, const at::Tensor& q_, const at::Tensor& k_,
                                          const at::Tensor& v_, const at::Tensor& out_, const at::Tensor& lse_,
                                          const at::Tensor& dlse_, double scale, bool causal, at::Tensor& dq,
                                          at::Tensor& dk, at::Tensor& dv) {
  const Shape p(q_, k_, causal);
  const Operand<In> q(q_), k(k_), v(v_), dout(dout_), out(out_);
  const RowValues lse(lse_), dlse(dlse_);
  In* dq_data = dq.data_ptr<In>();
  In* dk_data = dk.data_ptr<In>();
  In* dv_data = dv.data_ptr<In>();
  const Acc q_factor = static_cast<Acc>(scale * kLog2e), grad_scale = static_cast<Acc>(scale);
  const int64_t items = p.batch * p.heads_kv;
  const int64_t item_work = std::max<int64_t>(1, p.group * p.seqlen_q * p.seqlen_k * p.dim * 4);
  at::parallel_for(0, items, std::max<int64_t>(1, kParallelWork / item_work), [&](int64_t first, int64_t last) {
    const BackwardWork<In, Acc> work{p,   q,    k,    v,    dout, out, lse, dlse, dlse_.defined(),
                                     dq_data, dk_data, dv_data, q_factor, grad_scale};
    backward_items(work, first, last);
  });
}

// ---- The own kernel's decode path: few query rows per kv head, K and V read where they lie ---------------------

// Decoding shapes (a few queries a head over many keys) gain nothing from the small-problem path's per-head copies
// of K and V: each copied element is read once. This path reads K and V in place, tile by tile of
// kDecodeTileKeys(Acc) keys (converted into a small buffer where the operand is bf16/fp16, strided along the head
// dim, or its head dim needs padding), for all the query rows of a (batch, kv head) at once: its group's query
// heads times seqlen_q, which share every tile. Keys split further into parts where (batch, kv head) pairs are
// too few for the threads (flash-decoding's split-K): each part keeps its rows' running max, sum and output, and a
// second pass merges them. NaN and Inf follow reference.py's rule as on the small-problem path, without a scan:
// scores come from q and k as they are, so a NaN or Inf reaches the rows that read it; a row's output is the sum
// of its weights times the value vectors it sees, and only those (the products stop at each row's last key), so
// a value vector with a NaN or Inf makes a non-finite element in exactly the rows that see it, which then become
// NaN whole. The backward reads a non-finite key vector as zeros in dS K, and a non-finite query row as zeros in
// dS^T Q, as the chunked loop does.

// Query rows and keys are dot products here (K lies with the head dim contiguous): each row's products with a
// tile of keys accumulate in one vector per key, the lanes splitting the head dim; `sum_lanes` then adds every
// vector's lanes at once, by a butterfly of two-vector shuffles that halves the lanes a key holds and doubles the
// keys a vector holds, until lane j holds key j's sum. So a tile is one vector's lanes of keys.
template <class Acc>
constexpr int64_t kDecodeTileKeys = kVectorBytes / sizeof(Acc);

// The vector whose lane t is lane Lane::of(t) of x and y side by side (x's lanes first, then y's).
template <class Acc, class Lane, size_t... T>
FT_KERNEL_INLINE VectorOf<Acc> shuffle_pair(const VectorOf<Acc>& x, const VectorOf<Acc>& y,
                                            std::index_sequence<T...>) {
#if defined(__clang__)
  return __builtin_shufflevector(x, y, Lane::of(T)...);
#else
  return __builtin_shuffle(x, y, IndexOf<Acc>{Lane::of(T)...});
#endif
}

// One half of a fold of x and y, whose keys hold `Width` lanes each: the result's first half of lanes takes x's
// keys, its second y's, each key now `Width / 2` lanes wide; the lower half of every key's lanes, or (High) the
// upper half.
template <class Acc, int64_t Width, bool High>
struct FoldLane {
  static constexpr int of(size_t t) {
    constexpr int64_t lanes = kDecodeTileKeys<Acc>, half = Width / 2;
    const int64_t from_y = static_cast<int64_t>(t) >= lanes / 2 ? 1 : 0;
    const int64_t u = static_cast<int64_t>(t) - from_y * (lanes / 2);
    return static_cast<int>(from_y * lanes + u / half * Width + u % half + (High ? half : 0));
  }
};

// x[0, Width) hold Width keys of Width lanes each (a key's sum is the sum of its lanes): fold pairs until x[0]
// holds every key's sum, key j in lane j.
template <class Acc, int64_t Width>
FT_KERNEL_INLINE void sum_lanes(VectorOf<Acc>* x) {
  constexpr auto lanes = std::make_index_sequence<kDecodeTileKeys<Acc>>();
  for (int64_t i = 0; i < Width / 2; ++i) {
    x[i] = shuffle_pair<Acc, FoldLane<Acc, Width, false>>(x[2 * i], x[2 * i + 1], lanes) +
           shuffle_pair<Acc, FoldLane<Acc, Width, true>>(x[2 * i], x[2 * i + 1], lanes);
  }
  if constexpr (Width > 2) sum_lanes<Acc, Width / 2>(x);
}

// The products take the rows of a (batch, kv head) kDecodeRowTile at a time, padded to that, except one or two
// rows (MHA decoding), which take tiles of their own height.
constexpr int64_t kDecodeRowTile = 4;

inline int64_t decode_rows_padded(int64_t rows) { return rows <= 2 ? rows : padded(rows, kDecodeRowTile); }

// s[r * lds + j] = a_r . keys[j] for r < rows (a multiple of R) and every key of the tile, over dim elements (a
// multiple of the vector's lanes): R rows at a time with lanes / R keys, so that one fold sums them all and each
// loaded vector serves R rows or lanes / R keys.
template <int64_t R, class Acc>
FT_KERNEL_INLINE void tile_dots_t(const Acc* a, int64_t lda, int64_t rows, const Acc* const* keys, int64_t dim,
                                  Acc* s, int64_t lds) {
  constexpr int64_t kLanesPer = kDecodeTileKeys<Acc>, kKeysPer = kLanesPer / R;
  static_assert(kKeysPer * R == kLanesPer, "a fold sums R rows of kKeysPer keys");
  for (int64_t r0 = 0; r0 < rows; r0 += R) {
    for (int64_t j0 = 0; j0 < kLanesPer; j0 += kKeysPer) {
      VectorOf<Acc> sums[kLanesPer] = {};
      for (int64_t e0 = 0; e0 < dim; e0 += kLanesPer) {
        VectorOf<Acc> x[R];
        for (int64_t r = 0; r < R; ++r) x[r] = load_lanes(a + (r0 + r) * lda + e0);
        for (int64_t j = 0; j < kKeysPer; ++j) {
          const VectorOf<Acc> y = load_lanes(keys[j0 + j] + e0);
          for (int64_t r = 0; r < R; ++r) sums[r * kKeysPer + j] += x[r] * y;
        }
      }
      sum_lanes<Acc, kLanesPer>(sums);
      Acc lanes[kLanesPer];
      std::memcpy(lanes, &sums[0], sizeof(lanes));
      for (int64_t r = 0; r < R; ++r) {
        std::memcpy(s + (r0 + r) * lds + j0, lanes + r * kKeysPer, sizeof(Acc) * kKeysPer);
      }
    }
  }
}

// One stage of a tile's transpose in registers: of x and y (vectors H lanes apart in the stage's pairing), the
// first (or, Second, the second) of the pair with their off-diagonal blocks of H lanes swapped. After the stages
// H = lanes / 2, ..., 1, vector i holds lane i of every input vector.
template <class Acc, int64_t H, bool Second>
struct SwapLane {
  static constexpr int of(size_t t) {
    constexpr int64_t lanes = kDecodeTileKeys<Acc>;
    const int64_t u = static_cast<int64_t>(t);
    if ((u & H) == 0) return static_cast<int>(Second ? u + H : u);
    return static_cast<int>(Second ? lanes + u : lanes + u - H);
  }
};

template <class Acc, int64_t H>
FT_KERNEL_INLINE void transpose_stage(VectorOf<Acc>* x) {
  constexpr auto lanes = std::make_index_sequence<kDecodeTileKeys<Acc>>();
  for (int64_t i = 0; i < kDecodeTileKeys<Acc>; ++i) {
    if (i & H) continue;
    const VectorOf<Acc> a = x[i], b = x[i + H];
    x[i] = shuffle_pair<Acc, SwapLane<Acc, H, false>>(a, b, lanes);
    x[i + H] = shuffle_pair<Acc, SwapLane<Acc, H, true>>(a, b, lanes);
  }
  if constexpr (H > 1) transpose_stage<Acc, H / 2>(x);
}

// keys_t[e * lanes + j] = keys[j][e] for the tile's keys j and e < dim (a multiple of the lanes): a lanes x lanes
// block at a time, in registers (log2(lanes) stages of a two-vector shuffle per vector).
template <class Acc>
FT_KERNEL_INLINE void transpose_tile(const Acc* const* keys, int64_t dim, Acc* keys_t) {
  constexpr int64_t kLanesPer = kDecodeTileKeys<Acc>;
  for (int64_t e0 = 0; e0 < dim; e0 += kLanesPer) {
    VectorOf<Acc> x[kLanesPer];
    for (int64_t j = 0; j < kLanesPer; ++j) x[j] = load_lanes(keys[j] + e0);
    transpose_stage<Acc, kLanesPer / 2>(x);
    for (int64_t i = 0; i < kLanesPer; ++i) store_lanes(keys_t + (e0 + i) * kLanesPer, x[i]);
  }
}

// Independent chains of multiply-adds a register tile keeps, at least: FMA latency x the ports that issue them
// (4 x 2 on current x86); fewer leave a tile's products waiting on their own sums.
constexpr int64_t kDecodeChains = 8;

// s[r * lds + j] = a_r . keys_t[., j] for r < rows (a multiple of R) and the tile's keys j, from the transposed
// tile: the keys in a vector's lanes, one multiply-add per row and element; where R rows are fewer chains than
// kDecodeChains, the elements split among that many sets of accumulators.
template <int64_t R, class Acc>
FT_KERNEL_INLINE void lanes_dots_t(const Acc* a, int64_t lda, int64_t rows, const Acc* keys_t, int64_t dim, Acc* s,
                                   int64_t lds) {
  constexpr int64_t kLanesPer = kDecodeTileKeys<Acc>, kSets = R >= kDecodeChains ? 1 : kDecodeChains / R;
  for (int64_t r0 = 0; r0 < rows; r0 += R) {
    VectorOf<Acc> sums[kSets][R] = {};
    for (int64_t e0 = 0; e0 < dim; e0 += kSets) {
      for (int64_t u = 0; u < kSets; ++u) {
        const VectorOf<Acc> line = load_lanes(keys_t + (e0 + u) * kLanesPer);
        for (int64_t r = 0; r < R; ++r) sums[u][r] += a[(r0 + r) * lda + e0 + u] * line;
      }
    }
    for (int64_t r = 0; r < R; ++r) {
      for (int64_t u = 1; u < kSets; ++u) sums[0][r] += sums[u][r];
      store_lanes(s + (r0 + r) * lds, sums[0][r]);
    }
  }
}

// A tile's dot products either fold (tile_dots_t: per row, dim multiply-adds and the fold's share, 3 (lanes - 1)
// shuffles and adds) or first transpose the tile in registers (log2(lanes) shuffles, a store and a load per element
// of the tile, whatever the rows), then take one multiply-add per row and element. The transpose pays where
// dim (log2(lanes) + 2) < 3 (lanes - 1) rows: small head dims, several rows (notes.md, "Rows of four and eight").
// Its buffer is on the stack: head dims up to kDecodeTransposeDim.
constexpr int64_t kDecodeTransposeDim = 256;

template <class Acc>
inline bool transpose_pays(int64_t rows, int64_t dim) {
  constexpr int64_t lanes = kDecodeTileKeys<Acc>, stages = lanes == 16 ? 4 : 3;
  return dim <= kDecodeTransposeDim && rows % kDecodeRowTile == 0 && dim * (stages + 2) < 3 * (lanes - 1) * rows;
}

// tile_dots_t, or the transposed tile's product, for `rows` as decode_rows_padded gives them.
template <class Acc>
FT_KERNEL_INLINE void tile_dots(const Acc* a, int64_t lda, int64_t rows, const Acc* const* keys, int64_t dim, Acc* s,
                                int64_t lds) {
  constexpr int64_t kKeys = kDecodeTileKeys<Acc>;
  if (transpose_pays<Acc>(rows, dim)) {
    alignas(kVectorBytes) Acc keys_t[kDecodeTransposeDim * kKeys];
    transpose_tile(keys, dim, keys_t);
    if (rows % (2 * kDecodeRowTile) == 0) {
      lanes_dots_t<2 * kDecodeRowTile>(a, lda, rows, keys_t, dim, s, lds);
    } else {
      lanes_dots_t<kDecodeRowTile>(a, lda, rows, keys_t, dim, s, lds);
    }
    return;
  }
  if (rows == 1) {
    tile_dots_t<1>(a, lda, rows, keys, dim, s, lds);
  } else if (rows == 2) {
    tile_dots_t<2>(a, lda, rows, keys, dim, s, lds);
  } else {
    tile_dots_t<kDecodeRowTile>(a, lda, rows, keys, dim, s, lds);
  }
}

// Where a (batch, kv head)'s rows fill whole vectors (16 in fp32: MHA at 16 queries, a GQA group of four at four
// queries), its products take the other orientation, S^T = K Q^T: each key's scores for all the rows are a vector
// (or two), each element of the key broadcast against a vector of the rows' elements (Q^T, transposed once a
// unit). Neither folds nor transposed tiles; and the softmax's max, sum and rescaling run over the keys a vector
// of rows at a time, a row a lane, where the row-major form reduces within each row (notes.md, "Small head dims at
// 16 queries").
template <class Acc>
inline bool key_major(int64_t rows) {
  return rows % kDecodeTileKeys<Acc> == 0;
}

// s[j * lds + r] = a_t[e * rows + r] . keys[j][e] over e < dim, for the tile's keys j and rows r < rows (a
// multiple of V vectors' lanes): G keys x V vectors of accumulators, each loaded row vector serving G keys.
template <int64_t V, int64_t G, class Acc>
FT_KERNEL_INLINE void keys_dots_t(const Acc* a_t, int64_t rows, const Acc* const* keys, int64_t dim, Acc* s,
                                  int64_t lds) {
  constexpr int64_t kLanesPer = kDecodeTileKeys<Acc>;
  static_assert(kLanesPer % G == 0, "passes of G keys cover the tile");
  for (int64_t r0 = 0; r0 < rows; r0 += V * kLanesPer) {
    for (int64_t j0 = 0; j0 < kLanesPer; j0 += G) {
      VectorOf<Acc> sums[G][V] = {};
      for (int64_t e = 0; e < dim; ++e) {
        VectorOf<Acc> x[V];
        for (int64_t n = 0; n < V; ++n) x[n] = load_lanes(a_t + e * rows + r0 + n * kLanesPer);
        for (int64_t g = 0; g < G; ++g) {
          const Acc y = keys[j0 + g][e];
          for (int64_t n = 0; n < V; ++n) sums[g][n] += y * x[n];
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        for (int64_t n = 0; n < V; ++n) store_lanes(s + (j0 + g) * lds + r0 + n * kLanesPer, sums[g][n]);
      }
    }
  }
}

// Keys a pass of keys_dots_t takes: eight accumulators (times the row vectors) hide the multiply-adds' latency,
// and eight key pointers stay in registers.
constexpr int64_t kDecodeKeysAtOnce = 8;

template <class Acc>
FT_KERNEL_INLINE void keys_dots(const Acc* a_t, int64_t rows, const Acc* const* keys, int64_t dim, Acc* s,
                                int64_t lds) {
  constexpr int64_t kKeys = std::min(kDecodeKeysAtOnce, kDecodeTileKeys<Acc>);  // fp64's 32-byte tile: 4
  if (rows % (2 * kDecodeTileKeys<Acc>) == 0) {
    keys_dots_t<2, kKeys>(a_t, rows, keys, dim, s, lds);
  } else {
    keys_dots_t<1, kKeys>(a_t, rows, keys, dim, s, lds);
  }
}

// rows x dim elements (ld apart) transposed: to[e * rows + r] = from[r * ld + e].
template <class Acc>
FT_KERNEL_INLINE void transpose_rows(const Acc* from, int64_t ld, int64_t rows, int64_t dim, Acc* to) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t e = 0; e < dim; ++e) to[e * rows + r] = from[r * ld + e];
  }
}

// Where the score (or weight, or gradient) of row r and key j lies in a block. The folds and the transposed tile
// write a row's keys together (RowMajor, rows ld apart); keys_dots_t writes a key's rows together (KeyMajor, keys
// ld apart). The products take the layout as a type, so that a key-major tile's rows lie at constant offsets
// (with the stride a variable, a tile of 16 rows kept 16 offsets, more than the registers hold).
struct RowMajor {
  int64_t ld;
  int64_t at(int64_t r, int64_t j) const { return r * ld + j; }
};
struct KeyMajor {
  int64_t ld;
  int64_t at(int64_t r, int64_t j) const { return r + j * ld; }
};

// c[r] += sum over j < count of p[at(r, j)] * values[j], for r < rows (a multiple of R), over dim elements (a
// multiple of V vectors): register tiles of R rows x V vectors, each value vector loaded once for R rows.
template <int64_t R, int64_t V, class Layout, class Acc>
FT_KERNEL_INLINE void tile_accumulate_t(const Acc* p, Layout l, int64_t rows, const Acc* const* values,
                                        int64_t count, Acc* c, int64_t ldc, int64_t dim) {
  constexpr int64_t kLanesPer = kDecodeTileKeys<Acc>;
  for (int64_t r0 = 0; r0 < rows; r0 += R) {
    for (int64_t c0 = 0; c0 < dim; c0 += V * kLanesPer) {
      VectorOf<Acc> tile[R][V];
      for (int64_t r = 0; r < R; ++r) {
        for (int64_t n = 0; n < V; ++n) tile[r][n] = load_lanes(c + (r0 + r) * ldc + c0 + n * kLanesPer);
      }
      for (int64_t j = 0; j < count; ++j) {
        VectorOf<Acc> line[V];
        for (int64_t n = 0; n < V; ++n) line[n] = load_lanes(values[j] + c0 + n * kLanesPer);
        for (int64_t r = 0; r < R; ++r) {
          const Acc x = p[l.at(r0 + r, j)];
          for (int64_t n = 0; n < V; ++n) tile[r][n] += x * line[n];
        }
      }
      for (int64_t r = 0; r < R; ++r) {
        for (int64_t n = 0; n < V; ++n) store_lanes(c + (r0 + r) * ldc + c0 + n * kLanesPer, tile[r][n]);
      }
    }
  }
}

constexpr int64_t kDecodeWideVectors = 4;  // vectors of a register tile's row where the head dim allows

template <int64_t R, class Layout, class Acc>
FT_KERNEL_INLINE void tile_accumulate_rows(const Acc* p, Layout l, int64_t rows, const Acc* const* values,
                                           int64_t count, Acc* c, int64_t ldc, int64_t dim) {
  if (dim % (kDecodeWideVectors * kDecodeTileKeys<Acc>) == 0) {
    tile_accumulate_t<R, kDecodeWideVectors>(p, l, rows, values, count, c, ldc, dim);
  } else {
    tile_accumulate_t<R, 1>(p, l, rows, values, count, c, ldc, dim);
  }
}

// Where a register tile's row is one vector (a narrow head dim), kDecodeRowTile rows would be as many chains of
// dependent multiply-adds, too few to hide their latency: then tiles of kDecodeTallRows rows, or half that (and
// tile_outer_t's of half that many keys: more would keep more strides into key-major weights than registers).
constexpr int64_t kDecodeTallRows = 16;

// tile_accumulate_t for `rows` as decode_rows_padded gives them.
template <class Layout, class Acc>
FT_KERNEL_INLINE void tile_accumulate(const Acc* p, Layout l, int64_t rows, const Acc* const* values,
                                      int64_t count, Acc* c, int64_t ldc, int64_t dim) {
  const bool narrow = dim % (kDecodeWideVectors * kDecodeTileKeys<Acc>) != 0;
  if (rows == 1) {
    tile_accumulate_rows<1>(p, l, rows, values, count, c, ldc, dim);
  } else if (rows == 2) {
    tile_accumulate_rows<2>(p, l, rows, values, count, c, ldc, dim);
  } else if (narrow && rows % kDecodeTallRows == 0) {
    tile_accumulate_t<kDecodeTallRows, 1>(p, l, rows, values, count, c, ldc, dim);
  } else if (narrow && rows % (kDecodeTallRows / 2) == 0) {
    tile_accumulate_t<kDecodeTallRows / 2, 1>(p, l, rows, values, count, c, ldc, dim);
  } else {
    tile_accumulate_rows<kDecodeRowTile>(p, l, rows, values, count, c, ldc, dim);
  }
}

// out_j = factor * (sum over r < rows of a[at(r, j)] * b_r) for the tile's keys j < count, over dim elements
// (a multiple of V vectors), written as In to out + j * ld_out, its first out_dim elements: a key's gradient from
// all the rows of its (batch, kv head), stored as it is made. Register tiles of R keys x V vectors.
template <int64_t R, int64_t V, class Layout, class In, class Acc>
FT_KERNEL_INLINE void tile_outer_t(const Acc* a, Layout l, int64_t rows, const Acc* b, int64_t ldb, int64_t count,
                                   int64_t dim, Acc factor, In* out, int64_t ld_out, int64_t out_dim) {
  constexpr int64_t kLanesPer = kDecodeTileKeys<Acc>, kWidth = V * kLanesPer;
  for (int64_t j0 = 0; j0 < count; j0 += R) {
    for (int64_t c0 = 0; c0 < dim; c0 += kWidth) {
      VectorOf<Acc> tile[R][V] = {};
      for (int64_t r = 0; r < rows; ++r) {
        VectorOf<Acc> line[V];
        for (int64_t n = 0; n < V; ++n) line[n] = load_lanes(b + r * ldb + c0 + n * kLanesPer);
        for (int64_t j = 0; j < R; ++j) {
          const Acc x = a[l.at(r, j0 + j)];
          for (int64_t n = 0; n < V; ++n) tile[j][n] += x * line[n];
        }
      }
      if constexpr (std::is_same_v<In, Acc>) {
        if (j0 + R <= count && c0 + kWidth <= out_dim) {  // whole: stored from the registers
          for (int64_t j = 0; j < R; ++j) {
            for (int64_t n = 0; n < V; ++n) {
              store_lanes(out + (j0 + j) * ld_out + c0 + n * kLanesPer, tile[j][n] * factor);
            }
          }
          continue;
        }
      }
      Acc staged[R][kWidth];  // converted, or cut at the last key or element
      for (int64_t j = 0; j < R; ++j) {
        for (int64_t n = 0; n < V; ++n) store_lanes(staged[j] + n * kLanesPer, tile[j][n] * factor);
      }
      for (int64_t j = 0; j < std::min(R, count - j0); ++j) {
        In* to = out + (j0 + j) * ld_out + c0;
        for (int64_t e = 0; e < std::min(kWidth, out_dim - c0); ++e) to[e] = static_cast<In>(staged[j][e]);
      }
    }
  }
}

template <class Layout, class In, class Acc>
FT_KERNEL_INLINE void tile_outer(const Acc* a, Layout l, int64_t rows, const Acc* b, int64_t ldb, int64_t count,
                                 int64_t dim, Acc factor, In* out, int64_t ld_out, int64_t out_dim) {
  if (dim % (kDecodeWideVectors * kDecodeTileKeys<Acc>) == 0) {
    tile_outer_t<kDecodeRowTile, kDecodeWideVectors>(a, l, rows, b, ldb, count, dim, factor, out, ld_out, out_dim);
  } else {
    tile_outer_t<kDecodeTallRows / 2, 1>(a, l, rows, b, ldb, count, dim, factor, out, ld_out, out_dim);
  }
}

// Ask for keys [first, first + count) of x's (batch, kv head) ahead of their use, every cache line of each
// vector, into L2 (kPrefetchLocality: prefetcht1 on x86), kPrefetchTiles tiles before the tile that reads them:
// consecutive keys of a head lie heads_kv x head_dim elements apart, often a page or more, where the hardware's
// prefetchers stop. Into L1, or one tile ahead, measured slower on long streams (notes.md, "The decode path").
constexpr int64_t kCacheLine = 64;
constexpr int kPrefetchLocality = 2;
constexpr int64_t kPrefetchTiles = 4;

template <class In>
FT_KERNEL_INLINE void prefetch_keys(const Shape& p, const Operand<In>& x, int64_t b, int64_t hk, int64_t first,
                                    int64_t count) {
  if (x.sd != 1) return;
  for (int64_t j = 0; j < count; ++j) {
    const char* at = reinterpret_cast<const char*>(x.at(b, first + j, hk));
    for (int64_t offset = 0; offset < p.dim * static_cast<int64_t>(sizeof(In)); offset += kCacheLine) {
      __builtin_prefetch(at + offset, 0, kPrefetchLocality);
    }
  }
}

// Up to one tile of K or V vectors, keys [first, first + count) of one (batch, kv head), as the products read
// them: in place where the tile is whole and the operand holds Acc along a unit stride with a head dim that needs
// no padding, else converted into the tile's buffer (its padding zero); past `count`, and in place of any vector
// `hide_nonfinite` finds a NaN or Inf in, a vector of zeros.
template <class In, class Acc>
struct DecodeTile {
  static constexpr int64_t kKeys = kDecodeTileKeys<Acc>;
  std::vector<Acc> buffer, zeros;
  const Acc* rows[kKeys];

  explicit DecodeTile(const Shape& p) : buffer(kKeys * p.dim_padded), zeros(p.dim_padded) {}

  FT_KERNEL_INLINE void load(const Shape& p, const Operand<In>& x, int64_t b, int64_t hk, int64_t first,
                             int64_t count) {
    // Held in locals: the stores to `rows` might otherwise alias x's fields, which would be reloaded every key.
    const In* first_vector = x.at(b, first, hk);
    const int64_t step = x.ss, sd = x.sd;
    if constexpr (std::is_same_v<In, Acc>) {
      if (sd == 1 && p.dim == p.dim_padded && count == kKeys) {  // a whole tile in place: no test a key
        for (int64_t j = 0; j < kKeys; ++j) rows[j] = first_vector + j * step;
        return;
      }
    }
    for (int64_t j = 0; j < kKeys; ++j) {
      if (j >= count) {
        rows[j] = zeros.data();
        continue;
      }
      load_vector(first_vector + j * step, sd, p.dim, buffer.data() + j * p.dim_padded);
      rows[j] = buffer.data() + j * p.dim_padded;
    }
  }

  FT_KERNEL_INLINE void hide_nonfinite(int64_t dim) {
    for (int64_t j = 0; j < kKeys; ++j) {
      if (!finite_values_t(rows[j], dim)) rows[j] = zeros.data();
    }
  }
};

// One row's step of the online softmax over a block of base-2 scores s[0, width) (width a multiple of kLanes), of
// which the row sees the first `visible`: the running max rises to the block's, the scores become weights
// exp2(s - max) (0 past `visible`), and the running sum moves on; returns the factor by which the row's output
// so far must be scaled. A NaN score leaves the max alone and makes the sum NaN; while every score is -inf, the
// weights are 0 (the max stands in as 0), and a row whose scores are all -inf ends with sum 0 (LSE and output
// NaN), as on the small-problem path.
template <class Acc>
FT_KERNEL_INLINE Acc online_softmax_row_t(Acc* s, int64_t visible, int64_t width, Acc& running_max,
                                          Acc& running_sum) {
  using Vector = VectorOf<Acc>;
  constexpr int64_t kLanesPer = kDecodeTileKeys<Acc>;
  const Vector minus_inf = Vector{} - std::numeric_limits<Acc>::infinity();
  Vector key;  // each lane's key in a vector, counted in Acc (exact: a block is kDecodeBlockKeys keys)
  for (int64_t t = 0; t < kLanesPer; ++t) key[t] = static_cast<Acc>(t);
  const Vector last = Vector{} + static_cast<Acc>(visible);
  Vector lanes = minus_inf;
  for (int64_t j0 = 0; j0 < width; j0 += kLanesPer) {
    Vector x = load_lanes(s + j0);
    if (j0 + kLanesPer > visible) {  // the keys past `visible` become -inf: weight 0 whatever the max
      x = key + static_cast<Acc>(j0) < last ? x : minus_inf;
      store_lanes(s + j0, x);
    }
    lanes = lanes < x ? x : lanes;
  }
  Acc largest = running_max;
  for (int64_t t = 0; t < kLanesPer; ++t) largest = largest < lanes[t] ? lanes[t] : largest;
  const Acc shift = largest == -std::numeric_limits<Acc>::infinity() ? Acc(0) : largest;
  Vector sums = {};
  for (int64_t j0 = 0; j0 < width; j0 += kLanesPer) {
    const Vector weights = exp2_lanes(load_lanes(s + j0) - shift);
    store_lanes(s + j0, weights);
    sums += weights;
  }
  Acc total = 0;
  for (int64_t t = 0; t < kLanesPer; ++t) total += sums[t];
  const Acc factor = exp2_of(running_max - shift);
  running_sum = running_sum * factor + total;
  running_max = largest;
  return factor;
}

// online_softmax_row_t over key-major scores, a row a lane: s[j * rows + r] for the block's keys j < keys, of
// which row r sees the first seen[r] (all, where `whole`); the rows' running max and sum move on, and factor[r]
// is the scale for row r's output so far. The same rules for NaN and -inf, lane by lane.
template <class Acc>
FT_KERNEL_INLINE void online_softmax_keys_t(Acc* s, int64_t rows, int64_t keys, const int64_t* seen, bool whole,
                                            Acc* running_max, Acc* running_sum, Acc* factor) {
  using Vector = VectorOf<Acc>;
  constexpr int64_t kLanesPer = kDecodeTileKeys<Acc>;
  const Vector minus_inf = Vector{} - std::numeric_limits<Acc>::infinity();
  for (int64_t r0 = 0; r0 < rows; r0 += kLanesPer) {
    Vector last;  // keys each lane's row sees, in Acc (exact: a block is kDecodeBlockKeys keys)
    for (int64_t t = 0; t < kLanesPer; ++t) last[t] = static_cast<Acc>(seen[r0 + t]);
    Vector largest = load_lanes(running_max + r0);
    for (int64_t j = 0; j < keys; ++j) {
      Vector x = load_lanes(s + j * rows + r0);
      if (!whole) {  // the keys past a row's last become -inf: weight 0 whatever the max
        x = static_cast<Acc>(j) < last ? x : minus_inf;
        store_lanes(s + j * rows + r0, x);
      }
      largest = largest < x ? x : largest;
    }
    const Vector shift = largest == minus_inf ? Vector{} : largest;
    Vector total = {};
    for (int64_t j = 0; j < keys; ++j) {
      const Vector p = exp2_lanes(load_lanes(s + j * rows + r0) - shift);
      store_lanes(s + j * rows + r0, p);
      total += p;
    }
    const Vector scale = exp2_lanes(load_lanes(running_max + r0) - shift);
    store_lanes(running_sum + r0, load_lanes(running_sum + r0) * scale + total);
    store_lanes(running_max + r0, largest);
    store_lanes(factor + r0, scale);
  }
}

// gradient_row_t over a tile's key-major weights and gradients, s[j * rows + r] and dp[j * rows + r] for keys
// j < keys, a row a lane: p = exp2(s - lse2) and ds = p (dp - delta) over the keys row r sees (the first
// seen[r]), both exactly 0 past them.
template <class Acc>
FT_KERNEL_INLINE void gradient_keys_t(Acc* s, Acc* dp, int64_t rows, int64_t keys, const Acc* lse2, const Acc* delta,
                                      const int64_t* seen) {
  using Vector = VectorOf<Acc>;
  constexpr int64_t kLanesPer = kDecodeTileKeys<Acc>;
  for (int64_t r0 = 0; r0 < rows; r0 += kLanesPer) {
    Vector last;  // keys each lane's row sees, in Acc (exact: at most a tile)
    for (int64_t t = 0; t < kLanesPer; ++t) last[t] = static_cast<Acc>(seen[r0 + t]);
    const Vector row_lse2 = load_lanes(lse2 + r0), row_delta = load_lanes(delta + r0);
    for (int64_t j = 0; j < keys; ++j) {
      const Vector p = exp2_lanes(load_lanes(s + j * rows + r0) - row_lse2);
      const Vector ds = p * (load_lanes(dp + j * rows + r0) - row_delta);
      store_lanes(s + j * rows + r0, static_cast<Acc>(j) < last ? p : Vector{});
      store_lanes(dp + j * rows + r0, static_cast<Acc>(j) < last ? ds : Vector{});
    }
  }
}

// A row's out and LSE from its running max, sum and output (not yet divided by the sum): 0 and -inf where the
// row sees no key; a non-finite LSE (a NaN or Inf read through q or k) is NaN; an output with any non-finite
// element (the same, or a NaN or Inf value vector the row sees) is NaN whole.
template <class In, class Acc>
FT_KERNEL_INLINE void decode_finish_row(const Acc* o_row, Acc largest, Acc total, int64_t visible, int64_t dim,
                                        In* out, float& lse) {
  if (visible == 0) {
    std::fill(out, out + dim, static_cast<In>(0));
    lse = -std::numeric_limits<float>::infinity();
    return;
  }
  const Acc base2 = largest + std::log2(total);
  lse = std::isfinite(base2) ? static_cast<float>(base2 * kLn2) : std::numeric_limits<float>::quiet_NaN();
  const Acc inverse = Acc(1) / total;
  bool finite = true;
  for (int64_t e = 0; e < dim; ++e) {
    const Acc x = o_row[e] * inverse;
    finite &= std::isfinite(x);
    out[e] = static_cast<In>(x);
  }
  if (!finite) std::fill(out, out + dim, static_cast<In>(std::numeric_limits<float>::quiet_NaN()));
}

// Keys per block of the forward's online softmax: the block's scores for all rows stay in cache, and the
// output's rescaling is paid once a block.
constexpr int64_t kDecodeBlockKeys = 256;

// The decode path's work: units of (batch, kv head, key part), parts units per pair; each part's keys
// [part * part_keys, ...). A part's partial result (parts > 1) is, per row, max, sum and output: kPartialHead +
// dim_padded values.
constexpr int64_t kPartialHead = 2;

template <class In, class Acc>
struct DecodeForwardWork {
  const Shape& p;
  const Operand<In>& q;
  const Operand<In>& k;
  const Operand<In>& v;
  int64_t parts, part_keys;
  In* out_data;
  float* lse_data;
  Acc* partials;
  Acc q_factor;
};

// Row r of a (batch, kv head): query head hk * group + r / seqlen_q, query r % seqlen_q.
inline int64_t decode_head(const Shape& p, int64_t hk, int64_t r) { return hk * p.group + r / p.seqlen_q; }
inline int64_t decode_query(const Shape& p, int64_t r) { return r % p.seqlen_q; }

template <class In, class Acc>
FT_KERNEL_INLINE void decode_forward_items_t(const DecodeForwardWork<In, Acc>& w, int64_t first, int64_t last) {
  constexpr int64_t kKeys = kDecodeTileKeys<Acc>;
  const Shape& p = w.p;
  const int64_t rows = p.group * p.seqlen_q, rows_padded = decode_rows_padded(rows), dim = p.dim_padded;
  const bool by_key = key_major<Acc>(rows);
  const KeyMajor by_keys{rows_padded};
  const RowMajor by_rows{kDecodeBlockKeys};
  auto at = [&](int64_t r, int64_t j) { return by_key ? by_keys.at(r, j) : by_rows.at(r, j); };
  DecodeTile<In, Acc> tile(p);
  std::vector<Acc> q_rows(rows_padded * dim), q_t(by_key ? rows_padded * dim : 0), o_rows(rows_padded * dim),
      scores(rows_padded * kDecodeBlockKeys), largest(rows_padded), total(rows_padded), factor(rows_padded);
  std::vector<int64_t> visible(rows_padded), seen(rows_padded);
  for (int64_t item = first; item < last; ++item) {
    const int64_t pair = item / w.parts, part = item % w.parts, b = pair / p.heads_kv, hk = pair % p.heads_kv;
    const int64_t key_begin = part * w.part_keys, key_end = std::min(p.seqlen_k, key_begin + w.part_keys);
    for (int64_t r = 0; r < rows_padded; ++r) {
      Acc* line = q_rows.data() + r * dim;
      visible[r] = r < rows ? p.visible(decode_query(p, r)) : 0;
      if (r < rows) load_vector(w.q.at(b, decode_query(p, r), decode_head(p, hk, r)), w.q.sd, p.dim, line);
      for (int64_t e = 0; e < dim; ++e) line[e] = r < rows && e < p.dim ? line[e] * w.q_factor : Acc(0);
    }
    if (by_key) transpose_rows(q_rows.data(), dim, rows_padded, dim, q_t.data());
    std::fill(largest.begin(), largest.end(), -std::numeric_limits<Acc>::infinity());
    std::fill(total.begin(), total.end(), Acc(0));
    std::fill(o_rows.begin(), o_rows.end(), Acc(0));
    for (int64_t j0 = key_begin; j0 < key_end; j0 += kDecodeBlockKeys) {
      const int64_t keys = std::min(kDecodeBlockKeys, key_end - j0);
      for (int64_t t0 = 0; t0 < keys; t0 += kKeys) {
        const int64_t next = j0 + t0 + kPrefetchTiles * kKeys;
        prefetch_keys(p, w.k, b, hk, next, std::clamp<int64_t>(key_end - next, 0, kKeys));
        prefetch_keys(p, w.v, b, hk, next, std::clamp<int64_t>(key_end - next, 0, kKeys));
        tile.load(p, w.k, b, hk, j0 + t0, std::min(kKeys, keys - t0));
        if (by_key) {
          keys_dots(q_t.data(), rows_padded, tile.rows, dim, scores.data() + at(0, t0), rows_padded);
        } else {
          tile_dots(q_rows.data(), dim, rows_padded, tile.rows, dim, scores.data() + t0, kDecodeBlockKeys);
        }
      }
      int64_t common = keys, widest = 0;  // keys every row sees, keys some row sees
      for (int64_t r = 0; r < rows_padded; ++r) {
        seen[r] = std::clamp<int64_t>(visible[r] - j0, 0, keys);
        if (r < rows) common = std::min(common, seen[r]), widest = std::max(widest, seen[r]);
      }
      if (by_key) {
        online_softmax_keys_t(scores.data(), rows_padded, keys, seen.data(), common == keys, largest.data(),
                              total.data(), factor.data());
      } else {
        for (int64_t r = 0; r < rows_padded; ++r) {
          factor[r] = online_softmax_row_t(scores.data() + r * kDecodeBlockKeys, seen[r], padded(keys, kLanes),
                                           largest[r], total[r]);
        }
      }
      for (int64_t r = 0; r < rows_padded; ++r) {
        Acc* line = o_rows.data() + r * dim;
        for (int64_t e = 0; e < dim; ++e) line[e] *= factor[r];
      }
      // P V: over the keys every row sees, one product for all rows; past them (causal, several queries), each
      // row up to its own last key, so that no row multiplies a value vector it does not see.
      for (int64_t t0 = 0; t0 < widest; t0 += kKeys) {
        const int64_t count = std::min(kKeys, widest - t0), shared = std::clamp<int64_t>(common - t0, 0, count);
        tile.load(p, w.v, b, hk, j0 + t0, count);
        if (shared) {
          if (by_key) {
            tile_accumulate(scores.data() + at(0, t0), by_keys, rows_padded, tile.rows, shared, o_rows.data(), dim,
                            dim);
          } else {
            tile_accumulate(scores.data() + at(0, t0), by_rows, rows_padded, tile.rows, shared, o_rows.data(), dim,
                            dim);
          }
        }
        for (int64_t r = 0; r < rows; ++r) {
          Acc* line = o_rows.data() + r * dim;
          for (int64_t j = shared; j < std::min(count, seen[r] - t0); ++j) {
            const Acc weight = scores[at(r, t0 + j)];
            for (int64_t e = 0; e < dim; ++e) line[e] += weight * tile.rows[j][e];
          }
        }
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      const Acc* line = o_rows.data() + r * dim;
      if (w.parts == 1) {
        const int64_t h = decode_head(p, hk, r), i = decode_query(p, r);
        decode_finish_row(line, largest[r], total[r], visible[r], p.dim,
                          w.out_data + ((b * p.seqlen_q + i) * p.heads_q + h) * p.dim,
                          w.lse_data[(b * p.heads_q + h) * p.seqlen_q + i]);
        continue;
      }
      Acc* partial = w.partials + (item * rows + r) * (kPartialHead + dim);
      partial[0] = largest[r];
      partial[1] = total[r];
      std::copy(line, line + dim, partial + kPartialHead);
    }
  }
}

// The parts of pairs [first, last) merged: the largest max, and each part's sum and output scaled by 2^(its max -
// that), as the online softmax scales its blocks.
template <class In, class Acc>
FT_KERNEL_INLINE void decode_merge_items_t(const DecodeForwardWork<In, Acc>& w, int64_t first, int64_t last) {
  const Shape& p = w.p;
  const int64_t rows = p.group * p.seqlen_q, dim = p.dim_padded, stride = kPartialHead + dim;
  std::vector<Acc> line(dim);
  for (int64_t pair = first; pair < last; ++pair) {
    const int64_t b = pair / p.heads_kv, hk = pair % p.heads_kv;
    for (int64_t r = 0; r < rows; ++r) {
      const Acc* part0 = w.partials + (pair * w.parts * rows + r) * stride;
      Acc largest = -std::numeric_limits<Acc>::infinity();
      for (int64_t c = 0; c < w.parts; ++c) largest = std::max(largest, part0[c * rows * stride]);
      const Acc shift = largest == -std::numeric_limits<Acc>::infinity() ? Acc(0) : largest;
      Acc total = 0;
      std::fill(line.begin(), line.end(), Acc(0));
      for (int64_t c = 0; c < w.parts; ++c) {
        const Acc* partial = part0 + c * rows * stride;
        const Acc weight = exp2_of(partial[0] - shift);
        total += weight * partial[1];
        for (int64_t e = 0; e < dim; ++e) line[e] += weight * partial[kPartialHead + e];
      }
      const int64_t h = decode_head(p, hk, r), i = decode_query(p, r);
      decode_finish_row(line.data(), largest, total, p.visible(i), p.dim,
                        w.out_data + ((b * p.seqlen_q + i) * p.heads_q + h) * p.dim,
                        w.lse_data[(b * p.heads_q + h) * p.seqlen_q + i]);
    }
  }
}

template <class In, class Acc>
struct DecodeBackwardWork {
  const Shape& p;
  const Operand<In>& q;
  const Operand<In>& k;
  const Operand<In>& v;
  const Operand<In>& dout;
  const Operand<In>& out;
  const RowValues& lse;
  const RowValues& dlse;
  bool with_dlse;
  int64_t pairs, parts, part_keys;  // units part-major: unit = part * pairs + pair
  In* dq_data;
  In* dk_data;
  In* dv_data;
  Acc* partials;  // parts > 1: per (pair, part), per row, its part of dq (dim_padded values)
  Acc q_factor, grad_scale;
};

// The backward of a unit, tile by tile of keys: P = exp2(S - lse) and dS = P (dO V^T - D) for all rows, then the
// tile's dV = P^T dO and dK = dS^T Q whole (every row of the pair is here: they are final), and dQ += dS K.
template <class In, class Acc>
FT_KERNEL_INLINE void decode_backward_items_t(const DecodeBackwardWork<In, Acc>& w, int64_t first, int64_t last) {
  constexpr int64_t kKeys = kDecodeTileKeys<Acc>;
  const Shape& p = w.p;
  const int64_t rows = p.group * p.seqlen_q, rows_padded = decode_rows_padded(rows), dim = p.dim_padded;
  const Acc log2e = static_cast<Acc>(kLog2e), inf = std::numeric_limits<Acc>::infinity();
  const bool by_key = key_major<Acc>(rows);
  const KeyMajor by_keys{rows_padded};
  const RowMajor by_rows{kKeys};
  DecodeTile<In, Acc> k_tile(p), v_tile(p);
  std::vector<Acc> q_rows(rows_padded * dim), q_finite(rows_padded * dim), dout_rows(rows_padded * dim),
      q_t(by_key ? rows_padded * dim : 0), dout_t(by_key ? rows_padded * dim : 0), dq_rows(rows_padded * dim),
      out_line(dim), weights(rows_padded * kKeys), grads(rows_padded * kKeys), lse2(rows_padded), delta(rows_padded);
  std::vector<int64_t> visible(rows_padded), seen(rows_padded);
  for (int64_t item = first; item < last; ++item) {
    const int64_t pair = item % w.pairs, part = item / w.pairs, b = pair / p.heads_kv, hk = pair % p.heads_kv;
    const int64_t key_begin = part * w.part_keys, key_end = std::min(p.seqlen_k, key_begin + w.part_keys);
    for (int64_t r = 0; r < rows_padded; ++r) {
      Acc* q_line = q_rows.data() + r * dim;
      Acc* q_finite_line = q_finite.data() + r * dim;
      Acc* dout_line = dout_rows.data() + r * dim;
      if (r >= rows) {  // padding: no key, no gradient
        std::fill(q_line, q_line + dim, Acc(0));
        std::fill(q_finite_line, q_finite_line + dim, Acc(0));
        std::fill(dout_line, dout_line + dim, Acc(0));
        visible[r] = 0, lse2[r] = inf, delta[r] = 0;
        continue;
      }
      const int64_t h = decode_head(p, hk, r), i = decode_query(p, r);
      visible[r] = p.visible(i);
      load_vector(w.q.at(b, i, h), w.q.sd, p.dim, q_finite_line);
      for (int64_t e = 0; e < p.dim; ++e) q_line[e] = q_finite_line[e] * w.q_factor;
      load_vector(w.dout.at(b, i, h), w.dout.sd, p.dim, dout_line);
      load_vector(w.out.at(b, i, h), w.out.sd, p.dim, out_line.data());
      Acc d = row_dot_t(dout_line, out_line.data(), dim);
      if (w.with_dlse) d -= w.dlse.template at<Acc>(b, h, i);
      delta[r] = d;
      const Acc row_lse = w.lse.template at<Acc>(b, h, i);
      lse2[r] = row_lse == -inf ? inf : row_lse * log2e;  // a row that sees no key: every weight 0
    }
    zero_nonfinite_rows(q_finite.data(), q_finite.data(), dim, rows, p.dim);
    if (by_key) {
      transpose_rows(q_rows.data(), dim, rows_padded, dim, q_t.data());
      transpose_rows(dout_rows.data(), dim, rows_padded, dim, dout_t.data());
    }
    std::fill(dq_rows.begin(), dq_rows.end(), Acc(0));
    for (int64_t t0 = key_begin; t0 < key_end; t0 += kKeys) {
      const int64_t count = std::min(kKeys, key_end - t0);
      const int64_t next = t0 + kPrefetchTiles * kKeys, next_count = std::clamp<int64_t>(key_end - next, 0, kKeys);
      prefetch_keys(p, w.k, b, hk, next, next_count);
      prefetch_keys(p, w.v, b, hk, next, next_count);
      k_tile.load(p, w.k, b, hk, t0, count);
      v_tile.load(p, w.v, b, hk, t0, count);
      if (by_key) {
        keys_dots(q_t.data(), rows_padded, k_tile.rows, dim, weights.data(), rows_padded);
      } else {
        tile_dots(q_rows.data(), dim, rows_padded, k_tile.rows, dim, weights.data(), kKeys);
      }
      // A key vector with a NaN or Inf makes its scores NaN or Inf in every row (padding rows included), so clean
      // scores clear the whole tile at once.
      const bool k_finite = finite_values_t(weights.data(), rows_padded * kKeys);
      for (int64_t r = 0; r < rows_padded; ++r) seen[r] = std::clamp<int64_t>(visible[r] - t0, 0, count);
      if (by_key) {
        keys_dots(dout_t.data(), rows_padded, v_tile.rows, dim, grads.data(), rows_padded);
        gradient_keys_t(weights.data(), grads.data(), rows_padded, kKeys, lse2.data(), delta.data(), seen.data());
      } else {
        tile_dots(dout_rows.data(), dim, rows_padded, v_tile.rows, dim, grads.data(), kKeys);
        gradient_block_t(weights.data(), grads.data(), kKeys, rows_padded, lse2.data(), delta.data(), seen.data(),
                         kKeys);
      }
      const int64_t first_line = (b * p.seqlen_k + t0) * p.heads_kv + hk, ld_lines = p.heads_kv * p.dim;
      In* dv_lines = w.dv_data + first_line * p.dim;
      In* dk_lines = w.dk_data + first_line * p.dim;
      if (by_key) {
        tile_outer(weights.data(), by_keys, rows, dout_rows.data(), dim, count, dim, Acc(1), dv_lines, ld_lines, p.dim);
        tile_outer(grads.data(), by_keys, rows, q_finite.data(), dim, count, dim, w.grad_scale, dk_lines, ld_lines,
                   p.dim);
      } else {
        tile_outer(weights.data(), by_rows, rows, dout_rows.data(), dim, count, dim, Acc(1), dv_lines, ld_lines, p.dim);
        tile_outer(grads.data(), by_rows, rows, q_finite.data(), dim, count, dim, w.grad_scale, dk_lines, ld_lines,
                   p.dim);
      }
      if (!k_finite) k_tile.hide_nonfinite(dim);
      if (by_key) {
        tile_accumulate(grads.data(), by_keys, rows_padded, k_tile.rows, count, dq_rows.data(), dim, dim);
      } else {
        tile_accumulate(grads.data(), by_rows, rows_padded, k_tile.rows, count, dq_rows.data(), dim, dim);
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      const Acc* line = dq_rows.data() + r * dim;
      if (w.parts == 1) {
        In* dq_line = w.dq_data + ((b * p.seqlen_q + decode_query(p, r)) * p.heads_q + decode_head(p, hk, r)) * p.dim;
        for (int64_t e = 0; e < p.dim; ++e) dq_line[e] = static_cast<In>(line[e] * w.grad_scale);
        continue;
      }
      std::copy(line, line + dim, w.partials + ((pair * w.parts + part) * rows + r) * dim);
    }
  }
}

// dq of pairs [first, last): the sum of their parts'.
template <class In, class Acc>
FT_KERNEL_INLINE void decode_backward_merge_t(const DecodeBackwardWork<In, Acc>& w, int64_t first, int64_t last) {
  const Shape& p = w.p;
  const int64_t rows = p.group * p.seqlen_q, dim = p.dim_padded;
  for (int64_t pair = first; pair < last; ++pair) {
    const int64_t b = pair / p.heads_kv, hk = pair % p.heads_kv;
    for (int64_t r = 0; r < rows; ++r) {
      In* dq_line = w.dq_data + ((b * p.seqlen_q + decode_query(p, r)) * p.heads_q + decode_head(p, hk, r)) * p.dim;
      for (int64_t e = 0; e < p.dim; ++e) {
        Acc sum = 0;
        for (int64_t c = 0; c < w.parts; ++c) sum += w.partials[((pair * w.parts + c) * rows + r) * dim + e];
        dq_line[e] = static_cast<In>(sum * w.grad_scale);
      }
    }
  }
}

// The work for each input type, cloned for the machine like the products; fp64's too (the small-problem path's
// is not: it serves gradcheck's sizes), since decoding in fp64 built for the baseline machine ran well behind
// torch's kernel (notes.md, "The decode path").
#define FT_DECODE_CLONES(Work, name)                                                                              \
  FT_CPU_CLONES FT_KERNEL_OPTIONS static void name(const Work<float, float>& w, int64_t first, int64_t last) {    \
    name##_t(w, first, last);                                                                                      \
  }                                                                                                                \
  FT_CPU_CLONES FT_KERNEL_OPTIONS static void name(const Work<c10::BFloat16, float>& w, int64_t first,             \
                                                   int64_t last) {                                                 \
    name##_t(w, first, last);                                                                                      \
  }                                                                                                                \
  FT_CPU_CLONES FT_KERNEL_OPTIONS static void name(const Work<c10::Half, float>& w, int64_t first, int64_t last) { \
    name##_t(w, first, last);                                                                                      \
  }                                                                                                                \
  FT_CPU_CLONES FT_KERNEL_OPTIONS static void name(const Work<double, double>& w, int64_t first, int64_t last) {  \
    name##_t(w, first, last);                                                                                      \
  }
FT_DECODE_CLONES(DecodeForwardWork, decode_forward_items)
FT_DECODE_CLONES(DecodeForwardWork, decode_merge_items)
FT_DECODE_CLONES(DecodeBackwardWork, decode_backward_items)
FT_DECODE_CLONES(DecodeBackwardWork, decode_backward_merge)
#undef FT_DECODE_CLONES

// Key parts per (batch, kv head): one where the pairs alone give every thread kDecodeUnitsPerThread units, else
// as many as that takes, each at least kDecodeMinPartKeys keys (one block of the online softmax: shorter parts
// measured mixed, longer ones left 600 keys of one pair on one thread; notes.md, "The decode path").
constexpr int64_t kDecodeUnitsPerThread = 2;
constexpr int64_t kDecodeMinPartKeys = kDecodeBlockKeys;

struct DecodeSplit {
  int64_t parts, part_keys;
};

// at_least: the backward splits the keys over the threads at least, and its units go part-major, so that each
// thread owns a range of keys of every (batch, kv head): a key's dK and dV lines of all kv heads share memory pages,
// and two threads writing the same fresh pages both take their faults (notes.md, session twenty-one).
DecodeSplit decode_split(const Shape& p, int64_t at_least = 1) {
  const int64_t pairs = p.batch * p.heads_kv, wanted = kDecodeUnitsPerThread * at::get_num_threads();
  const int64_t most = std::max<int64_t>(1, p.seqlen_k / kDecodeMinPartKeys);
  const int64_t parts = std::clamp<int64_t>(std::max((wanted + pairs - 1) / pairs, at_least), 1, most);
  return {parts, padded((p.seqlen_k + parts - 1) / parts, kPad)};
}

template <class In, class Acc>
FT_KERNEL_OPTIONS void decode_forward_typed(const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_,
                                            double scale, bool causal, at::Tensor& out, at::Tensor& lse) {
  const Shape p(q_, k_, causal);
  const Operand<In> q(q_), k(k_), v(v_);
  const DecodeSplit split = decode_split(p);
  const int64_t rows = p.group * p.seqlen_q, pairs = p.batch * p.heads_kv, units = pairs * split.parts;
  std::vector<Acc> partials(split.parts > 1 ? units * rows * (kPartialHead + p.dim_padded) : 0);
  const DecodeForwardWork<In, Acc> work{p, q, k, v, split.parts, split.part_keys, out.data_ptr<In>(),
                                        lse.data_ptr<float>(), partials.data(), static_cast<Acc>(scale * kLog2e)};
  const int64_t unit_work = std::max<int64_t>(1, rows * split.part_keys * p.dim * 2);
  at::parallel_for(0, units, std::max<int64_t>(1, kParallelWork / unit_work),
                   [&](int64_t first, int64_t last) { decode_forward_items(work, first, last); });
  if (split.parts > 1) {
    at::parallel_for(0, pairs, 1, [&](int64_t first, int64_t last) { decode_merge_items(work, first, last); });
  }
}

template <class In, class Acc>
FT_KERNEL_OPTIONS void decode_backward_typed(const at::Tensor& dout_, const at::Tensor& q_, const at::Tensor& k_,
                                             const at::Tensor& v_, const at::Tensor& out_, const at::Tensor& lse_,
                                             const at::Tensor& dlse_, double scale, bool causal, at::Tensor& dq,
                                             at::Tensor& dk, at::Tensor& dv) {
  const Shape p(q_, k_, causal);
  const Operand<In> q(q_), k(k_), v(v_), dout(dout_), out(out_);
  const RowValues lse(lse_), dlse(dlse_);
  const DecodeSplit split = decode_split(p, at::get_num_threads());
  const int64_t rows = p.group * p.seqlen_q, pairs = p.batch * p.heads_kv, units = pairs * split.parts;
  std::vector<Acc> partials(split.parts > 1 ? units * rows * p.dim_padded : 0);
  const DecodeBackwardWork<In, Acc> work{p,
                                         q,
                                         k,
                                         v,
                                         dout,
                                         out,
                                         lse,
                                         dlse,
                                         dlse_.defined(),
                                         pairs,
                                         split.parts,
                                         split.part_keys,
                                         dq.data_ptr<In>(),
                                         dk.data_ptr<In>(),
                                         dv.data_ptr<In>(),
                                         partials.data(),
                                         static_cast<Acc>(scale * kLog2e),
                                         static_cast<Acc>(scale)};
  const int64_t unit_work = std::max<int64_t>(1, rows * split.part_keys * p.dim * 4);
  at::parallel_for(0, units, std::max<int64_t>(1, kParallelWork / unit_work),
                   [&](int64_t first, int64_t last) { decode_backward_items(work, first, last); });
  if (split.parts > 1) {
    const int64_t merge_work = std::max<int64_t>(1, rows * p.dim_padded * split.parts);
    at::parallel_for(0, pairs, std::max<int64_t>(1, kParallelWork / merge_work),
                     [&](int64_t first, int64_t last) { decode_backward_merge(work, first, last); });
  }
}

// Problems the own kernel takes (own_operands): head_dim_v == head_dim (the caller's cpu_kernel.serves checked it,
// with no softcap, ALiBi or window), the four float types, GQA. Its small-problem path takes them where it
// measured faster than torch's kernel (notes.md, "CPU small shapes (session sixteen)" and "The own kernel's
// wider limit (session twenty-four)"): at most kOwnWork multiply-adds per (batch, query head), or kOwnWideWork
// where the mask is causal (the own kernel skips the masked blocks; torch's kernel measured as slow causal as
// not) or a GQA group shares each kv head's copy of K and V; at most kOwnSeqlen keys; at least kOwnMinQueries
// queries, over which each head's copy of its keys and values is spread; and at most kOwnKeyValues elements of K
// (batch x seqlen_k x heads_kv x head_dim), past which those copies stream from memory (b8 h32 q16 k128 d128 ran
// at 0.73x torch's kernel). Where torch's kernel also serves, the call takes whichever of the two measures faster
// on the machine it runs on (KernelChoices, below).
constexpr int64_t kOwnWork = int64_t{1} << 20;
constexpr int64_t kOwnWideWork = int64_t{1} << 22;
constexpr int64_t kOwnSeqlen = 256;
constexpr int64_t kOwnMinQueries = 4;
constexpr int64_t kOwnKeyValues = int64_t{1} << 20;

// The decode path takes what the small-problem path leaves, any number of keys, where it measured faster than
// torch's kernel (notes.md, "The decode path"; where torch's kernel also serves, the faster of the two is measured,
// KernelChoices below): at most kDecodeQueries queries, past which torch's kernel, whose products take a block of
// queries of one head at a time, gains on it (here a GQA group's heads share each read of K and V instead); and at
// most kDecodeRows query rows per (batch, kv head) (group x seqlen_q), the most measured, whose block of scores
// (kDecodeRows x kDecodeBlockKeys) stays within L2.
constexpr int64_t kDecodeQueries = 16;
constexpr int64_t kDecodeRows = 256;

bool own_operands(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const auto type = q.scalar_type();
  if (type != at::kFloat && type != at::kDouble && type != at::kBFloat16 && type != at::kHalf) return false;
  if (k.scalar_type() != type || v.scalar_type() != type || q.dim() != 4 || k.dim() != 4 || v.dim() != 4) return false;
  return q.size(3) == v.size(3) && q.size(3) == k.size(3) && k.size(2) > 0 && q.size(2) % k.size(2) == 0;
}

bool own_small_serves(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal) {
  if (!own_operands(q, k, v)) return false;
  const int64_t work_limit = causal || q.size(2) > k.size(2) ? kOwnWideWork : kOwnWork;
  return k.size(1) <= kOwnSeqlen && q.size(1) >= kOwnMinQueries && q.size(1) * k.size(1) * q.size(3) <= work_limit &&
         k.size(0) * k.size(1) * k.size(2) * k.size(3) <= kOwnKeyValues;
}

bool own_decode_serves(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal) {
  return own_operands(q, k, v) && !own_small_serves(q, k, v, causal) && q.size(1) <= kDecodeQueries &&
         q.size(2) / k.size(2) * q.size(1) <= kDecodeRows;
}

bool own_kernel_serves(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal) {
  return own_small_serves(q, k, v, causal) || own_decode_serves(q, k, v, causal);
}

#define FT_OWN_DISPATCH(type, call)                                                    \
  switch (type) {                                                                      \
    case at::kFloat: call(float, float); break;                                        \
    case at::kDouble: call(double, double); break;                                     \
    case at::kBFloat16: call(c10::BFloat16, float); break;                             \
    case at::kHalf: call(c10::Half, float); break;                                     \
    default: require(false, "flashtile: the CPU kernel takes no ", c10::toString(type)); \
  }

// (out, lse) as cpu_forward returns them: out contiguous (b, s_q, h_q, d) in q's dtype, lse fp32 (b, h_q, s_q).
std::tuple<at::Tensor, at::Tensor> own_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                               double scale, bool causal) {
  at::Tensor out = at::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor lse = at::empty({q.size(0), q.size(2), q.size(1)}, q.options().dtype(at::kFloat));
  poison({&out, &lse});
  const bool small = own_small_serves(q, k, v, causal);
#define FT_OWN_FORWARD(In, Acc)                                        \
  if (small) {                                                         \
    own_forward_typed<In, Acc>(q, k, v, scale, causal, out, lse);      \
  } else {                                                             \
    decode_forward_typed<In, Acc>(q, k, v, scale, causal, out, lse);   \
  }
  FT_OWN_DISPATCH(q.scalar_type(), FT_OWN_FORWARD)
#undef FT_OWN_FORWARD
  return {out, lse};
}

// (dq, dk, dv), contiguous and shaped like q, k, v; dlse undefined where the loss does not use the LSE.
std::tuple<at::Tensor, at::Tensor, at::Tensor> own_backward(const at::Tensor& dout, const at::Tensor& q,
                                                            const at::Tensor& k, const at::Tensor& v,
                                                            const at::Tensor& out, const at::Tensor& lse,
                                                            const at::Tensor& dlse, double scale, bool causal) {
  if (dout.scalar_type() != q.scalar_type() || out.scalar_type() != q.scalar_type()) {
    return own_backward(dout.to(q.scalar_type()), q, k, v, out.to(q.scalar_type()), lse, dlse, scale, causal);
  }
  const auto contiguous = q.options().memory_format(at::MemoryFormat::Contiguous);
  at::Tensor dq = at::empty(q.sizes(), contiguous), dk = at::empty(k.sizes(), contiguous),
             dv = at::empty(v.sizes(), contiguous);
  poison({&dq, &dk, &dv});
  const at::Tensor lse_accum = lse.scalar_type() == at::kDouble ? lse : lse.to(at::kFloat);
  const at::Tensor dlse_accum =
      !dlse.defined() || dlse.scalar_type() == at::kDouble ? dlse : dlse.to(at::kFloat);
  const bool small = own_small_serves(q, k, v, causal);
#define FT_OWN_BACKWARD(In, Acc)                                                                          \
  if (small) {                                                                                            \
    own_backward_typed<In, Acc>(dout, q, k, v, out, lse_accum, dlse_accum, scale, causal, dq, dk, dv);    \
  } else {                                                                                                \
    decode_backward_typed<In, Acc>(dout, q, k, v, out, lse_accum, dlse_accum, scale, causal, dq, dk, dv); \
  }
  FT_OWN_DISPATCH(q.scalar_type(), FT_OWN_BACKWARD)
#undef FT_OWN_BACKWARD
  return {dq, dk, dv};
}

// How torch_forward learns that k holds nothing its answer would get wrong. A NaN in a key, or an Inf that gives
// a row's score +inf or NaN, shows in the LSE of every row that sees the key (rows_finite), and an Inf that gives a
// row's score -inf is a key of weight 0 there, as IEEE arithmetic and the Python path have it: the forward's answer
// stands (KeyCheck::lse). torch's backward, though, multiplies that key's zero gradient by its Inf (a NaN in dq
// where the rules want a number), and a backward that runs torch's kernel without a check of its own (the training
// node's, where only torch's kernel serves) needs k scanned by the forward (KeyCheck::scan).
enum class KeyCheck { lse, scan };

// torch's CPU FlashAttention kernel on (b, s, h, d) operands where it computes flashtile's definition (no softcap,
// ALiBi or window; causal only when seqlen_q == seqlen_k: torch_kernel_masks): a contiguous (b, s_q, h_q, d) output
// (the kernel writes that layout) and an fp32 (b, h_q, s_q) LSE laid out as the kernel writes it, over
// (b, s_q, h_q) memory, which its backward reads as it is. None when an input holds a NaN or an Inf its outputs
// would not show as flashtile's rules want (a NaN or Inf in v: its masked-out zeros spread it to rows that never
// read it), and the Python path or the own kernel applies the rules. So v is checked before the call, k as `keys`
// says, and q by the LSE after it (rows_finite), since a row that read a non-finite query always shows there.
std::optional<std::tuple<at::Tensor, at::Tensor>> torch_forward(const at::Tensor& q, const at::Tensor& k,
                                                                const at::Tensor& v, double scale, bool causal,
                                                                KeyCheck keys) {
  if (!finite(v) || (keys == KeyCheck::scan && !finite(k))) return std::nullopt;
  // Below autograd's dispatch: nothing here is recorded (the callers switch gradients off), and a view or a
  // kernel then skips autograd's and the view tracker's layers. Safe because nothing here writes in place, and
  // the views only feed the kernel or a copy.
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  auto [out, lse] = at::_scaled_dot_product_flash_attention_for_cpu(q.transpose(1, 2), k.transpose(1, 2),
                                                                     v.transpose(1, 2), 0.0, causal, std::nullopt,
                                                                     scale);
  if (!rows_finite(lse)) return std::nullopt;
  return std::make_tuple(out.transpose(1, 2).contiguous(), lse.to(at::kFloat));
}

// torch's backward for finite inputs: contiguous (dq, dk, dv) shaped like q, k, v.
std::tuple<at::Tensor, at::Tensor, at::Tensor> torch_backward(at::Tensor dout, const at::Tensor& q, const at::Tensor& k,
                                                              const at::Tensor& v, const at::Tensor& out,
                                                              const at::Tensor& lse, double scale, bool causal) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;  // as in torch_forward
  if (dout.stride(-1) != 1) dout = dout.contiguous();
  const at::Tensor lse_accum = lse.to(q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat);
  auto [dq, dk, dv] = at::_scaled_dot_product_flash_attention_for_cpu_backward(
      dout.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), out.transpose(1, 2), lse_accum,
      0.0, causal, std::nullopt, scale);
  return {dq.transpose(1, 2).contiguous(), dk.transpose(1, 2).contiguous(), dv.transpose(1, 2).contiguous()};
}

// torch's kernel masks as flashtile does (bottom-right) only where the two agree: square problems.
bool torch_kernel_masks(const at::Tensor& q, const at::Tensor& k, bool causal) {
  return !causal || q.size(1) == k.size(1);
}

// ---- The faster of two kernels, measured on first use -------------------------------------------------------

// Where the own kernel (its small-problem or its decode path) and torch's kernel both serve a problem, which is
// faster depends on the CPU and on torch's BLAS (notes.md, "Issue 14 on an Intel CPU", sessions thirty-four and
// thirty-nine): the own kernel's limits were set where it led, and on another CPU torch's kernel led inside them
// (its decode path too, where a call streams K and V from memory). So the first call of each kind of problem (a
// ChoiceKey: dtype, mask, GQA group, sizes by octave, head dim, pass, threads) runs both in turn, for at least
// kChoiceRounds rounds and until each has run about kChoiceSeconds at its median time (at most kChoiceMaxRounds
// rounds), and that kind then takes the one with the shorter median time for the rest of the process. The
// measuring call returns the chosen kernel's result, so that every call of a kind gives the same bits. In
// deterministic mode (`tuned` false) the own kernel runs whatever the timings, so that bits never depend on a
// measurement.
constexpr int kChoiceRounds = 5;
constexpr int kChoiceMaxRounds = 64;
constexpr double kChoiceSeconds = 0.01;

// Runs the two calls in turn, as above, after one untimed call of each (a process's first call of torch's kernel
// sets its kernels up, many times a later call's time); whether the first's median time is the shorter. The median,
// not the best time: torch's kernel at the smallest sizes runs in two modes, and its best call hides its usual one.
template <class First, class Second>
bool first_faster(First&& first, Second&& second) {
  first();
  second();
  std::vector<double> seconds[2];
  auto median = [&](int i) {
    std::vector<double> sorted = seconds[i];
    std::nth_element(sorted.begin(), sorted.begin() + sorted.size() / 2, sorted.end());
    return sorted[sorted.size() / 2];
  };
  for (int round = 0; round < kChoiceMaxRounds; ++round) {
    for (int i = 0; i < 2; ++i) {
      const auto start = std::chrono::steady_clock::now();
      if (i == 0) first(); else second();
      seconds[i].push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
    if (round + 1 >= kChoiceRounds && (round + 1) * (median(0) + median(1)) >= 2 * kChoiceSeconds) break;
  }
  return median(0) <= median(1);
}

enum class Pass : int64_t { forward, backward };

struct ChoiceKey {
  std::array<int64_t, 9> fields;
  bool operator==(const ChoiceKey& other) const { return fields == other.fields; }
};

struct ChoiceKeyHash {
  size_t operator()(const ChoiceKey& key) const {
    size_t h = 0;
    for (int64_t x : key.fields) h = h * 1000003u ^ static_cast<size_t>(x);
    return h;
  }
};

int64_t octave(int64_t n) { return 64 - __builtin_clzll(static_cast<uint64_t>(std::max<int64_t>(n, 1))); }

ChoiceKey choice_key(const at::Tensor& q, const at::Tensor& k, bool causal, Pass pass) {
  return {{static_cast<int64_t>(q.scalar_type()), causal, octave(q.size(2) / k.size(2)), octave(q.size(0) * q.size(2)),
           octave(q.size(1)), octave(k.size(1)), q.size(3), static_cast<int64_t>(pass), at::get_num_threads()}};
}

class KernelChoices {
 public:
  // true: the own kernel; false: torch's; none: not measured yet.
  std::optional<bool> own(const ChoiceKey& key) {
    std::lock_guard<std::mutex> lock(mutex);
    auto found = choices.find(key);
    if (found == choices.end()) return std::nullopt;
    return found->second;
  }

  void set(const ChoiceKey& key, bool own) {
    std::lock_guard<std::mutex> lock(mutex);
    choices.insert_or_assign(key, own);
  }

  void clear() {
    std::lock_guard<std::mutex> lock(mutex);
    choices.clear();
  }

  // (key fields, own) for each kind measured: what the tests inspect.
  std::vector<std::pair<std::vector<int64_t>, bool>> items() {
    std::lock_guard<std::mutex> lock(mutex);
    std::vector<std::pair<std::vector<int64_t>, bool>> result;
    for (const auto& [key, own] : choices) {
      result.emplace_back(std::vector<int64_t>(key.fields.begin(), key.fields.end()), own);
    }
    return result;
  }

 private:
  std::mutex mutex;
  std::unordered_map<ChoiceKey, bool, ChoiceKeyHash> choices;
};

KernelChoices& kernel_choices() {
  static KernelChoices choices;
  return choices;
}

// The forward of a problem both kernels serve, by the faster for its kind (measuring it on first use). torch's
// kernel checks k by the LSE alone: chosen_backward checks what it reads itself.
std::tuple<at::Tensor, at::Tensor> chosen_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                  double scale, bool causal) {
  const ChoiceKey key = choice_key(q, k, causal, Pass::forward);
  const std::optional<bool> own = kernel_choices().own(key);
  if (own && *own) return own_forward(q, k, v, scale, causal);
  if (own) {
    auto result = torch_forward(q, k, v, scale, causal, KeyCheck::lse);
    return result ? *result : own_forward(q, k, v, scale, causal);  // not finite: the own kernel keeps the rules
  }
  if (!finite(k) || !finite(v)) return own_forward(q, k, v, scale, causal);  // nothing to learn about the kind
  std::tuple<at::Tensor, at::Tensor> own_result;
  std::optional<std::tuple<at::Tensor, at::Tensor>> torch_result;
  bool finite_inputs = true;  // false once torch_forward finds a non-finite query
  const bool own_wins = first_faster([&] { own_result = own_forward(q, k, v, scale, causal); },
                                     [&] {
                                       if (finite_inputs) {
                                         torch_result = torch_forward(q, k, v, scale, causal, KeyCheck::lse);
                                       }
                                       finite_inputs = torch_result.has_value();
                                     });
  if (!finite_inputs) return own_result;
  kernel_choices().set(key, own_wins);
  return own_wins ? own_result : *torch_result;
}

// The backward of a problem both kernels serve, by the faster for its kind. The forward may have been either
// kernel's, so torch's backward runs only on inputs it proves finite (as cpu_backward's callers would).
std::tuple<at::Tensor, at::Tensor, at::Tensor> chosen_backward(const at::Tensor& dout, const at::Tensor& q,
                                                               const at::Tensor& k, const at::Tensor& v,
                                                               const at::Tensor& out, const at::Tensor& lse,
                                                               double scale, bool causal) {
  const ChoiceKey key = choice_key(q, k, causal, Pass::backward);
  const std::optional<bool> own = kernel_choices().own(key);
  if ((own && *own) || !finite(k) || !finite(v) || !rows_finite(lse)) {
    return own_backward(dout, q, k, v, out, lse, at::Tensor(), scale, causal);
  }
  if (own) return torch_backward(dout, q, k, v, out, lse, scale, causal);
  std::tuple<at::Tensor, at::Tensor, at::Tensor> own_result, torch_result;
  const bool own_wins =
      first_faster([&] { own_result = own_backward(dout, q, k, v, out, lse, at::Tensor(), scale, causal); },
                   [&] { torch_result = torch_backward(dout, q, k, v, out, lse, scale, causal); });
  kernel_choices().set(key, own_wins);
  return own_wins ? own_result : torch_result;
}

// ---- The CPU kernel calls: forward, backward, and the training node ----------------------------------------

// Whether both kernels serve (q, k, v) and the choice between them is measured.
bool choice_measured(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal, bool tuned) {
  return tuned && own_kernel_serves(q, k, v, causal) && torch_kernel_masks(q, k, causal);
}

// (out, lse) by the kernel that serves the problem (the own kernel's, torch's, or the faster of both); None as
// torch_forward's where only torch's kernel serves, which checks k as `keys` says.
std::optional<std::tuple<at::Tensor, at::Tensor>> kernel_forward(const at::Tensor& q, const at::Tensor& k,
                                                                 const at::Tensor& v, double scale, bool causal,
                                                                 bool tuned, KeyCheck keys) {
  if (choice_measured(q, k, v, causal, tuned)) return chosen_forward(q, k, v, scale, causal);
  if (own_kernel_serves(q, k, v, causal)) return own_forward(q, k, v, scale, causal);
  require(torch_kernel_masks(q, k, causal), "flashtile: torch's CPU kernel masks square problems only");
  return torch_forward(q, k, v, scale, causal, keys);
}

// kernel_forward as cpu_kernel.forward returns it, the LSE contiguous (it may reach the caller). Its backward, if
// any, is cpu_backward's, which checks k itself where only torch's kernel serves.
std::optional<std::tuple<at::Tensor, at::Tensor>> cpu_forward(const at::Tensor& q, const at::Tensor& k,
                                                               const at::Tensor& v, double scale, bool causal,
                                                               bool tuned) {
  auto result = kernel_forward(q, k, v, scale, causal, tuned, KeyCheck::lse);
  if (result) std::get<1>(*result) = std::get<1>(*result).contiguous();
  return result;
}

// The backward for what kernel_forward returned: contiguous (dq, dk, dv) shaped like q, k, v. Where only torch's
// kernel serves, its forward ran with KeyCheck::scan and proved the inputs finite.
std::tuple<at::Tensor, at::Tensor, at::Tensor> kernel_backward(const at::Tensor& dout, const at::Tensor& q,
                                                               const at::Tensor& k, const at::Tensor& v,
                                                               const at::Tensor& out, const at::Tensor& lse,
                                                               double scale, bool causal, bool tuned) {
  if (choice_measured(q, k, v, causal, tuned)) return chosen_backward(dout, q, k, v, out, lse, scale, causal);
  if (own_kernel_serves(q, k, v, causal)) return own_backward(dout, q, k, v, out, lse, at::Tensor(), scale, causal);
  return torch_backward(dout, q, k, v, out, lse, scale, causal);
}

// cpu_kernel.backward's square case, for ops.Attention's node: None when only torch's kernel serves and k or v is
// not finite or the forward's LSE shows a row that read a non-finite query (that node does not know which path its
// forward took: the Python path gives such a row a NaN LSE, torch's kernel never served it), or where the loss
// uses the LSE (dlse given), which torch's kernel has no term for. The own kernel takes both.
std::optional<std::tuple<at::Tensor, at::Tensor, at::Tensor>> cpu_backward(
    at::Tensor dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, std::optional<at::Tensor> dlse, double scale, bool causal, bool tuned) {
  if (own_kernel_serves(q, k, v, causal)) {
    if (dlse) return own_backward(dout, q, k, v, out, lse, *dlse, scale, causal);
    return kernel_backward(dout, q, k, v, out, lse, scale, causal, tuned);
  }
  if (dlse || !finite(k) || !finite(v) || !rows_finite(lse)) return std::nullopt;
  return torch_backward(std::move(dout), q, k, v, out, lse, scale, causal);
}

// The node of a CPU kernel call in training: recorded only after kernel_forward served the call, so its backward
// takes the kernels too. Its one output is out: calls whose LSE is returned keep ops.Attention, where dLSE has a
// path.
struct CpuAttentionBackward : SavedOperands {
  double scale = 0.0;
  bool causal = false;
  bool tuned = true;

  std::string name() const override { return "flashtile::CpuAttentionBackward"; }

  variable_list apply(variable_list&& grads) override {
    const at::Tensor& dout = grads[0];
    if (!dout.defined()) return {at::Tensor(), at::Tensor(), at::Tensor()};
    bool recorded = at::GradMode::is_enabled() && dout.requires_grad();
    auto [dq, dk, dv] = [&] {
      at::AutoGradMode off(false);
      return kernel_backward(dout, q.unpack(), k.unpack(), v.unpack(), out.unpack(), lse.unpack(), scale, causal,
                             tuned);
    }();
    return recorded ? refused_twice({dq, dk, dv}) : variable_list{dq, dk, dv};
  }
};

// kernel_forward with that node on out (and lse without history, never returned); None as kernel_forward.
std::optional<std::tuple<at::Tensor, at::Tensor>> cpu_train(const at::Tensor& q, const at::Tensor& k,
                                                             const at::Tensor& v, double scale, bool causal,
                                                             bool tuned) {
  auto result = [&] {
    at::AutoGradMode off(false);
    return kernel_forward(q, k, v, scale, causal, tuned, KeyCheck::scan);
  }();
  if (!result) return std::nullopt;
  auto& [out, lse] = *result;
  NodePtr node = new_node<CpuAttentionBackward>();
  auto* attention = static_cast<CpuAttentionBackward*>(node.get());
  attention->scale = scale;
  attention->causal = causal;
  attention->tuned = tuned;
  attention->save(q, k, v, out, lse);
  torch::autograd::set_history(out, node);
  return result;
}

// ---- Kept calls: a repeated call looked up and run in one crossing into C++ ---------------------------------------

// api.attention keeps the call it planned for each input signature: the shapes, strides, dtypes and devices of q,
// k and v, whether gradients are wanted, and the options. Where that call's whole run is C++ (a planned CUDA call's
// host path, torch's CPU kernel), api.py keeps it here as well, so that a repeated call costs one crossing: its
// signature is read, looked up and run here. Anything else (a miss) answers None, and api.py's own table serves.

constexpr int kRank = 4;                    // attention()'s (batch, seqlen, heads, head dim) operands
constexpr int kTensorFields = 3 + 2 * kRank;  // dtype, device type and index, sizes, strides

struct Signature {
  std::array<int64_t, 3 * kTensorFields> geometry;
  bool grad;
  Py_hash_t options_hash;
  bool operator==(const Signature& other) const {
    return grad == other.grad && options_hash == other.options_hash && geometry == other.geometry;
  }
};

struct SignatureHash {
  size_t operator()(const Signature& s) const {
    size_t h = static_cast<size_t>(s.options_hash) * 2 + s.grad;
    for (int64_t x : s.geometry) h = h * 1000003u ^ static_cast<size_t>(x);
    return h;
  }
};

// The operands as tensors and their signature, or nothing where one is not a rank-4 tensor or the options do not
// hash (api.py's checks then say what is wrong).
struct Operands {
  at::Tensor q, k, v;
  Signature signature;
};

std::optional<Operands> operands_of(py::handle q, py::handle k, py::handle v, py::handle options) {
  for (py::handle t : {q, k, v})
    if (!THPVariable_Check(t.ptr()) || THPVariable_Unpack(t.ptr()).dim() != kRank) return std::nullopt;
  Operands o{THPVariable_Unpack(q.ptr()), THPVariable_Unpack(k.ptr()), THPVariable_Unpack(v.ptr()), {}};
  const Py_hash_t options_hash = PyObject_Hash(options.ptr());
  if (options_hash == -1) {
    PyErr_Clear();
    return std::nullopt;
  }
  o.signature.options_hash = options_hash;
  o.signature.grad = at::GradMode::is_enabled() && (o.q.requires_grad() || o.k.requires_grad() || o.v.requires_grad());
  int64_t* field = o.signature.geometry.data();
  for (const at::Tensor* t : {&o.q, &o.k, &o.v}) {
    *field++ = static_cast<int64_t>(t->scalar_type());
    *field++ = static_cast<int64_t>(t->device().type());
    *field++ = t->device().index();
    for (int d = 0; d < kRank; ++d) *field++ = t->size(d);
    for (int d = 0; d < kRank; ++d) *field++ = t->stride(d);
  }
  return o;
}

// functorch's transforms (vmap, grad) wrap tensors in layers that ops.Attention handles; such calls stay in Python.
bool functorch_active() {
  const auto included = c10::impl::tls_local_dispatch_key_set().included_;
  return included.has(c10::DispatchKey::FuncTorchDynamicLayerFrontMode) ||
         included.has(c10::DispatchKey::FuncTorchDynamicLayerBackMode);
}

struct KeptCall {
  py::object options;               // compared with == where the hashes match
  std::shared_ptr<Forward> cuda;    // a planned CUDA call's host path; null: torch's CPU kernel
  double scale = 0.0;               // the CPU kernel's options
  bool causal = false;
  bool tuned = true;
  bool return_lse = false;
};

class KeptCalls {
 public:
  explicit KeptCalls(size_t capacity) : capacity(capacity) {}

  // The kept call's result for these operands: out, or (out, lse) where the LSE is returned. None on a miss, or
  // where api.py's path must decide: misaligned CUDA operands, a functorch transform, a CPU input that is not
  // finite.
  py::object run(py::handle q, py::handle k, py::handle v, py::handle options) {
    auto operands = operands_of(q, k, v, options);
    if (!operands || functorch_active()) return py::none();
    auto found = calls.find(operands->signature);
    if (found == calls.end() || !found->second.options.equal(options)) return py::none();
    const KeptCall& call = found->second;
    const Operands& o = *operands;
    std::optional<std::pair<at::Tensor, at::Tensor>> result;
    if (call.cuda) {
      const auto addresses = reinterpret_cast<uintptr_t>(o.q.data_ptr()) | reinterpret_cast<uintptr_t>(o.k.data_ptr()) |
                             reinterpret_cast<uintptr_t>(o.v.data_ptr());
      if (addresses % kAlignBytes) return py::none();
      result = o.signature.grad ? call.cuda->train(o.q, o.k, o.v) : call.cuda->run(o.q, o.k, o.v);
    } else {
      auto cpu = o.signature.grad ? cpu_train(o.q, o.k, o.v, call.scale, call.causal, call.tuned)
                                  : kernel_forward(o.q, o.k, o.v, call.scale, call.causal, call.tuned,
                                                   KeyCheck::lse);
      if (!cpu) return py::none();
      if (call.return_lse) std::get<1>(*cpu) = std::get<1>(*cpu).contiguous();
      result = std::make_pair(std::get<0>(*cpu), std::get<1>(*cpu));
    }
    if (call.return_lse) return py::make_tuple(result->first, result->second);
    return py::cast(result->first);
  }

  void keep(py::handle q, py::handle k, py::handle v, py::object options, KeptCall call) {
    auto operands = operands_of(q, k, v, options);
    if (!operands) return;
    if (calls.size() >= capacity) calls.clear();
    call.options = std::move(options);
    calls.insert_or_assign(operands->signature, std::move(call));
  }

  void clear() { calls.clear(); }
  size_t size() const { return calls.size(); }

 private:
  size_t capacity;
  std::unordered_map<Signature, KeptCall, SignatureHash> calls;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("cpu_forward", &cpu_forward);
  m.def("cpu_backward", &cpu_backward);
  m.def("cpu_train", &cpu_train);
  m.def("finite", static_cast<bool (*)(const at::Tensor&)>(&finite));
  m.def("rows_finite", &rows_finite);
  m.def("own_kernel_serves", &own_kernel_serves);
  m.def("own_small_serves", &own_small_serves);
  m.def("own_decode_serves", &own_decode_serves);
  m.def("own_forward", &own_forward);
  m.def("own_backward", [](const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& out, const at::Tensor& lse, std::optional<at::Tensor> dlse, double scale,
                           bool causal) {
    return own_backward(dout, q, k, v, out, lse, dlse ? *dlse : at::Tensor(), scale, causal);
  });
  m.def("set_poison", [](bool on) { poison_outputs = on; });
  m.def("vector_bytes", [] { return kVectorBytes; });
  m.def("kernel_choices", [] { return kernel_choices().items(); });
  m.def("clear_kernel_choices", [] { kernel_choices().clear(); });
  m.def("set_kernel_choice", [](const at::Tensor& q, const at::Tensor& k, bool causal, bool backward, bool own) {
    kernel_choices().set(choice_key(q, k, causal, backward ? Pass::backward : Pass::forward), own);
  });
  py::class_<Backward, std::shared_ptr<Backward>>(m, "Backward").def("run", &Backward::run);
  py::class_<Forward, std::shared_ptr<Forward>>(m, "Forward").def("run", &Forward::run).def("train", &Forward::train);
  py::class_<KeptCalls>(m, "KeptCalls")
      .def(py::init<size_t>())
      .def("run", &KeptCalls::run)
      .def("keep_cuda",
           [](KeptCalls& self, py::handle q, py::handle k, py::handle v, py::object options,
              std::shared_ptr<Forward> forward, bool return_lse) {
             self.keep(q, k, v, std::move(options),
                       KeptCall{py::none(), std::move(forward), 0.0, false, true, return_lse});
           })
      .def("keep_cpu",
           [](KeptCalls& self, py::handle q, py::handle k, py::handle v, py::object options, double scale,
              bool causal, bool tuned, bool return_lse) {
             self.keep(q, k, v, std::move(options), KeptCall{py::none(), nullptr, scale, causal, tuned, return_lse});
           })
      .def("clear", &KeptCalls::clear)
      .def("__len__", &KeptCalls::size);
  // Built by functions, not bound constructors: see launches_of.
  m.def("make_backward", [](const py::list& steps, py::bytes packed, uintptr_t context, size_t bwd_addresses,
                            std::vector<int64_t> dout_stride, int64_t lse_floats, int64_t accum_floats,
                            int64_t semaphore_ints, int64_t groups, int64_t q_heads, int64_t kv_heads,
                            int64_t lse_head_dim, py::object make_maps) {
    return std::make_shared<Backward>(launches_of(steps, packed, context), bwd_addresses, std::move(dout_stride),
                                      lse_floats, accum_floats, semaphore_ints, groups, q_heads, kv_heads,
                                      lse_head_dim, std::move(make_maps));
  });
  m.def("make_forward", [](const py::list& steps, py::bytes packed, uintptr_t context, std::vector<int64_t> out_shape,
                           std::vector<int64_t> lse_shape, py::object make_maps, bool maps_of_q, bool maps_of_o,
                           std::shared_ptr<Backward> backward, int64_t scratch_floats, int64_t zeroed_floats) {
    return std::make_shared<Forward>(launches_of(steps, packed, context), std::move(out_shape), std::move(lse_shape),
                                     std::move(make_maps), maps_of_q, maps_of_o, std::move(backward), scratch_floats,
                                     zeroed_floats);
  });
}
