// <MetalPerformancePrimitives/MetalPerformancePrimitives.h> in the emulator:
// Metal 4 tensor ops (the declarations live in ../../shim/mtl_tensor_ops.h).
#pragma once
#if !defined(__METAL_VERSION__) || __METAL_VERSION__ < 400
#error MSL language version: MetalPerformancePrimitives needs Metal 4.0 (-std=metal4.0; compile_shader(..., language_version="4.0"))
#endif
namespace mpp = __mtl::mpp;
