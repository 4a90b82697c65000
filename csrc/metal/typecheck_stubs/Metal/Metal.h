#pragma once
#include <Foundation/Foundation.h>
typedef NS_ENUM(NSUInteger, MTLLanguageVersion) {
  MTLLanguageVersion3_0 = (3 << 16),
  MTLLanguageVersion3_1 = (3 << 16) + 1,
};
typedef NS_ENUM(NSUInteger, MTLDataType) {
  MTLDataTypeFloat = 3,
  MTLDataTypeInt = 29,
  MTLDataTypeBool = 53,
};
typedef NS_ENUM(NSInteger, MTLGPUFamily) {
  MTLGPUFamilyApple7 = 1007,
  MTLGPUFamilyApple8 = 1008,
  MTLGPUFamilyApple9 = 1009,
  MTLGPUFamilyMac2 = 2002,
};
typedef struct { NSUInteger width, height, depth; } MTLSize;
static inline MTLSize MTLSizeMake(NSUInteger width, NSUInteger height, NSUInteger depth) {
  MTLSize s; s.width = width; s.height = height; s.depth = depth; return s;
}
@protocol MTLDevice;
@interface MTLCompileOptions : NSObject <NSCopying>
@property (readwrite, nonatomic) BOOL fastMathEnabled __attribute__((deprecated("use mathMode")));
@property (readwrite, nonatomic) MTLLanguageVersion languageVersion;
@end
#ifdef STUB_SDK15
typedef NS_ENUM(NSInteger, MTLMathMode) { MTLMathModeSafe = 0, MTLMathModeRelaxed = 1, MTLMathModeFast = 2 };
typedef NS_ENUM(NSInteger, MTLMathFloatingPointFunctions) { MTLMathFloatingPointFunctionsFast = 0, MTLMathFloatingPointFunctionsPrecise = 1 };
@interface MTLCompileOptions (SDK15)
@property (readwrite, nonatomic) MTLMathMode mathMode;
@property (readwrite, nonatomic) MTLMathFloatingPointFunctions mathFloatingPointFunctions;
@end
#endif
@interface MTLFunctionConstantValues : NSObject <NSCopying>
- (void)setConstantValue:(const void *)value type:(MTLDataType)type atIndex:(NSUInteger)index;
@end
@interface MTLFunctionConstant : NSObject
@property (readonly) NSString *name;
@property (readonly) MTLDataType type;
@property (readonly) NSUInteger index;
@property (readonly) BOOL required;
@end
@protocol MTLFunction <NSObject>
@property (readonly) NSDictionary<NSString *, MTLFunctionConstant *> *functionConstantsDictionary;
@end
@protocol MTLLibrary <NSObject>
- (id <MTLFunction>)newFunctionWithName:(NSString *)functionName;
- (id <MTLFunction>)newFunctionWithName:(NSString *)name constantValues:(MTLFunctionConstantValues *)constantValues error:(__autoreleasing NSError **)error;
@end
@protocol MTLComputePipelineState <NSObject>
@property (readonly) id <MTLDevice> device;
@property (readonly) NSUInteger maxTotalThreadsPerThreadgroup;
@property (readonly) NSUInteger threadExecutionWidth;
@property (readonly) NSUInteger staticThreadgroupMemoryLength;
@end
@interface MTLArchitecture : NSObject <NSCopying>
@property (readonly) NSString *name;
@end
@protocol MTLDevice <NSObject>
@property (readonly) MTLArchitecture *architecture;
- (id <MTLLibrary>)newLibraryWithSource:(NSString *)source options:(MTLCompileOptions *)options error:(__autoreleasing NSError **)error;
- (id <MTLLibrary>)newLibraryWithURL:(NSURL *)url error:(__autoreleasing NSError **)error;
- (id <MTLComputePipelineState>)newComputePipelineStateWithFunction:(id <MTLFunction>)computeFunction error:(__autoreleasing NSError **)error;
- (BOOL)supportsFamily:(MTLGPUFamily)gpuFamily;
@property (readonly) NSUInteger maxThreadgroupMemoryLength;
@end
@protocol MTLBuffer <NSObject>
@end
@protocol MTLCommandEncoder <NSObject>
- (void)endEncoding;
@end
@protocol MTLComputeCommandEncoder <MTLCommandEncoder>
- (void)setComputePipelineState:(id <MTLComputePipelineState>)state;
- (void)setBytes:(const void *)bytes length:(NSUInteger)length atIndex:(NSUInteger)index;
- (void)setBuffer:(id <MTLBuffer>)buffer offset:(NSUInteger)offset atIndex:(NSUInteger)index;
- (void)setThreadgroupMemoryLength:(NSUInteger)length atIndex:(NSUInteger)index;
- (void)dispatchThreadgroups:(MTLSize)threadgroupsPerGrid threadsPerThreadgroup:(MTLSize)threadsPerThreadgroup;
@end
@protocol MTLCommandQueue <NSObject>
@end
@protocol MTLSharedEvent <NSObject>
@end
@protocol MTLCommandBuffer <NSObject>
@end
typedef void (^MTLCommandBufferHandler)(id <MTLCommandBuffer>);
@interface MTLCaptureManager : NSObject
@end
