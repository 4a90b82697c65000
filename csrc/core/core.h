// The C++ op core of torch_metal_flash: generic op bodies, the plan cache and
// the Encoder seam (see docs/core.md).
//
// An op registered with the core (core::register_op, from Python) gets one
// boxed kernel for the CPU key and, when a Metal encoder exists, the MPS key.
// A call builds a key from its arguments (walking the IValues of the schema),
// looks up a PlanTemplate and, on a hit, allocates outputs and scratch, binds
// them with the arguments and hands the template to an Encoder: no Python, no
// strings.  On a miss the Python planner runs once (a callback) and its Plan
// becomes the template.  Backend choice, fallback and the reference path
// follow torch_metal_flash.backends exactly (the fallback calls Python).
//
// Encoders: "metal" (csrc/metal/launcher.mm, MPS tensors), "emulator" (the
// Python emulator backend through a callback, CPU tensors) and "stub" (does
// nothing: bench/overhead.py measures the host path with it).
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace tmf {

// One [[function_constant(index)]] value; typed like the plan's Python value.
struct Constant {
  enum class Type : uint8_t { Bool, Int, Float };
  uint32_t index = 0;
  Type type = Type::Bool;
  bool b = false;
  int32_t i = 0;
  float f = 0.0f;

  const void* data() const { return type == Type::Bool ? static_cast<const void*>(&b)
                                    : type == Type::Int ? static_cast<const void*>(&i)
                                                        : static_cast<const void*>(&f); }
  bool operator==(const Constant& o) const {
    return index == o.index && type == o.type && b == o.b && i == o.i && f == o.f;
  }
};

// What a [[buffer(index)]] of a launch binds, expressed so that a template can
// be replayed with another call's tensors.
enum class RefKind : uint8_t {
  Arg,     // the op's argument `source` (a tensor), at its storage offset
  Output,  // the op's output `source`
  Scratch, // the template's scratch tensor `source`
  Bytes,   // `bytes` by value (a packed params struct)
  Tensor,  // `tensor` itself (one-shot plans run with run_plan only)
};

struct BufferRef {
  uint32_t index = 0;
  RefKind kind = RefKind::Bytes;
  int32_t source = 0;
  int64_t nbytes = 0;  // the bound view's extent in bytes (tensor kinds)
  std::string bytes;
  at::Tensor tensor;

  bool operator==(const BufferRef& o) const {
    return index == o.index && kind == o.kind && source == o.source && nbytes == o.nbytes && bytes == o.bytes;
  }
};

struct LaunchTemplate {
  std::string source;  // shader file, e.g. "flash_fwd.metal"
  std::string kernel;  // [[host_name]]
  std::vector<Constant> constants;
  std::vector<BufferRef> buffers;
  std::array<uint32_t, 3> threadgroups{1, 1, 1};
  std::array<uint32_t, 3> threadgroup{1, 1, 1};
  std::vector<std::pair<uint32_t, uint32_t>> threadgroup_memory;  // (index, bytes, rounded to 16)
  // The encoder's handle (a pipeline-table slot, a Python object), set by Encoder::prepare.
  std::shared_ptr<void> prepared;

  bool same_launch(const LaunchTemplate& o) const {
    return source == o.source && kernel == o.kernel && constants == o.constants && buffers == o.buffers &&
           threadgroups == o.threadgroups && threadgroup == o.threadgroup && threadgroup_memory == o.threadgroup_memory;
  }
};

// An output or scratch tensor of a template: allocated per call (uninitialised).
struct TensorSpec {
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  at::ScalarType dtype = at::kFloat;

  TensorSpec() = default;
  explicit TensorSpec(const at::Tensor& t)
      : sizes(t.sizes().vec()), strides(t.strides().vec()), dtype(t.scalar_type()) {}

  bool operator==(const TensorSpec& o) const { return sizes == o.sizes && strides == o.strides && dtype == o.dtype; }
};

enum class PlanKind : uint8_t {
  Kernels,      // run `launches`
  Unsupported,  // the kernels do not cover it: fall back (warning / strict error) with `reason`
  Reference,    // nothing for a kernel to do (empty problem): the reference path, silently
};

struct PlanTemplate {
  PlanKind kind = PlanKind::Kernels;
  std::string reason;
  std::vector<TensorSpec> outputs;
  std::vector<TensorSpec> scratch;
  std::vector<LaunchTemplate> launches;
  int64_t threads = 0;  // threads dispatched over all launches (the encoder's commit heuristic)
  size_t num_buffers = 0;  // sum of launches[i].buffers.size()
};

// One binding resolved for a call.  Tensors: `storage` is the storage's data
// pointer (an id<MTLBuffer> on MPS), `offset` the view's byte offset in it.
// Bytes: `bytes` points at `nbytes` bytes and `storage` is null.
struct BoundBuffer {
  uint32_t index = 0;
  const void* storage = nullptr;
  uint64_t offset = 0;
  uint64_t nbytes = 0;
  const void* bytes = nullptr;
};

class Encoder {
 public:
  virtual ~Encoder() = default;
  std::atomic<uint64_t> runs{0};  // plans encoded (run_counts())
  // The name run_counts() reports ("metal", "emulator", "stub").
  virtual const std::string& name() const = 0;
  virtual c10::DeviceType device_type() const = 0;
  // Called once per launch of a new template, without the GIL: look up or
  // build what encode() needs (may compile).
  virtual void prepare(LaunchTemplate& launch) = 0;
  // Encode every launch of `plan`; `buffers` holds plan.num_buffers bindings,
  // launch by launch in template order.
  virtual void encode(const PlanTemplate& plan, const BoundBuffer* buffers) = 0;
};

// Backend slots an encoder can fill.
enum class Backend : uint8_t { Metal = 0, Emulator = 1 };

// Installs the encoder serving `backend` (the core owns it); drops the plan cache.
void set_encoder(Backend backend, std::shared_ptr<Encoder> encoder);

// Drops every cached template (e.g. the shader directory changed).
void clear_plan_cache();

}  // namespace tmf
