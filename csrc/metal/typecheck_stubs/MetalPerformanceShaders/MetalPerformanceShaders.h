#pragma once
#include <Metal/Metal.h>
@interface MPSCommandBuffer : NSObject <MTLCommandBuffer>
@end
