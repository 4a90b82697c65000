// When the neural-accelerator ("NAX") path can run: the rule, as plain C++ so
// that tests/tooling/test_neural_accelerators.py checks it on Linux. The
// launcher (launcher.mm) feeds it what Metal and the OS report.
//
// The path needs Metal 4's tensor operations on a GPU that has the
// accelerators: macOS 26.2 or newer, and a GPU architecture generation of at
// least 17 (M5, `MTLDevice.architecture.name` "applegpu_g17<variant>").
// Phone-class GPUs (variant 'p') need generation 18, as in MLX.
#pragma once

#include <cctype>
#include <string>

namespace torch_metal_flash {
namespace nax {

constexpr int kMacosMajor = 26;  // macOS 26.2
constexpr int kMacosMinor = 2;
constexpr int kGeneration = 17;
constexpr int kPhoneGeneration = 18;

struct Architecture {
  int generation = -1;  // -1: the name does not follow "applegpu_g<digits><variant>"
  char variant = '\0';  // the letter after the digits ('g', 's', 'd', 'p' ...)
};

// "applegpu_g17s" -> {17, 's'}.
inline Architecture parse_architecture(const std::string& name) {
  static const std::string prefix = "applegpu_g";
  Architecture a;
  if (name.compare(0, prefix.size(), prefix) != 0) {
    return a;
  }
  size_t i = prefix.size();
  int generation = 0;
  size_t digits = 0;
  for (; i < name.size() && std::isdigit(static_cast<unsigned char>(name[i])) && digits < 4; ++i, ++digits) {
    generation = generation * 10 + (name[i] - '0');
  }
  if (digits == 0) {
    return a;
  }
  a.generation = generation;
  a.variant = i < name.size() ? name[i] : '\0';
  return a;
}

// "" when the GPU named `name` has the accelerators, else why not.
inline std::string gpu_reason(const std::string& name) {
  const Architecture a = parse_architecture(name);
  const std::string gpu = "GPU " + (name.empty() ? std::string("(no architecture name)") : name);
  if (a.generation < 0) {
    return gpu + " (not an Apple GPU architecture name; the neural-accelerator path needs generation " +
           std::to_string(kGeneration) + ", M5 or newer)";
  }
  if (a.variant == 'p' && a.generation < kPhoneGeneration) {
    return gpu + " (phone-class 'p' GPUs need architecture generation " + std::to_string(kPhoneGeneration) + ")";
  }
  if (a.generation < kGeneration) {
    return gpu + " (needs architecture generation " + std::to_string(kGeneration) + ", M5 or newer)";
  }
  return "";
}

// Why the OS does not pass `@available(macOS 26.2, *)`, for a process that sees
// macOS `major`.`minor`.  macOS 26 reports itself as 16.x to programs built
// with an older SDK (its compatibility version), and then the availability
// check fails even on 26.2: that case is named, with the way out.
inline std::string os_reason(long major, long minor) {
  const std::string need = " (the neural-accelerator path needs macOS " + std::to_string(kMacosMajor) + "." +
                           std::to_string(kMacosMinor) + ")";
  if (major == 16) {
    return "macOS 26." + std::to_string(minor) + ", which this process sees as 16." + std::to_string(minor) +
           " (its compatibility version for programs built with an SDK older than macOS 26: run a Python built "
           "with the macOS 26 SDK, or set SYSTEM_VERSION_COMPAT=0)" + (minor < kMacosMinor ? need : "");
  }
  return "macOS " + std::to_string(major) + "." + std::to_string(minor) + need;
}

// Shader files of the path are compiled as Metal Shading Language 4.0.
// The kernel the launcher compiles (MSL 4.0) and builds a pipeline of before it
// turns the path on: one 16x32x16 tensor-op multiply, the shape the *_nax.metal
// kernels run (tests/tooling/test_neural_accelerators.py runs it in the emulator).
// The Command Line Tools compile the tensor ops at run time: a header that
// cannot be reached fails here, not in every attention call.
constexpr const char* kProbeKernel = "tmf_tensor_op_probe";
constexpr const char* kProbeSource = R"METAL(
#include <metal_stdlib>
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>
using namespace metal;

kernel void tmf_tensor_op_probe(device const half* a [[buffer(0)]], device const half* b [[buffer(1)]],
                                device float* d [[buffer(2)]], uint lane [[thread_index_in_simdgroup]]) {
  constexpr auto desc = mpp::tensor_ops::matmul2d_descriptor(
      16, 32, 16, false, true, true, mpp::tensor_ops::matmul2d_descriptor::mode::multiply);
  mpp::tensor_ops::matmul2d<desc, execution_simdgroup> op;
  auto x = op.get_left_input_cooperative_tensor<half, half, float>();
  auto y = op.get_right_input_cooperative_tensor<half, half, float>();
  auto z = op.get_destination_cooperative_tensor<decltype(x), decltype(y), float>();
  for (int i = 0; i < x.get_capacity(); i++) x[i] = a[lane * x.get_capacity() + i];
  for (int i = 0; i < y.get_capacity(); i++) y[i] = b[lane * y.get_capacity() + i];
  op.run(x, y, z);
  for (int i = 0; i < z.get_capacity(); i++) d[lane * z.get_capacity() + i] = z[i];
}
)METAL";

inline bool is_nax_source(const std::string& source) {
  static const std::string suffix = "_nax.metal";
  return source.size() >= suffix.size() && source.compare(source.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace nax
}  // namespace torch_metal_flash
