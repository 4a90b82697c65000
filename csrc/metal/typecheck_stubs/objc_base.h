#pragma once
typedef long NSInteger;
typedef unsigned long NSUInteger;
typedef signed char BOOL;
#define YES ((BOOL)1)
#define NO ((BOOL)0)
#define nil nullptr
#define Nil nullptr
#define NS_ENUM(_type, _name) enum _name : _type _name; enum _name : _type
#define API_AVAILABLE(...)
#define API_DEPRECATED(...)
@protocol NSObject
@end
@protocol NSCopying
@end
__attribute__((objc_root_class))
@interface NSObject <NSObject> { Class isa; }
+ (instancetype)alloc;
+ (instancetype)new;
- (instancetype)init;
@end
