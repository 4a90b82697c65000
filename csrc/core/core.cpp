// The C++ op core: generic boxed op bodies, the plan cache, backend routing.
// See core.h for the design and docs/core.md for the Python side.
#include "core.h"

#include "bridge.h"

#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <ATen/core/stack.h>
#include <c10/core/StorageImpl.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdlib>
#include <cstring>
#include <list>
#include <mutex>
#include <unordered_map>

namespace tmf {
namespace {

// ---------------------------------------------------------------------------
// Encoders: one slot per backend; the stub can stand in for the emulator.
// Encoders are never freed (templates point at their prepared state).
// ---------------------------------------------------------------------------

struct EncoderSlots {
  std::mutex mutex;
  std::vector<std::shared_ptr<Encoder>> all;  // every encoder ever installed (kept alive)
  std::atomic<Encoder*> slot[2] = {nullptr, nullptr};
};

EncoderSlots& encoders() {
  static EncoderSlots* s = new EncoderSlots();
  return *s;
}

// ---------------------------------------------------------------------------
// Ops registered with the core.
// ---------------------------------------------------------------------------

struct OpEntry {
  c10::OperatorHandle handle;
  std::string name;
  int32_t index;
  size_t num_args;
  size_t num_returns;
  bool debug_check;  // validate values on the host in debug mode (bridge::debug_check)
  std::vector<size_t> written;  // arguments the schema declares mutable (Tensor(a!))
};

constexpr size_t kMaxOps = 64;

struct OpTable {
  std::mutex mutex;
  std::atomic<size_t> count{0};
  std::array<std::optional<OpEntry>, kMaxOps> entries;
  std::vector<std::unique_ptr<torch::Library>> libraries;  // keep the registrations alive
};

OpTable& ops() {
  static OpTable* t = new OpTable();
  return *t;
}

const OpEntry& entry_for(const c10::OperatorHandle& op) {
  OpTable& t = ops();
  const size_t n = t.count.load(std::memory_order_acquire);
  for (size_t i = 0; i < n; ++i) {
    if (t.entries[i]->handle == op) {
      return *t.entries[i];
    }
  }
  TORCH_CHECK(false, "torch_metal_flash core: ", op.operator_name(), " is not registered with the core");
}

// ---------------------------------------------------------------------------
// Backend choice, mirrored from torch_metal_flash.backends (per thread).
// ---------------------------------------------------------------------------

enum class Choice : int8_t { Unsynced = -2, Env = -1, Auto = 0, Metal, Emulator, Reference, Invalid };

thread_local Choice tls_choice = Choice::Unsynced;

// The tuner's state plans depend on (torch_metal_flash.tuning): this thread's forced
// variants and emulator family (a token Python interns), and the cache's generation.
thread_local int64_t tls_tuning = 0;
std::atomic<int64_t> g_tuning_generation{0};

// An environment value as the Python side reads it: stripped, lower case.
std::string normalized(const char* text) {
  std::string v(text);
  const auto space = [](char ch) { return std::isspace(static_cast<unsigned char>(ch)) != 0; };
  v.erase(v.begin(), std::find_if_not(v.begin(), v.end(), space));
  v.erase(std::find_if_not(v.rbegin(), v.rend(), space).base(), v.end());
  for (char& ch : v) {
    ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  }
  return v;
}

Choice parse_choice(const char* text) {
  const std::string v = normalized(text);
  if (v.empty() || v == "auto") return Choice::Auto;
  if (v == "metal") return Choice::Metal;
  if (v == "emulator") return Choice::Emulator;
  if (v == "reference") return Choice::Reference;
  return Choice::Invalid;  // Python raises the error naming the variable
}

Choice requested() {
  Choice c = tls_choice;
  if (c == Choice::Unsynced) {
    // This thread has not mirrored its choice yet (the core loaded after it
    // entered backend(...), or it never entered one): read the contextvar once.
    std::optional<std::string> name = bridge::current_choice();
    c = name ? parse_choice(name->c_str()) : Choice::Env;
    tls_choice = c;
  }
  if (c == Choice::Env) {
    const char* env = std::getenv("TORCH_METAL_FLASH_BACKEND");
    c = env ? parse_choice(env) : Choice::Auto;
  }
  return c;
}

// TORCH_METAL_FLASH_DEBUG, as backends.is_debug() reads it.
bool debug_mode() {
  const char* env = std::getenv("TORCH_METAL_FLASH_DEBUG");
  if (env == nullptr) return false;
  const std::string v = normalized(env);
  return !(v.empty() || v == "0" || v == "false" || v == "no");
}

// The encoder that runs a call on `device`, or nullptr for the Python side:
// `reference` true = the reference path, false = a fallback (Python finds the
// reason, warns once or raises in strict mode).
Encoder* route(const c10::Device& device, bool& reference) {
  Choice c = requested();
  if (c == Choice::Auto) {
    c = device.type() == c10::DeviceType::MPS ? Choice::Metal : Choice::Reference;
  }
  reference = c == Choice::Reference;
  if (c == Choice::Metal || c == Choice::Emulator) {
    Encoder* enc = encoders().slot[c == Choice::Metal ? 0 : 1].load(std::memory_order_acquire);
    if (enc != nullptr && enc->device_type() == device.type()) {
      return enc;
    }
  }
  return nullptr;
}

// ---------------------------------------------------------------------------
// The plan-cache key: everything a plan depends on, walked from the IValues.
// ---------------------------------------------------------------------------

enum : int64_t { kTagNone = 1, kTagTensor, kTagInt, kTagDouble, kTagBool, kTagIntList, kTagString };

struct TensorSeen {
  const c10::StorageImpl* storage;
  int64_t offset;
};

void add_tensor_words(std::vector<int64_t>& w, const at::Tensor& t, std::vector<TensorSeen>& seen) {
  w.push_back(kTagTensor);
  w.push_back(static_cast<int64_t>(t.scalar_type()));
  w.push_back(static_cast<int64_t>(t.device().type()));
  w.push_back(t.device().index());
  w.push_back(t.dim());
  for (int64_t s : t.sizes()) w.push_back(s);
  for (int64_t s : t.strides()) w.push_back(s);
  if (!t.has_storage()) {
    w.push_back(-1);
    return;
  }
  const c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  const int64_t offset = t.storage_offset() * static_cast<int64_t>(t.itemsize());
  // Alignment classes: planners test vector alignment of offsets and, on the
  // CPU (the emulator binds host memory), of the storage base.
  w.push_back(offset % 64);
  const bool host = t.device().type() == c10::DeviceType::CPU;
  w.push_back(host ? static_cast<int64_t>(reinterpret_cast<uintptr_t>(t.storage().data()) % 64) : 0);
  // Aliasing: the first earlier tensor on the same storage, and where we sit
  // relative to it (bindings are matched by storage and offset).
  int64_t alias = -1, delta = 0;
  for (size_t i = 0; i < seen.size(); ++i) {
    if (seen[i].storage == storage) {
      alias = static_cast<int64_t>(i);
      delta = offset - seen[i].offset;
      break;
    }
  }
  w.push_back(alias);
  w.push_back(delta);
  seen.push_back({storage, offset});
}

void add_key_words(std::vector<int64_t>& w, c10::ArrayRef<c10::IValue> args) {
  std::vector<TensorSeen> seen;
  seen.reserve(8);
  for (const c10::IValue& v : args) {
    if (v.isNone() || (v.isTensor() && !v.toTensor().defined())) {
      w.push_back(kTagNone);
    } else if (v.isTensor()) {
      add_tensor_words(w, v.toTensor(), seen);
    } else if (v.isBool()) {
      w.push_back(kTagBool);
      w.push_back(v.toBool());
    } else if (v.isInt()) {
      w.push_back(kTagInt);
      w.push_back(v.toInt());
    } else if (v.isDouble()) {
      double d = v.toDouble();
      int64_t bits = 0;
      std::memcpy(&bits, &d, sizeof(bits));
      w.push_back(kTagDouble);
      w.push_back(bits);
    } else if (v.isIntList()) {
      w.push_back(kTagIntList);
      const auto list = v.toIntList();
      w.push_back(static_cast<int64_t>(list.size()));
      for (int64_t x : list) w.push_back(x);
    } else if (v.isString()) {
      const std::string& s = v.toStringRef();
      w.push_back(kTagString);
      w.push_back(static_cast<int64_t>(s.size()));
      for (char ch : s) w.push_back(ch);
    } else {
      TORCH_CHECK(false, "torch_metal_flash core: argument type ", v.tagKind(),
                  " is not supported in op schemas (Tensor, Tensor?, int, float, bool, int[], str)");
    }
  }
}

uint64_t hash_words(const std::vector<int64_t>& w) {
  uint64_t h = 1469598103934665603ull;
  for (int64_t x : w) {
    h = (h ^ static_cast<uint64_t>(x)) * 1099511628211ull;
  }
  h ^= h >> 33;
  h *= 0xff51afd7ed558ccdull;
  h ^= h >> 33;
  return h;
}

// ---------------------------------------------------------------------------
// The plan cache: bounded LRU of templates, hit/miss counters.
// ---------------------------------------------------------------------------

using TemplatePtr = std::shared_ptr<const PlanTemplate>;

struct PlanCache {
  struct Node {
    uint64_t hash;
    std::vector<int64_t> words;
    TemplatePtr plan;
  };
  std::mutex mutex;
  std::list<Node> lru;  // most recently used first
  std::unordered_map<uint64_t, std::list<Node>::iterator> index;
  size_t capacity = 512;
  std::atomic<uint64_t> hits{0}, misses{0}, evictions{0};
  std::atomic<bool> verify{false};

  TemplatePtr find(uint64_t hash, const std::vector<int64_t>& words) {
    std::lock_guard<std::mutex> lock(mutex);
    auto it = index.find(hash);
    if (it == index.end() || it->second->words != words) {
      return nullptr;
    }
    lru.splice(lru.begin(), lru, it->second);
    return it->second->plan;
  }

  void insert(uint64_t hash, const std::vector<int64_t>& words, TemplatePtr plan) {
    std::list<Node> dropped;  // destroyed after the lock is released (may hold Python objects)
    {
      std::lock_guard<std::mutex> lock(mutex);
      auto it = index.find(hash);
      if (it != index.end()) {
        dropped.splice(dropped.begin(), lru, it->second);
        index.erase(it);
      }
      lru.push_front(Node{hash, words, std::move(plan)});
      index[hash] = lru.begin();
      while (lru.size() > capacity) {
        index.erase(lru.back().hash);
        dropped.splice(dropped.begin(), lru, std::prev(lru.end()));
        evictions++;
      }
    }
  }

  void clear() {
    std::list<Node> dropped;
    {
      std::lock_guard<std::mutex> lock(mutex);
      dropped.swap(lru);
      index.clear();
    }
  }
};

PlanCache& cache() {
  static PlanCache* c = [] {
    auto* p = new PlanCache();
    if (const char* env = std::getenv("TORCH_METAL_FLASH_PLAN_CACHE_SIZE")) {
      p->capacity = static_cast<size_t>(std::max(1L, std::atol(env)));
    }
    if (const char* env = std::getenv("TORCH_METAL_FLASH_PLAN_CACHE_VERIFY")) {
      p->verify = env[0] != '\0' && std::strcmp(env, "0") != 0;
    }
    return p;
  }();
  return *c;
}

// ---------------------------------------------------------------------------
// Running a template.
// ---------------------------------------------------------------------------

const at::Tensor& first_tensor(c10::ArrayRef<c10::IValue> args, const OpEntry& e) {
  for (const c10::IValue& v : args) {
    if (v.isTensor() && v.toTensor().defined()) {
      return v.toTensor();
    }
  }
  TORCH_CHECK(false, "torch_metal_flash core: ", e.name, " was called without a tensor argument");
}

void allocate(const PlanTemplate& t, const c10::Device& device, CallTensors& call) {
  const at::TensorOptions options = at::TensorOptions().device(device);
  call.outputs.reserve(t.outputs.size());
  for (const TensorSpec& s : t.outputs) {
    call.outputs.push_back(at::empty_strided(s.sizes, s.strides, options.dtype(s.dtype)));
  }
  call.scratch.reserve(t.scratch.size());
  for (const TensorSpec& s : t.scratch) {
    call.scratch.push_back(at::empty_strided(s.sizes, s.strides, options.dtype(s.dtype)));
  }
}

void bind_and_encode(Encoder& enc, const PlanTemplate& t, c10::ArrayRef<c10::IValue> args, const CallTensors& call) {
  c10::SmallVector<BoundBuffer, 32> bound(t.num_buffers);
  size_t n = 0;
  for (const LaunchTemplate& launch : t.launches) {
    for (const BufferRef& ref : launch.buffers) {
      BoundBuffer& b = bound[n++];
      b.index = ref.index;
      if (ref.kind == RefKind::Bytes) {
        b.bytes = ref.bytes.data();
        b.nbytes = ref.bytes.size();
        continue;
      }
      const at::Tensor& tensor = ref.kind == RefKind::Arg      ? args[ref.source].toTensor()
                                 : ref.kind == RefKind::Output ? call.outputs[ref.source]
                                 : ref.kind == RefKind::Scratch ? call.scratch[ref.source]
                                                                : ref.tensor;
      b.storage = tensor.has_storage() ? tensor.storage().data() : nullptr;
      b.offset = static_cast<uint64_t>(tensor.storage_offset()) * tensor.itemsize();
      b.nbytes = static_cast<uint64_t>(ref.nbytes);
    }
  }
  enc.encode(t, bound.data());
  enc.runs.fetch_add(1, std::memory_order_relaxed);
}

std::string describe_difference(const PlanTemplate& a, const PlanTemplate& b) {
  if (a.kind != b.kind || a.reason != b.reason) return "kind/reason (" + a.reason + " vs " + b.reason + ")";
  if (a.outputs != b.outputs) return "output layouts";
  if (a.scratch != b.scratch) return "scratch buffers";
  if (a.launches.size() != b.launches.size()) return "number of launches";
  for (size_t i = 0; i < a.launches.size(); ++i) {
    if (!a.launches[i].same_launch(b.launches[i])) {
      return "launch " + std::to_string(i) + " (" + a.launches[i].kernel + " vs " + b.launches[i].kernel + ")";
    }
  }
  return "";
}

TemplatePtr plan_miss(const OpEntry& e, Encoder& enc, c10::ArrayRef<c10::IValue> args, CallTensors* call) {
  std::shared_ptr<PlanTemplate> t = bridge::plan(e.index, enc.name(), args, call);
  TORCH_CHECK(t->kind != PlanKind::Kernels || t->outputs.size() == e.num_returns, "torch_metal_flash core: the ",
              e.name, " planner returned ", t->outputs.size(), " outputs, the schema has ", e.num_returns);
  if (t->kind == PlanKind::Kernels) {
    bridge::WithoutGil no_gil;  // compiles must not hold the GIL
    for (LaunchTemplate& launch : t->launches) {
      enc.prepare(launch);
    }
  }
  return t;
}

TemplatePtr lookup_or_plan(const OpEntry& e, Encoder& enc, c10::ArrayRef<c10::IValue> args, CallTensors* call) {
  thread_local std::vector<int64_t> words;
  words.clear();
  words.push_back(e.index);
  words.push_back(static_cast<int64_t>(reinterpret_cast<uintptr_t>(&enc)));
  words.push_back(tls_tuning);
  words.push_back(g_tuning_generation.load(std::memory_order_relaxed));
  add_key_words(words, args);
  const uint64_t hash = hash_words(words);
  PlanCache& c = cache();
  TemplatePtr t = c.find(hash, words);
  if (t != nullptr) {
    c.hits++;
    if (c.verify.load(std::memory_order_relaxed)) {
      CallTensors fresh;
      TemplatePtr again = plan_miss(e, enc, args, &fresh);
      const std::string diff = describe_difference(*t, *again);
      TORCH_CHECK(diff.empty(), "torch_metal_flash plan cache (verify mode): the cached template of ", e.name,
                  " differs from a fresh plan in its ", diff,
                  "; the cache key misses something the planner depends on");
    }
    return t;
  }
  c.misses++;
  std::vector<int64_t> key(words);  // `words` may be reused by a nested call on this thread
  t = plan_miss(e, enc, args, call);
  c.insert(hash, key, t);
  return t;
}

// The body of every op registered with the core.
std::vector<at::Tensor> run_op(const OpEntry& e, c10::ArrayRef<c10::IValue> args) {
  const at::Tensor& first = first_tensor(args, e);
  bool reference = false;
  Encoder* enc = route(first.device(), reference);
  std::vector<at::Tensor> outputs;
  if (enc == nullptr) {
    outputs = bridge::reference(e.index, reference ? bridge::Why::Selected : bridge::Why::Route, "", args);
  } else {
    if (e.debug_check && debug_mode()) {
      bridge::debug_check(e.index, args);
    }
    CallTensors call;  // filled by the planner on a miss
    TemplatePtr t = lookup_or_plan(e, *enc, args, &call);
    if (t->kind == PlanKind::Kernels) {
      if (!call.filled) {
        allocate(*t, first.device(), call);
      }
      bind_and_encode(*enc, *t, args, call);
      outputs = std::move(call.outputs);
    } else {
      outputs = bridge::reference(e.index, t->kind == PlanKind::Reference ? bridge::Why::Empty : bridge::Why::Unsupported,
                                  t->reason, args);
    }
  }
  TORCH_CHECK(outputs.size() == e.num_returns, "torch_metal_flash core: ", e.name, " produced ", outputs.size(),
              " outputs, its schema returns ", e.num_returns);
  return outputs;
}

// The boxed kernel registered for the AutogradCPU and AutogradMPS keys: a call
// that needs no graph goes straight on in C++ (for a mutating op, past
// ADInplaceOrView too, doing its version bumps here); one that does runs the
// op's Python autograd formula (torch_metal_flash.core: an autograd.Function
// around the op).  Other devices keep torch.library's Python kernels.
void autograd_body(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  const OpEntry& e = entry_for(op);
  const c10::ArrayRef<c10::IValue> args = torch::jit::last(*stack, e.num_args);
  bool needs_graph = false;
  if (at::GradMode::is_enabled()) {
    for (const c10::IValue& v : args) {
      needs_graph |= v.isTensor() && v.toTensor().defined() && v.toTensor().requires_grad();
    }
  }
  if (!needs_graph && e.written.empty()) {
    at::AutoDispatchBelowAutograd guard;
    op.redispatchBoxed(keys & c10::after_autograd_keyset, stack);
    return;
  }
  if (!needs_graph) {
    // Also do what an ADInplaceOrView kernel does (torch.library's is Python, and slow):
    // bump the versions of the arguments the op writes.
    c10::SmallVector<at::Tensor, 4> written;
    for (size_t i : e.written) {
      if (args[i].isTensor() && args[i].toTensor().defined()) {
        written.push_back(args[i].toTensor());
      }
    }
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      op.redispatchBoxed(keys & c10::after_ADInplaceOrView_keyset, stack);
    }
    for (const at::Tensor& t : written) {
      torch::autograd::impl::bump_version(t);
    }
    return;
  }
  std::vector<at::Tensor> outputs = bridge::autograd(e.index, args);
  torch::jit::drop(*stack, e.num_args);
  for (at::Tensor& t : outputs) {
    stack->emplace_back(std::move(t));
  }
}

// The boxed kernel registered for the CPU and MPS keys.
void op_body(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  const OpEntry& e = entry_for(op);
  std::vector<at::Tensor> outputs = run_op(e, torch::jit::last(*stack, e.num_args));
  torch::jit::drop(*stack, e.num_args);
  for (at::Tensor& t : outputs) {
    stack->emplace_back(std::move(t));
  }
}

const OpEntry& entry_at(int32_t op_index) {
  OpTable& t = ops();
  TORCH_CHECK(op_index >= 0 && static_cast<size_t>(op_index) < t.count.load(), "torch_metal_flash core: bad op index");
  return *t.entries[op_index];
}

}  // namespace

// ---------------------------------------------------------------------------
// The API used by the bindings and the encoders.
// ---------------------------------------------------------------------------

void set_encoder(Backend backend, std::shared_ptr<Encoder> encoder) {
  EncoderSlots& s = encoders();
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    if (encoder != nullptr && std::find(s.all.begin(), s.all.end(), encoder) == s.all.end()) {
      s.all.push_back(encoder);
    }
    s.slot[static_cast<int>(backend)].store(encoder.get(), std::memory_order_release);
  }
  clear_plan_cache();
}

void clear_plan_cache() { cache().clear(); }

namespace core {

int32_t register_op(const std::string& qualified_name, bool debug_check) {
  OpTable& t = ops();
  std::lock_guard<std::mutex> lock(t.mutex);
  const size_t n = t.count.load();
  for (size_t i = 0; i < n; ++i) {
    if (t.entries[i]->name == qualified_name) {
      return t.entries[i]->index;
    }
  }
  TORCH_CHECK(n < kMaxOps, "torch_metal_flash core: too many ops");
  const auto sep = qualified_name.find("::");
  TORCH_CHECK(sep != std::string::npos, "torch_metal_flash core: expected 'namespace::name', got ", qualified_name);
  const std::string ns = qualified_name.substr(0, sep), name = qualified_name.substr(sep + 2);
  auto handle = c10::Dispatcher::singleton().findSchema({qualified_name, ""});
  TORCH_CHECK(handle.has_value(), "torch_metal_flash core: op ", qualified_name, " is not defined (define it first)");
  const c10::FunctionSchema& schema = handle->schema();
  std::vector<size_t> written;
  for (size_t i = 0; i < schema.arguments().size(); ++i) {
    const c10::AliasInfo* alias = schema.arguments()[i].alias_info();
    if (alias != nullptr && alias->isWrite()) {
      written.push_back(i);
    }
  }
  t.entries[n] = OpEntry{*handle, qualified_name, static_cast<int32_t>(n), schema.arguments().size(),
                         schema.returns().size(), debug_check, std::move(written)};
  for (c10::DispatchKey key : {c10::DispatchKey::CPU, c10::DispatchKey::MPS}) {
    auto lib = std::make_unique<torch::Library>(torch::Library::IMPL, ns, key, __FILE__, __LINE__);
    lib->impl(name.c_str(), torch::CppFunction::makeFromBoxedFunction<&op_body>());
    t.libraries.push_back(std::move(lib));
  }
  for (c10::DispatchKey key : {c10::DispatchKey::AutogradCPU, c10::DispatchKey::AutogradMPS}) {
    auto lib = std::make_unique<torch::Library>(torch::Library::IMPL, ns, key, __FILE__, __LINE__);
    lib->impl(name.c_str(), torch::CppFunction::makeFromBoxedFunction<&autograd_body>());
    t.libraries.push_back(std::move(lib));
  }
  t.count.store(n + 1, std::memory_order_release);
  return static_cast<int32_t>(n);
}

void set_thread_choice(const std::optional<std::string>& name) {
  tls_choice = name ? parse_choice(name->c_str()) : Choice::Env;
}

void set_thread_tuning(int64_t token) { tls_tuning = token; }

void set_tuning_generation(int64_t generation) { g_tuning_generation.store(generation); }

std::vector<at::Tensor> call(int32_t op_index, torch::jit::Stack& args) { return run_op(entry_at(op_index), args); }

std::optional<std::string> probe(int32_t op_index, const std::string& backend, torch::jit::Stack& args) {
  const OpEntry& e = entry_at(op_index);
  Encoder* enc = encoders().slot[backend == "metal" ? 0 : 1].load();
  TORCH_CHECK(enc != nullptr, "torch_metal_flash core: no encoder for backend ", backend);
  CallTensors call;
  TemplatePtr plan = lookup_or_plan(e, *enc, args, &call);
  if (plan->kind == PlanKind::Kernels) return std::nullopt;
  return plan->kind == PlanKind::Unsupported ? plan->reason : std::string("empty problem (the reference path fills it)");
}

const c10::FunctionSchema& schema(int32_t op_index) { return entry_at(op_index).handle.schema(); }

void run_plan(Backend backend, std::shared_ptr<PlanTemplate> plan) {
  Encoder* enc = encoders().slot[static_cast<int>(backend)].load();
  TORCH_CHECK(enc != nullptr, "torch_metal_flash core: no encoder installed for this backend");
  {
    bridge::WithoutGil no_gil;
    for (LaunchTemplate& launch : plan->launches) {
      enc->prepare(launch);
    }
  }
  bridge::WithoutGil no_gil;
  bind_and_encode(*enc, *plan, {}, CallTensors{});
}

CacheInfo cache_info() {
  PlanCache& c = cache();
  std::lock_guard<std::mutex> lock(c.mutex);
  return CacheInfo{c.hits.load(), c.misses.load(), c.evictions.load(), c.lru.size(), c.capacity, c.verify.load()};
}

void configure_cache(std::optional<int64_t> capacity, std::optional<bool> verify, bool reset_counters) {
  PlanCache& c = cache();
  if (verify) c.verify = *verify;
  if (reset_counters) {
    c.hits = 0;
    c.misses = 0;
    c.evictions = 0;
  }
  if (capacity) {
    TORCH_CHECK(*capacity >= 1, "plan cache capacity must be >= 1");
    {
      std::lock_guard<std::mutex> lock(c.mutex);
      c.capacity = static_cast<size_t>(*capacity);
    }
    c.clear();
  }
}

std::vector<std::pair<std::string, uint64_t>> run_counts(bool reset) {
  EncoderSlots& s = encoders();
  std::lock_guard<std::mutex> lock(s.mutex);
  std::vector<std::pair<std::string, uint64_t>> out;
  for (const auto& enc : s.all) {
    out.emplace_back(enc->name(), reset ? enc->runs.exchange(0) : enc->runs.load());
  }
  return out;
}

Encoder* encoder(Backend backend) { return encoders().slot[static_cast<int>(backend)].load(); }

}  // namespace core
}  // namespace tmf
