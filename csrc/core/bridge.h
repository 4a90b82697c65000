// Between the core (core.cpp, no Python) and Python (bridge.cpp): the
// callbacks into torch_metal_flash.core and the functions the bindings expose.
#pragma once

#include "core.h"

#include <ATen/core/function_schema.h>
#include <ATen/core/stack.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace pybind11 {
class handle;
class module_;
}

namespace tmf {

// The outputs and scratch tensors of one call (the planner's, on a miss).
struct CallTensors {
  bool filled = false;
  std::vector<at::Tensor> outputs;
  std::vector<at::Tensor> scratch;
};

namespace bridge {

// Why a call takes the reference path (the Python side acts accordingly).
enum class Why : int {
  Selected = 0,     // the reference backend is selected: run it, count it
  Route = 1,        // the selected backend cannot serve the call: backends.resolve warns / raises
  Unsupported = 2,  // the planner's reason: warn once / raise in strict mode
  Empty = 3,        // nothing for a kernel to do: run the reference silently
};

// The contextvar choice of torch_metal_flash.backend() (None: the environment).
std::optional<std::string> current_choice();

// Plans a call in Python for `encoder` and returns the template; on a kernels plan, `call`
// receives the outputs and scratch the planner allocated for this call.
std::shared_ptr<PlanTemplate> plan(int32_t op_index, const std::string& encoder, c10::ArrayRef<c10::IValue> args,
                                   CallTensors* call);

// Runs the reference path in Python and returns the op's outputs.
std::vector<at::Tensor> reference(int32_t op_index, Why why, const std::string& reason,
                                  c10::ArrayRef<c10::IValue> args);

// Validates the argument values on the host (the op's debug check, TORCH_METAL_FLASH_DEBUG=1).
void debug_check(int32_t op_index, c10::ArrayRef<c10::IValue> args);

// Runs the op's Python autograd formula (a call that needs a graph).
std::vector<at::Tensor> autograd(int32_t op_index, c10::ArrayRef<c10::IValue> args);

// Releases the GIL for its scope when the calling thread holds it.
class WithoutGil {
 public:
  WithoutGil();
  ~WithoutGil();
  WithoutGil(const WithoutGil&) = delete;
  WithoutGil& operator=(const WithoutGil&) = delete;

 private:
  void* state_ = nullptr;
};

}  // namespace bridge

namespace core {

struct CacheInfo {
  uint64_t hits, misses, evictions;
  size_t size, capacity;
  bool verify;
};

int32_t register_op(const std::string& qualified_name, bool debug_check);
void set_thread_choice(const std::optional<std::string>& name);
void set_thread_tuning(int64_t token);
void set_tuning_generation(int64_t generation);
std::vector<at::Tensor> call(int32_t op_index, torch::jit::Stack& args);
std::optional<std::string> probe(int32_t op_index, const std::string& backend, torch::jit::Stack& args);
const c10::FunctionSchema& schema(int32_t op_index);
void run_plan(Backend backend, std::shared_ptr<PlanTemplate> plan);
CacheInfo cache_info();
void configure_cache(std::optional<int64_t> capacity, std::optional<bool> verify, bool reset_counters);
std::vector<std::pair<std::string, uint64_t>> run_counts(bool reset);
Encoder* encoder(Backend backend);

}  // namespace core

// A plan's function-constant value (bool / int / float) as a typed Constant.
Constant to_constant(int64_t index, const pybind11::handle& value);

// The core's Python API, added to the extension module `m` (the Linux core
// module and, on macOS, torch_metal_flash._C).
void bind_core(pybind11::module_& m);

}  // namespace tmf
