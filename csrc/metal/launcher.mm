// torch_metal_flash._C — the Metal launcher: the Metal encoder of the C++ op
// core (csrc/core), plus shader libraries and pipeline states.
//
// Builds only on macOS (Apple SDK + Metal framework). Our build machines are
// Linux: tests/tooling/test_cross_build.py cross-compiles and links it for arm64 macOS
// against Apple's SDK headers and the torch macOS wheel, and
// tests/tooling/test_launcher_typecheck.py type-checks its macOS 15 branch. It follows,
// call for call, the pattern PyTorch itself uses and tests for custom Metal
// kernels in C++ extensions:
//   * pytorch/pytorch test/cpp_extensions/mps_extension.mm (the cpp-extension
//     MPS test): device from at::mps::MPSDevice::getInstance()->device(),
//     newLibraryWithSource:options:error:, newComputePipelineStateWithFunction:
//     error:, then `MPSStream* s = getCurrentMPSStream(); dispatch_sync(
//     s->queue(), ^{ id<MTLComputeCommandEncoder> e = s->commandEncoder(); ...
//     dispatch ...; })` — no endEncoding;
//   * aten/src/ATen/native/mps/OperationUtils.h (torch 2.13): getMTLBufferStorage
//     (the tensor's storage data pointer *is* its id<MTLBuffer>) and
//     mtl_setBuffer (offset = storage_offset() * element_size());
//   * aten/src/ATen/mps/MPSStream.mm: dispatch_sync_with_rethrow (copied below,
//     see the note there); MPSStream::synchronize(SyncType::COMMIT) (TORCH_API)
//     for the commit after large plans.
// Torch headers relied on (torch 2.10-2.13: bench/results/torch_range.md):
//   <torch/extension.h>          pybind11, at::Tensor, TORCH_CHECK
//   <ATen/mps/MPSDevice.h>       at::mps::MPSDevice::getInstance()->device(),
//                                at::mps::is_available()              (TORCH_API)
//   <ATen/mps/MPSStream.h>       at::mps::getCurrentMPSStream()       (TORCH_API)
//                                MPSStream::queue() -> dispatch_queue_t (inline)
//                                MPSStream::commandEncoder() -> id<MTLComputeCommandEncoder>
//                                MPSStream::synchronize(SyncType)
// We do not include <ATen/native/mps/OperationUtils.h>: it is an internal
// header (pulls in MPSGraph, fmt, the shader-library machinery) and its
// helpers are one-liners, reproduced here with a comment each.
//
// Requirements: macOS 14+ (the shaders use `bfloat`, which needs Metal
// Shading Language 3.1), Apple-silicon GPU, torch 2.10 to 2.13 built with MPS.
// Compiled with ARC (-fobjc-arc); see setup.py.
//
// Python API (see torch_metal_flash/backends/metal.py and torch_metal_flash/core):
//   core.*                           the C++ op core (csrc/core/bridge.cpp)
//   set_shader_dir(path)             where the .metal/.h sources (and .metallib files) live
//   register_source(name, text)      a source generated at run time (FlexAttention), read as shader_dir/name
//   gpu_family() -> "apple7" | "apple8" | "apple9" | ... | "mac2" | "unknown"
//   neural_accelerators() -> "" when the neural-accelerator path can run, else why not
//   pipeline_info(source, kernel, function_constants) -> dict
//   math_mode() -> the MTLCompileOptions math setting in use (string)
//   library_info(source) -> dict     where a library came from (metallib or source)
//   set_commit(enabled, threads) / commit_policy() -> (enabled, threads)
//
// Function-constant type convention (Python value -> Metal type):
//   bool  -> MTLDataTypeBool   (`constant bool  x [[function_constant(i)]]`)
//   int   -> MTLDataTypeInt    (`constant int   x [[function_constant(i)]]`, 32-bit; range-checked)
//   float -> MTLDataTypeFloat  (`constant float x [[function_constant(i)]]`, 32-bit)
// A plan's value must match the type the kernel declares (checked, the error
// names the constant). Constants a kernel does not declare are ignored, and
// pipelines are cached by the values of the declared ones only.

#include <torch/extension.h>

#include <ATen/mps/MPSDevice.h>
#include <ATen/mps/MPSProfiler.h>
#include <ATen/mps/MPSStream.h>

#import <Foundation/Foundation.h>
#import <Metal/Metal.h>

#include "../core/bridge.h"
#include "../core/core.h"

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <fstream>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

#if !__has_feature(objc_arc)
#error "csrc/metal/launcher.mm must be compiled with -fobjc-arc (see setup.py)"
#endif

// MTLCompileOptions.mathMode / mathFloatingPointFunctions (macOS 15 SDK), declared
// when the SDK is older; used only behind @available(macOS 15.0, *).
#include "macos15_api.h"
// MTLLanguageVersion4_0 (macOS 26 SDK), likewise; used only behind @available(macOS 26.0, *).
#include "macos26_api.h"
// When the neural-accelerator path can run (plain C++: tested on Linux).
#include "neural_accelerators.h"

namespace py = pybind11;

namespace torch_metal_flash {
namespace {

// MSL 3.1 (macOS 14): needed for `bfloat`. Spelled as its raw value, as torch
// does for MTLLanguageVersion3_2, so that older SDK headers do not matter.
constexpr MTLLanguageVersion kLanguageVersion = (MTLLanguageVersion)((3 << 16) + 1);
constexpr const char* kLanguageVersionName = "3.1";
// MSL 4.0 (macOS 26): Metal 4 tensor operations, for the neural-accelerator
// sources (`*_nax.metal`) only; MTLLanguageVersion4_0 comes from macos26_api.h.
constexpr const char* kNaxLanguageVersionName = "4.0";

// ---------------------------------------------------------------------------
// The two torch helpers we use, reproduced.
// ---------------------------------------------------------------------------

// Same as at::native::mps::getMTLBufferStorage (OperationUtils.h): an MPS
// tensor's storage data pointer is its id<MTLBuffer>. Written as a __bridge
// cast because this file uses ARC (no ownership change).
inline id<MTLBuffer> mtl_buffer(const void* storage_data) {
  return (__bridge id<MTLBuffer>)(const_cast<void*>(storage_data));
}

// Same as at::mps::dispatch_sync_with_rethrow (MPSStream.mm, torch 2.13): run
// `block` synchronously on the stream's serial queue and rethrow, on the
// calling thread, any C++ exception it raised (an exception must not unwind
// through libdispatch). Copied rather than called because MPSStream.h declares
// it without TORCH_API (it is not part of the exported surface, and its
// namespace moved between torch releases).
void dispatch_sync_with_rethrow(dispatch_queue_t queue, void (^block)()) {
  __block std::optional<std::exception_ptr> block_exception;
  dispatch_sync(queue, ^() {
    try {
      block();
    } catch (...) {
      block_exception = std::current_exception();
    }
  });
  if (block_exception) {
    std::rethrow_exception(*block_exception);
  }
}

id<MTLDevice> device() {
  TORCH_CHECK(at::mps::is_available(), "torch_metal_flash._C: the MPS device is not available");
  id<MTLDevice> dev = at::mps::MPSDevice::getInstance()->device();
  TORCH_CHECK(dev != nil, "torch_metal_flash._C: torch returned no Metal device");
  return dev;
}

std::string ns_error_text(NSError* error) {
  if (error == nil) {
    return "(no error message from Metal)";
  }
  const char* text = error.localizedDescription.UTF8String;
  return text ? std::string(text) : std::string("(unprintable error message from Metal)");
}

MTLDataType metal_type(tmf::Constant::Type type) {
  switch (type) {
    case tmf::Constant::Type::Bool:
      return MTLDataTypeBool;
    case tmf::Constant::Type::Int:
      return MTLDataTypeInt;
    case tmf::Constant::Type::Float:
      return MTLDataTypeFloat;
  }
  return MTLDataTypeFloat;
}

const char* type_name(MTLDataType type) {
  return type == MTLDataTypeBool ? "bool" : type == MTLDataTypeInt ? "int" : type == MTLDataTypeFloat ? "float" : "another type";
}

// ---------------------------------------------------------------------------
// Shader sources: the project's own quoted #include "x.h" are inlined
// textually (recursively, each header once), because newLibraryWithSource
// has no include path. #line directives keep compiler messages pointing at
// the right file and line. <...> includes (metal_stdlib) are left alone.
// Limitation (by design, like #pragma once at the first textual occurrence):
// a header is pasted where it first appears, even inside a disabled #if
// branch, so do not include project headers conditionally.
// ---------------------------------------------------------------------------

std::string read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::in | std::ios::binary);
  TORCH_CHECK(in.good(), "torch_metal_flash._C: cannot read shader file ", path);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void check_shader_name(const std::string& name) {
  TORCH_CHECK(!name.empty() && name[0] != '/' && name.find("..") == std::string::npos,
              "torch_metal_flash._C: shader names are file names inside the shader directory, got '", name, "'");
}

// Returns true and sets `header` when `line` is `#include "header"`.
bool parse_quoted_include(const std::string& line, std::string& header) {
  size_t p = line.find_first_not_of(" \t");
  if (p == std::string::npos || line[p] != '#') {
    return false;
  }
  p = line.find_first_not_of(" \t", p + 1);
  if (p == std::string::npos || line.compare(p, 7, "include") != 0) {
    return false;
  }
  p = line.find_first_not_of(" \t", p + 7);
  if (p == std::string::npos || line[p] != '"') {
    return false;
  }
  size_t end = line.find('"', p + 1);
  if (end == std::string::npos) {
    return false;
  }
  header = line.substr(p + 1, end - p - 1);
  return true;
}

bool is_pragma_once(const std::string& line) {
  size_t p = line.find_first_not_of(" \t");
  if (p == std::string::npos || line[p] != '#') {
    return false;
  }
  p = line.find_first_not_of(" \t", p + 1);
  if (p == std::string::npos || line.compare(p, 6, "pragma") != 0) {
    return false;
  }
  p = line.find_first_not_of(" \t", p + 6);
  return p != std::string::npos && line.compare(p, 4, "once") == 0;
}

// Sources generated at run time (register_source), by name: read instead of a file of the shader directory.
std::mutex generated_mutex;
std::unordered_map<std::string, std::string>& generated_sources() {
  static auto* sources = new std::unordered_map<std::string, std::string>();
  return *sources;
}

std::string shader_text(const std::string& dir, const std::string& name) {
  {
    std::lock_guard<std::mutex> lock(generated_mutex);
    auto it = generated_sources().find(name);
    if (it != generated_sources().end()) {
      return it->second;
    }
  }
  return read_text_file(dir + "/" + name);
}

void inline_includes(const std::string& dir, const std::string& name, std::set<std::string>& seen, std::string& out) {
  check_shader_name(name);
  const std::string text = shader_text(dir, name);
  std::istringstream lines(text);
  std::string line;
  size_t lineno = 0;
  while (std::getline(lines, line)) {
    ++lineno;
    std::string header;
    if (parse_quoted_include(line, header)) {
      if (seen.insert(header).second) {
        out += "#line 1 \"" + header + "\"\n";
        inline_includes(dir, header, seen, out);
        out += "#line " + std::to_string(lineno + 1) + " \"" + name + "\"\n";
      } else {
        out += "// (already included: " + header + ")\n";
      }
    } else if (is_pragma_once(line)) {
      out += "// #pragma once (inlined)\n";  // meaningless once inlined; avoids a warning
    } else {
      out += line;
      out += '\n';
    }
  }
}

std::string preprocess_source(const std::string& dir, const std::string& source) {
  std::set<std::string> seen{source};
  std::string out = "#line 1 \"" + source + "\"\n";
  inline_includes(dir, source, seen, out);
  return out;
}

// ---------------------------------------------------------------------------
// Compile options: one math mode, safe (MTLMathModeSafe; fastMathEnabled = NO
// before macOS 15), for the precompiled metallibs (setup.py: -fno-fast-math)
// and run-time compiles alike, on every macOS. It is the only setting that
// exists on every supported macOS and honours NaN and infinity, so a NaN in
// the inputs propagates as in torch's SDPA (whose own Metal kernels are built
// safe too); relaxed needs macOS 15. The kernels are written to be correct
// under fast math as well (tests/kernels/test_math_modes.py runs every mode):
// TORCH_METAL_FLASH_MATH_MODE=relaxed|fast opts in, compiling from source
// (metallibs are used only in the mode they were built in).
// ---------------------------------------------------------------------------

enum class MathChoice { Safe, Relaxed, Fast };
constexpr MathChoice kMetallibMath = MathChoice::Safe;  // setup.py's -fno-fast-math

MathChoice requested_math_mode() {
  static const MathChoice choice = [] {
    const char* env = std::getenv("TORCH_METAL_FLASH_MATH_MODE");
    std::string v = env ? env : "";
    for (auto& ch : v) {
      ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    }
    if (v.empty() || v == "safe") {
      return MathChoice::Safe;
    }
    if (v == "relaxed") {
      return MathChoice::Relaxed;
    }
    TORCH_CHECK(v == "fast", "TORCH_METAL_FLASH_MATH_MODE must be safe, relaxed or fast, got '", v, "'");
    return MathChoice::Fast;
  }();
  return choice;
}

// Fills `options` and returns a description of what was set.
std::string configure_math(MTLCompileOptions* options) {
  const MathChoice choice = requested_math_mode();
  if (@available(macOS 15.0, *)) {
    switch (choice) {
      case MathChoice::Relaxed:
        options.mathMode = MTLMathModeRelaxed;
        options.mathFloatingPointFunctions = MTLMathFloatingPointFunctionsFast;
        return "relaxed (mathMode=Relaxed, mathFloatingPointFunctions=Fast)";
      case MathChoice::Safe:
        options.mathMode = MTLMathModeSafe;
        options.mathFloatingPointFunctions = MTLMathFloatingPointFunctionsPrecise;
        return "safe (mathMode=Safe, mathFloatingPointFunctions=Precise)";
      case MathChoice::Fast:
        options.mathMode = MTLMathModeFast;
        options.mathFloatingPointFunctions = MTLMathFloatingPointFunctionsFast;
        return "fast (mathMode=Fast, mathFloatingPointFunctions=Fast)";
    }
  }
  // macOS 14: only the deprecated boolean exists.
#pragma clang diagnostic push
#pragma clang diagnostic ignored "-Wdeprecated-declarations"
  TORCH_CHECK(choice != MathChoice::Relaxed, "TORCH_METAL_FLASH_MATH_MODE=relaxed needs macOS 15 (MTLMathModeRelaxed); "
              "use safe (the default) or fast");
  options.fastMathEnabled = choice == MathChoice::Fast ? YES : NO;
#pragma clang diagnostic pop
  return choice == MathChoice::Fast ? "fast (fastMathEnabled=YES; macOS 14)" : "safe (fastMathEnabled=NO; macOS 14)";
}

// What math_mode() reports: the mode every library of this process uses.
std::string math_mode_description() {
  static const char* names[] = {"safe", "relaxed", "fast"};
  const MathChoice choice = requested_math_mode();
  return std::string(names[static_cast<int>(choice)]) +
         (choice == kMetallibMath ? " (precompiled metallibs: -fno-fast-math; run-time compiles: MTLMathModeSafe, "
                                    "fastMathEnabled=NO before macOS 15)"
                                  : " (TORCH_METAL_FLASH_MATH_MODE; every library compiled from source at run time)");
}

bool metallib_math_matches() {
  return requested_math_mode() == kMetallibMath;
}

// ---------------------------------------------------------------------------
// The neural-accelerator path (Metal 4 tensor operations, M5 and newer): ""
// when this machine can run it, else why not (neural_accelerators.h has the
// rule). Read once: neither the GPU nor the OS changes under a process.
// ---------------------------------------------------------------------------

// "" when a small Metal 4 tensor-op kernel (nax::kProbeSource) compiles and
// builds a pipeline here, else why not (as llama.cpp test-compiles before it
// enables its tensor-API path).
std::string tensor_op_probe_reason() API_AVAILABLE(macos(26.0)) {
  @autoreleasepool {
    MTLCompileOptions* options = [MTLCompileOptions new];
    options.languageVersion = MTLLanguageVersion4_0;
    configure_math(options);
    NSError* error = nil;
    id<MTLLibrary> lib = [device() newLibraryWithSource:[NSString stringWithUTF8String:nax::kProbeSource]
                                                options:options
                                                  error:&error];
    id<MTLFunction> fn = lib == nil ? nil : [lib newFunctionWithName:[NSString stringWithUTF8String:nax::kProbeKernel]];
    id<MTLComputePipelineState> pso = fn == nil ? nil : [device() newComputePipelineStateWithFunction:fn error:&error];
    if (pso != nil) {
      return "";
    }
    std::string text = error != nil ? ns_error_text(error) : "no such kernel in the compiled probe";
    const size_t end = text.find('\n', text.find_first_not_of(" \n"));
    return "a Metal 4 tensor-op test kernel did not " + std::string(lib == nil ? "compile" : "build") + " here (" +
           text.substr(0, end) + "); the simdgroup kernels (apple9's tables) are used";
  }
}

std::string read_neural_accelerators_reason() {
  if (!at::mps::is_available()) {
    return "torch reports no MPS device";
  }
  @autoreleasepool {
    if (@available(macOS 14.0, *)) {  // MTLDevice.architecture
      const char* name = device().architecture.name.UTF8String;
      std::string why = nax::gpu_reason(name ? name : "");
      if (!why.empty()) {
        return why;
      }
    } else {
      return "macOS older than 14 (the neural-accelerator path needs macOS 26.2)";
    }
    if (@available(macOS 26.2, *)) {
      return tensor_op_probe_reason();
    }
    const NSOperatingSystemVersion v = [NSProcessInfo processInfo].operatingSystemVersion;
    return nax::os_reason(static_cast<long>(v.majorVersion), static_cast<long>(v.minorVersion));
  }
}

const std::string& neural_accelerators_reason() {
  static const std::string reason = read_neural_accelerators_reason();
  return reason;
}

// Sets the language version of `source` and returns its name: MSL 4.0 for a
// neural-accelerator source (only where the path can run: the error says why
// not), 3.1 for every other.
const char* set_language_version(MTLCompileOptions* options, const std::string& source) {
  if (!nax::is_nax_source(source)) {
    options.languageVersion = kLanguageVersion;
    return kLanguageVersionName;
  }
  if (@available(macOS 26.0, *)) {
    options.languageVersion = MTLLanguageVersion4_0;
    return kNaxLanguageVersionName;
  }
  TORCH_CHECK(false, "torch_metal_flash: shaders/", source, " needs Metal Shading Language ", kNaxLanguageVersionName,
              " (macOS 26)");
  return kNaxLanguageVersionName;
}

// ---------------------------------------------------------------------------
// Libraries, kernel reflection and pipeline states.
//
// Each is a slot in a map that `State::mutex` guards only while a slot is
// found or inserted, never while compiling. A slot is built once, under its
// own mutex, so a compile blocks only the calls that need that very library or
// pipeline; templates hold their pipeline slots, so cache hits take no lock.
// Nothing here holds the GIL (callers release it). State is leaked on purpose:
// no Metal objects are released during interpreter shutdown.
// ---------------------------------------------------------------------------

// A slot is built once: a build that fails keeps its message in `error` and
// is never retried (every later request gets the same error at once).
struct LibrarySlot {
  std::mutex mutex;
  bool built = false;
  std::string error;
  id<MTLLibrary> library = nil;
  std::string origin;  // where it came from (library_info)
};

struct KernelSlot {  // the function constants a kernel declares
  struct Declared {
    NSUInteger index;
    MTLDataType type;
    std::string name;
  };
  std::mutex mutex;
  bool built = false;
  std::string error;
  std::vector<Declared> constants;  // by index
};

struct PipelineSlot {
  std::mutex mutex;
  std::atomic<bool> built{false};
  std::string error;  // written before `built` is released
  id<MTLComputePipelineState> pso = nil;
  NSUInteger max_threads = 0, thread_width = 0, static_tg_memory = 0, tg_memory_limit = 0;
};

struct State {
  std::mutex mutex;
  std::string shader_dir;
  std::unordered_map<std::string, std::shared_ptr<LibrarySlot>> libraries;
  std::unordered_map<std::string, std::shared_ptr<KernelSlot>> kernels;
  std::unordered_map<std::string, std::shared_ptr<PipelineSlot>> pipelines;
};

State& state() {
  static State* s = new State();
  return *s;
}

// The slot for `key` (created empty), and the shader directory at that moment.
template <class Slot>
std::shared_ptr<Slot> find_slot(std::unordered_map<std::string, std::shared_ptr<Slot>> State::*map,
                                const std::string& key, std::string* shader_dir = nullptr) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (shader_dir != nullptr) {
    *shader_dir = s.shader_dir;
  }
  std::shared_ptr<Slot>& slot = (s.*map)[key];
  if (slot == nullptr) {
    slot = std::make_shared<Slot>();
  }
  return slot;
}

inline void mark_built(bool& built) { built = true; }
inline void mark_built(std::atomic<bool>& built) { built.store(true, std::memory_order_release); }

// Runs `build` for a slot whose mutex the caller holds and marks the slot
// built; a c10::Error it throws is kept in the slot first, then rethrown.
template <class Slot, class Build>
void build_or_remember(Slot& slot, Build&& build) {
  try {
    build();
  } catch (const c10::Error& e) {
    slot.error = e.what_without_backtrace();
    mark_built(slot.built);
    throw;
  }
  mark_built(slot.built);
}

bool file_exists(const std::string& path) {
  std::ifstream f(path, std::ios::in | std::ios::binary);
  return f.good();
}

// Builds `slot`: shaders/<stem>.metallib when present (built by setup.py with
// the Metal toolchain), else the source compiled at run time.
void build_library(LibrarySlot& slot, const std::string& dir, const std::string& source) {
  check_shader_name(source);
  if (nax::is_nax_source(source)) {  // before any compile or load: a clear reason, not a compiler log
    const std::string& why = neural_accelerators_reason();
    TORCH_CHECK(why.empty(), "torch_metal_flash: shaders/", source, " is a neural-accelerator kernel (Metal Shading "
                "Language ", kNaxLanguageVersionName, "), which this machine cannot run: ", why);
  }
  @autoreleasepool {
    id<MTLDevice> dev = device();
    const size_t dot = source.rfind('.');
    const std::string stem = dot == std::string::npos ? source : source.substr(0, dot);
    const std::string metallib = dir + "/" + stem + ".metallib";
    std::string metallib_failure;
    if (file_exists(metallib) && metallib_math_matches()) {
      NSError* error = nil;
      NSURL* url = [NSURL fileURLWithPath:[NSString stringWithUTF8String:metallib.c_str()]];
      id<MTLLibrary> lib = [dev newLibraryWithURL:url error:&error];
      if (lib != nil) {
        slot.library = lib;
        slot.origin = "shaders/" + stem + ".metallib (precompiled, safe math)";
        return;
      }
      metallib_failure = "; shaders/" + stem + ".metallib did not load: " + ns_error_text(error);
    }
    if (@available(macOS 14.0, *)) {
      // MSL 3.1 is available
    } else {
      TORCH_CHECK(false, "torch_metal_flash: the Metal kernels need macOS 14 or newer (Metal Shading Language ",
                  kLanguageVersionName, " for bfloat)");
    }
    const std::string text = preprocess_source(dir, source);
    NSString* ns_text = [NSString stringWithUTF8String:text.c_str()];
    TORCH_CHECK(ns_text != nil, "torch_metal_flash._C: shaders/", source, " (with its headers) is not valid UTF-8");

    MTLCompileOptions* options = [MTLCompileOptions new];
    const char* language = set_language_version(options, source);
    const std::string math = configure_math(options);
    NSError* error = nil;
    id<MTLLibrary> lib = [dev newLibraryWithSource:ns_text options:options error:&error];
    TORCH_CHECK(lib != nil, "torch_metal_flash: compiling shaders/", source, " with the Metal compiler failed (MSL ",
                language, ", math ", math, "):\n", ns_error_text(error));
    slot.library = lib;
    slot.origin = "shaders/" + source + " compiled at run time (MSL " + language + ", math " + math + ")" +
                  metallib_failure;
  }
}

// The library of `source`, built once (a failure is kept and rethrown).
std::shared_ptr<LibrarySlot> library(const std::string& source) {
  std::string dir;
  std::shared_ptr<LibrarySlot> slot = find_slot(&State::libraries, source, &dir);
  std::lock_guard<std::mutex> lock(slot->mutex);
  if (slot->built) {
    TORCH_CHECK(slot->error.empty(), slot->error);
    return slot;
  }
  TORCH_CHECK(!dir.empty(), "torch_metal_flash._C: set_shader_dir() has not been called");
  build_or_remember(*slot, [&] { build_library(*slot, dir, source); });
  return slot;
}

// The function constants `kernel` declares, from its unspecialised function.
std::shared_ptr<KernelSlot> kernel_constants(const std::string& source, const std::string& kernel) {
  std::shared_ptr<KernelSlot> slot = find_slot(&State::kernels, source + "\n" + kernel);
  std::lock_guard<std::mutex> lock(slot->mutex);
  if (slot->built) {
    TORCH_CHECK(slot->error.empty(), slot->error);
    return slot;
  }
  build_or_remember(*slot, [&] {
    id<MTLLibrary> lib = library(source)->library;
    @autoreleasepool {
      NSString* name = [NSString stringWithUTF8String:kernel.c_str()];
      TORCH_CHECK(name != nil, "torch_metal_flash._C: kernel name is not valid UTF-8");
      id<MTLFunction> fn = [lib newFunctionWithName:name];
      TORCH_CHECK(fn != nil, "torch_metal_flash: shaders/", source, " has no kernel named '", kernel, "'");
      NSArray<MTLFunctionConstant*>* declared = fn.functionConstantsDictionary.allValues;
      for (NSUInteger i = 0; i < declared.count; ++i) {
        MTLFunctionConstant* c = [declared objectAtIndex:i];
        const char* cname = c.name.UTF8String;
        slot->constants.push_back({c.index, c.type, cname ? cname : "?"});
      }
    }
    std::sort(slot->constants.begin(), slot->constants.end(),
              [](const KernelSlot::Declared& a, const KernelSlot::Declared& b) { return a.index < b.index; });
  });
  return slot;
}

void build_pipeline(PipelineSlot& slot, const std::string& source, const std::string& kernel, const std::string& key,
                    const std::vector<tmf::Constant>& values);

// The pipeline of `kernel` specialised with the values of the constants it
// declares (others are ignored), built once (a failure is kept and rethrown).
std::shared_ptr<PipelineSlot> pipeline(const std::string& source, const std::string& kernel,
                                       const std::vector<tmf::Constant>& given) {
  std::shared_ptr<KernelSlot> declared = kernel_constants(source, kernel);
  std::vector<tmf::Constant> values;
  std::string key = source + "\n" + kernel + "\n";
  for (const KernelSlot::Declared& d : declared->constants) {
    const tmf::Constant* value = nullptr;
    for (const tmf::Constant& c : given) {
      if (c.index == d.index) {
        value = &c;
      }
    }
    if (value == nullptr) {
      key += std::to_string(d.index) + ":unset;";  // Metal names it if it is required
      continue;
    }
    TORCH_CHECK(metal_type(value->type) == d.type, "torch_metal_flash: kernel '", kernel, "' declares function constant ",
                d.name, " [[function_constant(", d.index, ")]] as ", type_name(d.type), ", the plan passes a ",
                type_name(metal_type(value->type)));
    values.push_back(*value);
    uint32_t bits = 0;
    std::memcpy(&bits, value->data(), value->type == tmf::Constant::Type::Bool ? 1 : 4);
    key += std::to_string(d.index) + ":" + std::to_string(bits) + ";";
  }
  std::shared_ptr<PipelineSlot> slot = find_slot(&State::pipelines, key);
  if (slot->built.load(std::memory_order_acquire)) {
    TORCH_CHECK(slot->error.empty(), slot->error);
    return slot;
  }
  std::lock_guard<std::mutex> lock(slot->mutex);
  if (slot->built.load(std::memory_order_relaxed)) {
    TORCH_CHECK(slot->error.empty(), slot->error);
    return slot;
  }
  build_or_remember(*slot, [&] { build_pipeline(*slot, source, kernel, key, values); });
  return slot;
}

void build_pipeline(PipelineSlot& slot, const std::string& source, const std::string& kernel,
                    const std::string& key, const std::vector<tmf::Constant>& values) {
  id<MTLLibrary> lib = library(source)->library;
  @autoreleasepool {
    MTLFunctionConstantValues* constant_values = [MTLFunctionConstantValues new];
    for (const tmf::Constant& c : values) {
      [constant_values setConstantValue:c.data() type:metal_type(c.type) atIndex:c.index];
    }
    NSString* name = [NSString stringWithUTF8String:kernel.c_str()];
    NSError* error = nil;
    id<MTLFunction> fn = [lib newFunctionWithName:name constantValues:constant_values error:&error];
    TORCH_CHECK(fn != nil, "torch_metal_flash: cannot specialise kernel '", kernel, "' of shaders/", source,
                " ({", key.substr(source.size() + kernel.size() + 2), "}):\n", ns_error_text(error));
    error = nil;
    id<MTLComputePipelineState> pso = [device() newComputePipelineStateWithFunction:fn error:&error];
    TORCH_CHECK(pso != nil, "torch_metal_flash: cannot build the pipeline state of kernel '", kernel, "' (shaders/",
                source, "):\n", ns_error_text(error));
    slot.pso = pso;
    slot.max_threads = pso.maxTotalThreadsPerThreadgroup;
    slot.thread_width = pso.threadExecutionWidth;
    slot.static_tg_memory = pso.staticThreadgroupMemoryLength;
    slot.tg_memory_limit = pso.device.maxThreadgroupMemoryLength;
  }
}

// ---------------------------------------------------------------------------
// Commit policy. After each plan, SyncType::COMMIT_ADAPTIVE, as torch's own
// MPSGraph ops: the stream commits when the allocator runs low on memory, so
// that buffers of finished work can be reused, and keeps encoding otherwise.
// TORCH_METAL_FLASH_COMMIT_THREADS=N also commits (never waits) after every
// plan of at least N threads, so the GPU starts on it while the host encodes
// what follows (bench/timing.py --commit measures it); TORCH_METAL_FLASH_COMMIT=0
// turns committing off.
// ---------------------------------------------------------------------------

struct CommitPolicy {
  std::atomic<bool> enabled{true};
  std::atomic<int64_t> threads{-1};  // -1: adaptive only
};

CommitPolicy& commit_policy() {
  static CommitPolicy* p = [] {
    auto* c = new CommitPolicy();
    if (const char* env = std::getenv("TORCH_METAL_FLASH_COMMIT")) {
      const std::string v = env;
      c->enabled = !(v == "0" || v == "off" || v == "false" || v == "no");
    }
    if (const char* env = std::getenv("TORCH_METAL_FLASH_COMMIT_THREADS")) {
      c->threads = std::max<int64_t>(0, std::atoll(env));
    }
    return c;
  }();
  return *p;
}

at::mps::SyncType commit_after(int64_t plan_threads) {
  CommitPolicy& policy = commit_policy();
  if (!policy.enabled.load(std::memory_order_relaxed)) {
    return at::mps::SyncType::NONE;
  }
  const int64_t threshold = policy.threads.load(std::memory_order_relaxed);
  return threshold >= 0 && plan_threads >= threshold ? at::mps::SyncType::COMMIT : at::mps::SyncType::COMMIT_ADAPTIVE;
}

// ---------------------------------------------------------------------------
// The Metal encoder of the C++ op core.
// ---------------------------------------------------------------------------

class MetalEncoder final : public tmf::Encoder {
 public:
  const std::string& name() const override { return name_; }
  c10::DeviceType device_type() const override { return c10::DeviceType::MPS; }

  // Compile (once) and check the launch against its pipeline's limits here,
  // before any launch of the plan is encoded.
  void prepare(tmf::LaunchTemplate& launch) override {
    std::shared_ptr<PipelineSlot> p = pipeline(launch.source, launch.kernel, launch.constants);
    const auto& t = launch.threadgroup;
    const NSUInteger per_group = static_cast<NSUInteger>(t[0]) * t[1] * t[2];
    TORCH_CHECK(per_group <= p->max_threads, "torch_metal_flash: kernel '", launch.kernel, "' planned with ",
                per_group, " threads per threadgroup, but its pipeline allows at most ", p->max_threads,
                " on this GPU (register pressure or [[max_total_threads_per_threadgroup]])");
    NSUInteger tg_bytes = p->static_tg_memory;
    for (const auto& m : launch.threadgroup_memory) {
      tg_bytes += m.second;
    }
    TORCH_CHECK(tg_bytes <= p->tg_memory_limit, "torch_metal_flash: kernel '", launch.kernel, "' needs ", tg_bytes,
                " bytes of threadgroup memory (", p->static_tg_memory, " static), this GPU allows ", p->tg_memory_limit);
    launch.prepared = p;
  }

  // One dispatch_sync per plan: PyTorch's pattern, on its stream's shared
  // compute encoder (never our own, never ended here).
  void encode(const tmf::PlanTemplate& plan, const tmf::BoundBuffer* buffers) override {
    at::mps::MPSStream* stream = at::mps::getCurrentMPSStream();
    TORCH_CHECK(stream != nullptr, "torch_metal_flash._C: no current MPS stream");
    const at::mps::SyncType commit = commit_after(plan.threads);
    const tmf::PlanTemplate* p = &plan;
    tmf::bridge::WithoutGil no_gil;
    dispatch_sync_with_rethrow(stream->queue(), ^() {
      @autoreleasepool {
        id<MTLComputeCommandEncoder> enc = stream->commandEncoder();
        TORCH_CHECK(enc != nil, "torch_metal_flash._C: the MPS stream returned no compute encoder");
        at::mps::Profiler::MPSProfiler& profiler = at::mps::getMPSProfiler();
        size_t n = 0;
        for (const tmf::LaunchTemplate& l : p->launches) {
          id<MTLComputePipelineState> pso = static_cast<const PipelineSlot*>(l.prepared.get())->pso;
          // as torch's own kernels: the profiler sees each dispatch (it does nothing unless enabled)
          profiler.beginProfileKernel((__bridge const void*)pso, l.kernel, {});
          [enc setComputePipelineState:pso];
          for (size_t i = 0; i < l.buffers.size(); ++i, ++n) {
            const tmf::BoundBuffer& b = buffers[n];
            if (b.bytes != nullptr) {
              [enc setBytes:b.bytes length:b.nbytes atIndex:b.index];
            } else {  // as at::native::mps::mtl_setBuffer
              [enc setBuffer:mtl_buffer(b.storage) offset:b.offset atIndex:b.index];
            }
          }
          for (const auto& m : l.threadgroup_memory) {
            [enc setThreadgroupMemoryLength:m.second atIndex:m.first];
          }
          const auto& g = l.threadgroups;
          if (g[0] != 0 && g[1] != 0 && g[2] != 0) {
            [enc dispatchThreadgroups:MTLSizeMake(g[0], g[1], g[2])
                threadsPerThreadgroup:MTLSizeMake(l.threadgroup[0], l.threadgroup[1], l.threadgroup[2])];
          }
          profiler.endProfileKernel((__bridge const void*)pso);
        }
        if (commit != at::mps::SyncType::NONE) {
          stream->synchronize(commit);  // ends the encoder and commits (never waits)
        }
      }
    });
  }

 private:
  std::string name_ = "metal";
};

// ---------------------------------------------------------------------------
// Python entry points. Each releases the GIL before taking any lock.
// ---------------------------------------------------------------------------

void set_shader_dir(const std::string& path) {
  TORCH_CHECK(!path.empty(), "torch_metal_flash._C.set_shader_dir: empty path");
  py::gil_scoped_release no_gil;
  bool changed = false;
  {
    State& s = state();
    std::lock_guard<std::mutex> lock(s.mutex);
    if (s.shader_dir != path) {
      // Different sources: forget what was built from the old directory.
      s.shader_dir = path;
      s.libraries.clear();
      s.kernels.clear();
      s.pipelines.clear();
      changed = true;
    }
  }
  if (changed) {
    tmf::clear_plan_cache();  // templates hold pipelines of the old directory
  }
}

void register_source(const std::string& name, const std::string& text) {
  check_shader_name(name);
  py::gil_scoped_release no_gil;
  std::lock_guard<std::mutex> lock(generated_mutex);
  generated_sources()[name] = text;
}

std::string neural_accelerators() {
  py::gil_scoped_release no_gil;
  return neural_accelerators_reason();
}

std::string gpu_family() {
  @autoreleasepool {
    id<MTLDevice> dev = device();
    // MTLGPUFamilyApple1 = 1001 ... Apple9 = 1009 (M3/M4), 1010, 1011 in newer
    // SDKs: probed by raw value so that the SDK version does not matter.
    for (NSInteger family = 1011; family >= 1001; --family) {
      if ([dev supportsFamily:(MTLGPUFamily)family]) {
        return "apple" + std::to_string(family - 1000);
      }
    }
    if ([dev supportsFamily:MTLGPUFamilyMac2]) {
      return "mac2";
    }
    return "unknown";
  }
}

py::dict pipeline_info(const std::string& source, const std::string& kernel,
                       const std::vector<std::pair<int64_t, py::object>>& function_constants) {
  std::vector<tmf::Constant> constants;
  for (const auto& item : function_constants) {
    constants.push_back(tmf::to_constant(item.first, item.second));
  }
  std::shared_ptr<PipelineSlot> p;
  {
    py::gil_scoped_release no_gil;
    p = pipeline(source, kernel, constants);
  }
  py::dict info;
  info["max_total_threads_per_threadgroup"] = static_cast<int64_t>(p->max_threads);
  info["thread_execution_width"] = static_cast<int64_t>(p->thread_width);
  info["static_threadgroup_memory_length"] = static_cast<int64_t>(p->static_tg_memory);
  info["max_threadgroup_memory_length"] = static_cast<int64_t>(p->tg_memory_limit);
  return info;
}

py::dict library_info(const std::string& source) {
  std::shared_ptr<LibrarySlot> lib;
  {
    py::gil_scoped_release no_gil;
    lib = library(source);
  }
  py::dict info;
  info["origin"] = lib->origin;
  return info;
}

std::string math_mode() {
  return math_mode_description();
}

}  // namespace
}  // namespace torch_metal_flash

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace tmfl = torch_metal_flash;
  m.doc() = "torch_metal_flash Metal launcher: the C++ op core with its Metal encoder";
  tmf::bind_core(m);
  if (at::mps::is_available()) {
    tmf::set_encoder(tmf::Backend::Metal, std::make_shared<tmfl::MetalEncoder>());
  }
  m.def("set_shader_dir", &tmfl::set_shader_dir, py::arg("path"),
        "Directory of the .metal/.h shader sources and .metallib files (caches are dropped when it changes).");
  m.def("register_source", &tmfl::register_source, py::arg("name"), py::arg("text"),
        "A shader source generated at run time, compiled as if it were the file `name` of the shader directory.");
  m.def("gpu_family", &tmfl::gpu_family, "Highest Apple GPU family the device supports, e.g. 'apple8'.");
  m.def("neural_accelerators", &tmfl::neural_accelerators,
        "'' when the neural-accelerator path (MSL 4.0 *_nax.metal kernels: macOS 26.2+, GPU generation 17+) can "
        "run, else why not.");
  m.def("pipeline_info", &tmfl::pipeline_info, py::arg("source"), py::arg("kernel"),
        py::arg("function_constants") = std::vector<std::pair<int64_t, py::object>>{},
        "Limits of a kernel's pipeline state (max threads per threadgroup, SIMD width, threadgroup memory).");
  m.def("library_info", &tmfl::library_info, py::arg("source"),
        "Where the library of a shader file came from (its .metallib or the source compiled at run time).");
  m.def("math_mode", &tmfl::math_mode, "The floating-point math mode every library of the process uses.");
  m.def("set_commit", [](bool enabled, int64_t threads) {
    TORCH_CHECK(threads >= -1, "set_commit: threads must be >= 0, or -1 (adaptive commits only)");
    tmfl::commit_policy().enabled = enabled;
    tmfl::commit_policy().threads = threads;
  }, py::arg("enabled"), py::arg("threads") = int64_t{1 << 16},
     "Commit (never wait) after plans of at least `threads` threads; TORCH_METAL_FLASH_COMMIT(_THREADS).");
  m.def("commit_policy", [] {
    return py::make_tuple(tmfl::commit_policy().enabled.load(), tmfl::commit_policy().threads.load());
  });
  m.attr("LANGUAGE_VERSION") = tmfl::kLanguageVersionName;
  m.attr("NAX_LANGUAGE_VERSION") = tmfl::kNaxLanguageVersionName;
}
