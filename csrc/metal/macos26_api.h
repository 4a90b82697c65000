// The macOS 26 Metal API the launcher uses (MTLLanguageVersion4_0: Metal
// Shading Language 4.0, for the neural-accelerator kernels), declared here by
// its raw value when the SDK predates it, with its availability, so that a use
// outside `@available(macOS 26.0, *)` is an error
// (-Werror=unguarded-availability-new, setup.py) whichever SDK builds the file.
#pragma once

#import <Metal/Metal.h>

#if !defined(__MAC_26_0)
static const MTLLanguageVersion MTLLanguageVersion4_0 API_AVAILABLE(macos(26.0)) = (MTLLanguageVersion)(4 << 16);
#endif
