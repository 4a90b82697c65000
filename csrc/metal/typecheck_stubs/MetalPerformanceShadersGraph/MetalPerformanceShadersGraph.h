#pragma once
#include <MetalPerformanceShaders/MetalPerformanceShaders.h>
@interface MPSGraph : NSObject
@end
@interface MPSGraphExecutionDescriptor : NSObject
@end
@interface MPSGraphCompilationDescriptor : NSObject
@end
