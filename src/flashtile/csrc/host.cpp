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
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <optional>
#include <stdexcept>
#include <tuple>
#include <string>
#include <type_traits>
#include <unordered_map>
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
constexpr size_t kMaxMapsBytes = 384;     // the forward's second argument: K's, V's (and Q's) 128-byte tensor maps
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

struct Backward {
  Launches launches;
  size_t bwd_addresses;  // byte offset of BwdParams' own address fields (dO first)
  std::vector<int64_t> dout_stride;
  int64_t lse_floats, accum_floats, semaphore_ints;          // a head group's
  int64_t groups, q_heads, kv_heads, lse_head_dim;           // plans.HeadGroups

  Backward(Launches launches, size_t bwd_addresses, std::vector<int64_t> dout_stride, int64_t lse_floats,
           int64_t accum_floats, int64_t semaphore_ints, int64_t groups, int64_t q_heads, int64_t kv_heads,
           int64_t lse_head_dim)
      : launches(std::move(launches)), bwd_addresses(bwd_addresses), dout_stride(std::move(dout_stride)),
        lse_floats(lse_floats), accum_floats(accum_floats), semaphore_ints(semaphore_ints), groups(groups),
        q_heads(q_heads), kv_heads(kv_heads), lse_head_dim(lse_head_dim) {}

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
      const std::array<uint64_t, 8> own = {
          head_address(dout, q_head), head_address(dq, q_head), head_address(dk, kv_head), head_address(dv, kv_head),
          base + accum_at * sizeof(float), base, base + lse_floats * sizeof(float),
          semaphore.defined() ? reinterpret_cast<uint64_t>(semaphore.data_ptr()) + g * semaphore_ints * sizeof(int)
                              : 0};
      std::memcpy(buffer.bytes + bwd_addresses, own.data(), sizeof(own));
      if (!dlse_part.defined()) {
        launches.run(0, steps, buffer.bytes, nullptr, stream);
      } else {  // the preprocess writes D; the LSE's gradient enters as D - dLSE
        launches.run(0, 1, buffer.bytes, nullptr, stream);
        scratch.narrow(0, 0, lse_floats).view(lse_part.sizes()).sub_(dlse_part);
        launches.run(1, steps, buffer.bytes, nullptr, stream);
      }
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

constexpr size_t kMaxKeptMaps = 64;  // plans.MAX_KEPT_MAPS

using MapsKey = std::array<uint64_t, 3>;  // the addresses the maps describe: Q's (0 where they omit Q), K's, V's
struct MapsKeyHash {
  size_t operator()(const MapsKey& a) const { return (a[0] * 1000003u ^ a[1]) * 1000003u ^ a[2]; }
};
using MapsStorage = std::array<char, kMaxMapsBytes + kMapsAlign>;

struct Forward {
  Launches launches;
  std::vector<int64_t> out_shape;  // empty: the output is at::empty_like(q)
  std::vector<int64_t> lse_shape;  // empty: no LSE
  py::object make_maps;  // (q, k, v) -> the tensor maps as bytes (K's, V's, then Q's if maps_of_q); None: one argument
  bool maps_of_q;        // the maps describe Q as well
  std::unordered_map<MapsKey, MapsStorage, MapsKeyHash> maps;
  std::shared_ptr<const Backward> backward;

  Forward(Launches launches, std::vector<int64_t> out_shape, std::vector<int64_t> lse_shape, py::object make_maps,
          bool maps_of_q, std::shared_ptr<Backward> backward)
      : launches(std::move(launches)), out_shape(std::move(out_shape)), lse_shape(std::move(lse_shape)),
        make_maps(std::move(make_maps)), maps_of_q(maps_of_q), backward(std::move(backward)) {}

  void* maps_for(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
    if (make_maps.is_none()) return nullptr;
    const MapsKey key{maps_of_q ? reinterpret_cast<uint64_t>(q.data_ptr()) : 0,
                      reinterpret_cast<uint64_t>(k.data_ptr()), reinterpret_cast<uint64_t>(v.data_ptr())};
    auto found = maps.find(key);
    if (found == maps.end()) {
      std::string bytes = make_maps(q, k, v).cast<std::string>();
      require(bytes.size() <= kMaxMapsBytes, "flashtile: tensor maps of ", bytes.size(), " bytes");
      if (maps.size() >= kMaxKeptMaps) maps.clear();
      found = maps.emplace(key, MapsStorage{}).first;
      std::memcpy(aligned(found->second), bytes.data(), bytes.size());
    }
    return aligned(found->second);
  }

  static void* aligned(MapsStorage& storage) {
    auto address = reinterpret_cast<uintptr_t>(storage.data());
    return reinterpret_cast<void*>((address + kMapsAlign - 1) / kMapsAlign * kMapsAlign);
  }

  std::pair<at::Tensor, at::Tensor> run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
    c10::DeviceGuard guard(q.device());
    at::Tensor o = out_shape.empty() ? at::empty_like(q) : at::empty(out_shape, q.options());
    at::Tensor lse = lse_shape.empty() ? at::Tensor() : at::empty(lse_shape, q.options().dtype(at::kFloat));
    poison({&o, &lse});
    ParamsBuffer buffer;
    std::memcpy(buffer.bytes, launches.params.data(), launches.params.size());
    put_operands(buffer, q, k, v, o, lse);
    launches.run(0, launches.steps.size(), buffer.bytes, maps_for(q, k, v), current_stream(q.device()));
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
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__)
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

bool all_finite(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  return finite(q) && finite(k) && finite(v);
}

// torch's CPU FlashAttention kernel on (b, s, h, d) operands where it computes flashtile's definition (no softcap,
// ALiBi or window; causal only when seqlen_q == seqlen_k: the caller decides): a contiguous (b, s_q, h_q, d) output
// (the kernel writes that layout) and an fp32 (b, h_q, s_q) LSE laid out as the kernel writes it, over
// (b, s_q, h_q) memory, which its backward reads as it is. None when an input holds a NaN or an Inf: the kernel's
// outputs do not show them as flashtile's rules want (often not at all: a finite LSE for a row that read a NaN
// in q), and the Python path applies the rules. So the inputs are checked, not the outputs.
std::optional<std::tuple<at::Tensor, at::Tensor>> kernel_forward(const at::Tensor& q, const at::Tensor& k,
                                                                 const at::Tensor& v, double scale, bool causal) {
  if (!all_finite(q, k, v)) return std::nullopt;
  // Below autograd's dispatch: nothing here is recorded (the callers switch gradients off), and a view or a
  // kernel then skips autograd's and the view tracker's layers. Safe because nothing here writes in place, and
  // the views only feed the kernel or a copy.
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  auto [out, lse] = at::_scaled_dot_product_flash_attention_for_cpu(q.transpose(1, 2), k.transpose(1, 2),
                                                                     v.transpose(1, 2), 0.0, causal, std::nullopt,
                                                                     scale);
  return std::make_tuple(out.transpose(1, 2).contiguous(), lse.to(at::kFloat));
}

// kernel_forward as cpu_kernel.forward returns it, the LSE contiguous (it may reach the caller).
std::optional<std::tuple<at::Tensor, at::Tensor>> cpu_forward(const at::Tensor& q, const at::Tensor& k,
                                                               const at::Tensor& v, double scale, bool causal) {
  auto result = kernel_forward(q, k, v, scale, causal);
  if (result) std::get<1>(*result) = std::get<1>(*result).contiguous();
  return result;
}

// The kernel's backward for what cpu_forward returned: contiguous (dq, dk, dv) shaped like q, k, v.
std::tuple<at::Tensor, at::Tensor, at::Tensor> kernel_backward(at::Tensor dout, const at::Tensor& q, const at::Tensor& k,
                                                               const at::Tensor& v, const at::Tensor& out,
                                                               const at::Tensor& lse, double scale, bool causal) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;  // as in cpu_forward
  if (dout.stride(-1) != 1) dout = dout.contiguous();
  const at::Tensor lse_accum = lse.to(q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat);
  auto [dq, dk, dv] = at::_scaled_dot_product_flash_attention_for_cpu_backward(
      dout.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), out.transpose(1, 2), lse_accum,
      0.0, causal, std::nullopt, scale);
  return {dq.transpose(1, 2).contiguous(), dk.transpose(1, 2).contiguous(), dv.transpose(1, 2).contiguous()};
}

// cpu_kernel.backward's square case, for ops.Attention's node: None when q, k or v is not finite (that node does
// not know which path its forward took).
std::optional<std::tuple<at::Tensor, at::Tensor, at::Tensor>> cpu_backward(
    at::Tensor dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, double scale, bool causal) {
  if (!all_finite(q, k, v)) return std::nullopt;
  return kernel_backward(std::move(dout), q, k, v, out, lse, scale, causal);
}

// The node of a CPU kernel call in training: recorded only after cpu_forward took the kernel, so its backward
// takes it too. Its one output is out: calls whose LSE is returned keep ops.Attention, where dLSE has a path.
struct CpuAttentionBackward : SavedOperands {
  double scale = 0.0;
  bool causal = false;

  std::string name() const override { return "flashtile::CpuAttentionBackward"; }

  variable_list apply(variable_list&& grads) override {
    const at::Tensor& dout = grads[0];
    if (!dout.defined()) return {at::Tensor(), at::Tensor(), at::Tensor()};
    bool recorded = at::GradMode::is_enabled() && dout.requires_grad();
    auto [dq, dk, dv] = [&] {
      at::AutoGradMode off(false);
      return kernel_backward(dout, q.unpack(), k.unpack(), v.unpack(), out.unpack(), lse.unpack(), scale, causal);
    }();
    return recorded ? refused_twice({dq, dk, dv}) : variable_list{dq, dk, dv};
  }
};

// kernel_forward with that node on out (and lse without history, never returned); None as kernel_forward.
std::optional<std::tuple<at::Tensor, at::Tensor>> cpu_train(const at::Tensor& q, const at::Tensor& k,
                                                             const at::Tensor& v, double scale, bool causal) {
  auto result = [&] {
    at::AutoGradMode off(false);
    return kernel_forward(q, k, v, scale, causal);
  }();
  if (!result) return std::nullopt;
  auto& [out, lse] = *result;
  NodePtr node = new_node<CpuAttentionBackward>();
  auto* attention = static_cast<CpuAttentionBackward*>(node.get());
  attention->scale = scale;
  attention->causal = causal;
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
      auto cpu = o.signature.grad ? cpu_train(o.q, o.k, o.v, call.scale, call.causal)
                                  : kernel_forward(o.q, o.k, o.v, call.scale, call.causal);
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
  m.def("all_finite", &all_finite);
  m.def("set_poison", [](bool on) { poison_outputs = on; });
  py::class_<Backward, std::shared_ptr<Backward>>(m, "Backward").def("run", &Backward::run);
  py::class_<Forward, std::shared_ptr<Forward>>(m, "Forward").def("run", &Forward::run).def("train", &Forward::train);
  py::class_<KeptCalls>(m, "KeptCalls")
      .def(py::init<size_t>())
      .def("run", &KeptCalls::run)
      .def("keep_cuda",
           [](KeptCalls& self, py::handle q, py::handle k, py::handle v, py::object options,
              std::shared_ptr<Forward> forward, bool return_lse) {
             self.keep(q, k, v, std::move(options), KeptCall{py::none(), std::move(forward), 0.0, false, return_lse});
           })
      .def("keep_cpu",
           [](KeptCalls& self, py::handle q, py::handle k, py::handle v, py::object options, double scale,
              bool causal, bool return_lse) {
             self.keep(q, k, v, std::move(options), KeptCall{py::none(), nullptr, scale, causal, return_lse});
           })
      .def("clear", &KeptCalls::clear)
      .def("__len__", &KeptCalls::size);
  // Built by functions, not bound constructors: see launches_of.
  m.def("make_backward", [](const py::list& steps, py::bytes packed, uintptr_t context, size_t bwd_addresses,
                            std::vector<int64_t> dout_stride, int64_t lse_floats, int64_t accum_floats,
                            int64_t semaphore_ints, int64_t groups, int64_t q_heads, int64_t kv_heads,
                            int64_t lse_head_dim) {
    return std::make_shared<Backward>(launches_of(steps, packed, context), bwd_addresses, std::move(dout_stride),
                                      lse_floats, accum_floats, semaphore_ints, groups, q_heads, kv_heads,
                                      lse_head_dim);
  });
  m.def("make_forward", [](const py::list& steps, py::bytes packed, uintptr_t context, std::vector<int64_t> out_shape,
                           std::vector<int64_t> lse_shape, py::object make_maps, bool maps_of_q,
                           std::shared_ptr<Backward> backward) {
    return std::make_shared<Forward>(launches_of(steps, packed, context), std::move(out_shape), std::move(lse_shape),
                                     std::move(make_maps), maps_of_q, std::move(backward));
  });
}
