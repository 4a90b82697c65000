// torch_metal_flash._C — the Metal launcher: encodes a planned kernel launch on
// PyTorch's current MPS stream.
//
// NOT COMPILED IN CI. This file builds only on macOS (Apple SDK + Metal
// framework); our build machines are Linux, so it has never been compiled by
// us on real hardware. It was written to follow, call for call, the pattern
// PyTorch itself uses and tests for custom Metal kernels in C++ extensions:
//   * pytorch/pytorch test/cpp_extensions/mps_extension.mm (the cpp-extension
//     MPS test): device from at::mps::MPSDevice::getInstance()->device(),
//     newLibraryWithSource:options:error:, newComputePipelineStateWithFunction:
//     error:, then `MPSStream* s = getCurrentMPSStream(); dispatch_sync(
//     s->queue(), ^{ id<MTLComputeCommandEncoder> e = s->commandEncoder(); ...
//     dispatch ...; })` — no endEncoding, no commit;
//   * aten/src/ATen/native/mps/OperationUtils.h (torch 2.13): getMTLBufferStorage
//     (the tensor's storage data pointer *is* its id<MTLBuffer>) and
//     mtl_setBuffer (offset = storage_offset() * element_size());
//   * aten/src/ATen/mps/MPSStream.mm: dispatch_sync_with_rethrow (copied below,
//     see the note there).
// Torch headers relied on (torch 2.13, checked against the installed headers):
//   <torch/extension.h>          pybind11, at::Tensor, TORCH_CHECK
//   <ATen/mps/MPSDevice.h>       at::mps::MPSDevice::getInstance()->device(),
//                                at::mps::is_available()              (TORCH_API)
//   <ATen/mps/MPSStream.h>       at::mps::getCurrentMPSStream()       (TORCH_API)
//                                MPSStream::queue() -> dispatch_queue_t (inline)
//                                MPSStream::commandEncoder() -> id<MTLComputeCommandEncoder>
// We do not include <ATen/native/mps/OperationUtils.h>: it is an internal
// header (pulls in MPSGraph, fmt, the shader-library machinery) and its
// helpers are one-liners, reproduced here with a comment each.
//
// Requirements: macOS 14+ (the shaders use `bfloat`, which needs Metal
// Shading Language 3.1), Apple-silicon GPU, torch 2.13 built with MPS.
// Compiled with ARC (-fobjc-arc); see setup.py.
//
// Python API (see torch_metal_flash/backends/metal.py, the only caller):
//   set_shader_dir(path)             where the .metal/.h sources live
//   launch(source, kernel, function_constants, buffer_indices, buffers,
//          threadgroups, threadgroup, threadgroup_memory)
//   gpu_family() -> "apple7" | "apple8" | "apple9" | ... | "mac2" | "unknown"
//   pipeline_info(source, kernel, function_constants) -> dict
//   math_mode() -> the MTLCompileOptions math setting in use (string)
//
// Function-constant type convention (Python value -> Metal type):
//   bool  -> MTLDataTypeBool   (`constant bool  x [[function_constant(i)]]`)
//   int   -> MTLDataTypeInt    (`constant int   x [[function_constant(i)]]`, 32-bit; range-checked)
//   float -> MTLDataTypeFloat  (`constant float x [[function_constant(i)]]`, 32-bit)
// A shader that declares another type (uint, short, half ...) cannot be fed by
// this launcher; Metal rejects a type mismatch when specializing the function
// and the error names the constant.

#include <torch/extension.h>

#include <ATen/mps/MPSDevice.h>
#include <ATen/mps/MPSStream.h>

#import <Foundation/Foundation.h>
#import <Metal/Metal.h>

#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <fstream>
#include <limits>
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

// MTLCompileOptions.mathMode / mathFloatingPointFunctions exist from the
// macOS 15 SDK on. When building with an older SDK, declare them exactly as
// torch 2.13 does in ATen/native/mps/MPSGraphSequoiaOps.h (same guard); they
// are only used behind @available(macOS 15.0, *).
#if !defined(__MAC_15_0) && (!defined(MAC_OS_X_VERSION_15_0) || (MAC_OS_X_VERSION_MIN_REQUIRED < MAC_OS_X_VERSION_15_0))
typedef NS_ENUM(NSInteger, MTLMathMode) {
  MTLMathModeSafe = 0,
  MTLMathModeRelaxed = 1,
  MTLMathModeFast = 2,
};

typedef NS_ENUM(NSInteger, MTLMathFloatingPointFunctions) {
  MTLMathFloatingPointFunctionsFast = 0,
  MTLMathFloatingPointFunctionsPrecise = 1,
};

@interface MTLCompileOptions ()
@property(readwrite, nonatomic) MTLMathMode mathMode;
@property(readwrite, nonatomic) MTLMathFloatingPointFunctions mathFloatingPointFunctions;
@end
#endif

namespace py = pybind11;

namespace torch_metal_flash {
namespace {

// MSL 3.1 (macOS 14): needed for `bfloat`. Spelled as its raw value, as torch
// does for MTLLanguageVersion3_2, so that older SDK headers do not matter.
constexpr MTLLanguageVersion kLanguageVersion = (MTLLanguageVersion)((3 << 16) + 1);
constexpr const char* kLanguageVersionName = "3.1";

// Metal limits checked here so that a bad plan fails with a clear message
// instead of a Metal validation abort.
constexpr int64_t kMaxBufferIndex = 30;      // 31 buffer-argument-table entries
constexpr size_t kMaxSetBytesLength = 4096;  // setBytes:length:atIndex: "smaller than 4 KB"
constexpr int64_t kMaxFunctionConstantIndex = 65535;

// ---------------------------------------------------------------------------
// The two torch helpers we use, reproduced.
// ---------------------------------------------------------------------------

// Same as at::native::mps::getMTLBufferStorage (OperationUtils.h): an MPS
// tensor's storage data pointer is its id<MTLBuffer>. Written as a __bridge
// cast because this file uses ARC (torch's __builtin_bit_cast spelling also
// compiles under ARC; the bridge cast states the intent: no ownership change).
inline id<MTLBuffer> getMTLBufferStorage(const at::Tensor& tensor) {
  return (__bridge id<MTLBuffer>)(const_cast<void*>(tensor.storage().data()));
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

// ---------------------------------------------------------------------------
// Function constants.
// ---------------------------------------------------------------------------

struct Constant {
  NSUInteger index = 0;
  MTLDataType type = MTLDataTypeBool;
  bool b = false;
  int32_t i = 0;
  float f = 0.0f;

  const void* data() const {
    switch (type) {
      case MTLDataTypeBool:
        return &b;
      case MTLDataTypeInt:
        return &i;
      default:
        return &f;
    }
  }

  // Exact, order-preserving text for the cache key (floats by bit pattern).
  void append_key(std::string& key) const {
    key += std::to_string(index);
    if (type == MTLDataTypeBool) {
      key += b ? ":b1;" : ":b0;";
    } else if (type == MTLDataTypeInt) {
      key += ":i" + std::to_string(i) + ";";
    } else {
      uint32_t bits = 0;
      std::memcpy(&bits, &f, sizeof(bits));
      key += ":f" + std::to_string(bits) + ";";
    }
  }
};

// Python value -> Constant, per the convention at the top of the file.
// bool is tested before int because Python's bool is a subclass of int.
Constant to_constant(int64_t index, const py::handle& value) {
  TORCH_CHECK(index >= 0 && index <= kMaxFunctionConstantIndex, "torch_metal_flash._C.launch: function constant index ",
              index, " out of range [0, ", kMaxFunctionConstantIndex, "]");
  Constant c;
  c.index = static_cast<NSUInteger>(index);
  PyObject* obj = value.ptr();
  if (PyBool_Check(obj)) {
    c.type = MTLDataTypeBool;
    c.b = (obj == Py_True);
  } else if (PyLong_Check(obj)) {
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(obj, &overflow);
    TORCH_CHECK(overflow == 0 && v >= std::numeric_limits<int32_t>::min() && v <= std::numeric_limits<int32_t>::max(),
                "torch_metal_flash._C.launch: function constant ", index,
                " does not fit a 32-bit Metal int (ints are passed as MTLDataTypeInt)");
    c.type = MTLDataTypeInt;
    c.i = static_cast<int32_t>(v);
  } else if (PyFloat_Check(obj)) {
    c.type = MTLDataTypeFloat;
    c.f = static_cast<float>(PyFloat_AsDouble(obj));
  } else {
    TORCH_CHECK(false, "torch_metal_flash._C.launch: function constant ", index,
                " must be a Python bool, int or float, got ", py::str(py::type::of(value)).cast<std::string>());
  }
  return c;
}

std::vector<Constant> to_constants(const std::vector<std::pair<int64_t, py::object>>& items) {
  std::vector<Constant> out;
  out.reserve(items.size());
  std::set<int64_t> seen;
  for (const auto& item : items) {
    TORCH_CHECK(seen.insert(item.first).second, "torch_metal_flash._C.launch: function constant ", item.first,
                " given twice");
    out.push_back(to_constant(item.first, item.second));
  }
  return out;
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

void inline_includes(const std::string& dir, const std::string& name, std::set<std::string>& seen, std::string& out) {
  check_shader_name(name);
  const std::string text = read_text_file(dir + "/" + name);
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
// Compile options.
//
// Math mode, chosen deliberately: the kernels mask with -inf scores and
// return lse = +inf for rows with no visible key, so the compiler must honour
// infinities. MTLMathModeFast (= fastMathEnabled YES, Metal's default) lets
// it assume there are none; MTLMathModeRelaxed keeps the fast-math
// optimisations *and* Inf/NaN semantics (Apple: "aggressive, potentially lossy
// assumptions about floating-point math, while honoring Inf/NaN").
//   macOS 15+: mathMode = Relaxed, mathFloatingPointFunctions = Fast.
//   macOS 14:  no Relaxed mode exists; fastMathEnabled = NO (Safe), which is
//              correct but may be slower.
// Override for experiments with TORCH_METAL_FLASH_MATH_MODE=relaxed|safe|fast
// (read once, when the first library is compiled).
// ---------------------------------------------------------------------------

enum class MathChoice { Relaxed, Safe, Fast };

MathChoice requested_math_mode() {
  const char* env = std::getenv("TORCH_METAL_FLASH_MATH_MODE");
  std::string v = env ? env : "";
  for (auto& ch : v) {
    ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  }
  if (v.empty() || v == "relaxed") {
    return MathChoice::Relaxed;
  }
  if (v == "safe") {
    return MathChoice::Safe;
  }
  if (v == "fast") {
    return MathChoice::Fast;
  }
  TORCH_CHECK(false, "TORCH_METAL_FLASH_MATH_MODE must be relaxed, safe or fast, got '", v, "'");
  return MathChoice::Relaxed;
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
  if (choice == MathChoice::Fast) {
    options.fastMathEnabled = YES;
    return "fast (fastMathEnabled=YES; macOS 14)";
  }
  options.fastMathEnabled = NO;
#pragma clang diagnostic pop
  return "safe (fastMathEnabled=NO; macOS 14 has no relaxed mode)";
}

// ---------------------------------------------------------------------------
// Process-wide caches: one MTLLibrary per source file, one pipeline state per
// (source, kernel, function-constant values). Guarded by one mutex; compiling
// under the lock keeps it simple (each library/pipeline is built once).
// The State object is intentionally leaked: no Metal objects are released
// during interpreter shutdown.
// ---------------------------------------------------------------------------

struct State {
  std::mutex mutex;
  std::string shader_dir;
  std::string math_description;
  std::unordered_map<std::string, id<MTLLibrary>> libraries;
  std::unordered_map<std::string, id<MTLComputePipelineState>> pipelines;
};

State& state() {
  static State* s = new State();
  return *s;
}

id<MTLLibrary> library_locked(State& s, id<MTLDevice> dev, const std::string& source) {
  auto it = s.libraries.find(source);
  if (it != s.libraries.end()) {
    return it->second;
  }
  TORCH_CHECK(!s.shader_dir.empty(), "torch_metal_flash._C: set_shader_dir() has not been called");
  if (@available(macOS 14.0, *)) {
    // MSL 3.1 is available
  } else {
    TORCH_CHECK(false, "torch_metal_flash: the Metal kernels need macOS 14 or newer (Metal Shading Language ",
                kLanguageVersionName, " for bfloat)");
  }
  const std::string text = preprocess_source(s.shader_dir, source);
  NSString* ns_text = [NSString stringWithUTF8String:text.c_str()];
  TORCH_CHECK(ns_text != nil, "torch_metal_flash._C: shaders/", source, " (with its headers) is not valid UTF-8");

  MTLCompileOptions* options = [MTLCompileOptions new];
  options.languageVersion = kLanguageVersion;
  s.math_description = configure_math(options);

  NSError* error = nil;
  id<MTLLibrary> lib = [dev newLibraryWithSource:ns_text options:options error:&error];
  TORCH_CHECK(lib != nil, "torch_metal_flash: compiling shaders/", source, " with the Metal compiler failed (MSL ",
              kLanguageVersionName, ", math ", s.math_description, "):\n", ns_error_text(error));
  s.libraries.emplace(source, lib);
  return lib;
}

std::string pipeline_key(const std::string& source, const std::string& kernel, const std::vector<Constant>& constants) {
  std::string key = source;
  key += '\n';
  key += kernel;
  key += '\n';
  for (const auto& c : constants) {
    c.append_key(key);
  }
  return key;
}

id<MTLComputePipelineState> pipeline(const std::string& source, const std::string& kernel,
                                     const std::vector<Constant>& constants) {
  std::string key = pipeline_key(source, kernel, constants);
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  auto it = s.pipelines.find(key);
  if (it != s.pipelines.end()) {
    return it->second;
  }
  id<MTLComputePipelineState> result = nil;
  @autoreleasepool {
    id<MTLDevice> dev = device();
    id<MTLLibrary> lib = library_locked(s, dev, source);

    MTLFunctionConstantValues* values = [MTLFunctionConstantValues new];
    for (const auto& c : constants) {
      [values setConstantValue:c.data() type:c.type atIndex:c.index];
    }
    NSString* name = [NSString stringWithUTF8String:kernel.c_str()];
    TORCH_CHECK(name != nil, "torch_metal_flash._C: kernel name is not valid UTF-8");
    NSError* error = nil;
    id<MTLFunction> fn = [lib newFunctionWithName:name constantValues:values error:&error];
    TORCH_CHECK(fn != nil, "torch_metal_flash: cannot make kernel '", kernel, "' of shaders/", source,
                " with function constants {", key.substr(source.size() + kernel.size() + 2), "}:\n",
                ns_error_text(error));
    error = nil;
    id<MTLComputePipelineState> pso = [dev newComputePipelineStateWithFunction:fn error:&error];
    TORCH_CHECK(pso != nil, "torch_metal_flash: cannot build the pipeline state of kernel '", kernel, "' (shaders/",
                source, "):\n", ns_error_text(error));
    s.pipelines.emplace(std::move(key), pso);
    result = pso;
  }
  return result;
}

// ---------------------------------------------------------------------------
// Launch.
// ---------------------------------------------------------------------------

struct Binding {
  NSUInteger index = 0;
  bool is_bytes = false;
  at::Tensor tensor;   // when !is_bytes
  std::string bytes;   // when is_bytes
};

std::vector<Binding> to_bindings(const std::vector<int64_t>& indices, const std::vector<py::object>& buffers) {
  TORCH_CHECK(indices.size() == buffers.size(), "torch_metal_flash._C.launch: ", indices.size(),
              " buffer indices for ", buffers.size(), " buffers");
  std::vector<Binding> out;
  out.reserve(buffers.size());
  std::set<int64_t> seen;
  for (size_t n = 0; n < buffers.size(); ++n) {
    const int64_t index = indices[n];
    TORCH_CHECK(index >= 0 && index <= kMaxBufferIndex, "torch_metal_flash._C.launch: buffer index ", index,
                " out of range [0, ", kMaxBufferIndex, "]");
    TORCH_CHECK(seen.insert(index).second, "torch_metal_flash._C.launch: buffer index ", index, " bound twice");
    Binding b;
    b.index = static_cast<NSUInteger>(index);
    const py::object& obj = buffers[n];
    if (py::isinstance<py::bytes>(obj)) {
      b.is_bytes = true;
      b.bytes = obj.cast<std::string>();
      TORCH_CHECK(!b.bytes.empty() && b.bytes.size() <= kMaxSetBytesLength, "torch_metal_flash._C.launch: buffer ",
                  index, " has ", b.bytes.size(), " bytes; setBytes takes 1 to ", kMaxSetBytesLength,
                  " bytes (use a tensor for more)");
    } else {
      TORCH_CHECK(THPVariable_Check(obj.ptr()), "torch_metal_flash._C.launch: buffer ", index,
                  " must be a torch.Tensor or bytes, got ", py::str(py::type::of(obj)).cast<std::string>());
      b.tensor = THPVariable_Unpack(obj.ptr());
      TORCH_CHECK(b.tensor.defined(), "torch_metal_flash._C.launch: buffer ", index, " is an undefined tensor");
      TORCH_CHECK(b.tensor.is_mps(), "torch_metal_flash._C.launch: buffer ", index,
                  " must be an MPS tensor, got device ", b.tensor.device());
    }
    out.push_back(std::move(b));
  }
  return out;
}

MTLSize to_size(const std::vector<int64_t>& v, const char* what) {
  TORCH_CHECK(v.size() == 3, "torch_metal_flash._C.launch: ", what, " must have 3 entries, got ", v.size());
  for (int64_t x : v) {
    TORCH_CHECK(x >= 0 && x <= std::numeric_limits<uint32_t>::max(), "torch_metal_flash._C.launch: ", what,
                " entries must be in [0, 2^32), got ", x);
  }
  return MTLSizeMake(static_cast<NSUInteger>(v[0]), static_cast<NSUInteger>(v[1]), static_cast<NSUInteger>(v[2]));
}

void encode(const std::string& source, const std::string& kernel, const std::vector<Constant>& constants,
            const std::vector<Binding>& bindings, MTLSize groups, MTLSize threads,
            const std::vector<std::pair<NSUInteger, NSUInteger>>& tg_memory) {
  @autoreleasepool {
    id<MTLComputePipelineState> pso = pipeline(source, kernel, constants);

    const NSUInteger per_group = threads.width * threads.height * threads.depth;
    TORCH_CHECK(per_group <= pso.maxTotalThreadsPerThreadgroup, "torch_metal_flash: kernel '", kernel, "' dispatched with ",
                per_group, " threads per threadgroup (", threads.width, "x", threads.height, "x", threads.depth,
                "), but its pipeline allows at most ", pso.maxTotalThreadsPerThreadgroup,
                " on this GPU (register pressure or [[max_total_threads_per_threadgroup]]); the planner's tile is too large");
    NSUInteger tg_bytes = pso.staticThreadgroupMemoryLength;
    for (const auto& m : tg_memory) {
      tg_bytes += m.second;
    }
    const NSUInteger tg_limit = pso.device.maxThreadgroupMemoryLength;
    TORCH_CHECK(tg_bytes <= tg_limit, "torch_metal_flash: kernel '", kernel, "' needs ", tg_bytes,
                " bytes of threadgroup memory (", pso.staticThreadgroupMemoryLength, " static), this GPU allows ", tg_limit);

    at::mps::MPSStream* stream = at::mps::getCurrentMPSStream();
    TORCH_CHECK(stream != nullptr, "torch_metal_flash._C: no current MPS stream");
    const std::vector<Binding>* binds = &bindings;
    const std::vector<std::pair<NSUInteger, NSUInteger>>* tgm = &tg_memory;

    // The documented PyTorch pattern: encode on the stream's serial queue into
    // the stream's shared compute encoder. Never create or end an encoder and
    // never commit here: PyTorch coalesces kernels into its command buffer and
    // commits at its own sync points (torch.mps.synchronize(), .cpu(), ...).
    dispatch_sync_with_rethrow(stream->queue(), ^() {
      @autoreleasepool {
        id<MTLComputeCommandEncoder> enc = stream->commandEncoder();
        TORCH_CHECK(enc != nil, "torch_metal_flash._C: the MPS stream returned no compute encoder");
        [enc setComputePipelineState:pso];
        for (const Binding& b : *binds) {
          if (b.is_bytes) {
            [enc setBytes:b.bytes.data() length:b.bytes.size() atIndex:b.index];
          } else {
            // as at::native::mps::mtl_setBuffer
            [enc setBuffer:getMTLBufferStorage(b.tensor)
                    offset:static_cast<NSUInteger>(b.tensor.storage_offset() * b.tensor.element_size())
                   atIndex:b.index];
          }
        }
        for (const auto& m : *tgm) {
          [enc setThreadgroupMemoryLength:m.second atIndex:m.first];
        }
        [enc dispatchThreadgroups:groups threadsPerThreadgroup:threads];
      }
    });
  }
}

// ---------------------------------------------------------------------------
// Python entry points.
// ---------------------------------------------------------------------------

void set_shader_dir(const std::string& path) {
  TORCH_CHECK(!path.empty(), "torch_metal_flash._C.set_shader_dir: empty path");
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (s.shader_dir != path) {
    // Different sources: drop what was compiled from the old directory.
    s.shader_dir = path;
    s.libraries.clear();
    s.pipelines.clear();
  }
}

void launch(const std::string& source, const std::string& kernel,
            const std::vector<std::pair<int64_t, py::object>>& function_constants,
            const std::vector<int64_t>& buffer_indices, const std::vector<py::object>& buffers,
            const std::vector<int64_t>& threadgroups, const std::vector<int64_t>& threadgroup,
            const std::vector<std::pair<int64_t, int64_t>>& threadgroup_memory) {
  // Everything that touches Python objects happens here, with the GIL.
  std::vector<Constant> constants = to_constants(function_constants);
  std::vector<Binding> bindings = to_bindings(buffer_indices, buffers);
  const MTLSize groups = to_size(threadgroups, "threadgroups");
  const MTLSize threads = to_size(threadgroup, "threadgroup");
  TORCH_CHECK(threads.width >= 1 && threads.height >= 1 && threads.depth >= 1,
              "torch_metal_flash._C.launch: threads per threadgroup must be >= 1 in every dimension");
  std::vector<std::pair<NSUInteger, NSUInteger>> tg_memory;
  std::set<int64_t> seen;
  for (const auto& m : threadgroup_memory) {
    TORCH_CHECK(m.first >= 0 && m.first <= kMaxBufferIndex, "torch_metal_flash._C.launch: threadgroup memory index ",
                m.first, " out of range");
    TORCH_CHECK(seen.insert(m.first).second, "torch_metal_flash._C.launch: threadgroup memory index ", m.first,
                " given twice");
    TORCH_CHECK(m.second > 0, "torch_metal_flash._C.launch: threadgroup memory ", m.first, " must be > 0 bytes");
    // setThreadgroupMemoryLength: "needs to be a multiple of 16 bytes".
    const int64_t rounded = (m.second + 15) / 16 * 16;
    tg_memory.emplace_back(static_cast<NSUInteger>(m.first), static_cast<NSUInteger>(rounded));
  }
  if (groups.width == 0 || groups.height == 0 || groups.depth == 0) {
    return;  // empty grid: nothing to run
  }
  // Compiling (first use) and waiting for the stream's queue can take a while:
  // let other Python threads run, as torch's own op bindings do.
  py::gil_scoped_release no_gil;
  encode(source, kernel, constants, bindings, groups, threads, tg_memory);
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
  std::vector<Constant> constants = to_constants(function_constants);
  NSUInteger max_threads = 0, width = 0, static_tg = 0, tg_limit = 0;
  {
    py::gil_scoped_release no_gil;
    @autoreleasepool {
      id<MTLComputePipelineState> pso = pipeline(source, kernel, constants);
      max_threads = pso.maxTotalThreadsPerThreadgroup;
      width = pso.threadExecutionWidth;
      static_tg = pso.staticThreadgroupMemoryLength;
      tg_limit = pso.device.maxThreadgroupMemoryLength;
    }
  }
  py::dict info;
  info["max_total_threads_per_threadgroup"] = static_cast<int64_t>(max_threads);
  info["thread_execution_width"] = static_cast<int64_t>(width);
  info["static_threadgroup_memory_length"] = static_cast<int64_t>(static_tg);
  info["max_threadgroup_memory_length"] = static_cast<int64_t>(tg_limit);
  return info;
}

std::string math_mode() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  return s.math_description.empty() ? std::string("(no library compiled yet)") : s.math_description;
}

}  // namespace
}  // namespace torch_metal_flash

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace tmf = torch_metal_flash;
  m.doc() = "torch_metal_flash Metal launcher: encodes planned kernels on PyTorch's current MPS stream";
  m.def("set_shader_dir", &tmf::set_shader_dir, py::arg("path"),
        "Directory of the .metal/.h shader sources (caches are dropped when it changes).");
  m.def("launch", &tmf::launch, py::arg("source"), py::arg("kernel"), py::arg("function_constants"),
        py::arg("buffer_indices"), py::arg("buffers"), py::arg("threadgroups"), py::arg("threadgroup"),
        py::arg("threadgroup_memory"),
        "Encode one dispatchThreadgroups on the current MPS stream (no commit). function_constants: "
        "[(index, bool|int|float)] -> MTLDataTypeBool|Int|Float; buffers: MPS tensors (bound at "
        "storage_offset*element_size) or bytes (setBytes, <= 4096); threadgroup_memory: [(index, bytes)].");
  m.def("gpu_family", &tmf::gpu_family, "Highest Apple GPU family the device supports, e.g. 'apple8'.");
  m.def("pipeline_info", &tmf::pipeline_info, py::arg("source"), py::arg("kernel"),
        py::arg("function_constants") = std::vector<std::pair<int64_t, py::object>>{},
        "Limits of a kernel's pipeline state (max threads per threadgroup, SIMD width, threadgroup memory).");
  m.def("math_mode", &tmf::math_mode, "The floating-point math mode the shader libraries are compiled with.");
  m.attr("LANGUAGE_VERSION") = tmf::kLanguageVersionName;
}
