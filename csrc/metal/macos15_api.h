// The macOS 15 Metal API the launcher uses (MTLCompileOptions.mathMode,
// mathFloatingPointFunctions), declared here when the SDK predates it, as the
// macOS 15 SDK declares it: with its availability, so that a use outside
// `@available(macOS 15.0, *)` is an error (-Werror=unguarded-availability-new,
// setup.py), whichever SDK builds the file. The guard is torch's
// (ATen/native/mps/MPSGraphSequoiaOps.h declares the same when it is set).
#pragma once

#import <Metal/Metal.h>

#if !defined(__MAC_15_0) && (!defined(MAC_OS_X_VERSION_15_0) || (MAC_OS_X_VERSION_MIN_REQUIRED < MAC_OS_X_VERSION_15_0))
typedef NS_ENUM(NSInteger, MTLMathMode) {
  MTLMathModeSafe = 0,
  MTLMathModeRelaxed = 1,
  MTLMathModeFast = 2,
} API_AVAILABLE(macos(15.0));

typedef NS_ENUM(NSInteger, MTLMathFloatingPointFunctions) {
  MTLMathFloatingPointFunctionsFast = 0,
  MTLMathFloatingPointFunctionsPrecise = 1,
} API_AVAILABLE(macos(15.0));

@interface MTLCompileOptions ()
@property(readwrite, nonatomic) MTLMathMode mathMode API_AVAILABLE(macos(15.0));
@property(readwrite, nonatomic) MTLMathFloatingPointFunctions mathFloatingPointFunctions API_AVAILABLE(macos(15.0));
@end
#endif
