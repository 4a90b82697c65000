// The Python side of the core: callbacks into torch_metal_flash.core (planner,
// reference path, backend choice, emulator), the emulator and stub encoders,
// and the `core` submodule of the extension.
#include "bridge.h"

#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <cstring>
#include <limits>
#include <mutex>

namespace py = pybind11;

namespace tmf {
namespace {

// Set once by core.init(); never destroyed (no Python objects die at shutdown).
struct Callbacks {
  py::object on_miss, reference, autograd, debug_check, current_choice, emulator_prepare, emulator_encode;
};
Callbacks* g_callbacks = nullptr;

Callbacks& callbacks() {
  TORCH_CHECK(g_callbacks != nullptr, "torch_metal_flash core: core.init() has not been called");
  return *g_callbacks;
}

py::object to_python(const c10::IValue& v) {
  if (v.isTensor()) {
    return v.toTensor().defined() ? py::cast(v.toTensor()) : py::none();
  }
  if (v.isNone()) return py::none();
  if (v.isBool()) return py::bool_(v.toBool());
  if (v.isInt()) return py::int_(v.toInt());
  if (v.isDouble()) return py::float_(v.toDouble());
  if (v.isIntList()) return py::cast(v.toIntVector());
  if (v.isString()) return py::str(v.toStringRef());
  if (v.isSymInt()) return py::cast(v.toSymInt());  // symbolic sizes while torch.compile traces
  if (v.isSymFloat()) return py::cast(v.toSymFloat());
  if (v.isSymBool()) return py::cast(v.toSymBool());
  TORCH_CHECK(false, "torch_metal_flash core: cannot pass a ", v.tagKind(), " argument to Python");
}

py::tuple to_python(c10::ArrayRef<c10::IValue> args) {
  py::tuple out(args.size());
  for (size_t i = 0; i < args.size(); ++i) {
    out[i] = to_python(args[i]);
  }
  return out;
}

c10::IValue from_python(const c10::Argument& arg, py::handle value) {
  c10::TypePtr type = arg.type();
  if (type->kind() == c10::TypeKind::OptionalType) {
    if (value.is_none()) return c10::IValue();
    type = type->castRaw<c10::OptionalType>()->getElementType();
  }
  switch (type->kind()) {
    case c10::TypeKind::TensorType:
      return py::cast<at::Tensor>(value);
    case c10::TypeKind::IntType:
      return py::cast<int64_t>(value);
    case c10::TypeKind::FloatType:
      return py::cast<double>(value);
    case c10::TypeKind::BoolType:
      return py::cast<bool>(value);
    case c10::TypeKind::StringType:
      return py::cast<std::string>(value);
    case c10::TypeKind::ListType:
      return py::cast<std::vector<int64_t>>(value);
    default:
      TORCH_CHECK(false, "torch_metal_flash core: argument '", arg.name(), "' has a type the core does not take: ",
                  type->str());
  }
}

torch::jit::Stack to_stack(int32_t op_index, py::sequence args) {
  const c10::FunctionSchema& schema = core::schema(op_index);
  TORCH_CHECK(args.size() == schema.arguments().size(), "torch_metal_flash core: ", schema.name(), " takes ",
              schema.arguments().size(), " arguments, got ", args.size());
  torch::jit::Stack stack;
  for (size_t i = 0; i < args.size(); ++i) {
    stack.push_back(from_python(schema.arguments()[i], args[i]));
  }
  return stack;
}

uint32_t to_u32(py::handle h, const char* what) {
  const int64_t v = py::cast<int64_t>(h);
  TORCH_CHECK(v >= 0 && v <= std::numeric_limits<uint32_t>::max(), "torch_metal_flash core: ", what,
              " must be in [0, 2^32), got ", v);
  return static_cast<uint32_t>(v);
}

// Metal limits checked for every encoder, so a bad plan fails the same way everywhere.
constexpr int64_t kMaxBufferIndex = 30;      // 31 buffer-argument-table entries
constexpr size_t kMaxSetBytesLength = 4096;  // setBytes:length:atIndex: "smaller than 4 KB"
constexpr int64_t kMaxFunctionConstantIndex = 65535;

}  // namespace

Constant to_constant(int64_t i, const py::handle& value) {
  Constant c;
  TORCH_CHECK(i >= 0 && i <= kMaxFunctionConstantIndex, "torch_metal_flash: function constant index ", i,
              " out of range [0, ", kMaxFunctionConstantIndex, "]");
  c.index = static_cast<uint32_t>(i);
  PyObject* obj = value.ptr();
  if (PyBool_Check(obj)) {  // before int: bool is an int in Python
    c.type = Constant::Type::Bool;
    c.b = obj == Py_True;
  } else if (PyLong_Check(obj)) {
    int overflow = 0;
    const long long v = PyLong_AsLongLongAndOverflow(obj, &overflow);
    TORCH_CHECK(overflow == 0 && v >= std::numeric_limits<int32_t>::min() && v <= std::numeric_limits<int32_t>::max(),
                "torch_metal_flash: function constant ", i, " does not fit a 32-bit Metal int");
    c.type = Constant::Type::Int;
    c.i = static_cast<int32_t>(v);
  } else if (PyFloat_Check(obj)) {
    c.type = Constant::Type::Float;
    c.f = static_cast<float>(PyFloat_AsDouble(obj));
  } else {
    TORCH_CHECK(false, "torch_metal_flash: function constant ", i, " must be a bool, int or float, got ",
                py::str(py::type::of(value)).cast<std::string>());
  }
  return c;
}

namespace {

BufferRef to_buffer(py::handle index, py::handle ref, bool one_shot) {
  BufferRef b;
  const int64_t i = py::cast<int64_t>(index);
  TORCH_CHECK(i >= 0 && i <= kMaxBufferIndex, "torch_metal_flash: buffer index ", i, " out of range [0, ",
              kMaxBufferIndex, "]");
  b.index = static_cast<uint32_t>(i);
  if (py::isinstance<py::bytes>(ref)) {
    b.kind = RefKind::Bytes;
    b.bytes = py::cast<std::string>(ref);
    TORCH_CHECK(!b.bytes.empty() && b.bytes.size() <= kMaxSetBytesLength, "torch_metal_flash: buffer ", i, " has ",
                b.bytes.size(), " bytes; setBytes takes 1 to ", kMaxSetBytesLength, " bytes (use a tensor for more)");
  } else {
    // (kind, source, nbytes): source is an index, or the tensor itself for RefKind::Tensor
    py::tuple t = py::cast<py::tuple>(ref);
    TORCH_CHECK(t.size() == 3, "torch_metal_flash core: a buffer reference is (kind, source, nbytes)");
    b.kind = static_cast<RefKind>(py::cast<int>(t[0]));
    TORCH_CHECK(one_shot ? b.kind == RefKind::Tensor
                         : (b.kind == RefKind::Arg || b.kind == RefKind::Output || b.kind == RefKind::Scratch),
                "torch_metal_flash core: bad buffer reference kind ", py::cast<int>(t[0]));
    if (b.kind == RefKind::Tensor) {
      b.tensor = py::cast<at::Tensor>(t[1]);
    } else {
      b.source = py::cast<int32_t>(t[1]);
    }
    b.nbytes = py::cast<int64_t>(t[2]);
  }
  return b;
}

LaunchTemplate to_launch(py::handle item, bool one_shot) {
  py::tuple t = py::cast<py::tuple>(item);
  TORCH_CHECK(t.size() == 7, "torch_metal_flash core: a launch is (source, kernel, constants, buffers, "
              "threadgroups, threadgroup, threadgroup_memory)");
  LaunchTemplate l;
  l.source = py::cast<std::string>(t[0]);
  l.kernel = py::cast<std::string>(t[1]);
  for (py::handle c : t[2]) {
    py::tuple pair = py::cast<py::tuple>(c);
    Constant constant = to_constant(py::cast<int64_t>(pair[0]), pair[1]);
    for (const Constant& other : l.constants) {
      TORCH_CHECK(other.index != constant.index, "torch_metal_flash: function constant ", constant.index, " given twice");
    }
    l.constants.push_back(constant);
  }
  for (py::handle b : t[3]) {
    py::tuple pair = py::cast<py::tuple>(b);
    BufferRef ref = to_buffer(pair[0], pair[1], one_shot);
    for (const BufferRef& other : l.buffers) {
      TORCH_CHECK(other.index != ref.index, "torch_metal_flash: buffer index ", ref.index, " bound twice");
    }
    l.buffers.push_back(std::move(ref));
  }
  for (int d = 0; d < 3; ++d) {
    l.threadgroups[d] = to_u32(py::cast<py::tuple>(t[4])[d], "threadgroups");
    l.threadgroup[d] = to_u32(py::cast<py::tuple>(t[5])[d], "threadgroup");
    TORCH_CHECK(l.threadgroup[d] >= 1, "torch_metal_flash: threads per threadgroup must be >= 1 in every dimension");
  }
  for (py::handle m : t[6]) {
    py::tuple pair = py::cast<py::tuple>(m);
    const uint32_t index = to_u32(pair[0], "threadgroup memory index");
    const uint32_t bytes = to_u32(pair[1], "threadgroup memory length");
    TORCH_CHECK(index <= kMaxBufferIndex && bytes > 0, "torch_metal_flash: threadgroup memory ", index,
                " must have an index <= 30 and > 0 bytes");
    l.threadgroup_memory.emplace_back(index, (bytes + 15) / 16 * 16);  // a multiple of 16 bytes
  }
  return l;
}

void finish(PlanTemplate& t) {
  t.num_buffers = 0;
  t.threads = 0;
  for (const LaunchTemplate& l : t.launches) {
    t.num_buffers += l.buffers.size();
    t.threads += static_cast<int64_t>(l.threadgroups[0]) * l.threadgroups[1] * l.threadgroups[2] * l.threadgroup[0] *
                 l.threadgroup[1] * l.threadgroup[2];
  }
}

// A Python object held by a template: released with the GIL.
std::shared_ptr<void> hold(py::object obj) {
  return std::shared_ptr<void>(new py::object(std::move(obj)), [](void* p) {
    py::gil_scoped_acquire gil;
    delete static_cast<py::object*>(p);
  });
}

// ---------------------------------------------------------------------------
// Encoders without Metal.
// ---------------------------------------------------------------------------

// Runs plans on the emulator backend (torch_metal_flash.backends.emulator):
// kernels take milliseconds there, so one Python call per plan costs nothing.
class EmulatorEncoder final : public Encoder {
 public:
  const std::string& name() const override { return name_; }
  c10::DeviceType device_type() const override { return c10::DeviceType::CPU; }

  void prepare(LaunchTemplate& l) override {
    py::gil_scoped_acquire gil;
    py::list constants;
    for (const Constant& c : l.constants) {
      py::object v = c.type == Constant::Type::Bool  ? py::object(py::bool_(c.b))
                     : c.type == Constant::Type::Int ? py::object(py::int_(c.i))
                                                     : py::object(py::float_(c.f));
      constants.append(py::make_tuple(c.index, v));
    }
    py::list tg_memory;
    for (const auto& m : l.threadgroup_memory) tg_memory.append(py::make_tuple(m.first, m.second));
    py::object handle = callbacks().emulator_prepare(
        l.source, l.kernel, constants, py::make_tuple(l.threadgroups[0], l.threadgroups[1], l.threadgroups[2]),
        py::make_tuple(l.threadgroup[0], l.threadgroup[1], l.threadgroup[2]), tg_memory);
    l.prepared = hold(std::move(handle));
  }

  void encode(const PlanTemplate& plan, const BoundBuffer* buffers) override {
    py::gil_scoped_acquire gil;
    py::list launches;
    size_t n = 0;
    for (const LaunchTemplate& l : plan.launches) {
      py::list bound;
      for (size_t i = 0; i < l.buffers.size(); ++i, ++n) {
        const BoundBuffer& b = buffers[n];
        if (b.bytes != nullptr) {
          bound.append(py::make_tuple(b.index, py::bytes(static_cast<const char*>(b.bytes), b.nbytes)));
        } else {
          const uintptr_t address = reinterpret_cast<uintptr_t>(b.storage) + b.offset;
          bound.append(py::make_tuple(b.index, py::make_tuple(address, b.nbytes)));
        }
      }
      launches.append(py::make_tuple(*static_cast<py::object*>(l.prepared.get()), bound));
    }
    callbacks().emulator_encode(launches);
  }

 private:
  std::string name_ = "emulator";
};

// Encodes nothing: bench/overhead.py measures the host path with it.
class StubEncoder final : public Encoder {
 public:
  const std::string& name() const override { return name_; }
  c10::DeviceType device_type() const override { return c10::DeviceType::CPU; }
  void prepare(LaunchTemplate&) override {}
  void encode(const PlanTemplate&, const BoundBuffer*) override {}

 private:
  std::string name_ = "stub";
};

std::shared_ptr<Encoder> g_emulator, g_stub;
std::mutex g_init_mutex;

}  // namespace

// ---------------------------------------------------------------------------
// Callbacks (bridge.h).
// ---------------------------------------------------------------------------

namespace bridge {

std::optional<std::string> current_choice() {
  py::gil_scoped_acquire gil;
  py::object name = callbacks().current_choice();
  if (name.is_none()) return std::nullopt;
  return py::cast<std::string>(name);
}

std::shared_ptr<PlanTemplate> plan(int32_t op_index, const std::string& encoder, c10::ArrayRef<c10::IValue> args,
                                   CallTensors* call) {
  py::gil_scoped_acquire gil;
  py::tuple result = py::cast<py::tuple>(callbacks().on_miss(op_index, encoder, to_python(args)));
  auto t = std::make_shared<PlanTemplate>();
  const int64_t kind = py::cast<int64_t>(result[0]);
  if (kind == 1) {
    t->kind = PlanKind::Unsupported;
    t->reason = py::cast<std::string>(result[1]);
    return t;
  }
  if (kind == 2) {
    t->kind = PlanKind::Reference;
    return t;
  }
  TORCH_CHECK(kind == 0 && result.size() == 4, "torch_metal_flash core: malformed planner result");
  t->kind = PlanKind::Kernels;
  for (py::handle o : result[1]) {
    at::Tensor out = py::cast<at::Tensor>(o);
    t->outputs.emplace_back(out);
    call->outputs.push_back(std::move(out));
  }
  for (py::handle s : result[2]) {
    at::Tensor scratch = py::cast<at::Tensor>(s);
    t->scratch.emplace_back(scratch);
    call->scratch.push_back(std::move(scratch));
  }
  for (py::handle l : result[3]) {
    t->launches.push_back(to_launch(l, false));
  }
  for (const LaunchTemplate& l : t->launches) {
    for (const BufferRef& b : l.buffers) {
      const size_t limit = b.kind == RefKind::Arg ? args.size() : b.kind == RefKind::Output ? t->outputs.size()
                                                                                           : t->scratch.size();
      TORCH_CHECK(b.kind == RefKind::Bytes || (b.source >= 0 && static_cast<size_t>(b.source) < limit),
                  "torch_metal_flash core: buffer ", b.index, " of ", l.kernel, " refers to a missing tensor");
    }
  }
  finish(*t);
  call->filled = true;
  return t;
}

std::vector<at::Tensor> reference(int32_t op_index, Why why, const std::string& reason,
                                  c10::ArrayRef<c10::IValue> args) {
  py::gil_scoped_acquire gil;
  py::object result = callbacks().reference(op_index, static_cast<int>(why), reason, to_python(args));
  std::vector<at::Tensor> out;
  for (py::handle t : result) {
    out.push_back(py::cast<at::Tensor>(t));
  }
  return out;
}

void debug_check(int32_t op_index, c10::ArrayRef<c10::IValue> args) {
  py::gil_scoped_acquire gil;
  callbacks().debug_check(op_index, to_python(args));
}

std::vector<at::Tensor> autograd(int32_t op_index, c10::ArrayRef<c10::IValue> args) {
  py::gil_scoped_acquire gil;
  py::object result = callbacks().autograd(op_index, to_python(args));
  std::vector<at::Tensor> out;
  for (py::handle t : result) {
    out.push_back(py::cast<at::Tensor>(t));
  }
  return out;
}

WithoutGil::WithoutGil() {
  if (PyGILState_Check()) {
    state_ = PyEval_SaveThread();
  }
}

WithoutGil::~WithoutGil() {
  if (state_ != nullptr) {
    PyEval_RestoreThread(static_cast<PyThreadState*>(state_));
  }
}

}  // namespace bridge

// ---------------------------------------------------------------------------
// Call signatures: the memo key of a face's argument checks (torch_metal_flash.problem.checks),
// what those checks read -- per tensor its dtype, device, sizes and whether the last
// dim is contiguous; per scalar its exact type and value.  None for anything else
// (the Python signature then decides).
// ---------------------------------------------------------------------------

enum : int64_t { kSigNone = 1, kSigTensor, kSigBool, kSigInt, kSigFloat, kSigTuple };

bool add_signature_words(std::vector<int64_t>& w, PyObject* o, bool nested) {
  if (o == Py_None) {
    w.push_back(kSigNone);
  } else if (THPVariable_Check(o)) {
    const at::Tensor& t = THPVariable_Unpack(o);
    if (t.is_nested() || t.unsafeGetTensorImpl()->has_symbolic_sizes_strides()) return false;
    w.push_back(kSigTensor);
    w.push_back(static_cast<int64_t>(t.scalar_type()));
    w.push_back(static_cast<int64_t>(t.device().type()));
    w.push_back(t.device().index());
    w.push_back(t.dim());
    for (int64_t n : t.sizes()) w.push_back(n);
    w.push_back(t.dim() > 0 && (t.sizes().back() <= 1 || t.strides().back() == 1));
  } else if (PyBool_Check(o)) {
    w.push_back(kSigBool);
    w.push_back(o == Py_True);
  } else if (PyLong_CheckExact(o)) {
    int overflow = 0;
    const long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (overflow != 0 || (v == -1 && PyErr_Occurred())) {
      PyErr_Clear();
      return false;
    }
    w.push_back(kSigInt);
    w.push_back(v);
  } else if (PyFloat_CheckExact(o)) {
    const double d = PyFloat_AS_DOUBLE(o);
    int64_t bits = 0;
    std::memcpy(&bits, &d, sizeof(bits));
    w.push_back(kSigFloat);
    w.push_back(bits);
  } else if (PyTuple_CheckExact(o) && !nested) {
    const Py_ssize_t n = PyTuple_GET_SIZE(o);
    w.push_back(kSigTuple);
    w.push_back(n);
    for (Py_ssize_t i = 0; i < n; ++i) {
      if (!add_signature_words(w, PyTuple_GET_ITEM(o, i), true)) return false;
    }
  } else {
    return false;
  }
  return true;
}

py::object call_signature(py::args args) {
  thread_local std::vector<int64_t> words;
  words.clear();
  for (py::handle a : args) {
    if (!add_signature_words(words, a.ptr(), false)) return py::none();
  }
  return py::bytes(reinterpret_cast<const char*>(words.data()), words.size() * sizeof(int64_t));
}

// ---------------------------------------------------------------------------
// The `core` submodule.
// ---------------------------------------------------------------------------

void bind_core(py::module_& parent) {
  py::module_ m = parent.def_submodule("core", "torch_metal_flash's C++ op core (see torch_metal_flash/core)");

  m.def("init", [](py::object on_miss, py::object reference, py::object autograd, py::object debug_check,
                   py::object current_choice, py::object emulator_prepare, py::object emulator_encode) {
    std::lock_guard<std::mutex> lock(g_init_mutex);
    if (g_callbacks == nullptr) {
      g_callbacks = new Callbacks{on_miss,      reference,        autograd,       debug_check,
                                  current_choice, emulator_prepare, emulator_encode};
      g_emulator = std::make_shared<EmulatorEncoder>();
      g_stub = std::make_shared<StubEncoder>();
      set_encoder(Backend::Emulator, g_emulator);
    }
  });
  m.def("register_op", &core::register_op, py::arg("qualified_name"), py::arg("debug_check") = false,
        "Register the core's kernels for an op defined with torch.library (CPU, MPS and their autograd keys); "
        "returns its index.");
  m.def("set_thread_backend", &core::set_thread_choice, py::arg("name"),
        "Mirror this thread's torch_metal_flash.backend() choice (None: the environment decides).");
  m.def("set_thread_tuning", &core::set_thread_tuning, py::arg("token"),
        "Mirror this thread's forced tuning variants and emulator family (a token from torch_metal_flash.tuning).");
  m.def("set_tuning_generation", &core::set_tuning_generation, py::arg("generation"),
        "The tuning cache's generation: plans made under another are not reused.");
  m.def("call", [](int32_t op_index, py::sequence args) {
    torch::jit::Stack stack = to_stack(op_index, args);
    return core::call(op_index, stack);
  }, py::arg("op_index"), py::arg("args"), "Run the op's C++ body directly (the Python body hands calls over).");
  m.def("probe", [](int32_t op_index, const std::string& backend, py::sequence args) -> std::optional<std::string> {
    torch::jit::Stack stack = to_stack(op_index, args);
    return core::probe(op_index, backend, stack);
  }, py::arg("op_index"), py::arg("backend"), py::arg("args"),
     "None when `backend` runs the op's kernels for these arguments, else the reason (plan-cache backed).");
  m.def("run_plan", [](const std::string& backend, py::list launches) {
    auto plan = std::make_shared<PlanTemplate>();
    for (py::handle l : launches) {
      plan->launches.push_back(to_launch(l, true));
    }
    finish(*plan);
    core::run_plan(backend == "metal" ? Backend::Metal : Backend::Emulator, plan);
  }, py::arg("backend"), py::arg("launches"), "Encode a one-shot plan whose buffers are tensors or bytes.");
  m.def("plan_cache_info", [] {
    core::CacheInfo i = core::cache_info();
    py::dict d;
    d["hits"] = i.hits;
    d["misses"] = i.misses;
    d["evictions"] = i.evictions;
    d["size"] = i.size;
    d["capacity"] = i.capacity;
    d["verify"] = i.verify;
    return d;
  });
  m.def("plan_cache_clear", &clear_plan_cache);
  m.def("plan_cache_configure", &core::configure_cache, py::arg("capacity") = py::none(),
        py::arg("verify") = py::none(), py::arg("reset_counters") = false);
  m.def("run_counts", [](bool reset) {
    py::dict d;
    for (const auto& [name, n] : core::run_counts(reset)) d[py::str(name)] = n;
    return d;
  }, py::arg("reset") = false);
  m.def("use_stub_encoder", [](bool stub) {
    TORCH_CHECK(g_stub != nullptr, "torch_metal_flash core: core.init() has not been called");
    set_encoder(Backend::Emulator, stub ? g_stub : g_emulator);
  }, py::arg("stub"), "Replace the emulator encoder by one that encodes nothing (host-overhead benchmarks).");
  m.def("transpose_12", [](const at::Tensor& a, const at::Tensor& b, const at::Tensor& c) {
    return std::make_tuple(a.transpose(1, 2), b.transpose(1, 2), c.transpose(1, 2));
  }, "(a, b, c) with dims 1 and 2 swapped: the flash-attn faces' views, in one call.");
  m.def("signature", &call_signature,
        "The memo key of a face call's argument checks (bytes), or None when an argument is not a tensor, "
        "None, bool, int, float or a tuple of those.");
  m.def("has_encoder", [](const std::string& backend) {
    return core::encoder(backend == "metal" ? Backend::Metal : Backend::Emulator) != nullptr;
  });
}

}  // namespace tmf
